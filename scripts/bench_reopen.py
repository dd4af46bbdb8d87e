#!/usr/bin/env python3
"""How long a persistent tier takes to come back warm: reopen with N blocks held.

Fills a tier with N small blocks, closes it, then times ``build_tiers`` (open, read and
validate every header, rebuild the manager's LRU order), with the page cache dropped
first when permitted. Usage::

    .venv/bin/python scripts/bench_reopen.py --blocks 100000 --dir out/reopen [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from kvoffload.blockpool import page_aligned_empty
from kvoffload.config import load_config
from kvoffload.keys import BlockKey, chain_key
from kvoffload.tier import build_tiers
from kvoffload.tools.bench_raw import drop_page_cache, layout_of_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--dir", type=Path, default=Path("out/reopen"))
    ap.add_argument("--backends", default="mmap,lmdb")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    layout = layout_of_size(args.block_bytes)
    results = {}
    for backend in args.backends.split(","):
        path = args.dir / backend
        shutil.rmtree(path, ignore_errors=True)
        slot = args.block_bytes + 128 + (4096 if backend == "mmap" else 0)
        raw = {
            "tiers": [
                {
                    "name": backend,
                    "backend": backend,
                    "path": str(path),
                    "capacity": int(args.blocks * slot * 1.02),
                }
            ]
        }
        config = load_config(raw)
        (tier,) = build_tiers(config, layout)
        batch = 8192
        data = page_aligned_empty(batch, args.block_bytes)
        data.random_(0, 256)
        t0 = time.perf_counter()
        for lo in range(0, args.blocks, batch):
            keys = [
                BlockKey(chain_key(b"reopen", i.to_bytes(8, "little")))
                for i in range(lo, min(args.blocks, lo + batch))
            ]
            plan = tier.manager.prepare_store(keys)
            assert plan is not None
            tier.backend.write(plan.slots, plan.keys_to_store, data[: len(keys)])
            tier.manager.complete_store(plan.keys_to_store)
        fill_s = time.perf_counter() - t0
        tier.close()
        dropped = drop_page_cache()
        t0 = time.perf_counter()
        (tier,) = build_tiers(config, layout)
        reopen_s = time.perf_counter() - t0
        held = len(tier.manager)
        tier.close()
        results[backend] = {
            "blocks": held,
            "reopen_s": reopen_s,
            "fill_s": fill_s,
            "page_cache_dropped": dropped,
        }
        print(
            f"{backend}: {held} blocks back in {reopen_s:.3f} s "
            f"(filled in {fill_s:.1f} s; page cache dropped: {dropped})"
        )
        assert held == args.blocks, f"{backend}: {held} of {args.blocks} recovered"
        shutil.rmtree(path, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
