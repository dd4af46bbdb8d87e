#!/usr/bin/env python3
"""Gather/scatter and cpu-tier throughput against a plain torch copy of the same bytes.

Every ratio's baseline is measured in the same run, on the same buffers' sizes:
``dst.copy_(src)`` of one contiguous region as large as the whole batch (the memcpy
limit of this machine). Usage::

    .venv/bin/python scripts/bench_blockpool.py [--blocks 256] [--repeat 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from kvoffload.backends.cpu import CPUBackend

from kvoffload.blockpool import BlockPool
from kvoffload.config import CPUTierConfig
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout

# (label, layout): per-block sizes from 16 KiB to 2 MiB, bf16.
LAYOUTS = [
    ("16KiB", KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)),
    ("64KiB", KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16)),
    ("256KiB", KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=8)),
    ("2MiB", KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)),
]


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: first touch of pages, allocator
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_layout(label: str, layout: KVLayout, total_mib: int, repeat: int) -> dict[str, Any]:
    """One row: the torch-copy baseline and our four paths, on the same byte count."""
    n = max(8, total_mib * 2**20 // layout.bytes_per_block)
    pool_blocks = 2 * n
    pool = BlockPool.allocate(layout, pool_blocks)
    for v in pool._views:
        v.view(torch.int16).random_()
    ids = torch.randperm(pool_blocks)[:n].tolist()
    staging = pool.new_staging(n)
    nbytes = n * layout.bytes_per_block
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    tier = CPUBackend(CPUTierConfig(name="cpu", capacity=nbytes), layout)
    got = tier.allocate(n)
    assert got is not None
    slots = [got[i] for i in torch.randperm(n).tolist()]  # scattered slots, as after churn
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(n)]
    seconds = {
        "copy": best_seconds(lambda: dst.copy_(src), repeat),
        "gather": best_seconds(lambda: pool.gather(ids, staging), repeat),
        "scatter": best_seconds(lambda: pool.scatter(ids, staging), repeat),
        "tier_write": best_seconds(lambda: tier.write(slots, keys, staging), repeat),
        "tier_read": best_seconds(lambda: tier.read(slots, keys, staging), repeat),
    }
    tier.close()
    row: dict[str, Any] = {"block": label, "block_bytes": layout.bytes_per_block, "blocks": n}
    for key, sec in seconds.items():
        row[f"{key}_gbps"] = nbytes / sec / 1e9
    for key in ("gather", "scatter", "tier_write", "tier_read"):
        row[f"{key}_ratio"] = row[f"{key}_gbps"] / row["copy_gbps"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per batch")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'block':>7} {'n':>5} {'copy GB/s':>9} {'gather':>13} {'scatter':>13} "
        f"{'tier write':>13} {'tier read':>13}"
    )
    for label, layout in LAYOUTS:
        row = bench_layout(label, layout, args.total_mib, args.repeat)
        rows.append(row)
        print(
            f"{label:>7} {row['blocks']:>5} {row['copy_gbps']:>9.2f} "
            + " ".join(
                f"{row[k + '_gbps']:>6.2f} ({row[k + '_ratio']:.2f}x)"
                for k in ("gather", "scatter", "tier_write", "tier_read")
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
