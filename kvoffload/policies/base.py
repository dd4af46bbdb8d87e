"""The eviction-policy interface, and the snapshot of a block's state.

A policy owns the key -> slot table, so one dict lookup serves both the manager's state
checks and the policy's ordering (no second index to keep in sync). A block's reference
count lives beside it in the manager's array, indexed by slot (see
:class:`~kvoffload.lru_manager.LRUOffloadingManager`): the table holds only bytes keys
and ints, so Python's garbage collector has nothing per block to walk. (It used to hold
one small object per block: a full collection then walked every held block, which for
a tier of millions of blocks stalls whichever thread triggered it, the engine's too.)

Policies never decide *whether* a block may go: :meth:`EvictionPolicy.evict` skips
pinned, in-flight and protected blocks, and is all-or-nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence, Set
from typing import final

from kvoffload.keys import BlockKey


@final
class BlockState:
    """A block's state at one moment (:meth:`LRUOffloadingManager.state`): its slot and
    reference count. A snapshot, built on demand; changing it changes nothing."""

    __slots__ = ("ref_cnt", "slot")

    def __init__(self, slot: int, ref_cnt: int = -1) -> None:
        self.slot = slot  # index of the backend slot holding the payload
        # -1: being written (not loadable, not evictable); 0: ready and evictable;
        # n > 0: pinned by n in-flight loads.
        self.ref_cnt = ref_cnt

    @property
    def ready(self) -> bool:
        return self.ref_cnt >= 0

    @property
    def evictable(self) -> bool:
        return self.ref_cnt == 0

    def __repr__(self) -> str:
        return f"BlockState(slot={self.slot}, ref_cnt={self.ref_cnt})"


class EvictionPolicy(ABC):
    """Ordering of resident blocks (key -> slot), and the choice of victims.

    Every method is O(1) per block, except :meth:`evict`, which also skips over the
    non-evictable blocks it meets.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks (ghost entries excluded)."""

    @abstractmethod
    def get(self, key: BlockKey) -> int | None:
        """The slot of a resident block, or ``None``."""

    def get_many(self, keys: Iterable[BlockKey]) -> list[int | None]:
        """:meth:`get` of each key, in order. The manager's per-batch loops call this
        once per batch: a policy whose table is a plain dict answers it without a
        Python call per key, which is most of the books' cost per block."""
        get = self.get
        return [get(k) for k in keys]

    @abstractmethod
    def insert(self, key: BlockKey, slot: int) -> None:
        """Add a new block as most recently used. ``key`` must not be resident."""

    def insert_many(self, keys: Iterable[BlockKey], slots: Iterable[int]) -> None:
        """:meth:`insert` of each pair, in order (so the last is the most recent)."""
        for key, slot in zip(keys, slots, strict=True):
            self.insert(key, slot)

    @abstractmethod
    def remove(self, key: BlockKey) -> int:
        """Drop a block that is not being evicted (a failed store); no ghost entry.
        Returns its slot."""

    @abstractmethod
    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark blocks used, in order: the last key becomes the most recently used."""

    @abstractmethod
    def evict(
        self, n: int, protected: Set[BlockKey], refs: Sequence[int]
    ) -> list[tuple[BlockKey, int]] | None:
        """Remove and return ``n`` evictable blocks (``refs[slot] == 0``) not in
        ``protected``, as ``(key, slot)``, or ``None`` (changing nothing) when fewer
        than ``n`` can go."""

    @abstractmethod
    def items(self) -> Iterator[tuple[BlockKey, int]]:
        """Resident blocks as ``(key, slot)``, in no promised order (for checks and
        introspection)."""
