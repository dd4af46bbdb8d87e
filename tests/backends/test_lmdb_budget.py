"""A compressed LMDB tier holds blocks by the bytes their records take (issue 33).

Through the Offloader and its books: the charges the tier's writes answer (128-byte
header plus stored payload) reach the manager's byte budget, so a zstd tier of the
same ``capacity`` holds more blocks than an uncompressed one; the records of evicted
blocks are deleted, so the database holds exactly what the manager does; a reopen
restores the same blocks at the same charges. Below the books: freeing a slot of a
budgeted tier deletes its record (an uncompressed tier keeps it until the slot is
reused, as before), recovery keeps the newest records its budget holds, and the map
covers the budget's records without growing with the 4x slots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvoffload.backends.lmdb import PACKING, LmdbBackend, map_size_for
from support.blocks import LAYOUT, make_keys
from support.tiers import kv_content, store_batches, two_tier_offloader, two_tiers

from kvoffload.config import LmdbTierConfig
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.offloader import Offloader
from kvoffload.record import HEADER_BYTES
from kvoffload.testing import make_backend
from kvoffload.tools.stress import kv_like

BPB = LAYOUT.bytes_per_block  # 16 KiB
FULL = 64  # full-size blocks the LMDB tier's capacity holds
SLOT = LmdbBackend.slot_bytes(LAYOUT)  # a full-size record: header plus payload
BATCH = 8


_content = kv_content


def _same(key: BlockKey) -> torch.Tensor:
    """The same KV-like values for every key: every record compresses alike."""
    return kv_like(LAYOUT, 1, 7)[0]


def _offloader(tmp: Path, compression: str) -> Offloader:
    return two_tier_offloader(
        two_tiers(
            tmp,
            compression,
            name="db",
            backend="lmdb",
            capacity=FULL * SLOT,
            cpu_capacity=BATCH * BPB,
        )
    )


def _store_all(off: Offloader, keys: list[BlockKey], content: Any = _content) -> None:
    store_batches(off, keys, batch=BATCH, timeout=60, content=content)


def _charges(manager: Any, keys: list[BlockKey]) -> dict[BlockKey, int]:
    return {k: manager._charges[manager.state(k).slot] for k in keys}


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_zstd_tier_holds_more_blocks_in_the_same_capacity(
    tmp_path: Path, compression: str
) -> None:
    """Both tiers get the same 200 distinct KV-like blocks. The uncompressed one holds
    exactly its 64 full-size blocks, unbudgeted; the zstd one holds over 1.2x that,
    its manager charging each block its record's length (the budget's bytes held are
    exactly the held records' headers plus stored payloads). Either way the database
    holds one record per block the manager holds, and no more: the records of evicted
    blocks are gone. A reopen restores the same blocks at the same charges."""
    off = _offloader(tmp_path, compression)
    keys = make_keys(200, salt=1)
    try:
        _store_all(off, keys)
        db = off.tiers[1]
        manager: Any = db.manager
        backend = db.backend
        assert isinstance(backend, LmdbBackend)
        held = [k for k in keys if manager.holds(k)]
        records = backend.entries()  # on the writer: after the queued deletions
        assert backend.capacity_bytes == FULL * SLOT
        if compression == "none":
            assert backend.budget() is None
            assert manager.byte_budget is None
            assert backend.num_slots == FULL
            assert len(held) == records == FULL
        else:
            assert backend.budget() == (FULL * SLOT, SLOT)
            assert backend.num_slots == PACKING * FULL
            assert len(held) > 1.2 * FULL
            assert records == len(held)
            footprint = backend.stats().held
            assert footprint is not None
            logical, stored = footprint
            assert logical == len(held) * BPB
            assert manager.bytes_held == stored + len(held) * HEADER_BYTES <= FULL * SLOT
            assert all(HEADER_BYTES < c < SLOT for c in _charges(manager, held).values())
        assert off.stats[1].rejected_stores == 0
        assert off.check() == []
        assert backend.check() == []
        assert manager.check() == []
        for key in held[-BATCH:]:  # what it holds loads back exactly
            slot = manager.prepare_load([key])
            row = torch.empty((1, BPB), dtype=torch.uint8)
            assert backend.read(slot, [key], row) == [True]
            manager.complete_load([key])
            assert torch.equal(row[0], _content(key))
        bytes_held = manager.bytes_held
        charges = _charges(manager, held) if compression != "none" else {}
    finally:
        off.close()

    again = _offloader(tmp_path, compression)
    try:
        manager = again.tiers[1].manager
        assert sorted(manager.held_keys()) == sorted(held)
        assert manager.bytes_held == bytes_held
        if compression != "none":
            assert _charges(manager, held) == charges
        assert again.tiers[1].backend.entries() == len(held)  # type: ignore[attr-defined]
        assert again.check() == []
    finally:
        again.close()


def test_equal_records_fill_the_budget_exactly(tmp_path: Path) -> None:
    """Every block compresses to the same record length ``c``: each batch of 8 is
    admitted at the full charge, so the fewest LRU blocks go that leave room for
    8 x full, and once charged the tier holds ``(budget - 8 x full) // c + 8``
    blocks, with one record each in the database."""
    off = _offloader(tmp_path, "zstd")
    try:
        keys = make_keys(240, salt=2)
        _store_all(off, keys, content=_same)
        manager: Any = off.tiers[1].manager
        backend = off.tiers[1].backend
        assert isinstance(backend, LmdbBackend)
        held = [k for k in keys if manager.holds(k)]
        (charge,) = set(_charges(manager, held).values())
        budget = FULL * SLOT
        assert len(held) == (budget - BATCH * SLOT) // charge + BATCH
        assert held == keys[-len(held) :]  # the newest: LRU
        assert manager.bytes_held == len(held) * charge
        assert backend.entries() == len(held)
        assert off.check() == []
    finally:
        off.close()


def _zstd(tmp: Path, full: int, **extra: Any) -> LmdbBackend:
    be = make_backend("lmdb", LAYOUT, full, tmp, compression="zstd", **extra)
    assert isinstance(be, LmdbBackend)
    return be


def test_freeing_a_budgeted_slot_deletes_its_record(tmp_path: Path) -> None:
    """Freed slots' records are deleted on the writer (no write needed), their keys
    forgotten, so writing a new block into a freed slot deletes nothing twice, and a
    reopen recovers the blocks still held at the charges their writes answered."""
    be = _zstd(tmp_path, full=4)
    keys = make_keys(7, salt=3)
    slots = be.allocate(6)
    assert slots is not None
    assert be.num_slots == 4 * PACKING
    sizes = be.write(slots, keys[:6], torch.stack([_content(k) for k in keys[:6]]))
    assert sizes is not None
    held = be.stats().held
    assert held is not None
    _, stored = held
    assert sum(sizes) == stored + 6 * HEADER_BYTES
    assert max(sizes) < SLOT
    assert be.entries() == 6
    be.free(slots[:2])
    assert be.entries() == 4
    assert be.check() == []
    slot = be.allocate(1)
    assert slot is not None
    assert slot[0] in slots[:2]
    more = be.write(slot, keys[6:], _content(keys[6]).unsqueeze(0))
    assert more is not None
    assert be.entries() == 5
    assert be.check() == []
    be.close()
    again = _zstd(tmp_path, full=4)
    found = {b.key: b.charge for b in again.recover()}
    assert found == dict(zip(keys[2:], sizes[2:] + more, strict=True))
    assert again.entries() == 5
    assert again.check() == []
    again.close()


def test_an_uncompressed_tier_keeps_a_freed_slots_record_until_reuse(tmp_path: Path) -> None:
    """No budget: the slots bind, ``released`` does nothing, and a freed slot's record
    stays intact until a write into the slot replaces it, in the same transaction."""
    be = make_backend("lmdb", LAYOUT, 4, tmp_path)
    assert isinstance(be, LmdbBackend)
    assert be.budget() is None
    assert be.num_slots == 4
    assert be.capacity_bytes == 4 * SLOT
    keys = make_keys(5, salt=4)
    slots = be.allocate(4)
    assert slots is not None
    assert be.write(slots, keys[:4], torch.stack([_content(k) for k in keys[:4]])) is None
    be.free(slots[:2])
    assert be.entries() == 4
    slot = be.allocate(1)
    assert slot is not None
    be.write(slot, keys[4:], _content(keys[4]).unsqueeze(0))
    assert be.entries() == 4
    assert be.check() == []
    be.close()


def test_recovery_keeps_the_newest_records_the_budget_holds(tmp_path: Path) -> None:
    """Six incompressible records (each a full charge) written over a budget of two:
    the maintenance tools' config (``existing_config``) grows the capacity to hold
    them all, and a reopen under the tier's own capacity keeps the newest two and
    deletes the rest."""
    be = _zstd(tmp_path, full=2)
    keys = make_keys(6, salt=5)
    slots = be.allocate(6)
    assert slots is not None
    for i in range(0, 6, 2):  # three transactions: later ones are newer
        data = torch.randint(0, 256, (2, BPB), dtype=torch.uint8)
        assert be.write(slots[i : i + 2], keys[i : i + 2], data) == [SLOT, SLOT]
    config = be.config
    be.close()
    wide = LmdbBackend.existing_config(config, write=False)
    assert isinstance(wide, LmdbTierConfig)
    assert wide.capacity == 6 * SLOT
    reader = LmdbBackend(wide, LAYOUT)
    assert sorted(b.key for b in reader.recover()) == sorted(keys)
    reader.close()
    again = _zstd(tmp_path, full=2)
    found = again.recover()
    assert [(b.key, b.charge) for b in found] == [(keys[4], SLOT), (keys[5], SLOT)]
    assert again.entries() == 2
    assert again.check() == []
    again.close()


@pytest.mark.parametrize(
    ("layout", "most"),
    [
        (LAYOUT, 1.7),  # 16 KiB: 4 slots' overflow rounding on a 4-page record
        (KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16), 1.01),
        (KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4), 1.2),  # leaf
    ],
    ids=["16KiB", "2MiB", "1KiB-leaf"],
)
def test_the_map_does_not_grow_with_the_slots(layout: KVLayout, most: float) -> None:
    """The same capacity maps at most ``most`` times the bytes uncompressed (4x the
    slots would map 4x): the budget bounds the records' bytes, the slots only the
    per-record rounding."""
    headroom = map_size_for(layout, 0)
    plain = map_size_for(layout, 100) - headroom
    budget = 100 * LmdbBackend.slot_bytes(layout)
    packed = map_size_for(layout, 100 * PACKING, budget) - headroom
    assert plain < packed <= most * plain
    assert map_size_for(layout, 100 * PACKING) - headroom >= 3.9 * plain


@pytest.mark.parametrize("share", [1.0, 0.3])
def test_the_map_holds_a_full_budget_under_churn(tmp_path: Path, share: float) -> None:
    """A zstd tier of 64 full-size blocks, mapped with 64 KiB for the B-tree instead
    of 64 MiB, so the records' share of the map is all the room they get, churned
    through its manager (400 blocks, a third incompressible). With the whole share
    every write fits and the database ends with one record per block held; with 30%
    of it a write fails with the map full once the budget fills: the churn does need
    the room the map reserves for it."""
    full = 64
    be = _zstd(tmp_path, full=full)
    records = map_size_for(LAYOUT, be.num_slots, full * SLOT) - map_size_for(LAYOUT, 0)
    be.map_size = int(records * share) // 4096 * 4096 + 64 * 1024
    budget = be.budget()
    assert budget is not None
    manager = LRUOffloadingManager(
        be.slots, "lru", name="db", byte_budget=budget[0], full_charge=budget[1]
    )
    gen = torch.Generator().manual_seed(9)
    keys = make_keys(400, salt=6)
    failure = ""
    try:
        for i in range(0, len(keys), 4):
            batch = keys[i : i + 4]
            out = manager.prepare_store(batch)
            assert out is not None
            parked = [s for s in out.evicted_slots if s not in out.slots]
            be.released(parked)  # what the job does once it read what it demotes
            raw = torch.randint(0, 256, (4, BPB), dtype=torch.uint8, generator=gen)
            rows = torch.stack([_content(k) if j % 3 else raw[j] for j, k in enumerate(batch)])
            try:
                sizes = be.write(out.slots, batch, rows)
            except BackendError as exc:
                failure = str(exc)
                break
            assert sizes is not None
            manager.charge(batch, sizes)
            manager.complete_store(batch)
        if share < 1:
            assert "MDB_MAP_FULL" in failure
            assert manager.bytes_held > budget[0] // 2  # not before the budget filled
            return
        assert failure == ""
        held = manager.held_keys()
        assert len(held) > full
        assert be.entries() == len(held)
        assert be.check() == []
        assert manager.check() == []
    finally:
        be.close()


def test_a_slot_released_twice_deletes_its_record_once(tmp_path: Path) -> None:
    """A discarded block's slot is released twice: when the books remove it, and when
    its discard has run and the slot is freed (kvoffload/withheld.py). The second
    release deletes nothing more, and a block written into the slot afterwards keeps
    its record and reads back exactly."""
    be = _zstd(tmp_path, full=4)
    keys = make_keys(4, salt=9)
    slots = be.allocate(3)
    assert slots is not None
    assert be.write(slots, keys[:3], torch.stack([_content(k) for k in keys[:3]])) is not None
    assert be.entries() == 3
    be.released(slots[:1])
    be.released(slots[:1])  # again: nothing more to delete
    assert be.entries() == 2
    assert be.write(slots[:1], keys[3:], _content(keys[3]).unsqueeze(0)) is not None
    assert be.entries() == 3
    want = [keys[3], *keys[1:3]]
    out = torch.empty(3, LAYOUT.bytes_per_block, dtype=torch.uint8)
    assert be.read(slots, want, out) == [True] * 3
    assert torch.equal(out, torch.stack([_content(k) for k in want]))
    assert be.check() == []
    be.close()
