"""What a load inside the engine step costs, by size: the measurement behind
``async_load_min_bytes`` (hits of that size or more load in the background).

A load inside the step stalls every running request for its whole copy; a background
load costs only its own request a step or more of latency. The budget is the size up
to which the in-step copy stays around a millisecond. Times, per hit size, the
Offloader's load of cpu-tier blocks into a host pool (claim, submit, wait: the
connector's in-step path), against a plain ``copy_`` of the same bytes in the same run
(the floor). Blocks of an 8B-class model on one rank: 32 layers x (K, V) x 16 tokens x
8 heads x 128 x bf16 = 2 MiB::

    .venv/bin/python scripts/bench_load_budget.py --json out/bench_load_budget.json
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader
from kvoffload.tools.bench.harness import gbps, timed, timed_result, write_json

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, namespace="b")
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def _load(off: Offloader, plan: Any, n: int, first: int) -> Any:
    """The connector's in-step load: submit into pool blocks from ``first`` on, wait."""
    load = off.submit_load(plan, list(range(first, first + n)))
    assert load is not None
    (res,) = off.wait([load], 120)
    return res


def measure(repeats: int) -> list[dict[str, Any]]:
    bpb = LAYOUT.bytes_per_block
    most = max(SIZES)
    pool = BlockPool.allocate(LAYOUT, 2 * most)
    tiers = [{"name": "cpu", "capacity": (most + 8) * bpb, "max_pending_stores": 64}]
    off = Offloader(load_config({"tiers": tiers}, env={}), LAYOUT, pool)
    keys = [BlockKey(i.to_bytes(4, "big") * 4) for i in range(most)]
    job = off.submit_store(keys, list(range(most)))
    assert job is not None
    off.wait([job], 120)
    off.drain()
    src = torch.empty(most * bpb, dtype=torch.uint8)
    dst = torch.empty_like(src)
    rows = []
    try:
        for n in SIZES:
            loads, copies = [], []
            for r in range(repeats):
                owner = ("bench", n, r)
                plan = off.claim(owner, keys[:n])
                assert plan is not None
                assert plan.hits == n
                seconds, res = timed_result(partial(_load, off, plan, n, most))
                loads.append(seconds)
                assert res.success, res.error
                off.release(owner)
                copies.append(timed(lambda: dst[: n * bpb].copy_(src[: n * bpb])))  # noqa: B023
            load_s, copy_s = min(loads), min(copies)
            rows.append(
                {
                    "blocks": n,
                    "mib": n * bpb / 2**20,
                    "load_ms": load_s * 1e3,
                    "load_gbps": gbps(n * bpb, load_s),
                    "memcpy_ms": copy_s * 1e3,
                    "ratio_to_memcpy": load_s / copy_s,
                }
            )
    finally:
        off.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="best of this many")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = measure(args.repeats)
    print("blocks     MiB  in-step load ms   GB/s  memcpy ms  load/memcpy")
    for r in rows:
        print(
            f"{r['blocks']:6d} {r['mib']:7.0f} {r['load_ms']:16.2f} {r['load_gbps']:6.2f} "
            f"{r['memcpy_ms']:10.2f} {r['ratio_to_memcpy']:12.2f}"
        )
    if args.json:
        write_json(args.json, rows, indent=1)


if __name__ == "__main__":
    main()
