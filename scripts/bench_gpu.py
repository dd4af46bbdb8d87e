#!/usr/bin/env python3
"""GPU <-> CPU block-copy throughput against the PCIe limit, on a machine with CUDA.

For block sizes from 16 KiB to 4 MiB, measures with CUDA events:
- GPU->CPU (store direction) and CPU->GPU (load direction), one direction at a time;
- both directions at once, on two streams;
- into/from pinned host memory and into/from pageable memory;
- through ``BlockPool.gather``/``scatter`` (the block API) into a pinned staging buffer.

``--sections offloader`` measures the :class:`~kvoffload.offloader.Offloader` itself
(once per ``--copy`` mode: the block pool's device copy as one Triton launch,
``kernel``, or as one torch op per layer, ``torch``) at 64 KiB, 256 KiB and 2 MiB blocks
(32 layers, bf16), from a CUDA pool of 2 GiB of blocks: store GB/s into the pinned cpu
tier, load GB/s back, both directions at once (new stores while loading), how much
slower a bf16 matmul loop runs while that 2 GiB moves each way, and a cpu -> mmap chain
(write-through store, then verified prefetch and load). ``--json`` keys per block size:
``store_ratio``, ``load_ratio`` (each to the contiguous pinned copy of the same
direction), ``both_ratio`` (both directions' bytes per second over the faster one-way
copy), ``compute_slowdown``. ``--sections pin`` times making a large pinned slab two
ways.

The baseline of every ratio is a plain ``tensor.copy_`` of one contiguous region of the
same total size, pinned, in the same run: the PCIe limit this machine reaches. Target
(docs/benchmarks.md): pinned one-way >= 0.8x of the contiguous copy at 2 MiB blocks.

    .venv/bin/python scripts/bench_gpu.py [--total-mib 1024] [--json out/bench_gpu.json]
        [--sections copies,offloader,pin] [--mmap-dir DIR]

Without CUDA it says so and exits 2: there is nothing to measure on a CPU-only box.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.hostcopy import host_rows, page_aligned_empty, unpin
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader
from kvoffload.tools.bench import harness
from kvoffload.tools.bench.inputs import key_chain

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

    row["d2h_pinned_gbps"] = harness.gbps(total, timed(lambda: per_block(b.pinned, b.gpu)))
    row["h2d_pinned_gbps"] = harness.gbps(total, timed(lambda: per_block(b.gpu, b.pinned)))
    row["d2h_pageable_gbps"] = harness.gbps(
        total, timed(lambda: per_block(b.pageable, b.gpu), reps=2)
    )
    row["h2d_pageable_gbps"] = harness.gbps(
        total, timed(lambda: per_block(b.gpu, b.pageable), reps=2)
    )
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            per_block(b.pinned, b.gpu)
        with torch.cuda.stream(s2):
            per_block(b.gpu2, b.pinned2)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    row["bidir_pinned_gbps"] = harness.gbps(2 * total, timed(both))
    layout = layout_for(block)
    pool_blocks = max(2, min(n, (4 << 30) // layout.bytes_per_block))
    pool = BlockPool.allocate(layout, pool_blocks, device=b.gpu.device)
    ids = torch.randperm(pool_blocks)[: min(n, pool_blocks)].tolist()
    staging = pool.new_staging(len(ids), pin_memory=True)
    moved = len(ids) * layout.bytes_per_block
    row["gather_to_pinned_gbps"] = harness.gbps(moved, timed(lambda: pool.gather(ids, staging)))
    row["scatter_from_pinned_gbps"] = harness.gbps(moved, timed(lambda: pool.scatter(ids, staging)))
    row["d2h_pinned_ratio"] = harness.ratio(row["d2h_pinned_gbps"], base_d2h)
    row["h2d_pinned_ratio"] = harness.ratio(row["h2d_pinned_gbps"], base_h2d)
    return row


OFFLOADER_KIB = (64, 256, 2048)
MOVE_BYTES = 2 << 30


def _jobs(off: Offloader, jobs: list[int | None]) -> int:
    """Wait for ``jobs``; the blocks they moved."""
    assert all(j is not None for j in jobs), "a job was refused (queue full)"
    results = off.wait([j for j in jobs if j is not None], timeout=600)
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    return sum(r.nbytes for r in results) // off.bpb


def _store_all(
    off: Offloader, keys: list[BlockKey], ids: list[int], batch: int
) -> list[int | None]:
    return [
        off.submit_store(keys[i : i + batch], ids[i : i + batch])
        for i in range(0, len(keys), batch)
    ]


def _load_all(off: Offloader, keys: list[BlockKey], ids: list[int], batch: int) -> list[int | None]:
    jobs: list[int | None] = []
    for i in range(0, len(keys), batch):
        plan = off.prepare_load(keys[i : i + batch])
        assert plan.hits == len(keys[i : i + batch]), "blocks missing from the cpu tier"
        jobs.append(off.submit_load(plan, ids[i : i + batch]))
    return jobs


def _quiet() -> None:
    """Start a timed phase with the device idle and Python's garbage collector just run.

    A full (generation 2) collection walks every object of the process, torch's
    included (113 ms over 277k objects on the 2-core VM), and the collector schedules it
    by allocation counts, so one could land inside a 50 ms phase and cut its figure by
    3-4x. Collecting first makes a full pass within the phase unlikely; the books' own
    collections still count, and :data:`GC_SECONDS` records what they cost per phase.
    vLLM freezes its startup heap (``gc.freeze``) for the same reason."""
    torch.cuda.synchronize()
    gc.collect()
    GC_SECONDS.clear()


GC_SECONDS: list[float] = []
"""Seconds of each garbage collection since the last :func:`_quiet`."""
_gc_start: list[float] = []


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start:
        GC_SECONDS.append(time.perf_counter() - _gc_start[0])


gc.callbacks.append(_on_gc)


def _matmul_seconds(steps: int = 60) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        a @ b
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_offloader(kib: int, base_d2h: float, base_h2d: float, mmap_dir: Path) -> dict[str, Any]:
    """The Offloader at one block size: see the module docstring."""
    layout = layout_for(kib * 1024)
    bpb = layout.bytes_per_block
    n = MOVE_BYTES // bpb
    batch = max(16, (64 << 20) // bpb)
    pool = BlockPool.allocate(layout, 2 * n, device="cuda")
    src, dst = list(range(n)), list(range(n, 2 * n))
    pool.scatter(src, torch.randint(0, 256, (n, bpb), dtype=torch.uint8, device="cuda"))
    cfg = load_config(
        {
            "tiers": [
                {
                    "name": "cpu",
                    "backend": "cpu",
                    "capacity": 3 * n * bpb,
                    "max_pending_stores": 4096,
                }
            ]
        },
        env={},
    )
    row: dict[str, Any] = {"block_bytes": bpb, "blocks": n, "batch_blocks": batch}
    t0 = time.perf_counter()
    off = Offloader(cfg, layout, pool)
    row["setup_seconds"] = time.perf_counter() - t0
    with off:
        # warm-up: the caching allocator, pinned index memory, the lanes
        warm = key_chain(batch, f"warm{kib}")
        _jobs(off, _store_all(off, warm, src[:batch], batch))
        _jobs(off, _load_all(off, warm, dst[:batch], batch))
        keys = key_chain(n, f"a{kib}")
        _quiet()
        t0 = time.perf_counter()
        assert _jobs(off, _store_all(off, keys, src, batch)) == n
        row["store_gbps"] = harness.gbps(n * bpb, time.perf_counter() - t0)
        row["store_gc_ms"] = sum(GC_SECONDS) * 1e3
        _quiet()
        t0 = time.perf_counter()
        assert _jobs(off, _load_all(off, keys, dst, batch)) == n
        row["load_gbps"] = harness.gbps(n * bpb, time.perf_counter() - t0)
        row["load_gc_ms"] = sum(GC_SECONDS) * 1e3
        ok = torch.equal(pool.gather(src[:batch]), pool.gather(dst[:batch]))
        row["bit_exact"] = ok
        # Both at once: new keys stored from src while the stored ones load into dst.
        more = key_chain(n, f"b{kib}")
        _quiet()
        t0 = time.perf_counter()
        jobs: list[int | None] = []
        for i in range(0, n, batch):
            jobs.append(off.submit_store(more[i : i + batch], src[i : i + batch]))
            plan = off.prepare_load(keys[i : i + batch])
            jobs.append(off.submit_load(plan, dst[i : i + batch]))
        moved = _jobs(off, jobs)
        row["both_gbps"] = harness.gbps(moved * bpb, time.perf_counter() - t0)
        # Cost to compute: a matmul loop alone, then while 2 GiB moves each way.
        alone = min(_matmul_seconds() for _ in range(3))
        again = key_chain(n, f"c{kib}")
        jobs = []
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            jobs.append(off.submit_store(again[i : i + batch], src[i : i + batch]))
            plan = off.prepare_load(more[i : i + batch])
            jobs.append(off.submit_load(plan, dst[i : i + batch]))
        busy = _matmul_seconds()
        _jobs(off, jobs)
        row["compute_slowdown"] = busy / alone
        row["copies_done_during_matmul"] = time.perf_counter() - t0 <= busy * 1.05
    row["store_ratio"] = harness.ratio(row["store_gbps"], base_d2h)
    row["load_ratio"] = harness.ratio(row["load_gbps"], base_h2d)
    row["both_ratio"] = harness.ratio(row["both_gbps"], max(base_d2h, base_h2d))
    row["both_vs_one_way"] = row["both_gbps"] / max(row["store_gbps"], row["load_gbps"])
    row.update(bench_chain(layout, pool, src, dst, mmap_dir / f"m{kib}", base_d2h))
    del pool
    torch.cuda.empty_cache()
    return row


def bench_chain(
    layout: KVLayout, pool: BlockPool, src: list[int], dst: list[int], path: Path, base: float
) -> dict[str, Any]:
    """cpu -> mmap: 256 MiB stored with write-through into the disk tier (timed to the
    last disk write), the cpu tier flushed, then claimed (prefetched and verified into
    the slab) and loaded."""
    bpb = layout.bytes_per_block
    n = max(8, (256 << 20) // bpb)
    batch = max(8, (32 << 20) // bpb)
    cfg = load_config(
        {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": n * bpb, "max_pending_stores": 4096},
                {
                    "name": "ssd",
                    "backend": "mmap",
                    "capacity": 2 * n * (bpb + 4096),
                    "max_pending_stores": 4096,
                    "path": str(path),
                },
            ]
        },
        env={},
    )
    out: dict[str, Any] = {}
    with Offloader(cfg, layout, pool) as off:
        keys = key_chain(n, f"chain{bpb}")
        t0 = time.perf_counter()
        _jobs(off, _store_all(off, keys, src[:n], batch))
        assert off.drain(600)
        out["chain_store_gbps"] = harness.gbps(n * bpb, time.perf_counter() - t0)
        flush = key_chain(n, f"flush{bpb}")
        _jobs(off, _store_all(off, flush, src[:n], batch))
        assert off.drain(600)
        t0 = time.perf_counter()
        loaded = 0
        for i in range(0, n, batch):
            part = keys[i : i + batch]
            while (plan := off.claim(i, part)) is None:
                time.sleep(0.0002)
            off.release(i)
            loaded += _jobs(off, [off.submit_load(plan, dst[i : i + plan.hits])])
        out["chain_load_gbps"] = harness.gbps(loaded * bpb, time.perf_counter() - t0)
        out["chain_loaded_blocks"] = loaded
        out["chain_blocks"] = n
    return out


def bench_pin(gib: int = 8) -> dict[str, Any]:
    """Seconds to make a ``gib`` GiB pinned slab: ``cudaHostAlloc`` (torch
    ``pin_memory=True``) against a pageable allocation first-touched by torch's threads
    and then ``cudaHostRegister``-ed (what the cpu tier does from 1 GiB up)."""
    rows = gib * 1024
    t0 = time.perf_counter()
    a = page_aligned_empty(rows, 1 << 20, pin_memory=True)
    alloc = time.perf_counter() - t0
    del a
    t0 = time.perf_counter()
    b = host_rows(rows, 1 << 20, pin=True)
    register = time.perf_counter() - t0
    pinned = b.is_pinned()
    unpin(b)
    return {
        "gib": gib,
        "host_alloc_s": alloc,
        "register_s": register,
        "registered_is_pinned": pinned,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sections", default="copies,offloader,pin")
    ap.add_argument("--mmap-dir", type=Path, default=None, help="where the mmap tier goes")
    ap.add_argument(
        "--copy",
        default="torch",
        help="device copies to measure the Offloader with: kernel (one Triton launch), torch",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (seconds; Python's default is 0.005)",
    )
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
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
    base_d2h = harness.gbps(total, timed(lambda: pinned.copy_(gpu, non_blocking=True)))
    base_h2d = harness.gbps(total, timed(lambda: gpu.copy_(pinned, non_blocking=True)))
    print(f"contiguous pinned copy: GPU->CPU {base_d2h:.1f} GB/s, CPU->GPU {base_h2d:.1f} GB/s")
    bufs = Buffers(gpu, gpu2, pinned, pinned2, pageable)
    rows: list[dict[str, Any]] = []
    for kib in SIZES_KIB if "copies" in sections else ():
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
    report: dict[str, Any] = {"base_d2h_gbps": base_d2h, "base_h2d_gbps": base_h2d, "rows": rows}
    if "offloader" in sections:
        for mode in args.copy.split(","):
            # The block pool's device copy: one Triton launch, or one torch op per layer.
            os.environ["KVOFFLOAD_CUDA_COPY"] = mode
            runs = report.setdefault("offloader" if mode == "torch" else f"offloader_{mode}", {})
            with tempfile.TemporaryDirectory(dir=args.mmap_dir) as tmp:
                for kib in OFFLOADER_KIB:
                    r = bench_offloader(kib, base_d2h, base_h2d, Path(tmp))
                    runs[f"{kib}KiB"] = r
                    print(
                        f"offloader[{mode}] {kib:>5} KiB  store {r['store_gbps']:5.1f} GB/s "
                        f"({r['store_ratio']:.2f}x)  load {r['load_gbps']:5.1f} "
                        f"({r['load_ratio']:.2f}x)  both {r['both_gbps']:5.1f} "
                        f"({r['both_ratio']:.2f}x; {r['both_vs_one_way']:.2f}x one way)  "
                        f"matmul {r['compute_slowdown']:.3f}x  exact {r['bit_exact']}  "
                        f"setup {r['setup_seconds']:.2f} s  "
                        f"gc {r['store_gc_ms']:.0f}/{r['load_gc_ms']:.0f} ms  "
                        f"chain store {r['chain_store_gbps']:.2f} "
                        f"load {r['chain_load_gbps']:.2f} GB/s "
                        f"({r['chain_loaded_blocks']}/{r['chain_blocks']})",
                        flush=True,
                    )
    if "pin" in sections:
        report["pin"] = bench_pin()
        print(f"pin: {report['pin']}")
    if args.json:
        harness.write_json(args.json, report, facts=harness.run_facts())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
