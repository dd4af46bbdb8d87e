"""The ``redis`` tier against raw pipelined ``SET`` / ``GET`` loops on the same server.

For each ``redis`` tier of the config and each block size, in one run against that
tier's server (its ``url`` or ``nodes``, credentials and timeouts), interleaved:

- **raw** (``redis_raw_set_gbps`` / ``redis_raw_get_gbps``): plain redis-py (with
  hiredis, at its defaults: 64 KiB reads, hiredis packing) doing pipelined ``SET``
  then ``GET`` of values of the tier's value size (the 128-byte record header plus
  the block), ``batch`` commands per pipeline; the values are ready-made ``bytes``,
  and the replies are only received, not copied anywhere. What a user of redis-py
  gets without tuning.
- **tuned** (``redis_tuned_set_gbps`` / ``redis_tuned_get_gbps``): the same loop on the
  tier's own client (:func:`~kvoffload.backends.redis.make_client`: 1 MiB reads,
  zero-copy packing), sending ``memoryview`` rows of one buffer and receiving every
  ``GET`` value into one reused row (:class:`_OneRow`): the tier's client settings
  without its work (no header, checksum, verification or row bookkeeping). The
  baseline the tier's overhead is measured against (issue 23: the raw loop alone
  compared client settings, not the tier).
- **redis-benchmark** (``redis_benchmark_set_gbps`` / ``..._get_gbps``): the server's
  own ``redis-benchmark -P batch -d value_bytes -t set,get -c 1 -n blocks``, one
  connection like the other loops; ``None``, with ``redis_benchmark`` saying why,
  where it is not installed or cannot be pointed at the server (a cluster, TLS,
  credentials, which it would take on its command line).
- **tier** (``store_gbps`` / ``load_gbps``): :meth:`RedisBackend.write` /
  :meth:`RedisBackend.read` of the same number of blocks, ``batch`` per call as the
  Offloader sends them: writes from the rows of one page-aligned source (a tier's
  slab or a staging buffer), reads into one page-aligned staging buffer of ``batch``
  rows reused for every call. Packing, headers, checksums and their verification are
  in the figure. GB/s of block bytes (the user's data; the header is 128 bytes more
  per block, under 0.05% at 256 KiB).

``store_vs_raw`` / ``load_vs_raw``, ``store_vs_tuned`` / ``load_vs_tuned`` and
``store_vs_redis_benchmark`` / ``load_vs_redis_benchmark`` are tier over each. Each side
runs ``reps`` times, interleaved, best kept. The keys live under their own prefix
(``kvobench-<pid>``; redis-benchmark's one key, ``key:__rand_int__``, is removed after
it) and are removed after each measurement, so the tier's own blocks are never touched
and the server holds one measurement's values at a time: its ``maxmemory`` must hold
``total_bytes`` plus a little, or it evicts mid-run (then this raises, it does not
report a figure of misses).
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import numpy as np
import redis
import torch
from redis.cluster import ClusterNode, RedisCluster

from kvoffload.backends.redis import RedisBackend, RedisTierConfig, make_client
from kvoffload.backends.redis.read import ReadSink, Sinks, Sunk
from kvoffload.blockpool import page_aligned_empty
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey, chain_key
from kvoffload.record import HEADER_BYTES
from kvoffload.tools.bench.harness import gbps, ratio, timed, timed_result
from kvoffload.tools.bench.raw import layout_of_size

logger = logging.getLogger(__name__)

REDIS_BATCH: Final = 32
"""Blocks per pipeline, raw and tier alike: one engine store of 512 tokens at 16 tokens
per block, which is what the Offloader hands a lower tier in one write."""

REDIS_BENCHMARK_KEY: Final = b"key:__rand_int__"
"""The one key ``redis-benchmark`` writes without ``-r``: removed after each run."""


class _OneRow(ReadSink):
    """The tuned loop's read sink: every ``GET`` value goes into one reused row,
    received by the tier's parser straight from the socket (its header through the
    parser's small buffer), and nothing is computed of it."""

    def __init__(self, block_bytes: int, value_bytes: int) -> None:
        super().__init__(page_aligned_empty(1, block_bytes).numpy(), [], value_bytes)

    def claim(self, header: bytes | memoryview) -> int | None:
        return 0

    def note(self, row: int, header: bytes | memoryview, payload: memoryview) -> None:
        """Nothing: no checksum, no header kept (the tier's work, not the client's)."""


def bench_redis(
    tier: TierConfig,
    block_bytes: int,
    total_bytes: int,
    *,
    reps: int = 3,
    batch: int = REDIS_BATCH,
) -> dict[str, Any]:
    """Raw ``SET``/``GET`` and the tier's store/load at one block size (module docs)."""
    if not isinstance(tier, RedisTierConfig):
        raise TypeError(f"tier {tier.name!r} is not a redis tier")
    layout = layout_of_size(block_bytes)
    n = max(1, total_bytes // block_bytes)
    value_bytes = HEADER_BYTES + block_bytes
    prefix = f"kvobench-{os.getpid()}"
    cfg = tier.model_copy(
        update={"key_prefix": prefix, "capacity": (n + 1) * value_bytes, "ttl_s": None}
    )
    gen = torch.Generator().manual_seed(block_bytes)
    data = page_aligned_empty(n, block_bytes)
    data.copy_(torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=gen))
    keys = [BlockKey(chain_key(b"bench", i.to_bytes(8, "little"))) for i in range(n)]
    staging = page_aligned_empty(min(batch, n), block_bytes)
    # The raw loop's values: a header's worth of bytes plus the block, as plain bytes.
    rows = data.numpy()
    values = [bytes(HEADER_BYTES) + rows[i].tobytes() for i in range(n)]
    raw_keys = [f"{prefix}:raw:{i}".encode() for i in range(n)]
    batches = [(lo, min(n, lo + batch)) for lo in range(0, n, batch)]

    # The tuned loop's values: the same bytes as rows of one buffer, sent as views.
    packed = np.zeros((n, value_bytes), dtype=np.uint8)
    packed[:, HEADER_BYTES:] = rows
    views = [memoryview(packed[i]) for i in range(n)]
    sinks = Sinks()
    bench_cmd, why_not = _redis_benchmark_cmd(cfg, value_bytes, n, batch)

    raw_client = _raw_client(cfg)
    tuned_client = make_client(cfg, sinks)
    backend = RedisBackend(cfg, layout)
    set_s: list[float] = []
    get_s: list[float] = []
    tuned_set_s: list[float] = []
    tuned_get_s: list[float] = []
    bench_set: list[float] = []
    bench_get: list[float] = []
    store_s: list[float] = []
    load_s: list[float] = []
    try:
        slots = backend.allocate(n)
        assert slots is not None
        for _ in range(reps):
            try:
                set_s.append(timed(lambda: _raw_set(raw_client, raw_keys, values, batches)))
                seconds, sizes = timed_result(lambda: _raw_get(raw_client, raw_keys, batches))
                get_s.append(seconds)
                if sizes != [value_bytes] * n:
                    raise AssertionError(_evicted(tier, "raw GET", total_bytes))
            finally:
                _raw_delete(raw_client, raw_keys, batches)
            try:
                tuned_set_s.append(timed(lambda: _raw_set(tuned_client, raw_keys, views, batches)))
                sinks.active = _OneRow(block_bytes, value_bytes)
                try:
                    seconds, got = timed_result(lambda: _tuned_get(tuned_client, raw_keys, batches))
                    tuned_get_s.append(seconds)
                finally:
                    sinks.active = None
                if got != n:
                    raise AssertionError(_evicted(tier, "tuned GET", total_bytes))
            finally:
                _raw_delete(raw_client, raw_keys, batches)
            try:
                store_s.append(timed(lambda: _store(backend, slots, keys, data, batches)))
                seconds, valid = timed_result(lambda: _load(backend, slots, keys, staging, batches))
                load_s.append(seconds)
                if not all(valid):
                    raise AssertionError(_evicted(tier, "tier read", total_bytes))
                lo, hi = batches[-1]
                if not torch.equal(staging[: hi - lo], data[lo:hi]):
                    raise AssertionError(f"tier {tier.name}: bench read back different bytes")
            finally:
                backend.delete(keys)
            if bench_cmd is not None:
                try:
                    set_rps, get_rps = _run_redis_benchmark(bench_cmd)
                finally:
                    raw_client.unlink(REDIS_BENCHMARK_KEY)
                bench_set.append(set_rps)
                bench_get.append(get_rps)
    finally:
        backend.close()
        raw_client.close()
        tuned_client.close()
    block_total = n * block_bytes
    value_total = n * value_bytes
    row: dict[str, Any] = {
        "tier": tier.name,
        "backend": tier.backend,
        "block_bytes": block_bytes,
        "value_bytes": value_bytes,
        "blocks": n,
        "batch_blocks": batch,
        "reps": reps,
        "server": tier.where(),
        "store_gbps": gbps(block_total, min(store_s)),
        "load_gbps": gbps(block_total, min(load_s)),
        "redis_raw_set_gbps": gbps(value_total, min(set_s)),
        "redis_raw_get_gbps": gbps(value_total, min(get_s)),
        "redis_tuned_set_gbps": gbps(value_total, min(tuned_set_s)),
        "redis_tuned_get_gbps": gbps(value_total, min(tuned_get_s)),
        "redis_benchmark": " ".join(bench_cmd) if bench_cmd is not None else why_not,
        "redis_benchmark_set_gbps": max(bench_set) * value_bytes / 1e9 if bench_set else None,
        "redis_benchmark_get_gbps": max(bench_get) * value_bytes / 1e9 if bench_get else None,
    }
    for side, op in (("store", "set"), ("load", "get")):
        mine = row[f"{side}_gbps"]
        row[f"{side}_vs_raw"] = ratio(mine, row[f"redis_raw_{op}_gbps"])
        row[f"{side}_vs_tuned"] = ratio(mine, row[f"redis_tuned_{op}_gbps"])
        row[f"{side}_vs_redis_benchmark"] = ratio(mine, row[f"redis_benchmark_{op}_gbps"])
    return row


def _evicted(tier: TierConfig, what: str, total_bytes: int) -> str:
    return (
        f"tier {tier.name}: {what} missed blocks just written: the server evicted or "
        f"expired them; give it a maxmemory above --total ({total_bytes} bytes) plus "
        "a margin, or a smaller --total"
    )


def _raw_client(cfg: RedisTierConfig) -> redis.Redis | RedisCluster:
    """A plain redis-py client of the tier's server: its url or nodes, credentials and
    timeouts, everything else at redis-py's defaults (hiredis parses and packs)."""
    common: dict[str, Any] = {
        "username": cfg.username.get_secret_value() if cfg.username else None,
        "password": cfg.password.get_secret_value() if cfg.password else None,
        "socket_timeout": max(cfg.socket_timeout_ms / 1000, 30.0),
        "socket_connect_timeout": cfg.connect_timeout_ms / 1000,
    }
    if cfg.url is not None:
        return redis.Redis.from_url(cfg.url, **common)
    nodes = []
    for node in cfg.nodes or []:
        host, _, port = node.rpartition(":")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))  # type: ignore[no-untyped-call]
    return RedisCluster(startup_nodes=nodes, **common)


def _raw_set(
    client: Any,
    keys: list[bytes],
    values: Sequence[bytes | memoryview],
    batches: list[tuple[int, int]],
) -> None:
    for lo, hi in batches:
        pipe = client.pipeline(transaction=False)
        for i in range(lo, hi):
            pipe.set(keys[i], values[i])
        pipe.execute()


def _raw_get(client: Any, keys: list[bytes], batches: list[tuple[int, int]]) -> list[int | None]:
    """The replies' lengths (``None`` for a miss): the values are dropped, not copied."""
    got: list[int | None] = []
    for lo, hi in batches:
        pipe = client.pipeline(transaction=False)
        for i in range(lo, hi):
            pipe.get(keys[i])
        got += [None if v is None else len(v) for v in pipe.execute()]
    return got


def _tuned_get(client: Any, keys: list[bytes], batches: list[tuple[int, int]]) -> int:
    """How many values came back; each was received into the active sink's one row."""
    got = 0
    for lo, hi in batches:
        pipe = client.pipeline(transaction=False)
        for i in range(lo, hi):
            pipe.get(keys[i])
        got += sum(type(v) is Sunk for v in pipe.execute())
    return got


def _redis_benchmark_cmd(
    cfg: RedisTierConfig, value_bytes: int, n: int, batch: int
) -> tuple[list[str] | None, str]:
    """The ``redis-benchmark`` command line for ``cfg``'s server, or ``None`` and why
    not (module docs)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None, "not run: redis-benchmark is not installed (PATH)"
    if cfg.url is None:
        return None, "not run: the tier is a cluster"
    if cfg.password is not None or cfg.username is not None:
        return None, "not run: the server needs credentials (never put on a command line)"
    parts = urlsplit(cfg.url)
    if parts.scheme != "redis":
        return None, "not run: TLS"
    db = parts.path.strip("/") or "0"
    cmd = [
        exe, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379),
        "--dbnum", db, "-P", str(batch), "-d", str(value_bytes), "-c", "1",
        "-n", str(max(n, batch)), "-t", "set,get", "--csv",
    ]  # fmt: skip
    return cmd, ""


def _run_redis_benchmark(cmd: list[str]) -> tuple[float, float]:
    """``SET`` and ``GET`` requests per second, from its CSV output."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = csv.reader(out.splitlines())
    rps = {row[0]: float(row[1]) for row in rows if len(row) > 1 and row[0] in ("SET", "GET")}
    if "SET" not in rps or "GET" not in rps:
        raise AssertionError(f"redis-benchmark printed no SET/GET figures: {out[-500:]!r}")
    return rps["SET"], rps["GET"]


def _raw_delete(client: Any, keys: list[bytes], batches: list[tuple[int, int]]) -> None:
    for lo, hi in batches:
        pipe = client.pipeline(transaction=False)
        for i in range(lo, hi):
            pipe.unlink(keys[i])
        pipe.execute()


def _store(
    backend: RedisBackend,
    slots: Sequence[int],
    keys: Sequence[BlockKey],
    data: torch.Tensor,
    batches: list[tuple[int, int]],
) -> None:
    for lo, hi in batches:
        backend.write(slots[lo:hi], keys[lo:hi], data[lo:hi])


def _load(
    backend: RedisBackend,
    slots: Sequence[int],
    keys: Sequence[BlockKey],
    staging: torch.Tensor,
    batches: list[tuple[int, int]],
) -> list[bool]:
    valid: list[bool] = []
    for lo, hi in batches:
        valid += backend.read(slots[lo:hi], keys[lo:hi], staging[: hi - lo])
    return valid
