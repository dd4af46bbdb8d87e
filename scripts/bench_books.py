#!/usr/bin/env python3
"""The books' cost per block, and how often a job takes their lock.

The Offloader's books (:mod:`kvoffload.books`) decide every move under one lock that
the lane threads and the engine's thread share, so what they cost per block, and how
many times each job takes the lock, bounds how much bookkeeping a step can afford and
how much the threads contend. This times the calls into the books (every public method
of the Offloader's ``Books``, wall time, nested calls counted once) and counts the
lock's acquisitions, per phase, over a real Offloader (cpu -> mmap, write-through)
whose jobs run one at a time, so nothing contends and the figures are the books' own:

- ``store``: an engine store into the cpu tier and its write-through copy into mmap;
- ``load_cpu``: ``prepare_load`` + ``submit_load`` of blocks the cpu tier holds;
- ``load_lower``: the same for blocks only mmap holds (read, promoted into cpu);
- ``claim``: a verified claim of blocks only mmap holds: the prefetch, then the claim
  that pins them up top and its load.

The bytes moved are small (16 KiB blocks) and excluded from the books' time; the
lock count is per job (a store's count includes its cascade copy). Usage::

    .venv/bin/python scripts/bench_books.py [--jobs 300] [--blocks 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader
from kvoffload.tools.bench.harness import write_json
from kvoffload.tools.bench.inputs import key_chain

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, namespace="bb")


class CountingLock:
    """A lock that counts its acquisitions and the time it was held."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.acquisitions = 0
        self.held_s = 0.0
        self._since = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got: bool = self._inner.acquire(blocking, timeout)
        if got:
            self.acquisitions += 1
            self._since = time.perf_counter()
        return got

    def release(self) -> None:
        self.held_s += time.perf_counter() - self._since
        self._inner.release()

    def locked(self) -> bool:
        return bool(self._inner.locked())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Meter:
    """Wall time spent inside the books' public methods (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = threading.local()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

        return timed


def instrument(off: Offloader) -> tuple[CountingLock, Meter]:
    """Swap the books' lock for a counting one (conditions rebuilt on it) and time
    every public method of the books (waits for in-flight loads excluded)."""
    books: Any = off._books
    lock = CountingLock(books.lock)
    books.lock = lock
    for name, value in list(vars(books).items()):
        if isinstance(value, threading.Condition):
            setattr(books, name, threading.Condition(lock))  # type: ignore[arg-type]
    meter = Meter()
    for name in dir(books):
        # yield_to_loads: a wait, not bookkeeping (the books had it before issue 22).
        if name.startswith("_") or name in ("yield_to_loads", "bypassed"):
            continue
        value = getattr(books, name)
        if callable(value) and hasattr(value, "__self__"):
            setattr(books, name, meter.wrap(value))
    return lock, meter


def _wait(off: Offloader, job: int | None) -> None:
    assert job is not None, "job refused"
    (res,) = off.wait([job], timeout=60)
    assert res.success, res.error
    assert off.drain()


def run(jobs: int, blocks: int, base: Path) -> dict[str, Any]:
    bpb = LAYOUT.bytes_per_block
    total = jobs * blocks
    pool = BlockPool.allocate(LAYOUT, 2 * blocks)
    pool.scatter(list(range(2 * blocks)), torch.randint(0, 256, (2 * blocks, bpb)).byte())
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": (total + 4 * blocks) * bpb},
        {
            "name": "ssd",
            "backend": "mmap",
            "capacity": (total + 4 * blocks) * (bpb + 4096),
            "path": str(base / "ssd"),
        },
    ]
    off = Offloader(load_config({"tiers": tiers}, env={}), LAYOUT, pool)
    lock, meter = instrument(off)
    groups = [key_chain(blocks, f"g{j}") for j in range(jobs)]
    ids = list(range(blocks))
    out: dict[str, Any] = {}

    def phase(name: str, body: Callable[[list[BlockKey]], None]) -> None:
        a0, h0, s0, c0 = lock.acquisitions, lock.held_s, meter.seconds, meter.calls
        t0 = time.perf_counter()
        for keys in groups:
            body(keys)
        wall = time.perf_counter() - t0
        out[name] = {
            "jobs": jobs,
            "blocks_per_job": blocks,
            "lock_acquisitions_per_job": (lock.acquisitions - a0) / jobs,
            "books_calls_per_job": (meter.calls - c0) / jobs,
            "books_us_per_block": (meter.seconds - s0) / total * 1e6,
            "lock_held_us_per_block": (lock.held_s - h0) / total * 1e6,
            "wall_us_per_block": wall / total * 1e6,
        }

    def store(keys: list[BlockKey]) -> None:
        _wait(off, off.submit_store(keys, ids))

    def load(keys: list[BlockKey]) -> None:
        plan = off.prepare_load(keys)
        assert plan.hits == len(keys), plan.hits
        _wait(off, off.submit_load(plan, list(range(blocks, 2 * blocks))))

    def claim(keys: list[BlockKey]) -> None:
        plan = None
        for _ in range(10_000):
            plan = off.claim("r", keys)
            if plan is not None:
                break
            time.sleep(0.0002)
        assert plan is not None
        assert plan.hits == len(keys), plan.hits
        off.release("r")
        _wait(off, off.submit_load(plan, list(range(blocks, 2 * blocks))))

    try:
        phase("store", store)
        phase("load_cpu", load)
        off.clear_first_tier()
        phase("load_lower", load)
        off.clear_first_tier()
        phase("claim", claim)
        problems = off.check()
        assert not problems, problems
        assert off.pinned() == [0, 0]
    finally:
        off.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=300, help="jobs per phase")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per job")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the fastest kept per phase")
    ap.add_argument("--dir", type=Path, default=None, help="where the mmap tier goes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        base = args.dir or Path(tempfile.mkdtemp(prefix="kvo-books-"))
        try:
            runs.append(run(args.jobs, args.blocks, base / f"r{len(runs)}"))
        finally:
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)
    result = {
        name: min((r[name] for r in runs), key=lambda p: p["books_us_per_block"])
        for name in runs[0]
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
