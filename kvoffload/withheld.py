"""Slots held back from new stores until the medium has forgotten what they held.

The books drop a block for good (found corrupt, or cleared by a reset) under their
lock, but forgetting it on the medium is I/O (an LMDB write transaction, a slab's
header write), which never runs under that lock: it comes back as a
:class:`~kvoffload.plans.Discard` order, carried out once the lock is released. Until
then the block's slot must not serve a new store, or the late discard would erase
the new block (an LMDB record is keyed by slot, a slab's header sits at its slot).
So the slot, freed by the manager with its block, is taken straight back out of the
allocator here, and freed again when the order has run; meanwhile the allocator counts
it used and no block held in it. This is the issue-33 parking of a budgeted store's
victims (``LRUOffloadingManager._parked``), for discards: the books own it and call it
under their lock only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.plans import Discard
from kvoffload.slots import SlotAllocator


class Withheld:
    """Slots of discarded blocks, per tier, out of their allocator until their discard
    order has run. ``lock`` is the books' lock: :meth:`settled` waits on it."""

    def __init__(self, managers: Sequence[OffloadingManager], lock: threading.Lock) -> None:
        self.managers = managers
        self._cond = threading.Condition(lock)
        self.pending = [0] * len(managers)
        """Slots held back now, per tier."""

    def drop(self, t: int, keys: Sequence[BlockKey]) -> Discard | None:
        """Remove idle ``keys`` from tier ``t``'s books, holding their slots back: the
        order that forgets them on the medium (``None`` when none was held)."""
        slots = self.managers[t].remove(keys)
        if not slots:
            return None
        allocator = self._allocator(t)
        if allocator is not None:
            _take(allocator, slots)
            self.pending[t] += len(slots)
        return Discard(t, slots)

    def release(self, order: Discard) -> None:
        """``order`` has run (or failed): its slots may serve new stores."""
        allocator = self._allocator(order.tier)
        if allocator is None:
            return
        allocator.free(order.slots)
        self.pending[order.tier] -= len(order.slots)
        if not any(self.pending):
            self._cond.notify_all()

    def settled(self, timeout: float) -> bool:
        """Wait (the lock released meanwhile) until no slot is held back, so that the
        allocators and the books agree again; ``False`` if some still are after
        ``timeout`` seconds (a discard stuck in its I/O)."""
        return self._cond.wait_for(lambda: not any(self.pending), timeout)

    def _allocator(self, t: int) -> SlotAllocator | None:
        """Tier ``t``'s slot allocator, where the books can reach it (a manager that
        keeps no slots of its own, a server's, has nothing to hold back)."""
        manager = self.managers[t]
        return manager.allocator if isinstance(manager, LRUOffloadingManager) else None


def _take(allocator: SlotAllocator, slots: list[int]) -> None:
    """Take ``slots``, just freed, back out of ``allocator``. The free list is a stack:
    the slots freed last are the next ones handed out, so one allocation takes exactly
    them; anything else (never seen) reserves them by number instead."""
    got = allocator.allocate(len(slots))
    if got is not None and sorted(got) == sorted(slots):
        return
    if got:
        allocator.free(got)
    allocator.reserve(slots)
