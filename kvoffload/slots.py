"""A free list of fixed-size slot indices, shared by every backend.

Slots are plain ints and the free list is one Python list used as a stack, so
allocating or freeing ``n`` slots is a slice operation, not ``n`` method calls. A
``bytearray`` of flags catches double frees and backs :meth:`SlotAllocator.check`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvoffload.exceptions import BlockStateError


class SlotAllocator:
    """Hands out slot indices ``0 .. num_slots-1``; lowest indices first."""

    __slots__ = ("_free", "_used", "num_slots", "on_free")

    def __init__(self, num_slots: int, *, used: Iterable[int] = ()) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._used = bytearray(num_slots)  # slot -> 1 while allocated
        for slot in used:
            self._used[slot] = 1
        # Stack with the lowest index on top: adjacent allocations get adjacent slots,
        # which lets file-backed tiers coalesce them into one large I/O.
        self._free = [s for s in range(num_slots - 1, -1, -1) if not self._used[s]]
        self.on_free: Callable[[Sequence[int]], None] | None = None
        """Told of every batch :meth:`free` returns, after it is free: a backend that
        keeps per-slot space apart from the slot (a packed slab's extents, an LMDB
        record) lets it go there (:meth:`~kvoffload.backend.Backend.released`)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or ``None`` (allocating nothing) if fewer are free."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        slots.reverse()
        used = self._used
        for s in slots:
            used[s] = 1
        return slots

    def reserve(self, slots: Iterable[int]) -> None:
        """Mark specific free slots allocated (a persistent tier adopting what it found
        on disk at open). O(num_slots): meant for start-up, not the hot path."""
        used = self._used
        for s in slots:
            if used[s]:
                raise BlockStateError(f"slot {s} reserved twice")
            used[s] = 1
        self._free = [s for s in self._free if not used[s]]

    def free(self, slots: Sequence[int]) -> None:
        """Return slots to the free list; freeing a free slot is a bug and raises."""
        used = self._used
        for s in slots:
            if not used[s]:
                raise BlockStateError(f"slot {s} freed twice")
            used[s] = 0
        self._free.extend(reversed(slots))
        if self.on_free is not None and slots:
            self.on_free(slots)

    def is_allocated(self, slot: int) -> bool:
        return bool(self._used[slot])

    def check(self) -> list[str]:
        """Problems found (empty when consistent): every slot is free xor allocated."""
        problems: list[str] = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("free list holds duplicate slots")
        for s in free:
            if self._used[s]:
                problems.append(f"slot {s} is both free and allocated")
        allocated = sum(self._used)
        if allocated + len(free) != self.num_slots:
            problems.append(f"{allocated} allocated + {len(free)} free != {self.num_slots} slots")
        return problems
