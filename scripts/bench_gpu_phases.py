#!/usr/bin/env python3
"""Where a store chunk's device time goes on a GPU: CUDA events around the three parts
a :class:`~kvoffload.devicelane.DeviceLane` queues for one chunk of a store (the index
upload, the pack, recorded as a graph after its first use, and the DMA into pinned
rows), and the chunk's wall time on the host, at 256 KiB and 2 MiB blocks, chunks of
32 and 64 MiB. A diagnostic for ``docs/benchmarks.md`` ("Where the time goes"): the
pack is an HBM pass that the lane's two threads overlap with each other's DMA.

    python3 scripts/bench_gpu_phases.py        # needs CUDA; exits 2 without
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu as bg

from kvoffload import devicelane, hostcopy
from kvoffload.blockpool import BlockPool
from kvoffload.devicelane import DeviceLane


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gpu_phases: no CUDA device here", file=sys.stderr)
        return 2
    slab = hostcopy.host_rows(2048 + 64, 1 << 20, pin=True)  # pinned as the cpu tier's
    for kib in (256, 2048):
        layout = bg.layout_for(kib * 1024)
        bpb = layout.bytes_per_block
        n, batch = (2 << 30) // bpb, (64 << 20) // bpb
        pool = BlockPool.allocate(layout, n, device="cuda")
        rows_all = slab.view(-1)[: n * bpb].view(n, bpb)
        for rows in ((32 << 20) // bpb, batch):  # 2 MiB: 16 blocks (the slow kernel), 32
            lane = DeviceLane(pool, "store")
            lane.chunk = rows
            for _ in range(3):  # the first use runs eagerly, the second records the graph
                lane.run(list(range(rows)), [(0, rows_all[:rows])])
            me = lane._me()
            size = me.sizes[devicelane.size_for(rows, lane.chunk)]
            me.ids[:rows] = range(rows)
            times: dict[str, list[float]] = {"upload": [], "pack": [], "dma": [], "wall": []}
            for j in range(0, n - rows + 1, rows):
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                t0 = time.perf_counter()
                with torch.cuda.stream(me.stream):
                    marks[0].record(me.stream)
                    size.index.copy_(me.pinned[:rows], non_blocking=True)
                    marks[1].record(me.stream)
                    lane._launch(me, size)
                    marks[2].record(me.stream)
                    rows_all[j : j + rows].copy_(size.packed[:rows], non_blocking=True)
                    marks[3].record(me.stream)
                marks[3].synchronize()
                times["wall"].append((time.perf_counter() - t0) * 1e3)
                for k, name in enumerate(("upload", "pack", "dma")):
                    times[name].append(marks[k].elapsed_time(marks[k + 1]))
            mb = rows * bpb / 1e6
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"{kib:>5} KiB, chunk {rows * bpb >> 20} MiB ({rows} blocks): upload "
                f"{med['upload']:.3f} ms, pack {med['pack']:.3f} ms "
                f"({mb / med['pack']:.0f} GB/s), DMA {med['dma']:.3f} ms "
                f"({mb / med['dma']:.1f} GB/s), wall {med['wall']:.3f} ms; "
                f"graph {size.graph is not None}",
                flush=True,
            )
        del pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
