"""Least-recently-used eviction: one ``OrderedDict`` of key -> slot, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence, Set

from kvoffload.keys import BlockKey
from kvoffload.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently used evictable block first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[BlockKey, int] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> int | None:
        return self._blocks.get(key)

    def get_many(self, keys: Iterable[BlockKey]) -> list[int | None]:
        return list(map(self._blocks.get, keys))

    def insert(self, key: BlockKey, slot: int) -> None:
        self._blocks[key] = slot

    def insert_many(self, keys: Iterable[BlockKey], slots: Iterable[int]) -> None:
        self._blocks.update(zip(keys, slots, strict=True))

    def remove(self, key: BlockKey) -> int:
        return self._blocks.pop(key)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)

    def evict(
        self, n: int, protected: Set[BlockKey], refs: Sequence[int]
    ) -> list[tuple[BlockKey, int]] | None:
        if n <= 0:
            return []
        victims: list[tuple[BlockKey, int]] = []
        for key, slot in self._blocks.items():
            if refs[slot] == 0 and key not in protected:
                victims.append((key, slot))
                if len(victims) == n:
                    break
        else:
            return None
        for key, _ in victims:
            del self._blocks[key]
        return victims

    def items(self) -> Iterator[tuple[BlockKey, int]]:
        return iter(self._blocks.items())
