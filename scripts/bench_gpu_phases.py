#!/usr/bin/env python3
"""Where an Offloader store job's time goes on a GPU: CPU time to queue its copies,
time waiting for them, and (CUDA events) the device gather and the DMA, summed over
1 GiB of stores at 256 KiB and 2 MiB blocks, with the lanes' two threads and one job at
a time. A diagnostic for ``docs/benchmarks.md`` ("Where the rest goes"); it wraps
``DataPath.pack`` with timing and changes nothing else.

    python3 scripts/bench_gpu_phases.py        # needs CUDA; exits 2 without
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg

from kvoffload import datapath
from kvoffload.config import load_config
from kvoffload.offloader import Offloader

_lock = threading.Lock()
_acc: dict[str, float] = {}


def _add(key: str, value: float) -> None:
    with _lock:
        _acc[key] = _acc.get(key, 0.0) + value


def _timed_pack(self: Any, pool_ids: Any, pieces: Any, after: Any = None) -> None:
    pool = self.pool
    t0 = time.perf_counter()
    stream = self._streams["store"]
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        e0 = stream.record_event(torch.cuda.Event(enable_timing=True))
        index = pool.device_index(pool_ids)
        packed = torch.empty((len(pool_ids), self.bpb), dtype=torch.uint8, device=pool.device)
        pool.pack(index, packed)
        e1 = stream.record_event(torch.cuda.Event(enable_timing=True))
        for pos, rows in pieces:
            rows.copy_(packed[pos : pos + rows.shape[0]], non_blocking=True)
        e2 = stream.record_event(torch.cuda.Event(enable_timing=True))
    t1 = time.perf_counter()
    e2.synchronize()
    _add("queue_ms", (t1 - t0) * 1e3)
    _add("wait_ms", (time.perf_counter() - t1) * 1e3)
    _add("gather_ms", e0.elapsed_time(e1))
    _add("dma_ms", e1.elapsed_time(e2))


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gpu_phases: no CUDA device here", file=sys.stderr)
        return 2
    datapath.DataPath.pack = _timed_pack  # type: ignore[method-assign]
    for kib in (256, 2048):
        layout = bg.layout_for(kib * 1024)
        bpb = layout.bytes_per_block
        n, batch = (1 << 30) // bpb, max(16, (64 << 20) // bpb)
        pool = bg.BlockPool.allocate(layout, 2 * n, device="cuda")
        tier = {"name": "cpu", "backend": "cpu", "capacity": 2 * n * bpb}
        tier["max_pending_stores"] = 4096
        with Offloader(load_config({"tiers": [tier]}, env={}), layout, pool) as off:
            warm = bg._keys(batch, "w")
            bg._jobs(off, bg._store_all(off, warm, list(range(batch)), batch))
            for mode in ("pipelined", "one job at a time"):
                _acc.clear()
                keys = bg._keys(n, f"{mode}{kib}")
                t0 = time.perf_counter()
                if mode == "pipelined":
                    bg._jobs(off, bg._store_all(off, keys, list(range(n)), batch))
                else:
                    for i in range(0, n, batch):
                        part = keys[i : i + batch]
                        bg._jobs(off, bg._store_all(off, part, list(range(i, i + batch)), batch))
                wall = time.perf_counter() - t0
                parts = ", ".join(f"{k} {v:.1f}" for k, v in _acc.items())
                print(f"{kib} KiB {mode}: {n * bpb / wall / 1e9:.1f} GB/s; {parts}")
        del pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
