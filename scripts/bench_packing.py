"""What packing compressed blocks into page extents buys an mmap tier (issue 33).

Why: a compressed tier with fixed full-size slots stores fewer bytes per block but
holds no more blocks. The packed slab (``backends/mmap/extents.py``) puts each block
in an extent of its stored pages, so the same ``capacity`` should hold more blocks;
this measures how many more, what fragmentation costs after a long churn with mixed
ratios, and whether loads keep their speed.

For each ``compression`` (``none`` first: the baseline), a fresh mmap tier of the same
``--capacity`` in ``--dir`` is filled through the real path, as the books do it:
``build_tiers`` (the manager gets the backend's byte budget), then per batch the
manager's ``prepare_store``, ``Backend.write``, ``complete_store(lost, success=False)``
for blocks the write found no room for (charge 0), ``manager.charge(stored, sizes)``
and ``complete_store(stored)``. Distinct blocks are stored until the first eviction
(the tier is full), then ``--churn`` times that many more (LRU evictions throughout).

Reported per codec: blocks held and ``held_vs_none`` (the capacity target: zstd >= 1.35,
lz4 >= 1.15 on real bf16 KV), blocks per GiB of capacity, ``stored_vs_used`` (payload
bytes held, ``Backend.footprint``, over the bytes of the pages they take,
``PackedSpace.used_pages``), the manager's ``bytes_held`` against its budget, the free
pages, the largest free extent and ``fragmentation`` (1 - largest / free), blocks that
found no room while filling and while churning (what the books count in
``rejected_stores``), the consistency checks of both the manager and the backend, then
the tier closed and, ``--load-reps`` times, the page cache dropped (root only; the
report says whether), the tier reopened (``reopen_s``, the fastest) and every held
block loaded through ``prepare_load`` / ``Backend.read`` / ``complete_load``, compared
byte for byte: load GB/s of logical bytes (the best round, and every round's) and
``load_vs_none``.

Why blocks find no room: the manager evicts until the *bytes* fit, the allocator needs
one free extent as long as the block. ``no_room_fragmented`` counts refusals where the
free pages after the write would have held the block but not in one piece;
``no_room_short`` where they would not have (the books and the slab disagreeing).

Blocks: ``--capture`` (an ``.npz`` by ``scripts/capture_kv.py`` whose ``blocks`` is
``uint8 [n, bytes_per_block]``, cycled under fresh keys) or ``--mixed``: KV-like bf16
rows (``kvoffload.tools.stress.kv_like``) of which a seeded share is random bytes
(incompressible) and a share has a random fraction of its values zeroed (compresses
further), so per-block ratios vary::

    .venv/bin/python scripts/capture_kv.py --only smollm2-bf16
    .venv/bin/python scripts/bench_packing.py --capture out/kv_capture/smollm2-bf16.npz \\
        --capacity 256MiB --churn 4 --json out/bench_packing.json
    .venv/bin/python scripts/bench_packing.py --mixed --block-bytes 64KiB --capacity 256MiB
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvoffload.config import load_config
from kvoffload.extents import PAGE_BYTES, pages_for
from kvoffload.keys import BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.sizes import parse_size
from kvoffload.tier import Tier, build_tiers
from kvoffload.tools.bench.harness import gbps, ratio, save_report, timed_result
from kvoffload.tools.bench.inputs import block_layout, read_capture
from kvoffload.tools.bench.raw import drop_page_cache
from kvoffload.tools.stress import kv_like

LOAD_BATCH_BYTES = 32 * 1024 * 1024
MIXED_POOL = 512
"""Distinct rows a ``--mixed`` run draws from (cycled under fresh keys): enough that
the ratios mix, few enough that generating them is instant."""
FRAGMENTATION_FIELDS = (
    "total_pages",
    "used_pages",
    "free_pages",
    "free_extents",
    "largest_free_pages",
    "fragmentation",
    "byte_budget",
    "bytes_held_books",
)


NAMESPACE = "bench-packing"


def capture_rows(path: Path) -> tuple[KVLayout, torch.Tensor, str]:
    layout, blocks, what = read_capture(path, NAMESPACE)
    return layout, torch.from_numpy(np.ascontiguousarray(blocks)), what


def mixed_rows(
    block_bytes: int, seed: int, random_share: float, zeroed_share: float
) -> tuple[KVLayout, torch.Tensor, str]:
    """KV-like bf16 rows; ``random_share`` of them random bytes, ``zeroed_share`` with
    30-90% of their values zeroed (the rest as ``kv_like`` makes them)."""
    layout = block_layout(block_bytes, 2, NAMESPACE)
    rows = kv_like(layout, MIXED_POOL, seed=seed)
    rng = np.random.default_rng(seed)
    kind = rng.random(MIXED_POOL)
    values = rows.view(torch.int16)  # a bf16 value is 2 bytes
    for r in range(MIXED_POOL):
        if kind[r] < random_share:
            rows[r] = torch.from_numpy(rng.integers(0, 256, block_bytes, dtype=np.uint8))
        elif kind[r] < random_share + zeroed_share:
            gone = rng.random(values.shape[1]) < rng.uniform(0.3, 0.9)
            values[r, torch.from_numpy(gone)] = 0
    what = (
        f"mixed: {MIXED_POOL} rows of kv_like bf16, {random_share:.0%} random, "
        f"{zeroed_share:.0%} with 30-90% of values zeroed (seed {seed}), cycled"
    )
    return layout, rows, what


def key_of(i: int) -> BlockKey:
    return BlockKey(chain_key(b"bench-packing", i.to_bytes(8, "little")))


def row_of(i: int, pool: int) -> int:
    """Which pool row block ``i`` carries: a fixed scramble, the same for every codec,
    so neighbours in a batch have unrelated ratios."""
    return (i * 2654435761 + 12345) % pool


def open_tier(path: Path, codec: str, capacity: int, layout: KVLayout) -> Tier:
    raw = {
        "tiers": [
            {
                "name": f"mmap-{codec}",
                "backend": "mmap",
                "path": str(path),
                "capacity": capacity,
                "compression": codec,
            }
        ]
    }
    (tier,) = build_tiers(load_config(raw), layout)
    return tier


def store_batch(
    tier: Tier,
    keys: list[BlockKey],
    rows: torch.Tensor,
    need: list[int],
    diag: dict[str, int],
    early_release: bool,
) -> tuple[bool, int]:
    """One store as the books make it: ``(whether it evicted, blocks with no room)``.

    For a packed slab, ``diag`` gathers why a block found no room: the pages of the
    victims' slots the store parked (still allocated while it writes, though the books
    already count their bytes as free), and for each block refused whether the free
    pages after the write would have held it (``no_room_fragmented``: free, but not in
    one extent) or not (``no_room_short``). ``need``: each block's pages.

    ``early_release``: the parked victims' space is handed back to the backend
    (``Backend.released``) before the write, as the jobs do once any demotion has read
    them (``Write.released``); otherwise only when the store is settled."""
    manager, backend = tier.manager, tier.backend
    space = getattr(backend, "space", None)
    plan = manager.prepare_store(keys)
    if plan is None:
        raise SystemExit(f"tier {tier.name}: prepare_store found no room (nothing pinned)")
    if not plan.keys_to_store:
        return bool(plan.evicted), 0
    parked = 0
    if space is not None:
        reused = set(plan.slots)
        released = [s for s in plan.evicted_slots if s not in reused]
        for slot in released:
            extent = space.extent(slot)
            parked += extent[1] if extent is not None else 0
        if early_release and released:
            backend.released(released)
            parked = 0
    sizes = backend.write(plan.slots, plan.keys_to_store, rows)
    if sizes is None:  # unbudgeted: every block stored at full size
        manager.complete_store(plan.keys_to_store, success=True)
        return bool(plan.evicted), 0
    stored = [k for k, s in zip(plan.keys_to_store, sizes, strict=True) if s > 0]
    lost = [j for j, s in enumerate(sizes) if s <= 0]
    if lost and space is not None:
        diag["no_room_batches"] += 1
        diag["parked_pages_in_those"] += parked
        diag["parked_pages_max"] = max(diag["parked_pages_max"], parked)
        for j in lost:
            key = "no_room_fragmented" if space.free_pages >= need[j] else "no_room_short"
            diag[key] += 1
    if lost:
        manager.complete_store([plan.keys_to_store[j] for j in lost], success=False)
    manager.charge(stored, [s for s in sizes if s > 0], unplaced=len(sizes) - len(stored))
    manager.complete_store(stored, success=True)
    return bool(plan.evicted), len(lost)


def pages_needed(tier: Tier, pool: torch.Tensor) -> list[int]:
    """Each pool row's pages in this tier: its codec's output, or the row if that is
    not smaller (what the write stores)."""
    packer = getattr(tier.backend, "packer", None)
    out = []
    for row in pool.numpy():
        packed = None if packer is None else packer.compress(row)
        out.append(pages_for(row.nbytes if packed is None else len(packed)))
    return out


def fragmentation(tier: Tier) -> dict[str, Any]:
    """The packed slab's space after the churn (``None`` fields: a fixed-slot slab)."""
    space = getattr(tier.backend, "space", None)
    manager = tier.manager
    budget = getattr(manager, "byte_budget", None)
    if space is None:
        return dict.fromkeys(FRAGMENTATION_FIELDS)
    free, largest = space.free_pages, space.largest_free()
    values = (
        space.total_pages,
        space.used_pages,
        free,
        sum(a.free_extents for a in space.files),
        largest,
        1.0 - largest / free if free else 0.0,
        budget,
        getattr(manager, "bytes_held", None),
    )
    return dict(zip(FRAGMENTATION_FIELDS, values, strict=True))


def run_codec(
    codec: str, layout: KVLayout, pool: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    path = args.dir / f"mmap-{codec}"
    shutil.rmtree(path, ignore_errors=True)
    capacity = parse_size(args.capacity)
    bpb = layout.bytes_per_block
    tier = open_tier(path, codec, capacity, layout)
    full_at: int | None = None
    end: int | None = None
    rejected_fill = rejected_churn = 0
    limit = 64 * max(1, tier.backend.num_slots)  # a tier that never fills is a bug
    pool_pages = pages_needed(tier, pool)
    diag = dict.fromkeys(
        (
            "no_room_batches",
            "no_room_fragmented",
            "no_room_short",
            "parked_pages_in_those",
            "parked_pages_max",
        ),
        0,
    )
    i = 0
    t0 = time.perf_counter()
    try:
        while end is None or i < end:
            n = args.batch if end is None else min(args.batch, end - i)
            which = [row_of(j, len(pool)) for j in range(i, i + n)]
            keys = [key_of(j) for j in range(i, i + n)]
            need = [pool_pages[w] for w in which]
            evicted, unplaced = store_batch(
                tier, keys, pool[torch.tensor(which)], need, diag, args.release == "early"
            )
            if full_at is None and evicted:
                full_at = i  # blocks stored before the first eviction: the tier's fill
                end = i + max(1, int(args.churn * i))
            if full_at is None or i < full_at:
                rejected_fill += unplaced
            else:
                rejected_churn += unplaced
            i += n
            if i > limit:
                raise SystemExit(f"{codec}: {i} blocks stored and no eviction yet")
        store_s = time.perf_counter() - t0
        manager, backend = tier.manager, tier.backend
        held = len(manager.held_keys())
        footprint = backend.stats().held
        logical, stored_bytes = footprint if footprint is not None else (held * bpb, held * bpb)
        space = getattr(backend, "space", None)
        used_bytes = (
            space.used_pages * PAGE_BYTES
            if space is not None
            else held * -(-bpb // PAGE_BYTES) * PAGE_BYTES
        )
        problems = manager.check() + backend.check()
        row: dict[str, Any] = {
            "compression": codec,
            "slots": backend.num_slots,
            "stored_blocks": i,
            "filled_at": full_at,
            "held": held,
            "blocks_per_gib": held / (capacity / 1024**3),
            "stored_vs_logical": stored_bytes / logical if logical else None,
            "stored_bytes": stored_bytes,
            "used_bytes": used_bytes,
            "stored_vs_used": stored_bytes / used_bytes if used_bytes else None,
            "rejected_fill": rejected_fill,
            "rejected_churn": rejected_churn,
            "rejected_churn_share": rejected_churn / (i - full_at) if full_at is not None else None,
            "store_gbps": gbps(i * bpb, store_s),
            "problems": problems,
            **diag,
            **fragmentation(tier),
        }
    finally:
        tier.close()
    once = partial(load_once, path, codec, capacity, layout, pool, held, i)
    row.update(load_all(once, held, args.load_reps))
    shutil.rmtree(path, ignore_errors=True)
    return row


def load_all(once: Callable[[], dict[str, Any]], held: int, reps: int) -> dict[str, Any]:
    """``reps`` rounds of ``once`` (:func:`load_once`: page cache dropped, reopen
    (timed), every held block loaded and checked against what was stored). The best
    round's figures (the machine is shared: its worst rounds measure the neighbours),
    and every round's."""
    rounds = [once() for _ in range(reps)]
    gbps = [r["load_gbps"] for r in rounds]
    return {
        "reopen_s": min(r["reopen_s"] for r in rounds),
        "loaded": rounds[0]["loaded"],
        "recovered_over_held": rounds[0]["loaded"] - held,
        "load_gbps": max(gbps),
        "load_gbps_rounds": gbps,
        "page_cache_dropped": all(r["page_cache_dropped"] for r in rounds),
        "direct_io": all(r["direct_io"] for r in rounds),
    }


def load_once(
    path: Path,
    codec: str,
    capacity: int,
    layout: KVLayout,
    pool: torch.Tensor,
    held: int,
    stored: int,
) -> dict[str, Any]:
    """Reopen (timed), then load every block held, checked against what was stored."""
    dropped = drop_page_cache()
    reopen_s, tier = timed_result(lambda: open_tier(path, codec, capacity, layout))
    try:
        keys = tier.manager.held_keys()
        if len(keys) < held:
            raise SystemExit(f"{codec}: {len(keys)} blocks back after reopen, {held} held")
        # More than held: blocks evicted after the last header write, whose cleared
        # headers a clean close left on disk, came back (reported, and loaded too).
        index = {key_of(i): i for i in range(stored)}
        bpb = layout.bytes_per_block
        per = max(1, LOAD_BATCH_BYTES // bpb)
        out = torch.empty((per, bpb), dtype=torch.uint8)
        seconds = 0.0
        bad = 0
        for lo in range(0, len(keys), per):
            batch = keys[lo : lo + per]
            t0 = time.perf_counter()
            slots = tier.manager.prepare_load(batch)
            valid = tier.backend.read(slots, batch, out[: len(batch)])
            tier.manager.complete_load(batch)
            seconds += time.perf_counter() - t0
            want = pool[torch.tensor([row_of(index[k], len(pool)) for k in batch])]
            bad += sum(
                1 for j in range(len(batch)) if not valid[j] or not torch.equal(out[j], want[j])
            )
        if bad:
            raise SystemExit(f"{codec}: {bad} of {len(keys)} blocks came back wrong")
        return {
            "reopen_s": reopen_s,
            "loaded": len(keys),
            "load_gbps": gbps(len(keys) * bpb, seconds),
            "page_cache_dropped": dropped,
            "direct_io": bool(getattr(tier.backend, "direct", False)),
        }
    finally:
        tier.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--capture", type=Path, help="an .npz by scripts/capture_kv.py")
    src.add_argument("--mixed", action="store_true", help="synthetic KV-like rows, mixed")
    ap.add_argument("--block-bytes", default="256KiB", help="--mixed: bytes per block")
    ap.add_argument("--random-share", type=float, default=0.15)
    ap.add_argument("--zeroed-share", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", default="256MiB")
    ap.add_argument("--churn", type=float, default=4.0, help="stores after full, x the fill")
    ap.add_argument("--batch", type=int, default=16, help="blocks per store")
    ap.add_argument("--codecs", default="none,lz4,zstd")
    ap.add_argument(
        "--release",
        choices=("early", "settle"),
        default="early",
        help="parked victims' space back before the write (the jobs' way) or at settle",
    )
    ap.add_argument("--load-reps", type=int, default=3, help="load rounds; the best is kept")
    ap.add_argument("--dir", type=Path, default=Path("out/bench-packing"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    codecs = args.codecs.split(",")
    if codecs[0] != "none":
        raise SystemExit("--codecs: the uncompressed tier is the baseline: list none first")
    if args.capture is not None:
        layout, pool, what = capture_rows(args.capture)
    else:
        layout, pool, what = mixed_rows(
            parse_size(args.block_bytes), args.seed, args.random_share, args.zeroed_share
        )
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"blocks: {what}; {layout.bytes_per_block} B each; capacity {args.capacity}", flush=True)
    rows = [run_codec(codec, layout, pool, args) for codec in codecs]
    none = rows[0]
    for r in rows:
        r["held_vs_none"] = ratio(r["held"], none["held"])
        r["load_vs_none"] = ratio(r["load_gbps"] or None, none["load_gbps"])
    report = {
        "blocks": what,
        "bytes_per_block": layout.bytes_per_block,
        "capacity": parse_size(args.capacity),
        "churn": args.churn,
        "batch": args.batch,
        "release": args.release,
        "load_reps": args.load_reps,
        "codecs": rows,
    }
    print(
        f"{'codec':<5} {'held':>6} {'x none':>6} {'blk/GiB':>8} {'stored/log':>10} "
        f"{'stored/used':>11} {'free pg':>8} {'largest':>8} {'frag':>5} "
        f"{'no room':>8} {'churn%':>6} {'reopen s':>8} {'load GB/s':>9} {'x none':>6}"
    )
    for r in rows:
        frag = "-" if r["fragmentation"] is None else f"{r['fragmentation']:.2f}"
        print(
            f"{r['compression']:<5} {r['held']:>6} {r['held_vs_none']:>6.3f} "
            f"{r['blocks_per_gib']:>8.0f} {r['stored_vs_logical']:>10.3f} "
            f"{r['stored_vs_used']:>11.3f} {r['free_pages'] or 0:>8} "
            f"{r['largest_free_pages'] or 0:>8} {frag:>5} "
            f"{r['rejected_fill']}+{r['rejected_churn']:<6} {r['rejected_churn_share']:>6.1%} "
            f"{r['reopen_s']:>8.3f} "
            f"{r['load_gbps'] or 0:>9.2f} {r['load_vs_none'] or 0:>6.2f}"
        )
    print(
        f"page cache dropped: {all(r['page_cache_dropped'] for r in rows)}; "
        f"O_DIRECT: {all(r['direct_io'] for r in rows)}; "
        f"problems: {sum(len(r['problems']) for r in rows)}; "
        f"blocks back after reopen over those held: "
        f"{[r['recovered_over_held'] for r in rows]}",
        flush=True,
    )
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
