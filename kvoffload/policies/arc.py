"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Two resident lists, T1 (seen once) and T2 (seen again), and two ghost lists of recently
evicted keys, B1 and B2. A hit in a ghost list moves the target size ``p`` of T1, so
the cache leans towards recency or frequency, whichever the workload rewards. On the
Mooncake traces this buys 1-3 points of hit rate over LRU at small capacities.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence, Set

from kvoffload.keys import BlockKey
from kvoffload.policies.base import EvictionPolicy


def _next_victim(
    it: Iterator[tuple[BlockKey, int]], protected: Set[BlockKey], refs: Sequence[int]
) -> tuple[BlockKey, int] | None:
    for key, slot in it:
        if refs[slot] == 0 and key not in protected:
            return key, slot
    return None


class ARCPolicy(EvictionPolicy):
    """ARC over resident blocks; ghost lists hold keys only, capped at ``capacity`` each."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[BlockKey, int] = OrderedDict()  # recency, LRU first: key -> slot
        self._t2: OrderedDict[BlockKey, int] = OrderedDict()  # frequency, LRU first
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()  # ghosts evicted from T1
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()  # ghosts evicted from T2
        self.p = 0.0  # target size of T1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def get(self, key: BlockKey) -> int | None:
        slot = self._t1.get(key)
        return slot if slot is not None else self._t2.get(key)

    def get_many(self, keys: Iterable[BlockKey]) -> list[int | None]:
        t1, t2 = self._t1.get, self._t2.get
        return [s if (s := t1(k)) is not None else t2(k) for k in keys]

    def insert(self, key: BlockKey, slot: int) -> None:
        if key in self._b1:
            # It was evicted for being seen once, and came back: favour recency less.
            self.p = min(self.p + max(1.0, len(self._b2) / len(self._b1)), float(self.capacity))
            del self._b1[key]
            self._t2[key] = slot
        elif key in self._b2:
            self.p = max(self.p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2[key] = slot
        else:
            self._t1[key] = slot

    def remove(self, key: BlockKey) -> int:
        slot = self._t1.pop(key, None)
        return slot if slot is not None else self._t2.pop(key)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            slot = self._t1.pop(key, None)
            if slot is not None:
                self._t2[key] = slot
            elif key in self._t2:
                self._t2.move_to_end(key)

    def evict(
        self, n: int, protected: Set[BlockKey], refs: Sequence[int]
    ) -> list[tuple[BlockKey, int]] | None:
        if n <= 0:
            return []
        # Choose all victims before removing any, so a failure changes nothing.
        it1, it2 = iter(self._t1.items()), iter(self._t2.items())
        from_t1: list[tuple[BlockKey, int]] = []
        from_t2: list[tuple[BlockKey, int]] = []
        while len(from_t1) + len(from_t2) < n:
            prefer_t1 = len(self._t1) - len(from_t1) > max(self.p, 0.0) or not self._t2
            first, second = (it1, it2) if prefer_t1 else (it2, it1)
            victim = _next_victim(first, protected, refs)
            from_first = victim is not None
            if victim is None:
                victim = _next_victim(second, protected, refs)
                if victim is None:
                    return None
            took_t1 = prefer_t1 == from_first
            (from_t1 if took_t1 else from_t2).append(victim)
        for key, _ in from_t1:
            del self._t1[key]
            self._b1[key] = None
        for key, _ in from_t2:
            del self._t2[key]
            self._b2[key] = None
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return from_t1 + from_t2

    def items(self) -> Iterator[tuple[BlockKey, int]]:
        yield from self._t1.items()
        yield from self._t2.items()
