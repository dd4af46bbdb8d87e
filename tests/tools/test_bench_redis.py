"""The redis part of ``kvoffload bench`` against real ``redis-server`` processes.

Tiny runs (a few MiB): the figures mean nothing at this size, but the schema, the
ratios, the cleanup of the bench's keys and the refusal to report a figure of misses
must hold at any size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from support.redisserver import RedisClusterProcs, RedisServer, require_redis

from kvoffload.config import load_config
from kvoffload.tools.bench import disk_rows, redis_rows
from kvoffload.tools.bench.redis import bench_redis

KIB = 1024
MIB = 1024 * KIB
KEYS = (
    "store_gbps",
    "load_gbps",
    "redis_raw_set_gbps",
    "redis_raw_get_gbps",
    "store_vs_raw",
    "load_vs_raw",
    "redis_tuned_set_gbps",
    "redis_tuned_get_gbps",
    "store_vs_tuned",
    "load_vs_tuned",
)
CEILING = (
    "redis_benchmark_set_gbps",
    "redis_benchmark_get_gbps",
    "store_vs_redis_benchmark",
    "load_vs_redis_benchmark",
)


def _positive_finite(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _tier(url: str | None = None, nodes: list[str] | None = None) -> Any:
    where = {"url": url} if url is not None else {"nodes": nodes}
    config = load_config(
        {
            "version": 1,
            "tiers": [
                {"name": "cpu", "backend": "cpu"},
                {"name": "shared", "backend": "redis", **where},
            ],
        }
    )
    return config, config.resolved_tiers()[1]


def test_bench_measures_redis_tier_against_raw(server: RedisServer) -> None:
    """The tier parts of ``run_bench`` (its manager and cpu parts take 20 s and are
    tested in test_bench_parts.py): the redis tier is no disk tier, and gets one row
    per block size."""
    config, _ = _tier(url=server.url())
    sizes = (256 * KIB, 2 * MIB)
    assert disk_rows(config, sizes, 4 * MIB, 1, None) == []
    rows = redis_rows(config, sizes, 4 * MIB, 1, None)
    assert [r["block_bytes"] for r in rows] == [256 * KIB, 2 * MIB]
    for row in rows:
        assert row["tier"] == "shared"
        assert row["value_bytes"] == row["block_bytes"] + 128
        assert row["blocks"] == 4 * MIB // row["block_bytes"]
        for key in KEYS:
            assert _positive_finite(row[key]), (row["block_bytes"], key)
        assert row["store_vs_raw"] == row["store_gbps"] / row["redis_raw_set_gbps"]
        assert row["load_vs_raw"] == row["load_gbps"] / row["redis_raw_get_gbps"]
        assert row["store_vs_tuned"] == row["store_gbps"] / row["redis_tuned_set_gbps"]
        assert row["load_vs_tuned"] == row["load_gbps"] / row["redis_tuned_get_gbps"]
        # redis-benchmark is installed beside redis-server here: the ceiling is run.
        n = max(row["blocks"], 32)
        assert row["redis_benchmark"].endswith(
            f"-P 32 -d {row['value_bytes']} -c 1 -n {n} -t set,get --csv"
        ), row["redis_benchmark"]
        for key in CEILING:
            assert _positive_finite(row[key]), (row["block_bytes"], key)
        assert row["load_vs_redis_benchmark"] == (
            row["load_gbps"] / row["redis_benchmark_get_gbps"]
        )
    with server.client() as c:
        assert c.dbsize() == 0  # every key of the bench removed, redis-benchmark's too


def test_bench_redis_without_redis_benchmark(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without redis-benchmark on PATH the row says so, and its figures are None."""
    _, tier = _tier(url=server.url())
    monkeypatch.setenv("PATH", "/nonexistent")
    row = bench_redis(tier, 256 * KIB, 1 * MIB, reps=1)
    assert row["redis_benchmark"] == "not run: redis-benchmark is not installed (PATH)"
    for key in CEILING:
        assert row[key] is None, key
    for key in KEYS:
        assert _positive_finite(row[key]), key


def test_bench_redis_on_a_cluster(tmp_path: Path) -> None:
    require_redis()
    cluster = RedisClusterProcs(tmp_path / "cluster").start()
    try:
        _, tier = _tier(nodes=cluster.nodes)
        row = bench_redis(tier, 256 * KIB, 2 * MIB, reps=1, batch=4)
        for key in KEYS:
            assert _positive_finite(row[key]), key
        assert row["redis_benchmark"] == "not run: the tier is a cluster"
        for srv in cluster.servers:
            with srv.client() as c:
                assert c.dbsize() == 0
    finally:
        cluster.stop()


def test_bench_redis_refuses_a_server_that_evicts(tmp_path: Path) -> None:
    """A server too small for --total evicts what the bench just wrote: an error that
    says so, not a load figure made of misses."""
    require_redis()
    srv = RedisServer(tmp_path / "small", maxmemory="2mb").start()
    try:
        _, tier = _tier(url=srv.url())
        with pytest.raises(AssertionError, match="maxmemory"):
            bench_redis(tier, 256 * KIB, 8 * MIB, reps=1)
    finally:
        srv.kill()
