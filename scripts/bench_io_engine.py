#!/usr/bin/env python3
"""Thread pool or aiofiles for the slab's positional I/O? Measured, same disk, same run.

Both issue the same O_DIRECT ``pwrite``/``pread`` of 2 MiB blocks, 8 in flight:
- a ``ThreadPoolExecutor`` of 8 threads calling ``os.pwrite``/``os.preadv``;
- asyncio with 8 concurrent tasks awaiting ``aiofiles.os.wrap(os.pwrite)`` (aiofiles
  has no positional I/O of its own; ``wrap`` runs the call in the loop's executor).
Usage::

    .venv/bin/python scripts/bench_io_engine.py --dir out/io-engine
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles.os

from kvoffload.tools.bench_raw import drop_page_cache

BLOCK = 2 * 1024 * 1024
INFLIGHT = 8


def threads(fd: int, n: int, bufs: list[mmap.mmap], write: bool) -> float:
    def worker(t: int) -> None:
        for i in range(t, n, INFLIGHT):
            if write:
                os.pwrite(fd, bufs[t], i * BLOCK)
            else:
                os.preadv(fd, [bufs[t]], i * BLOCK)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(INFLIGHT) as pool:
        list(pool.map(worker, range(INFLIGHT)))
    return time.perf_counter() - t0


def with_aiofiles(fd: int, n: int, bufs: list[mmap.mmap], write: bool) -> float:
    pwrite = aiofiles.os.wrap(os.pwrite)  # type: ignore[attr-defined]
    preadv = aiofiles.os.wrap(os.preadv)  # type: ignore[attr-defined]

    async def worker(t: int) -> None:
        for i in range(t, n, INFLIGHT):
            if write:
                await pwrite(fd, bufs[t], i * BLOCK)
            else:
                await preadv(fd, [bufs[t]], i * BLOCK)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(INFLIGHT))
        await asyncio.gather(*(worker(t) for t in range(INFLIGHT)))

    t0 = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path("out/io-engine"))
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "io.bin"
    n = args.total_mib * 1024 * 1024 // BLOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, n * BLOCK)
    bufs = [mmap.mmap(-1, BLOCK) for _ in range(INFLIGHT)]
    best: dict[str, float] = {}
    for _ in range(args.reps):
        for name, fn in (("threads", threads), ("aiofiles", with_aiofiles)):
            for write in (True, False):
                drop_page_cache()
                key = f"{name} {'write' if write else 'read'}"
                best[key] = max(best.get(key, 0.0), n * BLOCK / fn(fd, n, bufs, write) / 1e9)
    os.close(fd)
    path.unlink()
    for key, gbps in best.items():
        print(f"{key:16s} {gbps:.2f} GB/s (best of {args.reps})")


if __name__ == "__main__":
    main()
