"""Least-recently-used eviction: one ``OrderedDict``, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Set

from kvoffload.keys import BlockKey
from kvoffload.policies.base import BlockState, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently used evictable block first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[BlockKey, BlockState] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> BlockState | None:
        return self._blocks.get(key)

    def insert(self, key: BlockKey, state: BlockState) -> None:
        self._blocks[key] = state

    def get_many(self, keys: Iterable[BlockKey]) -> list[BlockState | None]:
        return list(map(self._blocks.get, keys))

    def insert_many(self, keys: Iterable[BlockKey], states: Iterable[BlockState]) -> None:
        self._blocks.update(zip(keys, states, strict=True))

    def remove(self, key: BlockKey) -> BlockState:
        return self._blocks.pop(key)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)

    def evict(self, n: int, protected: Set[BlockKey]) -> list[tuple[BlockKey, BlockState]] | None:
        if n <= 0:
            return []
        victims: list[tuple[BlockKey, BlockState]] = []
        for key, state in self._blocks.items():
            if state.ref_cnt == 0 and key not in protected:
                victims.append((key, state))
                if len(victims) == n:
                    break
        else:
            return None
        for key, _ in victims:
            del self._blocks[key]
        return victims

    def items(self) -> Iterator[tuple[BlockKey, BlockState]]:
        return iter(self._blocks.items())
