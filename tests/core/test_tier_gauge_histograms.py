"""The tier metrics that are not plain counters: the ``breaker_open`` gauge and the
latency histograms (``kvoffload/metrics.py``), from the books to Prometheus.

Both travel the connector's counter path: deltas of cumulative values, summed by vLLM
over workers and intervals. A gauge's drop is a negative delta, and a histogram
travels as per-bucket counts and seconds that the exposition turns back into
observations. These tests follow them from the books (real ``Books``, settled by
hand) and ``LatencySamples`` through the deltas the worker side computes to a real
``prometheus_client`` registry, with exact values at each step.
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
from types import SimpleNamespace
from typing import Any, Final

import pytest
from support.blocks import make_keys

from kvoffload.books import Books
from kvoffload.config import load_config
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.metrics import LATENCY_BUCKETS, LatencySamples, bucket_value, histogram_values
from kvoffload.plans import Tally, WriteOutcome
from kvoffload.slots import SlotAllocator

HAS_VLLM: Final = importlib.util.find_spec("vllm") is not None
BPB: Final = 4096


def _books(breaker_errors: int) -> Books:
    """A cpu tier over a lower one whose breaker trips after ``breaker_errors``."""
    config = load_config(
        {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": 8 * BPB},
                {"name": "low", "backend": "cpu", "capacity": 8 * BPB},
            ]
        },
        env={},
    )
    tiers = config.resolved_tiers()
    tiers[1] = tiers[1].model_copy(update={"breaker_errors": breaker_errors})
    return Books(
        [
            LRUOffloadingManager(SlotAllocator(8), "lru", name=t.name, enable_events=False)
            for t in tiers
        ],
        tiers,
        bytes_per_block=BPB,
        persistent=[False, True],
        prefetch_max_inflight=4 * BPB,
        depth=lambda t: 0,
        discard=lambda t, slots: None,
    )


def _settle_health(books: Books, ok: bool, key: int) -> None:
    """A first-tier store that landed, whose tally carries one read or write of the
    lower tier, ``ok`` or failed: what feeds that tier's breaker."""
    (k,) = make_keys(1, salt=key)
    write = books.plan_store([k], [0], 0.0)
    assert write is not None
    books.settle(WriteOutcome(write, [True], tally=Tally(health=[(1, ok)])))


def test_breaker_open_is_one_from_the_trip_to_the_next_success() -> None:
    books = _books(breaker_errors=2)
    low = books.stats[1]
    seen = []
    for i, ok in enumerate([False, False, False, True, False]):
        _settle_health(books, ok, i)
        seen.append((low.breaker_open, low.breaker_trips))
    # The second failure trips it; a third (bypassed meanwhile) keeps it open, with one
    # trip; a success closes it; one failure after that is below the limit again.
    assert seen == [(0, 0), (1, 1), (1, 1), (0, 1), (0, 1)]
    assert books.stats[0].breaker_open == 0  # the first tier has no breaker


def test_latency_samples_keep_a_histogram_of_every_sample() -> None:
    samples = LatencySamples(maxlen=2)
    for s in (0.0004, 0.0005, 0.0007, 0.003, 42.0):
        samples.append(s)
    assert list(samples) == [0.003, 42.0]  # the recent ones only
    counts, sums = samples.histogram
    assert len(counts) == len(LATENCY_BUCKETS) + 1
    # le is inclusive: 0.0005 is in the first bucket, 0.0007 in the second; 42 in +Inf.
    assert {i: c for i, c in enumerate(counts) if c} == {0: 2, 1: 1, 3: 1, 14: 1}
    assert sums[0] == pytest.approx(0.0009)
    assert histogram_values("h", samples) == {
        "h_n0": 2,
        "h_s0": sums[0],
        "h_n1": 1,
        "h_s1": 0.0007,
        "h_n3": 1,
        "h_s3": 0.003,
        "h_n14": 1,
        "h_s14": 42.0,
    }
    # A copy (pickled to another process, copied) keeps the whole histogram.
    assert pickle.loads(pickle.dumps(samples)).histogram == samples.histogram


def test_bucket_value_stays_inside_its_bucket() -> None:
    # Three samples of exactly a bound: their mean, rounded, may not leave the bucket.
    assert bucket_value(1, 3, 0.003) <= LATENCY_BUCKETS[1]
    assert bucket_value(1, 3, 0.003) > LATENCY_BUCKETS[0]
    # Rounding below the lower bound is lifted back in.
    assert bucket_value(1, 1, LATENCY_BUCKETS[0]) > LATENCY_BUCKETS[0]
    assert bucket_value(len(LATENCY_BUCKETS), 2, 30.0) == 15.0  # +Inf: the mean


def test_deltas_rebuild_the_gauge_and_histograms_in_prometheus() -> None:
    """Two intervals of deltas, as the worker side computes them (now minus what it
    reported): the breaker opens, then closes (a delta of -1); loads land in buckets
    in both intervals. The exposition's gauge, bucket counts and sums are exact."""
    if not HAS_VLLM:  # a runtime skip: under CI=true (vLLM installed) a skip fails
        pytest.skip("vLLM is not installed")
    from kvoffload.connectors.vllm import TieredOffloadPromMetrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    types = {c: functools.partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = TieredOffloadPromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    loads = LatencySamples(maxlen=8)
    reported: dict[str, Any] = {}

    def interval(breaker_open: int, new_loads: list[float]) -> None:
        loads.extend(new_loads)
        now = {"tier.disk.breaker_open": breaker_open, "tier.disk.hits": len(loads)}
        now |= {
            f"tier.disk.{k}": v for k, v in histogram_values("load_latency_seconds", loads).items()
        }
        delta = {k: v - reported.get(k, 0) for k, v in now.items()}
        reported.update(now)
        prom.observe({k: v for k, v in delta.items() if v}, engine_idx=0)

    labels = {"engine": "0", "tier": "disk"}

    def value(name: str, **more: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvoffload_tier_{name}", {**labels, **more})

    interval(1, [0.002, 0.002, 0.02])
    assert value("breaker_open") == 1
    assert value("hits_total") == 3
    interval(0, [0.002, 0.2])
    assert value("breaker_open") == 0
    assert value("hits_total") == 5
    cumulative = {"0.001": 0, "0.0025": 3, "0.01": 3, "0.025": 4, "0.25": 5, "+Inf": 5}
    for le, count in cumulative.items():
        assert value("load_latency_seconds_bucket", le=le) == count, le
    assert value("load_latency_seconds_count") == 5
    assert value("load_latency_seconds_sum") == pytest.approx(0.226)
