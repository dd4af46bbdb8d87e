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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles.os

from kvoffload.tools.bench.harness import gbps, ratio, timed
from kvoffload.tools.bench.raw import drop_page_cache

BLOCK = 2 * 1024 * 1024
INFLIGHT = 8


def threads(fd: int, n: int, bufs: list[mmap.mmap], write: bool) -> float:
    def worker(t: int) -> None:
        for i in range(t, n, INFLIGHT):
            if write:
                os.pwrite(fd, bufs[t], i * BLOCK)
            else:
                os.preadv(fd, [bufs[t]], i * BLOCK)

    def run() -> None:
        with ThreadPoolExecutor(INFLIGHT) as pool:
            list(pool.map(worker, range(INFLIGHT)))

    return timed(run)


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

    return timed(lambda: asyncio.run(run()))


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
                best[key] = max(best.get(key, 0.0), gbps(n * BLOCK, fn(fd, n, bufs, write)))
    os.close(fd)
    path.unlink()
    for key, figure in best.items():
        # The baseline is the thread pool of the same run: aiofiles is one on top of it.
        vs = ratio(figure, best[key.replace("aiofiles", "threads")])
        tail = f", {vs:.2f}x threads" if key.startswith("aiofiles") and vs is not None else ""
        print(f"{key:16s} {figure:.2f} GB/s (best of {args.reps}){tail}")


if __name__ == "__main__":
    main()
