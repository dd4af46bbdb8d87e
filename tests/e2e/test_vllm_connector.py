"""End to end on a real vLLM engine (CPU build, dummy-weight tiny Llama, no mocks).

Each engine runs in a subprocess (``engine_run.py``: vLLM spawns processes and needs a
``__main__`` guard), in vLLM's default mode (the worker in its own process) except the
preemption test, which reads the connector's counters and so runs single-process.
Under ``CI=true`` a missing vLLM fails these tests (tests/conftest.py turns skips into
failures).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from engine_run import write_tiny_llama  # noqa: E402
from kvoffload.backends.mmap import MmapBackend  # noqa: E402

from kvoffload.record import HEADER_BYTES  # noqa: E402

PROMPT_TOKENS = 300  # 9 full blocks of 32, plus a partial one


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _run_engine(
    tmp: Path,
    kvoffload: dict[str, Any] | None,
    rounds: list[list[list[int]]],
    max_tokens: int = 8,
    single_process: bool = False,
    env_extra: dict[str, str] | None = None,
    failure_policy: str | None = "recompute",
    **engine: Any,
) -> tuple[Any, subprocess.CompletedProcess[str]]:
    """Run one engine over ``rounds`` of prompts: its JSON result (``None`` when it
    printed none) and the finished process. ``failure_policy`` is vLLM's
    ``kv_load_failure_policy`` (``None``: vLLM's default, ``"fail"``); these tests were
    written for ``"recompute"`` (tests/e2e/test_verified_hits.py runs both)."""
    model = write_tiny_llama(tmp / "model")
    spec = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "kvoffload": kvoffload,
                "failure_policy": failure_policy,
                "rounds": rounds,
                "max_tokens": max_tokens,
                "engine": {"gpu_memory_utilization": 0.2, **engine},
            }
        )
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    # vLLM's default runs the worker in its own process, and the scheduler side then
    # asks it over a socket; single-process mode lets the test read the counters.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single_process else "1"
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), str(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("E2E-RESULT "):
            return json.loads(line.removeprefix("E2E-RESULT ")), proc
    return None, proc


def _engine(tmp: Path, kvoffload: dict[str, Any] | None, rounds: list[list[list[int]]]) -> Any:
    """The JSON result of one engine run, or the failed process when there is none."""
    result, proc = _run_engine(tmp, kvoffload, rounds)
    return result if result is not None else proc


def _cpu(capacity: str = "64MiB") -> dict[str, Any]:
    return {"config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": capacity}]}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Outputs without any connector: two prompts, twice."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result = _engine(tmp_path_factory.mktemp("ref"), None, rounds)
    assert isinstance(result, dict), result.stderr[-3000:]
    return result


def _tokens(result: Any, round_: int) -> list[list[int]]:
    return [r["tokens"] for r in result["rounds"][round_]]


def test_outputs_equal_and_a_repeat_is_served_from_the_cpu_tier(
    tmp_path: Path, reference: Any
) -> None:
    """Greedy outputs are identical with the connector; after reset_prefix_cache the
    repeated prompts come back from our cpu tier (9 blocks of 32 tokens each)."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result = _engine(tmp_path, _cpu(), rounds)
    assert isinstance(result, dict), result.stderr[-3000:]
    assert _tokens(result, 0) == _tokens(reference, 0)
    assert _tokens(result, 1) == _tokens(reference, 1)
    assert [r["cached"] for r in result["rounds"][0]] == [0, 0]
    assert [r["cached"] for r in result["rounds"][1]] == [288, 288]
    assert [r["cached"] for r in reference["rounds"][1]] == [0, 0]  # vLLM alone: nothing


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_restarted_engine_is_served_from_the_disk_tier(
    tmp_path: Path, reference: Any, backend: str
) -> None:
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "disk", "backend": backend, "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    first = _engine(tmp_path, {"config": {"tiers": tiers}}, [[_prompt(1)]])
    assert isinstance(first, dict), first.stderr[-3000:]
    second = _engine(tmp_path, {"config": {"tiers": tiers}}, [[_prompt(1)]])
    assert isinstance(second, dict), second.stderr[-3000:]
    assert second["rounds"][0][0]["cached"] == 288  # a new process: only the disk had it
    assert _tokens(second, 0)[0] == _tokens(reference, 0)[0]


def test_bad_yaml_fails_engine_start_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - name: cpu\n    capacity: -1GiB\n")
    result = _engine(tmp_path, {"config_file": str(bad)}, [[_prompt(1)]])
    assert not isinstance(result, dict)
    assert result.returncode != 0
    assert "tiers[0].capacity = '-1GiB'" in result.stderr + result.stdout


def test_corrupt_disk_block_is_recomputed_not_served(tmp_path: Path, reference: Any) -> None:
    """Between two engine runs, one payload byte of a stored block is flipped on disk.
    The second run's output still equals the reference, the engine does not crash, and
    the bad block is counted. The prefetch into the cpu tier finds it before the hit is
    claimed: the hit ends before it (3 blocks loaded), so vLLM computes the rest itself
    and nothing is a load error."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "ssd", "backend": "mmap", "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    first = _engine(tmp_path, {"config": {"tiers": tiers}}, [[_prompt(1)]])
    assert isinstance(first, dict), first.stderr[-3000:]
    slab = tmp_path / "t" / "slab-000.kvo"
    meta = MmapBackend.read_superblock(slab)
    assert meta is not None
    align = 4096
    table = (meta["num_slots"] * HEADER_BYTES + align - 1) // align * align
    with open(slab, "r+b") as f:  # slot 3: the 4th of the prompt's 9 blocks
        f.seek(align + table + 3 * meta["stride"] + 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    # Single-process, so that the connector's counters can be read.
    second, proc = _run_engine(
        tmp_path, {"config": {"tiers": tiers}}, [[_prompt(1)]], single_process=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second is not None
    assert _tokens(second, 0)[0] == _tokens(reference, 0)[0]
    assert "1 of " in proc.stderr
    assert "failed verification" in proc.stderr
    counters = second["kvoffload"]
    assert counters["tier.ssd.corrupt_blocks"] == 1, json.dumps(counters)
    assert counters["blocks_loaded"] == 3, json.dumps(counters)  # the blocks before it
    assert counters["load_errors"] == 0, json.dumps(counters)  # found before the claim


def test_preempted_requests_come_back_from_the_tiers(tmp_path: Path) -> None:
    """A 24-block KV pool for 4 concurrent requests of 10 prompt blocks and 64 new
    tokens each: vLLM must preempt. With vLLM's own prefix cache off, a resumed request
    can only recompute or load: outputs equal those of an engine with room to spare,
    and resumed requests load their blocks back from our tiers."""
    prompts = [_prompt(10 + i) for i in range(4)]
    ref, proc = _run_engine(tmp_path / "ref", None, [prompts], max_tokens=64)
    assert ref is not None, proc.stderr[-3000:]
    got, proc = _run_engine(
        tmp_path / "small",
        _cpu(),
        [prompts],
        max_tokens=64,
        single_process=True,
        num_gpu_blocks_override=24,
        max_model_len=512,
        enable_prefix_caching=False,  # so a resumed request's blocks can only come from us
    )
    assert got is not None, proc.stderr[-3000:]
    assert _tokens(got, 0) == _tokens(ref, 0)
    counters = got["kvoffload"]
    assert counters["blocks_loaded_after_preemption"] > 0, json.dumps(counters)
    assert counters["load_errors"] == 0


def test_layerwise_loads_give_identical_outputs(tmp_path: Path, reference: Any) -> None:
    """``layerwise_loads``: the repeat's blocks are copied in layer by layer while the
    forward pass runs, each attention layer waiting for its own (vLLM's CPU build
    calls ``wait_for_layer_load`` from its attention op). Outputs equal the engine's
    without the connector; single-process, to read the counters."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result, proc = _run_engine(
        tmp_path, {**_cpu(), "layerwise_loads": True}, rounds, single_process=True
    )
    assert result is not None, proc.stderr[-3000:]
    assert result["error"] is None, result["error"]
    assert _tokens(result, 0) == _tokens(reference, 0)
    assert _tokens(result, 1) == _tokens(reference, 1)
    assert [r["cached"] for r in result["rounds"][1]] == [288, 288]
    counters = result["kvoffload"]
    assert counters["blocks_loaded"] == 18, json.dumps(counters)
    assert counters["blocks_loaded_layerwise"] == 18, json.dumps(counters)
    assert counters["layer_wait_seconds"] > 0, json.dumps(counters)  # the hook ran
    assert counters["load_errors"] == 0


def test_tensor_parallel_ranks_keep_their_own_shards(tmp_path: Path) -> None:
    """TP=2: two worker processes, each with its own tiers (``<path>/rank<r>``) holding
    its half of every block; the scheduler side asks both ranks and loads only what
    both hold. A repeat is served from the cpu tier, a restart from the disk tier, and
    outputs equal those of the same engine without the connector."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "ssd", "backend": "mmap", "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    conn = {"config": {"tiers": tiers}}
    rounds = [[_prompt(1)], [_prompt(1)]]
    # vLLM's CPU workers bind their threads per NUMA node, and this machine has one:
    # one core per rank, by hand.
    tp: dict[str, Any] = {
        "tensor_parallel_size": 2,
        "env_extra": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    }
    ref, proc = _run_engine(tmp_path / "ref", None, rounds, **tp)
    assert ref is not None, proc.stderr[-3000:]
    first, proc = _run_engine(tmp_path, conn, rounds, **tp)
    assert first is not None, proc.stderr[-3000:]
    assert _tokens(first, 0) == _tokens(ref, 0)
    assert _tokens(first, 1) == _tokens(ref, 1)
    assert first["rounds"][1][0]["cached"] == 288
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["rank0", "rank1"]
    second, proc = _run_engine(tmp_path, conn, [[_prompt(1)]], **tp)
    assert second is not None, proc.stderr[-3000:]
    assert second["rounds"][0][0]["cached"] == 288
    assert _tokens(second, 0) == _tokens(ref, 0)
