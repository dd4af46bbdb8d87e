"""``chain_store_ratio``: the whole store chain against what the disk can write.

The engine's side of write-through, end to end: blocks are gathered from a
:class:`~kvoffload.blockpool.BlockPool` into a cpu tier by the :class:`Offloader`,
which copies each one on into an mmap tier under ``write_policy: write_through``. The
figure is *sustained*: bytes that reached the mmap tier divided by the time from the
first submit until every queue has drained, so a fast cpu tier cannot hide a slow
disk. The baseline is raw ``O_DIRECT`` ``pwrite`` of the same block size in the same
directory, measured in the same run (the best of several thread counts, as in
:func:`kvoffload.tools.bench.raw.raw_best`). The target is a ratio of at least 0.7.

The caller behaves like an engine that must not lose blocks: it keeps the mmap tier's
queue nearly full but never full, and when the first tier refuses a store (queue full,
or no unpinned room), it waits for a finished job and resubmits. So no block is
dropped (``chain_dropped`` says so) and the disk is kept busy.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Final

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.offloader import Offloader
from kvoffload.tools.bench.harness import gbps, ratio
from kvoffload.tools.bench.raw import layout_of_size, raw_best

logger = logging.getLogger(__name__)

CHAIN_BLOCK: Final = 2 * 1024 * 1024
BATCH: Final = 16
"""Blocks per engine store (a 256-token request at 16 tokens per block)."""
WARMUP_BLOCKS: Final = 4 * BATCH
DISK_QUEUE: Final = 8


def bench_chain(
    mmap_tier: TierConfig,
    *,
    block_bytes: int = CHAIN_BLOCK,
    total_bytes: int = 1024 * 1024 * 1024,
    raw_write_gbps: float | None = None,
) -> dict[str, Any]:
    """Measure pool -> cpu -> mmap under write-through, in a fresh directory under the
    mmap tier's path (removed afterwards); ``raw_write_gbps`` is measured here when not
    given."""
    base = Path(getattr(mmap_tier, "path", "kvoffload-tier")) / "bench-chain"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        layout = layout_of_size(block_bytes)
        n_blocks = total_bytes // block_bytes
        slot = block_bytes + 4096
        config = KVOffloadConfig.model_validate(
            {
                "tiers": [
                    {
                        "name": "cpu",
                        "backend": "cpu",
                        "capacity": 8 * BATCH * block_bytes,
                        "max_pending_stores": 4,
                    },
                    {
                        **mmap_tier.model_dump(exclude={"name", "capacity", "path"}),
                        "name": "ssd",
                        "capacity": (n_blocks + WARMUP_BLOCKS + BATCH) * slot,
                        "path": str(base / "tier"),
                        "write_policy": "write_through",
                        "admit_after_hits": 0,
                        "max_pending_stores": DISK_QUEUE,
                    },
                ]
            }
        )
        key = "raw_write_gbps"
        raw_before = raw_best(base, block_bytes, total_bytes)[key] if raw_write_gbps is None else 0
        pool = BlockPool.allocate(layout, 2 * BATCH)
        pool.scatter(
            list(range(2 * BATCH)),
            torch.randint(0, 256, (2 * BATCH, block_bytes), dtype=torch.uint8),
        )
        with Offloader(config, layout, pool) as off:
            # Warm-up on other keys: staging buffers get allocated and faulted in once,
            # as in a server that has been running for a while.
            _drive(off, WARMUP_BLOCKS, first=n_blocks)
            before = off.stats[1].bytes_written
            elapsed, resubmits = _drive(off, n_blocks)
            stats = off.stats
        written = stats[1].bytes_written - before
        chain_gbps = gbps(written, elapsed)
        raw_after = raw_best(base, block_bytes, total_bytes)[key] if raw_write_gbps is None else 0
        if raw_write_gbps is None:
            # The mean of just before and just after the chain: this VM's disk drifts
            # by 2x from minute to minute, so one side alone could flatter either.
            raw_write_gbps = (raw_before + raw_after) / 2
        return {
            "chain_block_bytes": block_bytes,
            "chain_total_bytes": n_blocks * block_bytes,
            "chain_store_gbps": chain_gbps,
            "chain_raw_write_gbps": raw_write_gbps,
            "chain_raw_write_gbps_before_after": [raw_before, raw_after],
            "chain_store_ratio": ratio(chain_gbps, raw_write_gbps),
            "chain_blocks_reached_disk": written // block_bytes,
            "chain_dropped": stats[0].dropped_stores + stats[1].dropped_stores,
            "chain_resubmits": resubmits,
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _drive(off: Offloader, n_blocks: int, first: int = 0) -> tuple[float, int]:
    """Store ``n_blocks`` fresh blocks (keys from index ``first`` on) in batches; the
    seconds until all reached the disk, and how often a store had to be resubmitted."""
    parent: BlockKey = ROOT_KEY
    resubmits = 0
    inflight: dict[int, int] = {}  # job id -> pool half it reads
    start = time.perf_counter()
    for b in range(0, n_blocks, BATCH):
        keys = []
        for i in range(first + b, first + min(b + BATCH, n_blocks)):
            parent = chain_key(parent, i.to_bytes(8, "little"))
            keys.append(parent)
        half = (b // BATCH) % 2
        # The pool half this batch reads must not be in use by the previous batch of it.
        for busy, h in list(inflight.items()):
            if h == half:
                off.wait([busy])
                del inflight[busy]
        ids = list(range(half * BATCH, half * BATCH + len(keys)))
        # Keep the disk's queue full but never overflowing, so no copy is dropped: the
        # figure is what the chain sustains, not what a burst leaves behind.
        while off.pending_stores()[-1] >= DISK_QUEUE - 1:
            time.sleep(0.0005)
        while (submitted := off.submit_store(keys, ids)) is None:
            resubmits += 1
            done = off.wait(list(inflight), timeout=0.01) if inflight else []
            for r in done:
                inflight.pop(r.job_id, None)
            if not done:
                time.sleep(0.002)
        inflight[submitted] = half
    off.wait(list(inflight))
    if not off.drain(timeout=600):
        logger.warning("chain bench: queues did not drain in 600 s")
    return time.perf_counter() - start, resubmits
