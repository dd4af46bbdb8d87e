#!/usr/bin/env python3
"""What checksum verification costs on load, at 256 KiB blocks (mmap tier).

Times ``Backend.read`` of the same blocks with verification as shipped (xxh3_64 of every
payload) and with the checksum stubbed out, alternating runs, page cache dropped before
each. Also prints the raw speed of the candidate hashes on this CPU. Usage::

    .venv/bin/python scripts/bench_verify.py --dir out/verify [--total 512MiB]
"""

from __future__ import annotations

import argparse
import os
import shutil
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import xxhash
from kvoffload.backends.mmap import backend as mmap_backend

from kvoffload.blockpool import byte_view, page_aligned_empty
from kvoffload.config import MmapTierConfig
from kvoffload.keys import BlockKey, chain_key
from kvoffload.record import payload_checksum
from kvoffload.sizes import parse_size
from kvoffload.tools.bench.harness import gbps, timed, timed_result
from kvoffload.tools.bench.raw import drop_page_cache, layout_of_size


def hash_speeds(block: memoryview) -> dict[str, float]:
    out = {}
    for name, fn in (
        ("xxh3_64", xxhash.xxh3_64_intdigest),
        ("xxh64", xxhash.xxh64_intdigest),
        ("zlib.crc32", zlib.crc32),
    ):
        fn(block)
        out[name] = gbps(200 * len(block), timed(partial(_hash_200, fn, block)))
    return out


def _hash_200(fn: Callable[[memoryview], int], block: memoryview) -> None:
    for _ in range(200):
        fn(block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path("out/verify"))
    ap.add_argument("--total", default="512MiB")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    block = 256 * 1024
    n = parse_size(args.total) // block
    layout = layout_of_size(block)
    shutil.rmtree(args.dir, ignore_errors=True)
    cfg = MmapTierConfig(
        name="verify",
        path=str(args.dir),
        capacity=int(n * mmap_backend.MmapBackend.slot_bytes(layout) * 1.05),
    )
    backend = mmap_backend.MmapBackend(cfg, layout)
    data = page_aligned_empty(n, block)
    data.random_(0, 256)
    keys = [BlockKey(chain_key(b"verify", i.to_bytes(8, "little"))) for i in range(n)]
    slots = backend.allocate(n)
    assert slots is not None
    backend.write(slots, keys, data)
    out = page_aligned_empty(n, block)
    times: dict[str, list[float]] = {"verified": [], "unverified": []}
    real_sums = [f.headers["checksum"].copy() for f in backend.files]
    for _ in range(args.reps):
        for mode in ("verified", "unverified"):
            # Unverified: headers say 0 and the "hash" returns 0 without reading the
            # payload, so every other check still runs and blocks still read as valid.
            for f, sums in zip(backend.files, real_sums, strict=True):
                f.headers["checksum"] = sums if mode == "verified" else 0
            mmap_backend.payload_checksum = payload_checksum if mode == "verified" else _zero
            drop_page_cache()
            seconds, ok = timed_result(partial(backend.read, slots, keys, out))
            times[mode].append(seconds)
            assert all(ok)
    mmap_backend.payload_checksum = payload_checksum
    backend.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    v, u = min(times["verified"]), min(times["unverified"])
    print(
        f"load 256 KiB blocks: verified {gbps(n * block, v):.2f} GB/s, "
        f"unverified {gbps(n * block, u):.2f} GB/s, "
        f"cost {(v - u) / u:+.1%} (best of {args.reps} each, alternating)"
    )
    speeds = hash_speeds(byte_view(data[0]))
    print(
        "hash speed on one 256 KiB block: "
        + ", ".join(f"{k} {s:.1f} GB/s" for k, s in speeds.items())
    )
    print(f"cpus: {os.cpu_count()}")


def _zero(view: object) -> int:
    return 0


if __name__ == "__main__":
    main()
