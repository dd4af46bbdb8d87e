"""A packed (compressed) mmap tier holds blocks by the pages they take (issue 33).

Through the Offloader and its books: the charges a write answers reach the manager's
byte budget, so a zstd tier of the same ``capacity`` holds more blocks than an
uncompressed one, and every block it serves is bit-exact. Below the books: a budgeted
store parks the victims' slots it does not reuse until it is settled, freeing a slot
gives its extent back and clears its header, a block with no room is not stored, and a
reopen keeps the newest of two headers whose extents overlap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvoffload.backends.mmap import ALIGN, MmapBackend
from kvoffload.backends.mmap.extents import resolve
from support.blocks import LAYOUT, make_keys
from support.tiers import kv_content, store_batches, two_tier_offloader, two_tiers

from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.record import HEADER_BYTES
from kvoffload.testing import make_backend
from kvoffload.tier import adopt_recovered, local_manager

BPB = LAYOUT.bytes_per_block  # 16 KiB: 4 pages
FULL = 64  # full-size blocks the disk tier's capacity holds


_content = kv_content


def _offloader(tmp: Path, compression: str) -> Offloader:
    cap = FULL * MmapBackend.slot_bytes(LAYOUT)
    return two_tier_offloader(
        two_tiers(tmp, compression, name="ssd", backend="mmap", capacity=cap, cpu_capacity=8 * BPB)
    )


def _store_all(off: Offloader, keys: list[BlockKey]) -> None:
    store_batches(off, keys)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_zstd_tier_holds_more_blocks_in_the_same_capacity(
    tmp_path: Path, compression: str
) -> None:
    """Both tiers get the same 200 blocks; the uncompressed one holds exactly its 64
    full-size blocks, the zstd one every block its budget's pages hold at the charge
    each block's write answered (3 pages of 4 here, or 4 with a splinter): 76 to 80
    (a tier this small loses a larger share to the reserve and to a batch's headroom
    than a big one), and each
    block it serves reads back bit-exact. Nothing is refused for want of an extent."""
    off = _offloader(tmp_path, compression)
    try:
        keys = make_keys(200, salt=3)
        _store_all(off, keys)
        ssd = off.tiers[1]
        manager: Any = ssd.manager
        held = [k for k in keys if manager.holds(k)]
        if compression == "none":
            assert len(held) == FULL
        else:
            budget, full = ssd.backend.budget()  # type: ignore[misc]
            assert full == 4 * ALIGN
            charges = [manager._charges[manager.state(k).slot] for k in held]
            # Every block compressed to 3 pages; one placed in a run of 4 took the
            # page left over too (no block could use it), and is charged for it.
            assert set(charges) <= {3 * ALIGN, 4 * ALIGN}
            assert manager.bytes_held == sum(charges) <= budget
            # LRU by bytes: a batch of 8 at full charge no longer fits on top (the
            # headroom a store in flight needs is what keeps it under 1.33x).
            assert manager.bytes_held + 8 * full > budget
            # 242 pages budgeted: 80 blocks of 3 pages at most, fewer by the headroom
            # of the last batch and the splinters taken (which ones: the I/O threads'
            # order), so about 1.2x the 64 full-size blocks.
            assert 76 <= len(held) <= 80
        assert off.stats[1].rejected_stores == 0
        assert off.check() == []
        # What it holds loads back exactly.
        for key in held[:40]:
            slot = manager.prepare_load([key])
            row = torch.empty((1, BPB), dtype=torch.uint8)
            assert ssd.backend.read(slot, [key], row) == [True]
            manager.complete_load([key])
            assert torch.equal(row[0], _content(key))
    finally:
        off.close()


def _packed(tmp: Path, full: int = 8, **extra: Any) -> MmapBackend:
    be = make_backend("mmap", LAYOUT, full, tmp, compression="zstd", **extra)
    assert isinstance(be, MmapBackend)
    return be


def _rows(keys: list[BlockKey]) -> torch.Tensor:
    return torch.stack([_content(k) for k in keys])


def test_a_budgeted_store_parks_the_victims_slots_it_does_not_reuse(tmp_path: Path) -> None:
    """Room for two incompressible blocks takes five one-page victims: the store
    reuses two victims' slots, and the other three keep their extents (a demotion may
    still read them) until the job releases them, as it does once it has read what it
    demotes; the slots stay allocated until the store completes, and the write places
    both blocks."""
    be = _packed(tmp_path, full=8)  # 32 slots, 31 pages, a budget of 23 (8 reserved)
    manager = local_manager(be)
    small = make_keys(20, salt=1)
    for key in small:  # one at a time: each admitted at 4 pages, then charged 1
        out = manager.prepare_store([key])
        assert out is not None
        assert not out.evicted
        manager.charge(
            [key], be.write(out.slots, [key], torch.zeros((1, BPB), dtype=torch.uint8)) or []
        )
        manager.complete_store([key])
    assert manager.bytes_held == 20 * ALIGN
    big = make_keys(2, salt=2)
    out = manager.prepare_store(big)
    assert out is not None
    assert out.evicted == small[:5]  # 20 + 2 x 4 - 23 = 5 pages to free
    parked = [s for s in out.evicted_slots if s not in out.slots]
    assert len(parked) == 3
    assert out.slots == out.evicted_slots[:2]
    assert be.space is not None
    assert all(be.is_allocated(s) and be.space.extent(s) is not None for s in parked)
    assert manager.check() == []
    be.released(parked)  # what the job does after its demotion read
    assert all(be.is_allocated(s) and be.space.extent(s) is None for s in parked)
    sizes = be.write(out.slots, big, torch.randint(0, 256, (2, BPB), dtype=torch.uint8))
    assert sizes == [4 * ALIGN] * 2  # random bytes: stored raw, in full
    manager.charge(big, sizes)
    manager.complete_store(big)
    assert not any(be.is_allocated(s) for s in parked)
    assert be.space.used_pages == 15 + 8
    assert manager.bytes_held == 23 * ALIGN
    assert manager.check() == []
    assert be.check() == []
    be.close()


def test_a_block_with_no_room_is_not_stored(tmp_path: Path) -> None:
    """Outside any budget, the slab places what its pages hold and answers 0 for the
    rest, which it leaves empty: a miss, never data."""
    be = _packed(tmp_path, full=2)
    keys = make_keys(4, salt=4)
    slots = be.allocate(4)
    assert slots is not None
    data = torch.randint(0, 256, (4, BPB), dtype=torch.uint8)  # raw: 4 pages each
    sizes = be.write(slots, keys, data)
    assert sizes is not None
    assert sorted(sizes) == [0, 0, 0, 4 * ALIGN]
    out = torch.empty_like(data)
    assert be.read(slots, keys, out) == [bool(size) for size in sizes]
    first = sizes.index(4 * ALIGN)
    assert torch.equal(out[first], data[first])
    be.free(slots)
    assert be.space is not None
    assert be.space.used_pages == 0
    assert be.check() == []
    be.close()


def test_freed_blocks_are_not_recovered(tmp_path: Path) -> None:
    """Freeing a slot clears its header, on disk with the next write: a reopen finds
    only the blocks still held, with the charges they were written at."""
    be = _packed(tmp_path)
    keys = make_keys(4, salt=5)
    slots = be.allocate(4)
    assert slots is not None
    assert be.write(slots, keys, _rows(keys)) == [3 * ALIGN] * 4
    be.free(slots[:2])
    more = make_keys(1, salt=6)
    slot = be.allocate(1)
    assert slot is not None
    be.write(slot, more, _rows(more))  # carries the cleared headers to disk
    be.close()
    again = _packed(tmp_path)
    manager = local_manager(again)
    assert adopt_recovered(manager, again) == 3
    assert sorted(manager.held_keys()) == sorted(keys[2:] + more)
    assert manager.bytes_held == 3 * 3 * ALIGN
    assert manager.check() == []
    assert again.check() == []
    again.close()


def test_a_reopen_keeps_the_newer_of_two_overlapping_extents(tmp_path: Path) -> None:
    """A header left on disk for a freed block whose pages a newer block took: the
    reopen keeps the newer block (it reads back exactly) and reclaims the older."""
    be = _packed(tmp_path)
    old = make_keys(1, salt=7)
    slot = be.allocate(1)
    assert slot is not None
    be.write(slot, old, _rows(old))
    f, local = be._locate(slot[0])
    stale = f.headers[local].tobytes()  # the old block's header, as on disk
    be.free(slot)
    new = make_keys(1, salt=8)
    other = be.allocate(2)
    assert other is not None
    be.write(other[1:], new, _rows(new))
    assert be.space is not None
    assert be.space.extent(other[1]) == (0, 3)  # the old block's pages, best fit
    be.close()
    with open(f.path, "r+b") as fh:  # the stale header, back on disk
        fh.seek(ALIGN + local * HEADER_BYTES)
        fh.write(stale)
    again = _packed(tmp_path)
    found = again.recover()
    assert [b.key for b in found] == new
    row = torch.empty((1, BPB), dtype=torch.uint8)
    assert again.read([found[0].slot], new, row) == [True]
    assert torch.equal(row[0], _content(new[0]))
    assert again.check() == []
    again.close()


def test_resolve_keeps_the_newest_of_overlapping_extents() -> None:
    starts = np.array([0, 2, 5, 9, 10], dtype=np.int64)
    pages = np.array([4, 4, 2, 1, 3], dtype=np.int64)
    seqs = np.array([1, 5, 3, 4, 2], dtype=np.uint64)
    # (2, 4) is newest and takes pages 2..5: (0, 4) and (5, 2) overlap it and go;
    # (9, 1) and (10, 3) do not overlap anything kept.
    assert resolve(starts, pages, seqs).tolist() == [False, True, False, True, True]
    assert resolve(starts[3:], pages[3:], seqs[3:]).tolist() == [True, True]


def test_the_canary_over_a_full_packed_tier_leaves_nothing(tmp_path: Path) -> None:
    """The readiness canary's raw (full-size) block on a packed tier whose budget has
    no room for one more full-size block: its room takes the least recent block, the
    round passes, the canary's key is in no books afterwards, the books and the slab
    are consistent, and a reopen recovers exactly the blocks still held."""
    from kvoffload.connectors.vllm.canary import Canary

    off = _offloader(tmp_path, "zstd")
    try:
        keys = make_keys(200, salt=9)
        _store_all(off, keys[:64])
        ssd: Any = off.tiers[1].manager
        budget, full = off.tiers[1].backend.budget()  # type: ignore[misc]
        for key in keys[64:]:  # one at a time, until a full-size block no longer fits
            if ssd.bytes_held + full > budget:
                break
            _store_all(off, [key])
        before = [k for k in keys if ssd.holds(k)]
        canary = Canary(off, LAYOUT.fingerprint)
        report = canary.probe(30.0)
        assert [entry["ok"] for entry in report] == [True, True], report
        after = sorted(ssd.held_keys())
        assert canary.key not in after
        assert after == sorted(before[1:])  # the least recent block made its room
        assert off.check() == []
    finally:
        off.close()
    reopened = _offloader(tmp_path, "zstd")
    try:
        assert sorted(reopened.tiers[1].manager.held_keys()) == after
        assert reopened.check() == []
    finally:
        reopened.close()


def test_the_reserve_simulation_runs_the_real_books_and_map() -> None:
    """scripts/sim_packing_reserve.py (the figures behind the budget's reserve): over
    the same churn of one-block stores, no reserve leaves stores with no run of pages
    long enough, and the reserve the budget keeps at this size (two full-size blocks,
    2% of 100) leaves none."""
    import runpy

    from support.checkout import REPO

    sim = runpy.run_path(str(REPO / "scripts" / "sim_packing_reserve.py"))["simulate"]
    bare = sim(16, 100, 1, 0.0, 3000)
    kept = sim(16, 100, 1, 0.02, 3000)
    assert bare["unplaced"] > 0
    assert kept["unplaced"] == 0
    assert 1.3 < kept["held_vs_full"] <= bare["held_vs_full"]


def test_a_clean_close_carries_cleared_headers_to_disk(tmp_path: Path) -> None:
    """Blocks freed after the last write are not recovered after a clean close: the
    close writes the header pages they were cleared from."""
    be = _packed(tmp_path)
    keys = make_keys(4, salt=10)
    slots = be.allocate(4)
    assert slots is not None
    be.write(slots, keys, _rows(keys))
    be.free(slots[:3])
    be.close()
    again = _packed(tmp_path)
    assert [b.key for b in again.recover()] == keys[3:]
    again.close()


def test_a_reopen_over_the_budget_keeps_the_most_recent_blocks(tmp_path: Path) -> None:
    """A slab holding more than its budget (written here below the books, as a crash
    before cleared headers reached the disk could leave it) opens: the least recently
    written blocks are dropped until the rest fit, and the books take them."""
    be = _packed(tmp_path)  # 8 full-size blocks: 31 pages, a budget of 23
    budget, full = be.budget()  # type: ignore[misc]
    data = torch.randint(0, 256, (1, BPB), dtype=torch.uint8)  # raw: 4 pages
    keys = make_keys(7, salt=11)
    for key in keys:  # one by one: each a later write time than the last
        slot = be.allocate(1)
        assert slot is not None
        assert be.write(slot, [key], data) == [full]
    be.close()
    again = _packed(tmp_path)
    manager = local_manager(again)
    assert adopt_recovered(manager, again) == budget // full  # 5 of the 7
    assert sorted(manager.held_keys()) == sorted(keys[-5:])
    assert manager.check() == []
    assert again.check() == []
    again.close()


def test_a_slot_released_twice_gives_its_extent_back_once(tmp_path: Path) -> None:
    """A discarded block's slot is released twice: when the books remove it, and when
    its discard has run and the slot is freed (kvoffload/withheld.py). The second
    release finds no extent and changes nothing: the pages freed once are not freed
    again, and a block written into the slot afterwards reads back exactly."""
    be = _packed(tmp_path)
    keys = make_keys(3, salt=11)
    slots = be.allocate(3)
    assert slots is not None
    assert be.write(slots, keys, _rows(keys)) == [3 * ALIGN] * 3
    space = be.space
    assert space is not None
    used = space.used_pages
    be.released(slots[:1])
    assert space.used_pages == used - 3
    assert space.extent(slots[0]) is None
    be.released(slots[:1])  # again: a no-op
    assert space.used_pages == used - 3
    assert space.check() == []
    new = make_keys(1, salt=12)
    assert be.write(slots[:1], new, _rows(new)) == [3 * ALIGN]
    out = torch.empty_like(_rows(keys))
    assert be.read(slots, new + keys[1:], out) == [True] * 3
    assert torch.equal(out, _rows(new + keys[1:]))
    assert be.check() == []
    be.close()
