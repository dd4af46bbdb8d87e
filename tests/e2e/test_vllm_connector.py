"""End to end on a real vLLM engine (CPU build, dummy-weight tiny Llama, no mocks).

The engines run in the session's engine server (``support/e2e.py``), in vLLM's
single-process mode, so that each test proves its hits from the connector's counters
(``blocks_loaded``, ``load_errors``): vLLM's ``num_cached_tokens`` is no proof, since
it does not lower it when it recomputes blocks whose load failed. The tests with a
``loads`` parameter also run with every load failing (``loads="failing"``: the first
tier is the test plugin's ``flakycpu`` with every read an I/O error) and must then
fail their own checks; ``E2E_FAIL_EVERY_LOAD=1`` runs every test so
(``support/e2e.py``, docs/reliability.md). The restart over mmap and the
tensor-parallel test run in vLLM's default multi-process mode (the scheduler side asks
the worker's books over a socket) under ``kv_load_failure_policy="fail"``, where a
failed load fails its request; they read the connector's counters from its Prometheus
metrics. Under ``CI=true`` a missing vLLM fails these tests (``support/ci_rules.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload.backends.mmap import MmapBackend
from support.e2e import (
    BATCH,
    BATCH_BLOCKS,
    EngineRun,
    EngineServer,
    assert_loaded,
    cached,
    connector_tiers,
    failures,
    outputs,
    sabotaged,
    tokens,
)

from kvoffload.record import HEADER_BYTES

pytestmark = pytest.mark.slow  # real vLLM engines
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

PROMPT_TOKENS = 300  # 9 full blocks of 32, plus a partial one
LOADS = ["real", "failing"]
"""``failing``: the same test with every load failing, which must fail its checks."""


def _prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    return tokens(seed, n)


def _run(
    engines: EngineServer,
    tmp: Path,
    kvoffload: dict[str, Any] | None,
    rounds: list[list[list[int]]],
    max_tokens: int = 8,
    single_process: bool = True,
    failure_policy: str | None = "recompute",
    env: dict[str, str] | None = None,
    **engine: Any,
) -> EngineRun:
    """Run one engine over ``rounds`` of prompts. ``failure_policy`` is vLLM's
    ``kv_load_failure_policy`` (``None``: vLLM's default, ``"fail"``); these tests were
    written for ``"recompute"`` (tests/e2e/test_verified_hits.py runs both)."""
    return engines.run(
        tmp,
        single_process=single_process,
        kvoffload=kvoffload,
        failure_policy=failure_policy,
        rounds=rounds,
        max_tokens=max_tokens,
        engine=engine,
        env=env or {},
    )


def _engine(
    engines: EngineServer, tmp: Path, kvoffload: dict[str, Any] | None, rounds: Any, **kw: Any
) -> dict[str, Any]:
    """The result of one engine run that must run without an error."""
    run = _run(engines, tmp, kvoffload, rounds, **kw)
    assert not run.failed, run.detail()
    assert len(run.results) == 1, run.detail()
    result: dict[str, Any] = run.results[0]
    return result


@contextlib.contextmanager
def _checks(loads: str) -> Iterator[None]:
    """The test's checks: they pass with real loads, and fail with failing ones."""
    if loads == "real":
        yield
        return
    with pytest.raises(AssertionError):
        yield


def _conn(conn: dict[str, Any], loads: str) -> dict[str, Any]:
    return conn if loads == "real" else sabotaged(conn)


def _cpu(capacity: str = "64MiB") -> dict[str, Any]:
    return {"config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": capacity}]}}


@pytest.fixture(scope="module")
def reference(engines: EngineServer, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Outputs without any connector: two prompts, twice."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    return _engine(engines, tmp_path_factory.mktemp("ref"), None, rounds)


@pytest.mark.parametrize("loads", LOADS)
def test_outputs_equal_and_a_repeat_is_served_from_the_cpu_tier(
    engines: EngineServer, tmp_path: Path, reference: Any, loads: str
) -> None:
    """Greedy outputs are identical with the connector; after reset_prefix_cache the
    repeated prompts come back from our cpu tier (9 blocks of 32 tokens each)."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result = _engine(engines, tmp_path, _conn(_cpu(), loads), rounds)
    with _checks(loads):
        assert outputs(result, 0) == outputs(reference, 0)
        assert outputs(result, 1) == outputs(reference, 1)
        assert cached(result, 0) == [0, 0]
        assert cached(result, 1) == [288, 288]
        assert cached(reference, 1) == [0, 0]  # vLLM alone: nothing
        assert_loaded(result, 18)


def _background(conn: dict[str, Any]) -> dict[str, Any]:
    """``conn`` with every hit loaded in the background (``async_load_min_bytes`` 1)."""
    conn["config"]["async_load_min_bytes"] = 1
    return conn


@pytest.mark.parametrize("loads", LOADS)
def test_a_large_hit_loads_in_the_background(
    engines: EngineServer, tmp_path: Path, reference: Any, loads: str
) -> None:
    """A hit of ``async_load_min_bytes`` or more (here every hit) is vLLM's asynchronous
    load: the request waits in ``WAITING_FOR_REMOTE_KVS`` while the worker loads it
    between steps, and is reported received (``get_finished``). Under vLLM's default
    ``"fail"``: outputs equal, the repeat's 18 blocks loaded in the background."""
    conn = _conn(_background(_cpu()), loads)
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result = _engine(engines, tmp_path, conn, rounds, failure_policy=None)
    with _checks(loads):
        assert outputs(result, 0) == outputs(reference, 0)
        assert outputs(result, 1) == outputs(reference, 1)
        assert cached(result, 1) == [288, 288]
        assert_loaded(result, 18)
        assert result["kvoffload"]["loads_in_background"] == 2


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_background_load_follows_vllms_policy(
    engines: EngineServer, tmp_path: Path, reference: Any, policy: str
) -> None:
    """Every read of the cpu tier an I/O error, in the background: the load fails whole
    (``failed_recving``). Under ``"recompute"`` vLLM recomputes the request (outputs
    equal, no request failed) and the connector does not look it up again; under
    ``"fail"`` both requests fail (``finish_reason`` "error") and the engine serves on:
    a third round, on prompts of their own, is served in full."""
    conn = sabotaged(_background(_cpu()))
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)], [_prompt(3)]]
    result = _engine(engines, tmp_path, conn, rounds, failure_policy=policy)
    counts = result["kvoffload"]
    assert (counts["blocks_loaded"], counts["load_errors"]) == (0, 18)
    assert counts["loads_in_background"] == 2
    assert outputs(result, 0) == outputs(reference, 0)
    if policy == "recompute":
        assert outputs(result, 1) == outputs(reference, 1)
        assert result["failed"] == 0
    else:
        second = result["rounds"][1]
        assert [r["failed"] for r in second] == [True, True], second
        assert [r["finish_reason"] for r in second] == ["error", "error"], second
        assert result["failed"] == 2
    third = result["rounds"][2]
    assert not third[0]["failed"], third
    assert third[0]["finish_reason"] in ("length", "stop"), third


@pytest.mark.parametrize(
    ("backend", "loads"), [("mmap", "real"), ("lmdb", "real"), ("lmdb", "failing")]
)
def test_a_restarted_engine_is_served_from_the_disk_tier(
    engines: EngineServer, tmp_path: Path, reference: Any, backend: str, loads: str
) -> None:
    """An engine stores a prompt through cpu -> disk; a new engine over the same tiers
    (its cpu tier empty) is served the prompt's 9 blocks from the disk: 9 blocks
    loaded. Over mmap the new engine runs in vLLM's default multi-process mode under
    ``"fail"``, where a failed load would fail the request, its counters read from its
    Prometheus metrics; over lmdb single-process, its counters read in the process,
    each of the 9 a hit of the disk tier."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "disk", "backend": backend, "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    conn = _conn({"config": {"tiers": tiers}}, loads)
    _engine(engines, tmp_path, conn, [[_prompt(1)]])
    default_mode = backend == "mmap"
    second = _engine(
        engines,
        tmp_path,
        conn,
        [[_prompt(1)]],
        single_process=not default_mode,
        failure_policy="fail" if default_mode else "recompute",
    )
    with _checks(loads):
        assert second["rounds"][0][0]["cached"] == 288  # a new engine: only the disk had it
        assert outputs(second, 0)[0] == outputs(reference, 0)[0]
        assert second["failed"] == 0
        assert_loaded(second, 9)
        if not default_mode:
            assert second["kvoffload"]["tier.disk.hits"] == 9, json.dumps(second["kvoffload"])


def test_bad_yaml_fails_engine_start_naming_the_field(
    engines: EngineServer, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - name: cpu\n    capacity: -1GiB\n")
    run = _run(engines, tmp_path, {"config_file": str(bad)}, [[_prompt(1)]])
    assert not run.results
    assert len(run.failed) == 1
    assert "tiers[0].capacity = '-1GiB'" in run.detail() + run.stderr


@pytest.mark.parametrize(
    ("loads", "background"), [("real", False), ("failing", False), ("real", True)]
)
def test_corrupt_disk_block_is_recomputed_not_served(
    engines: EngineServer, tmp_path: Path, reference: Any, loads: str, background: bool
) -> None:
    """Between two engine runs, one payload byte of a stored block is flipped on disk.
    The second run's output still equals the reference, the engine does not crash, and
    the bad block is counted. The prefetch into the cpu tier finds it before the hit is
    claimed: the hit ends before it (3 blocks loaded), so vLLM computes the rest itself
    and nothing is a load error. With the hit loaded in the background (``background``)
    under vLLM's default ``"fail"``: the same, and no request failed."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "ssd", "backend": "mmap", "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    conn = _conn({"config": {"tiers": tiers}}, loads)
    policy: dict[str, Any] = {}
    if background:
        conn = _background(conn)
        policy = {"failure_policy": "fail"}
    _engine(engines, tmp_path, conn, [[_prompt(1)]])
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
    run = _run(engines, tmp_path, conn, [[_prompt(1)]], **policy)
    assert len(run.results) == 1, run.detail()
    (second,) = run.results
    assert second["failed"] == 0, failures(second)
    assert outputs(second, 0)[0] == outputs(reference, 0)[0]
    assert "1 of " in run.stderr
    assert "failed verification" in run.stderr
    counters = second["kvoffload"]
    assert counters["tier.ssd.corrupt_blocks"] == 1, json.dumps(counters)
    with _checks(loads):
        assert_loaded(second, 3)  # the blocks before it; found before the claim
        assert counters["loads_in_background"] == int(background)


@pytest.mark.parametrize("loads", LOADS)
def test_preempted_requests_come_back_from_the_tiers(
    engines: EngineServer, tmp_path: Path, loads: str
) -> None:
    """A 24-block KV pool for 4 concurrent requests of 10 prompt blocks and 64 new
    tokens each: vLLM must preempt. With vLLM's own prefix cache off, a resumed request
    can only recompute or load: outputs equal those of an engine with room to spare,
    and the resumed request loads its blocks back from our tiers. vLLM's schedule is
    the same every run (one process, a cpu tier: no prefetch to wait for): one request
    is preempted, and on its return loads its prompt's 9 full blocks (a hit never goes
    past the prompt): 9 blocks loaded, all after preemption."""
    prompts = [_prompt(10 + i) for i in range(4)]
    small = {
        "num_gpu_blocks_override": 24,
        "max_model_len": 512,
        "enable_prefix_caching": False,  # so a resumed request's blocks can only come from us
    }
    ref, got = engines.results(
        tmp_path,
        rounds=[prompts],
        max_tokens=64,
        failure_policy="recompute",
        engines=[
            {"kvoffload": None},
            {"kvoffload": _conn(_cpu(), loads), "engine": {"gpu_memory_utilization": 0.2, **small}},
        ],
    )
    counters = got["kvoffload"]
    with _checks(loads):
        assert outputs(got, 0) == outputs(ref, 0)
        assert counters["blocks_loaded_after_preemption"] == 9, json.dumps(counters)
        assert_loaded(got, 9)


@pytest.mark.parametrize("loads", LOADS)
def test_layerwise_loads_give_identical_outputs(
    engines: EngineServer, tmp_path: Path, reference: Any, loads: str
) -> None:
    """``layerwise_loads``: the repeat's blocks are copied in layer by layer while the
    forward pass runs, each attention layer waiting for its own (vLLM's CPU build
    calls ``wait_for_layer_load`` from its attention op). Outputs equal the engine's
    without the connector."""
    rounds = [[_prompt(1), _prompt(2)], [_prompt(1), _prompt(2)]]
    result = _engine(engines, tmp_path, {**_conn(_cpu(), loads), "layerwise_loads": True}, rounds)
    counters = result["kvoffload"]
    with _checks(loads):
        assert outputs(result, 0) == outputs(reference, 0)
        assert outputs(result, 1) == outputs(reference, 1)
        assert cached(result, 1) == [288, 288]
        assert_loaded(result, 18)
        assert counters["blocks_loaded_layerwise"] == 18, json.dumps(counters)
        assert counters["layer_wait_seconds"] > 0, json.dumps(counters)  # the hook ran


def test_tensor_parallel_ranks_keep_their_own_shards(engines: EngineServer, tmp_path: Path) -> None:
    """TP=2: two worker processes, each with its own tiers (``<path>/rank<r>``) holding
    its half of every block; the scheduler side asks both ranks and loads only what
    both hold. The first round runs on empty tiers (no token cached): computed by the
    engine, it is the reference. A repeat is served from the cpu tier, a restart from
    the disk tier, both with the first round's outputs. vLLM's default multi-process
    mode, under ``"fail"``: a failed load would fail its request. The connector's
    Prometheus counters, summed over the ranks, count each rank's load of its own half
    of the prompt's 9 blocks: 18 blocks loaded by the repeat, 18 by the restart, no
    load error."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB"},
        {"name": "ssd", "backend": "mmap", "capacity": "128MiB", "path": str(tmp_path / "t")},
    ]
    conn = {"config": {"tiers": tiers}}
    # vLLM's CPU workers bind their threads per NUMA node, and this machine has one:
    # one core per rank, by hand.
    first, second = engines.results(
        tmp_path,
        single_process=False,
        failure_policy="fail",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        engine={"tensor_parallel_size": 2},
        engines=[
            {"kvoffload": conn, "rounds": [[_prompt(1)], [_prompt(1)]]},
            {"kvoffload": conn, "rounds": [[_prompt(1)]]},
        ],
    )
    assert first["rounds"][0][0]["cached"] == 0  # empty tiers: the engine computed it
    assert outputs(first, 1) == outputs(first, 0)
    assert first["rounds"][1][0]["cached"] == 288
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["rank0", "rank1"]
    assert second["rounds"][0][0]["cached"] == 288
    assert outputs(second, 0) == outputs(first, 0)
    for result in (first, second):
        assert not result["kvoffload"]  # multi-process: only Prometheus has them
        assert_loaded(result, 2 * 9)  # each rank its half of the 9 blocks


@pytest.mark.parametrize("loads", LOADS)
def test_an_fp8_cache_is_stored_byte_for_byte(
    engines: EngineServer, tmp_path: Path, reference: Any, loads: str
) -> None:
    """``kv_cache_dtype="fp8"``: vLLM keeps the cache in ``uint8`` tensors, and the
    connector stores those bytes as they are. A repeat is served from the cpu tier and
    a new engine from the disk tier (28 blocks each: the batch's every full block),
    outputs equal to the same fp8 engine without the connector."""
    conn = _conn(connector_tiers("mmap", tmp_path / "disk", capacity="64MiB"), loads)
    ref, repeat, restart = engines.results(
        tmp_path,
        rounds=[BATCH, BATCH],
        failure_policy="recompute",
        engine={"kv_cache_dtype": "fp8"},
        engines=[
            {"kvoffload": None},
            {"kvoffload": conn},
            {"kvoffload": conn, "rounds": [BATCH]},
        ],
    )
    with _checks(loads):
        assert outputs(repeat, 0) == outputs(ref, 0)
        assert outputs(repeat, 1) == outputs(ref, 1)
        assert outputs(restart, 0) == outputs(ref, 0)
        assert_loaded(repeat, BATCH_BLOCKS)
        assert_loaded(restart, BATCH_BLOCKS)
        assert restart["kvoffload"]["tier.disk.hits"] == BATCH_BLOCKS
