#!/usr/bin/env python3
"""GPU <-> CPU block-copy throughput against the PCIe limit, on a machine with CUDA.

For block sizes from 16 KiB to 4 MiB, measures with CUDA events:
- GPU->CPU (store direction) and CPU->GPU (load direction), one direction at a time;
- both directions at once, on two streams;
- into/from pinned host memory and into/from pageable memory;
- through ``BlockPool.gather``/``scatter`` (the block API) into a pinned staging buffer.

The baseline of every ratio is a plain ``tensor.copy_`` of one contiguous region of the
same total size, pinned, in the same run: the PCIe limit this machine reaches. Target
(docs/benchmarks.md): pinned one-way >= 0.8x of the contiguous copy at 2 MiB blocks.

    .venv/bin/python scripts/bench_gpu.py [--total-mib 1024] [--json out/bench_gpu.json]

Without CUDA it says so and exits 2: there is nothing to measure on a CPU-only box.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.layout import KVLayout

SIZES_KIB = (16, 64, 256, 1024, 2048, 4096)


def timed(fn: Any, reps: int = 5) -> float:
    """Best seconds of ``reps`` runs of ``fn`` on the current stream, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def layout_for(block_bytes: int, layers: int = 32) -> KVLayout:
    """A bf16 layout of ``layers`` layers whose blocks are ``block_bytes``."""
    per_layer = block_bytes // layers
    head_dim = per_layer // (2 * 16 * 2)
    if head_dim < 1:
        return KVLayout(num_layers=1, num_kv_heads=1, head_dim=block_bytes // 64, block_size=16)
    return KVLayout(num_layers=layers, num_kv_heads=1, head_dim=head_dim, block_size=16)


@dataclass
class Buffers:
    """Device and host buffers of the run's total size, allocated once (pinning is slow)."""

    gpu: torch.Tensor
    gpu2: torch.Tensor
    pinned: torch.Tensor
    pinned2: torch.Tensor
    pageable: torch.Tensor


def bench_size(
    block: int, total: int, b: Buffers, base_d2h: float, base_h2d: float
) -> dict[str, Any]:
    """One block size: per-block copies each way, pinned and pageable, both ways at once,
    and the block API's gather/scatter into pinned staging."""
    n = total // block
    row: dict[str, Any] = {"block_bytes": block, "blocks": n}

    def per_block(dst: torch.Tensor, src: torch.Tensor) -> None:
        d, s = dst.view(n, block), src.view(n, block)
        for i in range(n):
            d[i].copy_(s[i], non_blocking=True)

    row["d2h_pinned_gbps"] = total / timed(lambda: per_block(b.pinned, b.gpu)) / 1e9
    row["h2d_pinned_gbps"] = total / timed(lambda: per_block(b.gpu, b.pinned)) / 1e9
    row["d2h_pageable_gbps"] = total / timed(lambda: per_block(b.pageable, b.gpu), reps=2) / 1e9
    row["h2d_pageable_gbps"] = total / timed(lambda: per_block(b.gpu, b.pageable), reps=2) / 1e9
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            per_block(b.pinned, b.gpu)
        with torch.cuda.stream(s2):
            per_block(b.gpu2, b.pinned2)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    row["bidir_pinned_gbps"] = 2 * total / timed(both) / 1e9
    layout = layout_for(block)
    pool_blocks = max(2, min(n, (4 << 30) // layout.bytes_per_block))
    pool = BlockPool.allocate(layout, pool_blocks, device=b.gpu.device)
    ids = torch.randperm(pool_blocks)[: min(n, pool_blocks)].tolist()
    staging = pool.new_staging(len(ids), pin_memory=True)
    moved = len(ids) * layout.bytes_per_block
    row["gather_to_pinned_gbps"] = moved / timed(lambda: pool.gather(ids, staging)) / 1e9
    row["scatter_from_pinned_gbps"] = moved / timed(lambda: pool.scatter(ids, staging)) / 1e9
    row["d2h_pinned_ratio"] = row["d2h_pinned_gbps"] / base_d2h
    row["h2d_pinned_ratio"] = row["h2d_pinned_gbps"] / base_h2d
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    total = args.total_mib * 1024 * 1024
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    gpu = torch.empty(total, dtype=torch.uint8, device=dev)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(total, dtype=torch.uint8)
    gpu2 = torch.empty(total, dtype=torch.uint8, device=dev)
    pinned2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    base_d2h = total / timed(lambda: pinned.copy_(gpu, non_blocking=True)) / 1e9
    base_h2d = total / timed(lambda: gpu.copy_(pinned, non_blocking=True)) / 1e9
    print(f"contiguous pinned copy: GPU->CPU {base_d2h:.1f} GB/s, CPU->GPU {base_h2d:.1f} GB/s")
    bufs = Buffers(gpu, gpu2, pinned, pinned2, pageable)
    rows: list[dict[str, Any]] = []
    for kib in SIZES_KIB:
        row = bench_size(kib * 1024, total, bufs, base_d2h, base_h2d)
        rows.append(row)
        print(
            f"{kib:>5} KiB  d2h pinned {row['d2h_pinned_gbps']:6.1f} "
            f"({row['d2h_pinned_ratio']:.2f}x)  h2d pinned {row['h2d_pinned_gbps']:6.1f} "
            f"({row['h2d_pinned_ratio']:.2f}x)  pageable {row['d2h_pageable_gbps']:5.1f}/"
            f"{row['h2d_pageable_gbps']:5.1f}  both {row['bidir_pinned_gbps']:6.1f}  "
            f"gather {row['gather_to_pinned_gbps']:6.1f}  "
            f"scatter {row['scatter_from_pinned_gbps']:6.1f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"base_d2h_gbps": base_d2h, "base_h2d_gbps": base_h2d, "rows": rows}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
