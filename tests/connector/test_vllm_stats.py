"""The connector's vLLM stats object: sums that aggregate across workers and intervals."""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("vllm")

from kvoffload.connectors.vllm import (
    TieredOffloadConnector,
    TieredOffloadStats,
    rank_affinity,
    rank_cpus,
)


def test_stats_aggregate_by_addition_and_reduce_to_the_sums() -> None:
    a = TieredOffloadConnector.build_kv_connector_stats({"blocks_loaded": 3, "tier.cpu.hits": 3})
    b = TieredOffloadConnector.build_kv_connector_stats(
        {"blocks_loaded": 2, "tier.ssd.hits": 2, "load_errors": 1}
    )
    assert isinstance(a, TieredOffloadStats)
    assert isinstance(b, TieredOffloadStats)
    assert not a.is_empty()
    merged = a.aggregate(b)
    assert merged.reduce() == {
        "blocks_loaded": 5,
        "tier.cpu.hits": 3,
        "tier.ssd.hits": 2,
        "load_errors": 1,
    }
    merged.reset()
    assert merged.is_empty()
    assert TieredOffloadStats(data={"blocks_loaded": 0}).is_empty()


def test_token_and_seconds_counters_add_up_too() -> None:
    a = TieredOffloadConnector.build_kv_connector_stats(
        {"tokens_loaded": 96, "tier.cpu.read_seconds": 0.25, "tier.cpu.write_seconds": 0.5}
    )
    b = TieredOffloadConnector.build_kv_connector_stats(
        {"tokens_stored": 64, "tokens_loaded": 32, "tier.cpu.read_seconds": 0.5}
    )
    assert isinstance(a, TieredOffloadStats)
    assert isinstance(b, TieredOffloadStats)
    assert a.aggregate(b).reduce() == {
        "tokens_loaded": 128,
        "tokens_stored": 64,
        "tier.cpu.read_seconds": 0.75,
        "tier.cpu.write_seconds": 0.5,
    }
    assert TieredOffloadStats(data={"tier.cpu.read_seconds": 0.0}).is_empty()
    assert not TieredOffloadStats(data={"tier.cpu.read_seconds": 1e-6}).is_empty()


@pytest.mark.parametrize(
    ("environ", "cpus"),
    [
        ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),
        ({"GOMP_CPU_AFFINITY": "4-6,9"}, {4, 5, 6, 9}),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}, {2, 3}),
        ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}, {0, 1}),
        ({}, None),
    ],
)
def test_rank_cpus_reads_what_vllm_set_for_openmp(
    environ: dict[str, str], cpus: set[int] | None
) -> None:
    """vLLM's CPU build binds the worker's main thread to one CPU; the connector starts
    its threads on the rank's whole OpenMP CPU list, read from these variables."""
    assert rank_cpus(environ) == cpus


@pytest.mark.parametrize("ranks", [1, 2])
def test_threads_made_under_rank_affinity_get_more_than_the_bound_cpu(
    monkeypatch: pytest.MonkeyPatch, ranks: int
) -> None:
    """The thread that builds the Offloader is bound to one CPU (as vLLM binds its CPU
    worker's main thread); threads made inside ``rank_affinity`` run on every CPU the
    process may use (one rank) or on the rank's OpenMP CPUs (several), and the
    builder's own binding is restored after."""
    allowed = os.sched_getaffinity(0)
    rank_cpus = {max(allowed)} if ranks > 1 else allowed
    monkeypatch.setenv("GOMP_CPU_AFFINITY", " ".join(map(str, sorted(rank_cpus))))
    seen: dict[str, set[int]] = {}

    def builder() -> None:
        os.sched_setaffinity(0, {min(allowed)})
        with rank_affinity(ranks):
            lane = threading.Thread(target=lambda: seen.update(lane=os.sched_getaffinity(0)))
            lane.start()
            lane.join()
        seen["builder"] = os.sched_getaffinity(0)

    t = threading.Thread(target=builder)
    t.start()
    t.join()
    assert seen == {"lane": rank_cpus, "builder": {min(allowed)}}
