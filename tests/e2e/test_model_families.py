"""Every family of model vLLM serves, end to end on the CPU build: a sliding-window
hybrid (Gemma-3 style), MLA (DeepSeek-V2 style) at TP=1 and TP=2, and a Mamba hybrid
(Granite-4 style), each a tiny dummy-weight model (``support/engine_run.FAMILIES``).
Dense bf16 and fp8 caches are in test_vllm_connector.py.

Each family: outputs equal the same engine without the connector; a repeat after
vLLM's prefix cache is reset is served from the cpu tier, and a new engine over the
same disk tier from the disk, the connector's counters showing the exact blocks
loaded and prefetched and no load error; all under vLLM's default
``kv_load_failure_policy="fail"``, where a failed load fails its request. The hybrids
run under vLLM's hybrid KV cache manager (the connector is ``SupportsHMA``): no
"Turning off hybrid kv cache manager".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.e2e import (
    BATCH,
    EngineServer,
    assert_loaded,
    cached,
    connector_tiers,
    outputs,
    sabotaged,
    tokens,
)
from support.engine_run import TINY_GEMMA3

pytestmark = pytest.mark.slow  # real vLLM engines
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

HMA_OFF = "Turning off hybrid kv cache manager"
FULL_BLOCKS = [13] * 4 + [9]
"""The batch's full blocks of 32 tokens per prompt (never counting its last token)."""
MAMBA_GROUPS = 2
"""The tiny Granite-4's Mamba-state groups (its 4 Mamba2 layers), one block each."""


def _family_run(
    engines: EngineServer, tmp: Path, family: str, **engine: Any
) -> tuple[list[dict[str, Any]], str]:
    """The batch twice on the engine without the connector, twice on one with a cpu
    tier over a disk tier, once on a new engine over the same disk: results and the
    engines' standard error."""
    conn = connector_tiers("mmap", tmp / "disk")
    run = engines.run(
        tmp,
        family=family,
        rounds=[BATCH, BATCH],
        engine={"gpu_memory_utilization": 0.2, **engine},
        engines=[
            {"kvoffload": None},
            {"kvoffload": conn},
            {"kvoffload": conn, "rounds": [BATCH]},
        ],
    )
    assert not run.failed, run.detail()
    assert len(run.results) == 3, run.detail()
    return run.results, run.stderr


def _hybrid_loads(boundary: int) -> int:
    """Blocks a hybrid's repeat of the batch loads, each prompt its whole hit: its
    full-attention blocks (13, 9 for the last) and the ``boundary`` blocks its other
    groups keep right before its boundary (a sliding window's 2; a Mamba group's
    state, 1 each)."""
    return sum(blocks + boundary for blocks in FULL_BLOCKS)


def _served_and_hit(
    results: list[dict[str, Any]],
    hits: list[int],
    loaded: int,
    stored: int,
    first_round_loads: int = 0,
) -> None:
    """The repeat and the restart: outputs, hits, ``loaded`` blocks loaded by each (the
    repeat's first round, on empty tiers, loads ``first_round_loads`` more: none where
    vLLM's prefix cache gives a later prompt the prefix an earlier one computed), and
    the restart's ``stored`` blocks (what the first engine stored) each prefetched from
    the disk."""
    ref, repeat, restart = results
    assert outputs(repeat, 0) == outputs(ref, 0)
    assert outputs(repeat, 1) == outputs(ref, 1)
    assert outputs(restart, 0) == outputs(ref, 0)
    assert cached(repeat, 1) == hits
    assert cached(restart, 0) == hits
    assert_loaded(repeat, loaded + first_round_loads)
    assert_loaded(restart, loaded)
    prefetched = restart["kvoffload"]["prefetched_blocks"]
    assert prefetched == stored, restart["kvoffload"]  # from the disk tier


def test_sliding_window_hybrid_under_the_hybrid_manager(
    engines: EngineServer, tmp_path: Path
) -> None:
    """Gemma-3 style: sliding-window and full-attention groups. Every prompt of the
    batch hits in full (13 blocks of 32, 9 for the last), and a request stores its
    full-attention blocks and only the sliding window's 2 blocks before its boundary:
    counted on a prompt of 20 blocks, the cpu tier's bytes are those of 20 blocks of
    the full-attention layers and 2 of the sliding ones. The repeat and the restart
    each load 71 blocks, every prompt its whole hit (its full-attention blocks and
    its window's 2): vLLM's own cache cannot serve one prompt the prefix another
    loaded, whose window blocks are those of the other's boundary. The restart
    prefetches the 38 the first engine stored: 28 full-attention, 2 per prompt of the
    window."""
    results, stderr = _family_run(engines, tmp_path / "batch", "gemma3")
    window = TINY_GEMMA3["sliding_window"] // 32
    _served_and_hit(results, [416] * 4 + [288], _hybrid_loads(window), 28 + 5 * window)
    assert HMA_OFF not in stderr
    ref = results[0]

    # Every load failing: vLLM takes no block-level load error from an engine with
    # several KV cache groups (it raises), so such an engine's hits load as vLLM's
    # asynchronous loads, which fail whole: recomputed under "recompute", failed
    # under "fail", and the engine serves on.
    failing = sabotaged(connector_tiers(None))
    recompute, fail = engines.results(
        tmp_path / "failing",
        family="gemma3",
        rounds=[BATCH, BATCH],
        kvoffload=failing,
        engines=[{"failure_policy": "recompute"}, {"failure_policy": "fail"}],
    )
    assert outputs(recompute, 1) == outputs(ref, 1)
    assert recompute["failed"] == 0
    assert recompute["kvoffload"]["load_errors"] == _hybrid_loads(window)
    assert recompute["kvoffload"]["blocks_loaded"] == 0
    assert [r["failed"] for r in fail["rounds"][1]] == [True] * len(BATCH)
    assert fail["error"] is None

    blocks = 20
    (window,) = engines.results(
        tmp_path / "window",
        family="gemma3",
        rounds=[[tokens(300, blocks * 32 + 1)]],
        kvoffload=connector_tiers(None),
    )
    layer_types = TINY_GEMMA3["layer_types"]
    full = layer_types.count("full_attention")
    sliding = layer_types.count("sliding_attention")
    window_blocks = TINY_GEMMA3["sliding_window"] // 32
    layer_block = 2 * 32 * TINY_GEMMA3["num_key_value_heads"] * TINY_GEMMA3["head_dim"] * 2
    written = window["kvoffload"]["tier.cpu.bytes_written"]
    bound = (full * blocks + sliding * window_blocks) * layer_block
    assert full * blocks * layer_block < written <= bound, (written, bound)


def test_mla_is_stored_once_across_tensor_parallel_ranks(
    engines: EngineServer, tmp_path: Path
) -> None:
    """DeepSeek-V2 style MLA: one latent vector of 576 per token (vLLM's CPU build
    forces 16-token blocks, and turns its own prefix cache off for MLA: every hit
    here is the connector's). At TP=2 both ranks hold the same latent cache: rank 0
    stores it, in the tiers a TP=1 engine uses, and sends its loads to rank 1. The
    TP=2 engine writes the bytes the TP=1 engine writes, and serves the repeat and a
    restart from them (vLLM's default multi-process mode: the counters are read from
    its Prometheus metrics, summed over the ranks: rank 0 alone loads and counts).
    Without vLLM's prefix cache every prompt loads its whole hit: 4 x 26 + 18 = 122
    blocks, in the repeat and in the restart, whose prefetches bring up the 56 blocks
    stored (the prefix's 22, 4 of each of the four suffixes, the last prompt's 18). In
    the first round, on empty tiers, a prompt vLLM schedules after the first one's
    prefix is stored loads that prefix (how many do depends on the steps: one CI run
    had three of them load its 22 blocks); without vLLM's prefix cache the connector
    alone gives cached tokens, so those loads are read from the round's cached tokens:
    the count stays exact."""
    results, _ = _family_run(engines, tmp_path / "tp1", "deepseek_v2")
    hits = [416] * 4 + [288]  # 26 and 18 blocks of 16
    loaded = sum(hits) // 16  # 122: every block of every prompt
    stored = 352 // 16 + 4 * (416 - 352) // 16 + 288 // 16  # 56
    _served_and_hit(results, hits, loaded, stored, sum(cached(results[1], 0)) // 16)
    tp1 = results[1]["kvoffload"]
    tp1_bytes = sum(v for k, v in tp1.items() if k.endswith(".bytes_written"))

    disk = tmp_path / "tp2" / "disk"
    conn = connector_tiers("mmap", disk)
    first, restart = engines.results(
        tmp_path / "tp2",
        family="deepseek_v2",
        single_process=False,
        failure_policy="fail",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        rounds=[BATCH, BATCH],
        engine={"gpu_memory_utilization": 0.2, "tensor_parallel_size": 2},
        engines=[{"kvoffload": conn}, {"kvoffload": conn, "rounds": [BATCH]}],
    )
    # Round 0 ran on empty tiers: computed by the engine, the reference.
    assert outputs(first, 1) == outputs(first, 0)
    assert outputs(restart, 0) == outputs(first, 0)
    assert cached(first, 1) == hits
    assert cached(restart, 0) == hits
    for result, before in ((first, sum(cached(first, 0)) // 16), (restart, 0)):
        assert not result["kvoffload"]  # multi-process: only Prometheus has them
        assert_loaded(result, loaded + before)
    assert restart["prometheus"]["prefetched_blocks"] == stored, restart["prometheus"]
    assert not list(disk.glob("rank*"))  # one copy, where a TP=1 engine keeps it
    ratio = first["prometheus"]["tier_bytes_written"] / tp1_bytes
    assert ratio <= 1.05, (first["prometheus"], tp1)


def test_mamba_hybrid_stores_its_boundary_states(engines: EngineServer, tmp_path: Path) -> None:
    """Granite-4 style: Mamba2 and attention layers (two Mamba-state groups, one
    full-attention group), with vLLM's prefix caching in its ``"align"`` mode. The
    connector stores the state vLLM hands over at each request's boundary with the
    attention blocks, and a hit restores both. vLLM's CPU Mamba kernel returns no
    state inside a prefill chunk, so this runs with chunks of one block
    (``max_num_batched_tokens=32``); longer chunks crash vLLM itself, connector or
    not (docs/vllm.md). The repeat and the restart each load 71 blocks, every prompt
    its whole hit (its attention blocks and each Mamba group's state): vLLM's own
    cache holds no state at the end of the shared prefix for another prompt. The
    restart prefetches the 38 the first engine stored: 28 attention blocks, and per
    prompt the state of each Mamba group."""
    results, stderr = _family_run(
        engines, tmp_path / "align", "granite4", max_num_batched_tokens=32
    )
    _served_and_hit(results, [416] * 4 + [288], _hybrid_loads(MAMBA_GROUPS), 28 + 5 * MAMBA_GROUPS)
    assert HMA_OFF not in stderr
    # The attention group's 28 blocks and, per request, each Mamba group's state.
    assert results[1]["kvoffload"]["tier.cpu.blocks_stored"] >= 28 + 5 * MAMBA_GROUPS

    # vLLM's prefix caching off: it hashes in blocks of max_model_len, so there is
    # nothing to key; the connector says so, stores nothing, and the engine serves.
    (off,) = engines.results(
        tmp_path / "off",
        family="granite4",
        rounds=[BATCH],
        kvoffload=connector_tiers(None),
        engine={"max_num_batched_tokens": 32, "enable_prefix_caching": False},
    )
    assert outputs(off, 0) == outputs(results[0], 0)
    assert off["failed"] == 0
    assert off["kvoffload"]["blocks_submitted_for_store"] == 0
