"""Compressed tiers against the same tier uncompressed, in one run (issue 24's targets).

**mmap** (and ``--backends lmdb``): for each ``compression`` (``none`` first, then the
codecs), interleaved over ``--reps`` rounds, a fresh tier in ``--dir`` stores
``--total`` bytes of blocks in batches of 32 MiB (``Backend.write``, slots allocated
as the manager does), is closed, the page cache is dropped (root only; the report says
whether), and the tier is reopened and loads every block back (``Backend.read``),
checked byte for byte. Reported per codec: store and load GB/s of logical bytes (best
of the rounds), ``stored / logical`` from the tier's own count (``footprint``), and
``load_vs_none`` / ``store_vs_none``: the codec's GB/s over the uncompressed tier's in
the same run. Target: ratio <= 0.8 on real bf16 KV with ``load_vs_none >= 0.9``.

**redis** (``--redis``): a real ``redis-server`` with ``maxmemory`` (``--maxmemory``)
and ``allkeys-lru``; for each codec, the server flushed, then 3x its memory worth of
blocks stored through the tier (distinct keys), and ``DBSIZE`` counted: the blocks the
server holds under the same ``maxmemory``. ``held_vs_none`` is the codec's count over
the uncompressed tier's. Target: >= 1.2x.

Blocks: a capture of real KV by ``scripts/capture_kv.py`` (``--capture``, an ``.npz``
whose ``blocks`` is ``uint8 [n, bytes_per_block]``; cycled under fresh keys to fill
``--total``), or synthetic KV-like bf16 values (``--capture`` omitted)::

    .venv/bin/python scripts/capture_kv.py       # out/kv_capture/smollm2-bf16.npz
    .venv/bin/python scripts/bench_compression.py \\
        --capture out/kv_capture/smollm2-bf16.npz --dir /var/tmp/kvo-bench \\
        --redis --json out/bench_compression.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvoffload.backend import Backend
from kvoffload.keys import BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.registry import get_backend_class
from kvoffload.sizes import parse_size
from kvoffload.tools.bench.harness import gbps, ratio, save_report, timed, timed_result
from kvoffload.tools.bench.inputs import block_layout, read_capture
from kvoffload.tools.bench.raw import drop_page_cache
from kvoffload.tools.stress import kv_like

BATCH_BYTES = 32 * 1024 * 1024


NAMESPACE = "bench-compression"


def load_blocks(capture: Path | None, total: int) -> tuple[KVLayout, torch.Tensor, str]:
    if capture is None:
        layout = block_layout(256 * 1024, 2, NAMESPACE)
        n = max(1, total // layout.bytes_per_block)
        return layout, kv_like(layout, n, seed=0), "synthetic kv_like bf16"
    layout, blocks, what = read_capture(capture, NAMESPACE)
    n = max(1, total // layout.bytes_per_block)
    return layout, torch.from_numpy(blocks[np.arange(n) % len(blocks)].copy()), what


def keys_for(n: int, salt: bytes) -> list[BlockKey]:
    return [BlockKey(chain_key(salt, i.to_bytes(8, "little"))) for i in range(n)]


def make(kind: str, layout: KVLayout, n: int, path: Path, codec: str, **extra: Any) -> Backend:
    cls = get_backend_class(kind)
    data = {
        "name": f"{kind}-{codec}",
        "backend": kind,
        "capacity": int(n * cls.slot_bytes(layout) * 1.05) + 1,
        "compression": codec,
        **extra,
    }
    if kind != "redis":
        data["path"] = str(path)
    return cls(cls.config_model.model_validate(data), layout)


def disk_round(
    kind: str, layout: KVLayout, data: torch.Tensor, base: Path, codec: str
) -> dict[str, Any]:
    n = len(data)
    per = max(1, BATCH_BYTES // layout.bytes_per_block)
    keys = keys_for(n, codec.encode())
    path = base / f"{kind}-{codec}"
    shutil.rmtree(path, ignore_errors=True)
    be = make(kind, layout, n, path, codec)
    try:
        slots = be.allocate(n)
        assert slots is not None

        def store() -> None:
            for lo in range(0, n, per):
                be.write(slots[lo : lo + per], keys[lo : lo + per], data[lo : lo + per])

        store_s = timed(store)
        footprint = be.stats().held
        packed = be.stats().codec
    finally:
        be.close()
    dropped = drop_page_cache()
    be = make(kind, layout, n, path, codec)
    out = torch.zeros_like(data)
    try:
        where = {b.key: b.slot for b in be.recover()}
        slots = [where[k] for k in keys]

        def load() -> list[bool]:
            got: list[bool] = []
            for lo in range(0, n, per):
                got += be.read(slots[lo : lo + per], keys[lo : lo + per], out[lo : lo + per])
            return got

        load_s, valid = timed_result(load)
        unpacked = be.stats().codec
    finally:
        be.close()
    shutil.rmtree(path, ignore_errors=True)
    if not all(valid) or not torch.equal(out, data):
        raise SystemExit(f"{kind} {codec}: a block came back different")
    logical = n * layout.bytes_per_block
    return {
        "store_gbps": gbps(logical, store_s),
        "load_gbps": gbps(logical, load_s),
        "ratio": footprint[1] / footprint[0] if footprint else None,
        "page_cache_dropped": dropped,
        "compress_gbps": packed.compress_gbps if packed else None,
        "decompress_gbps": unpacked.decompress_gbps if unpacked else None,
    }


def bench_disk(
    kind: str, layout: KVLayout, data: torch.Tensor, base: Path, codecs: list[str], reps: int
) -> list[dict[str, Any]]:
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in codecs}
    for _ in range(reps):
        for codec in codecs:  # interleaved: the disk drifts from minute to minute
            rounds[codec].append(disk_round(kind, layout, data, base, codec))
    rows = []
    for codec in codecs:
        rs = rounds[codec]
        rows.append(
            {
                "backend": kind,
                "compression": codec,
                "store_gbps": max(r["store_gbps"] for r in rs),
                "load_gbps": max(r["load_gbps"] for r in rs),
                "ratio": rs[-1]["ratio"],
                "page_cache_dropped": all(r["page_cache_dropped"] for r in rs),
                "compress_gbps": max((r["compress_gbps"] or 0) for r in rs) or None,
                "decompress_gbps": max((r["decompress_gbps"] or 0) for r in rs) or None,
            }
        )
    none = next(r for r in rows if r["compression"] == "none")
    for r in rows:
        r["store_vs_none"] = ratio(r["store_gbps"], none["store_gbps"])
        r["load_vs_none"] = ratio(r["load_gbps"], none["load_gbps"])
    return rows


def bench_redis(
    layout: KVLayout, data: torch.Tensor, codecs: list[str], maxmemory: int
) -> list[dict[str, Any]]:
    import redis

    tmp = Path(tempfile.mkdtemp(prefix="kvo-redis-"))
    port = 20000 + (int(time.time()) % 20000)
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            str(maxmemory),
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        n = max(len(data), 3 * maxmemory // layout.bytes_per_block)
        per = max(1, min(32, BATCH_BYTES // layout.bytes_per_block))
        rows = []
        for codec in codecs:
            client.flushall()
            be = make("redis", layout, n, tmp, codec, url=f"redis://127.0.0.1:{port}/0")
            try:
                keys = keys_for(n, b"redis-" + codec.encode())
                for lo in range(0, n, per):
                    hi = min(n, lo + per)
                    rows_ = data[np.arange(lo, hi) % len(data)]
                    be.write(list(range(lo, hi)), keys[lo:hi], rows_)
                held = int(client.dbsize())
                # What is left is intact: read back the last blocks stored.
                tail = list(range(max(0, n - per), n))
                out = torch.zeros((len(tail), layout.bytes_per_block), dtype=torch.uint8)
                valid = be.read(tail, [keys[i] for i in tail], out)
                ok = all(
                    torch.equal(out[j], data[i % len(data)]) for j, i in enumerate(tail) if valid[j]
                )
                if not ok:
                    raise SystemExit(f"redis {codec}: a block came back different")
                used = int(client.info("memory")["used_memory"])
            finally:
                be.close()
            rows.append({"compression": codec, "stored": n, "held": held, "used_memory": used})
        none = next(r for r in rows if r["compression"] == "none")
        for r in rows:
            r["held_vs_none"] = ratio(r["held"], none["held"])
        return rows
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capture", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=Path("out/bench-compression"))
    ap.add_argument("--total", default="512MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codecs", default="none,lz4,zstd")
    ap.add_argument("--backends", default="mmap")
    ap.add_argument("--redis", action="store_true")
    ap.add_argument("--maxmemory", default="64MiB")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    codecs = args.codecs.split(",")
    assert codecs[0] == "none", "the uncompressed tier is the baseline: list none first"
    layout, data, what = load_blocks(args.capture, parse_size(args.total))
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"blocks: {what}; {len(data)} x {layout.bytes_per_block} B ({layout.dtype})", flush=True)
    report: dict[str, Any] = {
        "blocks": what,
        "bytes_per_block": layout.bytes_per_block,
        "n": len(data),
    }
    report["disk"] = []
    for kind in args.backends.split(","):
        rows = bench_disk(kind, layout, data, args.dir, codecs, args.reps)
        report["disk"] += rows
        for r in rows:
            print(
                f"{kind:<5} {r['compression']:<5} stored/logical {r['ratio']:.3f}  "
                f"store {r['store_gbps']:.2f} GB/s ({r['store_vs_none']:.2f}x none)  "
                f"load {r['load_gbps']:.2f} GB/s ({r['load_vs_none']:.2f}x none)  "
                f"codec per thread {r['compress_gbps'] or 0:.2f} / "
                f"{r['decompress_gbps'] or 0:.2f} GB/s  "
                f"page cache dropped: {r['page_cache_dropped']}",
                flush=True,
            )
    if args.redis:
        report["redis"] = bench_redis(layout, data, codecs, parse_size(args.maxmemory))
        for r in report["redis"]:
            print(
                f"redis {r['compression']:<5} {r['held']} of {r['stored']} blocks held under "
                f"maxmemory {args.maxmemory} ({r['held_vs_none']:.2f}x none), "
                f"used_memory {r['used_memory']}",
                flush=True,
            )
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
