"""The eviction-policy interface and the per-block state it stores.

A policy owns the key -> :class:`BlockState` table, so one dict lookup serves both the
manager's state checks and the policy's ordering (no second index to keep in sync).
Policies never decide *whether* a block may go: :meth:`EvictionPolicy.evict` skips
pinned, in-flight and protected blocks, and is all-or-nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Set
from typing import final

from kvoffload.keys import BlockKey


@final
class BlockState:
    """Compact per-block state: two small ints in a ``__slots__`` object (~48 bytes)."""

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
    """Ordering of resident blocks, and the choice of victims.

    Every method is O(1) per block, except :meth:`evict`, which also skips over the
    non-evictable blocks it meets.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks (ghost entries excluded)."""

    @abstractmethod
    def get(self, key: BlockKey) -> BlockState | None:
        """The state of a resident block, or ``None``."""

    @abstractmethod
    def insert(self, key: BlockKey, state: BlockState) -> None:
        """Add a new block as most recently used. ``key`` must not be resident."""

    def get_many(self, keys: Iterable[BlockKey]) -> list[BlockState | None]:
        """:meth:`get` of each key, in order. The manager's per-batch loops call this
        once per batch: a policy whose table is a plain dict answers it without a
        Python call per key, which is most of the books' cost per block."""
        get = self.get
        return [get(k) for k in keys]

    def insert_many(self, keys: Iterable[BlockKey], states: Iterable[BlockState]) -> None:
        """:meth:`insert` of each pair, in order (so the last is the most recent)."""
        for key, state in zip(keys, states, strict=True):
            self.insert(key, state)

    @abstractmethod
    def remove(self, key: BlockKey) -> BlockState:
        """Drop a block that is not being evicted (a failed store); no ghost entry."""

    @abstractmethod
    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark blocks used, in order: the last key becomes the most recently used."""

    @abstractmethod
    def evict(self, n: int, protected: Set[BlockKey]) -> list[tuple[BlockKey, BlockState]] | None:
        """Remove and return ``n`` evictable blocks not in ``protected``, or ``None``
        (changing nothing) when fewer than ``n`` can go."""

    @abstractmethod
    def items(self) -> Iterator[tuple[BlockKey, BlockState]]:
        """Resident blocks, in no promised order (for checks and introspection)."""
