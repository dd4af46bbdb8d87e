#!/usr/bin/env python3
"""How long a persistent tier takes to come back warm: reopen with N blocks held.

Fills a tier with N small blocks, closes it, then times ``build_tiers`` (open, read and
validate every header, rebuild the manager's LRU order), with the page cache dropped
first when permitted.

``--compression lz4|zstd`` makes the mmap tier a *packed* slab (issue 33): its reopen
also resolves overlapping extents and adopts every block's extent into the free-space
map, which is what this times against the fixed-slot slab (``none``). The fill goes
through the manager's budget the way the books do it (``charge`` with the write's
answer). ``--data kv`` stores KV-like bf16 values (they compress, so extents vary in
length) instead of random bytes (which no codec shrinks: full-size extents). Usage::

    .venv/bin/python scripts/bench_reopen.py --blocks 100000 --dir out/reopen [--json PATH]
    .venv/bin/python scripts/bench_reopen.py --backends mmap --compression none,zstd \
        --block-bytes 16384 --data kv
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from kvoffload.blockpool import page_aligned_empty
from kvoffload.config import load_config
from kvoffload.keys import BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.tier import build_tiers
from kvoffload.tools.bench.harness import ratio, timed, timed_result, write_json
from kvoffload.tools.bench.raw import drop_page_cache, layout_of_size
from kvoffload.tools.stress import kv_like


def reopen(
    args: argparse.Namespace, layout: KVLayout, backend: str, codec: str, path: Path
) -> dict[str, Any]:
    """Fill one tier with ``args.blocks`` blocks, close it, and time its reopen."""
    shutil.rmtree(path, ignore_errors=True)
    slot = args.block_bytes + 128 + (4096 if backend == "mmap" else 0)
    # A packed slab spends 128 bytes of header per slot on 4x the slots: 5% more
    # room so that every full-size block fits whatever the blocks compress to.
    margin = 1.02 if codec == "none" else 1.05
    tier_raw: dict[str, Any] = {
        "name": backend,
        "backend": backend,
        "path": str(path),
        "capacity": int(args.blocks * slot * margin),
    }
    if codec != "none":
        tier_raw["compression"] = codec
    config = load_config({"tiers": [tier_raw]})
    (tier,) = build_tiers(config, layout)
    batch = 8192
    data = page_aligned_empty(batch, args.block_bytes)
    if args.data == "kv":
        data.copy_(kv_like(layout, batch, seed=0))
    else:
        data.random_(0, 256)

    def fill() -> None:
        for lo in range(0, args.blocks, batch):
            keys = [
                BlockKey(chain_key(b"reopen", i.to_bytes(8, "little")))
                for i in range(lo, min(args.blocks, lo + batch))
            ]
            plan = tier.manager.prepare_store(keys)
            assert plan is not None
            assert not plan.evicted, f"{path.name}: the tier is full at {lo} blocks"
            sizes = tier.backend.write(plan.slots, plan.keys_to_store, data[: len(keys)])
            if sizes is not None:  # a packed slab: charge what each block took, as the books do
                assert all(sizes), f"{path.name}: no room for a block at {lo} blocks"
                tier.manager.charge(plan.keys_to_store, sizes)
            tier.manager.complete_store(plan.keys_to_store)

    fill_s = timed(fill)
    footprint = tier.backend.stats().held
    tier.close()
    dropped = drop_page_cache()
    reopen_s, (tier,) = timed_result(lambda: build_tiers(config, layout))
    held = len(tier.manager.held_keys())
    tier.close()
    print(
        f"{path.name}: {held} blocks back in {reopen_s:.3f} s "
        f"(filled in {fill_s:.1f} s; page cache dropped: {dropped})"
    )
    assert held == args.blocks, f"{path.name}: {held} of {args.blocks} recovered"
    shutil.rmtree(path, ignore_errors=True)
    return {
        "blocks": held,
        "compression": codec,
        "reopen_s": reopen_s,
        "fill_s": fill_s,
        "stored_vs_logical": ratio(footprint[1], footprint[0]) if footprint else None,
        "page_cache_dropped": dropped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--dir", type=Path, default=Path("out/reopen"))
    ap.add_argument("--backends", default="mmap,lmdb")
    ap.add_argument("--compression", default="none", help="comma-separated: none,zstd")
    ap.add_argument("--data", choices=("random", "kv"), default="random")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    layout = layout_of_size(args.block_bytes)
    results = {}
    for backend in args.backends.split(","):
        for codec in args.compression.split(","):
            name = backend if codec == "none" else f"{backend}-{codec}"
            results[name] = reopen(args, layout, backend, codec, args.dir / name)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
