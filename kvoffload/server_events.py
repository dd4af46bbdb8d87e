"""Store / removal records of a shared server's tier, for KV events.

A shared server's tier (:class:`~kvoffload.server_manager.ServerBookedManager`) keeps
no books: what the server holds changes without this engine (other engines write it,
it evicts by itself). So its records are what this engine can know:

- **stored**: the blocks this engine's stores wrote there (once per block: a block
  already told as stored is not told again);
- **removed**: a told block that a later lookup found missing on the server (evicted,
  expired, flushed), or that this engine dropped (found corrupt); and the oldest told
  block once more than ``capacity`` are remembered (a subscriber then forgets a
  block the server may still hold: a router underestimates the tier rather than
  sending a request to blocks that are gone).

A block is found missing only when a lookup asks about it (a request whose prefix
reaches it past the first tier), so a removal is told late, or never for a block no
request asks about again; blocks other engines stored are their events, not ours.
A subclass rather than part of the manager so that a tier records nothing unless a
consumer drains the records (``build_tiers(events=True)``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent
from kvoffload.server_manager import KeyedStore, ServerBookedManager


class EventfulServerManager(ServerBookedManager):
    """A :class:`ServerBookedManager` that records stored / removed events (see the
    module docstring)."""

    def __init__(self, store: KeyedStore, capacity: int, *, name: str = "tier") -> None:
        super().__init__(store, capacity, name=name)
        self._events_lock = threading.Lock()
        self._told: dict[BlockKey, None] = {}  # insertion-ordered, bounded by capacity
        self._events: list[OffloadingEvent] = []

    def refresh(self, keys: Sequence[BlockKey]) -> bool:
        answered = super().refresh(keys)
        if answered:
            with self._events_lock:
                gone = [k for k in keys if k in self._told and not self.ready(k)]
                self._forget(gone)
        return answered

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        super().complete_store(keys, success)
        if not success:
            return
        with self._events_lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._told]
            if new:
                self._told.update(dict.fromkeys(new))
                self._events.append(OffloadingEvent(tuple(new), self.name, False))
            excess = len(self._told) - max(1, self.capacity)
            if excess > 0:
                self._forget([k for k, _ in zip(self._told, range(excess), strict=False)])

    def remove(self, keys: Sequence[BlockKey]) -> list[int]:
        freed = super().remove(keys)
        with self._events_lock:
            self._forget([k for k in keys if k in self._told])
        return freed

    def take_events(self) -> list[OffloadingEvent]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def _forget(self, keys: list[BlockKey]) -> None:
        """Tell ``keys`` (told as stored) removed; under ``_events_lock``."""
        if not keys:
            return
        for key in keys:
            del self._told[key]
        self._events.append(OffloadingEvent(tuple(keys), self.name, True))
