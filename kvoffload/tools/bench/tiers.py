"""``kvoffload bench``: tier throughput against what the disk and vLLM do, in one run.

For each persistent tier of the config and each block size, in a fresh directory
under the tier's ``path`` (existing data is never touched):

- **store / load**: ``Backend.write`` / ``Backend.read`` of randomly generated blocks
  into slots allocated as the manager would (adjacent, so runs coalesce);
- **raw**: the best of 1, 4, 8 and 16 threads doing ``O_DIRECT`` ``pwrite`` / ``pread``
  of that block size on a preallocated file in the same directory: what the disk does.
  Writes get two figures, without and with the closing ``fdatasync``
  (``raw_write_gbps`` / ``raw_write_synced_gbps``): ``O_DIRECT`` does not make data
  durable, and on a disk with a volatile cache the flush is most of a durable write.
  ``store_vs_raw`` is against the first, as issue 11 set it; ``store_vs_raw_synced``
  against the second, the like-for-like figure for a tier with ``fsync: true``;
- **vLLM fs**: vLLM's own filesystem tier (``batch_store_block`` / ``batch_load_block``,
  one file per block, 8 threads) on the same blocks, when vLLM is importable. It
  never syncs (``O_DIRECT`` write and rename), so its store is like-for-like only with
  a tier that has ``fsync: false``; ``configs/bench.yaml`` benches each backend both
  ways.

The page cache is dropped before every load measurement when the process may
(root), with the tier closed and reopened around it, as a restarted engine finds it (a
tier left open keeps its pages mapped, and mapped pages are not dropped); otherwise a
buffered tier's load figure is the page cache's, and the report says so. Runs in its
own process, not beside an engine.

A ``redis`` tier (:mod:`kvoffload.tools.bench.redis`) is measured against its own
server instead of a disk: the tier's store and load beside pipelined ``SET`` / ``GET``
loops with values of the same size, in the same run and interleaved: plain redis-py at
its defaults, the same loop with the tier's client settings (the baseline of the
tier's overhead), and ``redis-benchmark``; rows under ``redis`` with
``redis_raw_*_gbps``, ``redis_tuned_*_gbps``, ``redis_benchmark_*_gbps`` and the
ratios ``store_vs_raw`` / ``load_vs_raw``, ``store_vs_tuned`` / ``load_vs_tuned``,
``store_vs_redis_benchmark`` / ``load_vs_redis_benchmark``. Without a redis tier
``redis`` is an empty list.

Two parts need no tier of the config and run first, whatever it holds (and alone with
``disk=False``), because they are seconds where the disk part is minutes:

- **manager** (:mod:`kvoffload.tools.bench.manager`): scheduler-side ns per block of our
  manager against vLLM's CPU offloading manager with its LRU policy, on a Mooncake
  trace; top-level ``manager_ns_per_block``, ``vllm_lru_ns_per_block`` and
  ``manager_vs_vllm_lru`` (ours / theirs), details under ``manager``;
- **cpu** (:mod:`kvoffload.tools.bench.cpu`): ``BlockPool.gather`` / ``scatter`` and the cpu
  tier against a plain torch copy, per block size under ``cpu_ratios``; top-level
  ``cpu_gather_ratio`` / ``cpu_scatter_ratio`` are the minimum over blocks of 64 KiB
  and more.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from os import PathLike
from pathlib import Path
from typing import Any, Final

import torch

from kvoffload.blockpool import byte_view, page_aligned_empty
from kvoffload.codec import CodecStats
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.keys import BlockKey, chain_key
from kvoffload.registry import get_backend_class
from kvoffload.tools.bench.chain import bench_chain
from kvoffload.tools.bench.cpu import bench_cpu
from kvoffload.tools.bench.harness import gbps, ratio, timed
from kvoffload.tools.bench.manager import DEFAULT_CAPACITY, DEFAULT_TRACE, bench_manager
from kvoffload.tools.bench.raw import drop_page_cache, layout_of_size, raw_best
from kvoffload.tools.stress import kv_like

logger = logging.getLogger(__name__)

BLOCK_SIZES: Final = (16 * 1024, 64 * 1024, 256 * 1024, 2 * 1024 * 1024)
VLLM_THREADS: Final = 8
BATCH_BYTES: Final = 1024 * 1024 * 1024
"""Bytes per ``write``/``read`` call. The baselines (raw threads, vLLM's batch calls)
keep their whole data set in flight; so does the tier, with one call per 1 GiB."""


# ----------------------------------------------------------------------------- vLLM
def vllm_fs(directory: Path, data: torch.Tensor) -> dict[str, float | None]:
    """vLLM's filesystem tier on the same blocks: one file per block, 8 threads."""
    try:
        from vllm.v1.kv_offload.tiering.fs import io as vio
    except Exception as exc:  # not installed, or not importable on this build
        logger.warning("vLLM fs tier not benchmarked: %s", exc)
        return {"vllm_fs_store_gbps": None, "vllm_fs_load_gbps": None}
    n, block_bytes = data.shape
    root = directory / "vllm-fs"
    root.mkdir(parents=True, exist_ok=True)
    paths = [str(root / f"{i:08d}.bin") for i in range(n)]
    out = page_aligned_empty(n, block_bytes)
    src_view = byte_view(data)
    dst_view = byte_view(out)
    offsets = [i * block_bytes for i in range(n)]
    with ThreadPoolExecutor(VLLM_THREADS) as pool:

        def run(fn: Any, view: memoryview) -> float:
            # Each of the 8 threads stores or loads its share with one vLLM call.
            shares = [
                (paths[t::VLLM_THREADS], offsets[t::VLLM_THREADS]) for t in range(VLLM_THREADS)
            ]
            return timed(
                lambda: list(pool.map(lambda s: fn(s[0], view, s[1], block_bytes), shares))
            )

        w = run(vio.batch_store_block, src_view)
        drop_page_cache()
        r = run(vio.batch_load_block, dst_view)
    if not torch.equal(out, data):
        raise AssertionError("vLLM fs tier returned different bytes")
    shutil.rmtree(root, ignore_errors=True)
    return {
        "vllm_fs_store_gbps": gbps(n * block_bytes, w),
        "vllm_fs_load_gbps": gbps(n * block_bytes, r),
    }


# ----------------------------------------------------------------------------- tiers
def bench_tier(
    tier: TierConfig,
    block_bytes: int,
    total_bytes: int,
    batch_bytes: int = BATCH_BYTES,
    reps: int = 3,
    data_kind: str = "random",
) -> dict[str, Any]:
    """Store and load throughput of one backend at one block size, over random bytes
    or (``data_kind="kv"``) KV-like values that a compressing tier shrinks."""
    cls = get_backend_class(tier.backend)
    layout = layout_of_size(block_bytes)
    base = Path(getattr(tier, "path", ".")) / f"bench-{block_bytes}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    n = max(1, total_bytes // block_bytes)
    capacity = int(n * cls.slot_bytes(layout) * 1.05) + 1
    cfg = tier.model_copy(update={"path": str(base / "tier"), "capacity": capacity})
    gen = torch.Generator().manual_seed(block_bytes)
    # Page-aligned, like the staging buffers BlockPool hands out.
    data = page_aligned_empty(n, block_bytes)
    if data_kind == "kv":
        data.copy_(kv_like(layout, n, seed=block_bytes))
    else:
        data.copy_(torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=gen))
    keys = [BlockKey(chain_key(b"bench", i.to_bytes(8, "little"))) for i in range(n)]
    per_batch = max(1, batch_bytes // block_bytes)
    out = page_aligned_empty(n, block_bytes)
    # This machine's disk drifts by 2x from minute to minute, and raw gets the best of
    # four thread counts: so every side gets several tries, interleaved, best kept.
    store_s: list[float] = []
    load_s: list[float] = []
    raw: list[dict[str, float]] = []
    vllm: list[dict[str, float | None]] = []
    dropped = True
    footprint: tuple[int, int] | None = None
    codec: CodecStats | None = None
    for _ in range(reps):
        backend = cls(cfg, layout)
        try:
            slots = backend.allocate(n)
            assert slots is not None
            start = time.perf_counter()
            for lo in range(0, n, per_batch):
                hi = min(n, lo + per_batch)
                backend.write(slots[lo:hi], keys[lo:hi], data[lo:hi])
            store_s.append(time.perf_counter() - start)
            footprint = backend.stats().held
        finally:
            backend.close()
        # Loads as after a restart: closed, page cache dropped, reopened. A backend left
        # open keeps its pages mapped (LMDB, mmap), and drop_caches cannot drop mapped
        # pages: the load figure would be the page cache's.
        dropped = drop_page_cache() and dropped
        backend = cls(cfg, layout)
        try:
            where = {b.key: b.slot for b in backend.recover()}
            slots = [where[k] for k in keys]
            out.zero_()
            start = time.perf_counter()
            valid: list[bool] = []
            for lo in range(0, n, per_batch):
                hi = min(n, lo + per_batch)
                valid += backend.read(slots[lo:hi], keys[lo:hi], out[lo:hi])
            load_s.append(time.perf_counter() - start)
            codec = backend.stats().codec  # this rep's load: decompression only
        finally:
            backend.close()
        if not all(valid) or not torch.equal(out, data):
            raise AssertionError(f"tier {tier.name}: bench read back different bytes")
        shutil.rmtree(cfg.path, ignore_errors=True)  # type: ignore[attr-defined]
        raw.append(raw_best(base, block_bytes, total_bytes))
        vllm.append(vllm_fs(base, data))
    row: dict[str, Any] = {
        "tier": tier.name,
        "backend": tier.backend,
        "block_bytes": block_bytes,
        "blocks": n,
        "reps": reps,
        "store_gbps": gbps(n * block_bytes, min(store_s)),
        "load_gbps": gbps(n * block_bytes, min(load_s)),
        "page_cache_dropped": dropped,
        "fsync": getattr(tier, "fsync", None),
        "data": data_kind,
        "compression": getattr(tier, "compression", "none"),
        "compression_ratio": footprint[1] / footprint[0] if footprint and footprint[0] else None,
        "decompress_gbps": codec.decompress_gbps if codec else None,
    }
    for key in ("raw_write_gbps", "raw_write_synced_gbps", "raw_read_gbps"):
        row[key] = max(r[key] for r in raw)
    for key in ("vllm_fs_store_gbps", "vllm_fs_load_gbps"):
        got = [v[key] for v in vllm if v[key] is not None]
        row[key] = max(got) if got else None  # type: ignore[type-var]
    shutil.rmtree(base, ignore_errors=True)
    return row


def run_bench(
    config: KVOffloadConfig,
    *,
    sizes: Sequence[int] = BLOCK_SIZES,
    total_bytes: int = 512 * 1024 * 1024,
    reps: int = 3,
    progress: Callable[[str], None] | None = None,
    disk: bool = True,
    trace: str | PathLike[str] | None = None,
    manager_capacity: int = DEFAULT_CAPACITY,
    cpu_total_bytes: int = 256 * 1024 * 1024,
    data_kind: str = "random",
) -> dict[str, Any]:
    """The manager and cpu parts, then (``disk``) every persistent tier at every block
    size and every redis tier against raw redis-py; the ``--json`` schema. ``trace``
    defaults to the checkout's Mooncake slice; when that is absent (an installed
    package) the manager figures are ``None``."""
    report: dict[str, Any] = {"total_bytes": total_bytes, "reps": reps}
    if progress is not None:
        progress(f"manager: ours vs vLLM's LRU, {manager_capacity} blocks of capacity")
    manager = _manager_part(trace, manager_capacity, reps)
    report["manager"] = manager
    for key in ("manager_ns_per_block", "vllm_lru_ns_per_block", "manager_vs_vllm_lru"):
        report[key] = manager[key] if manager is not None else None
    if progress is not None:
        progress("cpu: gather / scatter vs a plain torch copy")
    report.update(bench_cpu(total_bytes=cpu_total_bytes, repeat=reps))
    report["data"] = data_kind
    report["tiers"] = (
        disk_rows(config, sizes, total_bytes, reps, progress, data_kind) if disk else []
    )
    report["redis"] = redis_rows(config, sizes, total_bytes, reps, progress) if disk else []
    report.update(_chain_part(config, total_bytes, progress) if disk else _NO_CHAIN)
    return report


_NO_CHAIN: Final[dict[str, Any]] = {"chain_store_ratio": None, "chain_store_gbps": None}


def _chain_part(
    config: KVOffloadConfig, total_bytes: int, progress: Callable[[str], None] | None
) -> dict[str, Any]:
    """pool -> cpu -> the config's first mmap tier, write-through (see bench_chain)."""
    mmap_tiers = [t for t in config.resolved_tiers() if t.backend == "mmap"]
    if not mmap_tiers:
        logger.warning("chain not benchmarked: the config has no mmap tier")
        return dict(_NO_CHAIN)
    if progress is not None:
        progress(f"chain: pool -> cpu -> {mmap_tiers[0].name} (write-through) vs raw write")
    return bench_chain(mmap_tiers[0], total_bytes=max(total_bytes, 256 * 1024 * 1024))


def _manager_part(
    trace: str | PathLike[str] | None, capacity: int, reps: int
) -> dict[str, Any] | None:
    if trace is None:
        if not DEFAULT_TRACE.is_file():
            logger.warning("manager not benchmarked: no trace at %s (pass one)", DEFAULT_TRACE)
            return None
        trace = DEFAULT_TRACE
    return bench_manager(trace, capacity=capacity, reps=reps)


def disk_rows(
    config: KVOffloadConfig,
    sizes: Sequence[int],
    total_bytes: int,
    reps: int,
    progress: Callable[[str], None] | None,
    data_kind: str = "random",
) -> list[dict[str, Any]]:
    rows = []
    for tier in config.resolved_tiers():
        cls = get_backend_class(tier.backend)
        if not cls.persistent or cls.server_booked:  # a shared server: see redis_rows
            continue
        for size in sizes:
            if progress is not None:
                progress(f"{tier.name} ({tier.backend}) at {size // 1024} KiB")
            rows.append(bench_tier(tier, size, total_bytes, reps=reps, data_kind=data_kind))
    for row in rows:
        row["store_vs_raw"] = ratio(row["store_gbps"], row["raw_write_gbps"])
        row["store_vs_raw_synced"] = ratio(row["store_gbps"], row["raw_write_synced_gbps"])
        row["load_vs_raw"] = ratio(row["load_gbps"], row["raw_read_gbps"])
        row["store_vs_vllm_fs"] = ratio(row["store_gbps"], row["vllm_fs_store_gbps"])
        row["load_vs_vllm_fs"] = ratio(row["load_gbps"], row["vllm_fs_load_gbps"])
    return rows


def redis_rows(
    config: KVOffloadConfig,
    sizes: Sequence[int],
    total_bytes: int,
    reps: int,
    progress: Callable[[str], None] | None,
) -> list[dict[str, Any]]:
    tiers = [t for t in config.resolved_tiers() if t.backend == "redis"]
    if not tiers:
        return []
    # Imported here: redis-py is an optional dependency (the ``redis`` extra).
    from kvoffload.tools.bench.redis import bench_redis

    rows = []
    for tier in tiers:
        for size in sizes:
            if progress is not None:
                progress(f"{tier.name} (redis) at {size // 1024} KiB vs SET/GET loops")
            rows.append(bench_redis(tier, size, total_bytes, reps=reps))
    return rows
