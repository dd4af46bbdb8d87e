#!/usr/bin/env python3
"""How much of a packed slab's pages to keep out of its budget: a churn simulation.

A packed ``mmap`` tier's manager budgets pages, but a block needs its pages in one
run. This drives the real books (``LRUOffloadingManager`` with a byte budget) and the
real free-space map (``PackedSpace``) through ``--stores`` stores of ``--batch`` new
blocks each, with no disk I/O: each block's pages drawn from a seeded mix (15% stored
raw at full size, 10% at 40%, the rest 62-75%, like zstd on bf16 KV), the store's
victims' space released as the job releases it, and each block placed as the slab
places it. Printed per reserve (a share of the pages the budget never hands out):
blocks held against the full-size count, and the share of stores that found no run
of pages long enough (``unplaced``: a block not stored). Usage::

    .venv/bin/python scripts/sim_packing_reserve.py --pages-per-block 64 --blocks 1000 \\
        --batch 1 --reserves 0,0.005,0.01
"""

from __future__ import annotations

import argparse
import random

from kvoffload.backends.mmap.extents import PackedSpace

from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.slots import SlotAllocator

PAGE = 4096


def simulate(ppb: int, blocks: int, batch: int, reserve: float, stores: int) -> dict[str, float]:
    """One run; the figures printed for it."""
    slots = blocks * 4
    pages = blocks * ppb - slots * 128 // PAGE
    space = PackedSpace([pages], slots, ppb)
    allocator = SlotAllocator(slots)
    allocator.on_free = lambda freed: [space.release(s) for s in freed]
    budget = int(pages * (1 - reserve)) * PAGE
    books = LRUOffloadingManager(allocator, byte_budget=budget, full_charge=ppb * PAGE)
    rng = random.Random(0)

    def pages_of_next() -> int:
        r = rng.random()
        if r < 0.15:
            return ppb
        if r < 0.25:
            return max(1, int(ppb * 0.4))
        return max(1, round(ppb * rng.uniform(0.62, 0.75)))

    key = unplaced = placed = 0
    for _ in range(stores):
        keys = [BlockKey((key + i).to_bytes(8, "little") + bytes(8)) for i in range(batch)]
        key += batch
        out = books.prepare_store(keys)
        if out is None:
            continue
        for slot in out.evicted_slots:  # the job releases its victims' space...
            space.release(slot)
        sizes = []
        for slot in out.slots:  # ...and places each block
            start = space.place(slot, pages_of_next())
            sizes.append(0 if start is None else int(space.pages[slot]) * PAGE)
        good = [k for k, size in zip(out.keys_to_store, sizes, strict=True) if size]
        books.complete_store([k for k in out.keys_to_store if k not in good], success=False)
        books.charge(good, [size for size in sizes if size], unplaced=len(sizes) - len(good))
        books.complete_store(good)
        placed += len(good)
        unplaced += len(out.keys_to_store) - len(good)
    return {
        "reserve": reserve,
        "held_vs_full": len(books) / blocks,
        "unplaced": unplaced / max(1, placed + unplaced),
        "pages_used": space.used_pages / pages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages-per-block", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1000, help="full-size blocks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--stores", type=int, default=20000)
    parser.add_argument("--reserves", default="0,0.005,0.01,0.02")
    args = parser.parse_args()
    for reserve in (float(r) for r in args.reserves.split(",")):
        got = simulate(args.pages_per_block, args.blocks, args.batch, reserve, args.stores)
        print(
            f"reserve {got['reserve']:.3f}: held {got['held_vs_full']:.3f}x the full-size "
            f"blocks, unplaced {got['unplaced']:.4f} of stores, pages used {got['pages_used']:.3f}"
        )


if __name__ == "__main__":
    main()
