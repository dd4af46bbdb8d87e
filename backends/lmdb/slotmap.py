"""Which record each slot of an ``lmdb`` tier holds, as this process knows it.

LMDB addresses values by key, not by position, so slots are bookkeeping only: a
``slot -> key`` map lets a write into a reused slot delete the record it replaces in
the same transaction. The database therefore never holds more than ``num_slots``
records, and the capacity the manager enforces is the capacity on disk.

A budgeted (compressing) tier's freed slots are queued here too: their records no
longer count against the budget, so the writer thread deletes them soon after, before
anything else it does (:meth:`SlotRecords.release`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from kvoffload.backends.lmdb.env import Handles


class SlotRecords:
    """The slot <-> key maps, each slot's stored payload bytes, and the released slots
    whose records the writer has yet to delete. The maps change under :attr:`lock`,
    and on the writer thread only, except when read-only (nothing is written then)
    and at recovery (before any write)."""

    def __init__(self, num_slots: int) -> None:
        # slot -> key and key -> slot, inverse of each other. A freed slot keeps its key
        # until the slot is reused or discarded: the record is still intact, and a
        # restart may as well recover it.
        self.slot_key: list[bytes | None] = [None] * num_slots
        self.key_slot: dict[bytes, int] = {}
        self.stored = np.zeros(num_slots, dtype=np.int64)
        """Payload bytes as stored, per slot whose record this process knows of."""
        self.lock = threading.Lock()
        self._released: list[int] = []
        """Freed slots of a budgeted tier whose records the writer has yet to delete."""
        self._released_lock = threading.Lock()  # held for list operations only

    def renew_locks(self) -> None:
        """In a forked child: fresh locks, as a parent thread may have held one at fork
        time and it would never be released here."""
        self.lock = threading.Lock()
        self._released_lock = threading.Lock()

    # -- released slots (budgeted) ------------------------------------------------------
    def release(self, slots: Sequence[int]) -> bool:
        """Queue freed slots for the writer; whether the queue was empty before (the
        caller then asks the writer to delete them, once for the whole queue)."""
        with self._released_lock:
            first = not self._released
            self._released.extend(slots)
        return first

    def take_released(self) -> list[int]:
        with self._released_lock:
            slots, self._released = self._released, []
        return slots

    def requeue(self, slots: list[int]) -> None:
        """Put back released slots whose records a failed transaction did not delete."""
        with self._released_lock:
            self._released[:0] = slots

    # -- the maps (under ``lock``) ------------------------------------------------------
    def keys_of(self, slots: Iterable[int]) -> list[bytes]:
        """The keys the slots map to, skipping the ones that map to none."""
        return [k for k in (self.slot_key[s] for s in slots) if k is not None]

    def forget(self, slots: Sequence[int]) -> None:
        for slot in slots:
            key = self.slot_key[slot]
            if key is not None:
                self.slot_key[slot] = None
                del self.key_slot[key]
            self.stored[slot] = 0

    def adopt(self, records: Sequence[tuple[bytes, int]]) -> None:
        """At recovery: slot ``i`` holds the ``i``-th (key, stored payload bytes)."""
        with self.lock:
            for slot, (key, size) in enumerate(records):
                self.slot_key[slot] = key
                self.key_slot[key] = slot
                self.stored[slot] = size

    def journal(self) -> Journal:
        return Journal(self)

    def footprint(self, bytes_per_block: int) -> tuple[int, int]:
        """Logical and stored payload bytes of the records the slots map to."""
        with self.lock:
            held = [s for s, key in enumerate(self.slot_key) if key is not None]
            stored = int(self.stored[held].sum())
        return len(held) * bytes_per_block, stored

    def problems(self) -> list[str]:
        """The two maps' disagreements: each must be the other's inverse."""
        problems = []
        with self.lock:
            for slot, key in enumerate(self.slot_key):
                if key is not None and self.key_slot.get(key) != slot:
                    problems.append(f"slot {slot} maps to {key.hex()}, which maps elsewhere")
            for key, slot in self.key_slot.items():
                if self.slot_key[slot] != key:
                    problems.append(f"{key.hex()} maps to slot {slot}, which maps elsewhere")
        return problems

    def db_problems(self, handles: Handles, path: Path) -> list[str]:
        """On the writer thread (so no batch commits between the two snapshots): the
        records in the database that the slots do not map to, and the other way round."""
        with self.lock:
            held = set(self.key_slot)
        with handles.env.begin(db=handles.blocks) as txn:
            stored = set(txn.cursor().iternext(values=False))
        problems = []
        if len(stored) != len(held):
            problems.append(f"{len(stored)} records in {path} but {len(held)} blocks mapped")
        for what, keys in (("unmapped record", stored - held), ("no record for", held - stored)):
            problems += [f"{what} {key.hex()}" for key in sorted(keys)[:5]]
        return problems


class Journal:
    """The changes one write transaction makes to the maps, with their old values, so
    that they can be undone if the transaction fails. Used under the maps' lock."""

    def __init__(self, records: SlotRecords) -> None:
        self._records = records
        self._slots: dict[int, bytes | None] = {}
        self._keys: dict[bytes, int | None] = {}

    def set_slot(self, slot: int, key: bytes | None) -> None:
        slot_key = self._records.slot_key
        self._slots.setdefault(slot, slot_key[slot])
        slot_key[slot] = key

    def set_key(self, key: bytes, slot: int | None) -> None:
        key_slot = self._records.key_slot
        self._keys.setdefault(key, key_slot.get(key))
        if slot is None:
            key_slot.pop(key, None)
        else:
            key_slot[key] = slot

    def undo(self) -> None:
        slot_key, key_slot = self._records.slot_key, self._records.key_slot
        for slot, old_key in self._slots.items():
            slot_key[slot] = old_key
        for key, old_slot in self._keys.items():
            if old_slot is None:
                key_slot.pop(key, None)
            else:
                key_slot[key] = old_slot
