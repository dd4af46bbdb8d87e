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
