"""The ``redis`` tier against a raw pipelined ``SET`` / ``GET`` loop on the same server.

For each ``redis`` tier of the config and each block size, in one run against that
tier's server (its ``url`` or ``nodes``, credentials and timeouts):

- **raw** (``redis_raw_set_gbps`` / ``redis_raw_get_gbps``): plain redis-py (with
  hiredis, at its defaults) doing pipelined ``SET`` then ``GET`` of values of the
  tier's value size (the 128-byte record header plus the block), ``batch`` commands
  per pipeline; the values are ready-made ``bytes``, and the replies are only
  received, not copied anywhere. GB/s of value bytes.
- **tier** (``store_gbps`` / ``load_gbps``): :meth:`RedisBackend.write` /
  :meth:`RedisBackend.read` of the same number of blocks, ``batch`` per call as the
  Offloader sends them: writes from the rows of one page-aligned source (a tier's
  slab or a staging buffer), reads into one page-aligned staging buffer of ``batch``
  rows reused for every call. Packing, headers, checksums and their verification are
  in the figure. GB/s of block bytes (the user's data; the header is 128 bytes more
  per block, under 0.05% at 256 KiB).

``store_vs_raw`` and ``load_vs_raw`` are tier over raw. Each side runs ``reps`` times,
interleaved, best kept. The keys live under their own prefix (``kvobench-<pid>``)
and are removed after each measurement, so the tier's own blocks are never touched
and the server holds one measurement's values at a time: its ``maxmemory`` must hold
``total_bytes`` plus a little, or it evicts mid-run (then this raises, it does not
report a figure of misses).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Final

import redis
import torch
from redis.cluster import ClusterNode, RedisCluster

from kvoffload.backends.redis import RedisBackend, RedisTierConfig
from kvoffload.blockpool import page_aligned_empty
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey, chain_key
from kvoffload.record import HEADER_BYTES
from kvoffload.tools.bench_raw import gbps, layout_of_size

logger = logging.getLogger(__name__)

REDIS_BATCH: Final = 32
"""Blocks per pipeline, raw and tier alike: one engine store of 512 tokens at 16 tokens
per block, which is what the Offloader hands a lower tier in one write."""


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

    raw_client = _raw_client(cfg)
    backend = RedisBackend(cfg, layout)
    set_s: list[float] = []
    get_s: list[float] = []
    store_s: list[float] = []
    load_s: list[float] = []
    try:
        slots = backend.allocate(n)
        assert slots is not None
        for _ in range(reps):
            try:
                start = time.perf_counter()
                _raw_set(raw_client, raw_keys, values, batches)
                set_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                sizes = _raw_get(raw_client, raw_keys, batches)
                get_s.append(time.perf_counter() - start)
                if sizes != [value_bytes] * n:
                    raise AssertionError(_evicted(tier, "raw GET", total_bytes))
            finally:
                _raw_delete(raw_client, raw_keys, batches)
            try:
                start = time.perf_counter()
                _store(backend, slots, keys, data, batches)
                store_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                valid = _load(backend, slots, keys, staging, batches)
                load_s.append(time.perf_counter() - start)
                if not all(valid):
                    raise AssertionError(_evicted(tier, "tier read", total_bytes))
                lo, hi = batches[-1]
                if not torch.equal(staging[: hi - lo], data[lo:hi]):
                    raise AssertionError(f"tier {tier.name}: bench read back different bytes")
            finally:
                backend.delete(keys)
    finally:
        backend.close()
        raw_client.close()
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
    }
    row["store_vs_raw"] = row["store_gbps"] / row["redis_raw_set_gbps"]
    row["load_vs_raw"] = row["load_gbps"] / row["redis_raw_get_gbps"]
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
    client: Any, keys: list[bytes], values: list[bytes], batches: list[tuple[int, int]]
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
