"""The connector's vLLM stats object: sums that aggregate across workers and intervals."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvoffload.connectors.vllm import TieredOffloadConnector, TieredOffloadStats


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
