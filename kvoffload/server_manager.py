"""The manager of a tier whose books live on its server (a shared remote store).

A local LRU over a store that several engines write and that evicts by itself
(Redis with ``maxmemory`` and ``allkeys-lru``) would be a guess about someone else's
state: it would claim blocks the server dropped and miss blocks other replicas
stored. So this manager keeps no books of its own. A lookup asks the server
(:meth:`ServerBookedManager.refresh`: one batched round trip per node, made by the
Offloader's books *before* they take their lock, so no network wait ever holds it),
and the answers serve the per-key questions of that same lookup (:meth:`ready`).
Eviction, recency and capacity are the server's: :meth:`touch` is a no-op (a read
is already a use there), :meth:`prepare_store` never evicts, and nothing is pinned,
since a pin cannot stop another engine's server from evicting; a block gone by the
time it is read is a miss, which the read's verification reports like any other.

What the manager does keep is the writes in flight (so the same block is not queued
twice), the blocks this process stored since the last answer (so a lookup right after
a store sees them), and a bounded memory of blocks the server said it had: those are
not written back when a hit promoted from the server is copied down again (a stale
memory costs a miss later, never data). Slots are nominal: the backend addresses
values by key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput

logger = logging.getLogger(__name__)

NOMINAL_SLOT = 0
"""The slot handed out for every block: the backend ignores slots."""
RECENT_STORES = 4096
"""Blocks this process stored that a lookup counts as held before the server's next
answer about them (bounded: older ones are the server's word only)."""
SEEN = 65536
"""Blocks the server reported, remembered so that they are not written again."""


class KeyedStore(Protocol):
    """What the manager needs of its backend: presence by key."""

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...


class ServerBookedManager(OffloadingManager):
    """Bookkeeping of a tier whose server keeps the books (see the module docstring).
    ``capacity`` is nominal: the server's memory limit decides what it holds."""

    def __init__(self, store: KeyedStore, capacity: int, *, name: str = "tier") -> None:
        self.name = name
        self._store = store
        self._capacity = capacity
        self._lock = threading.Lock()
        self._answer: dict[BlockKey, bool] = {}
        self._writing: set[BlockKey] = set()
        self._recent: dict[BlockKey, None] = {}  # insertion-ordered, bounded
        self._seen: dict[BlockKey, None] = {}  # insertion-ordered, bounded

    # -- asking the server ---------------------------------------------------------------
    def refresh(self, keys: Sequence[BlockKey]) -> bool:
        """Ask the server which of ``keys`` it holds (one batched round trip per node);
        the answer serves :meth:`ready` and :meth:`lookup` until the next call.
        ``False`` when the server could not answer: then nothing counts as held."""
        try:
            found = self._store.exists(keys) if keys else []
        except BackendError as exc:
            logger.debug("tier %s: lookup of %d keys failed: %s", self.name, len(keys), exc)
            with self._lock:
                self._answer = {}
            return False
        answer = dict(zip(keys, found, strict=True))
        with self._lock:
            for key in keys:  # the server's word is newer than our memory of a store
                self._recent.pop(key, None)
            self._answer = answer
            _remember(self._seen, [k for k, found in answer.items() if found], SEEN)
        return True

    @property
    def server_booked(self) -> bool:
        return True

    # -- OffloadingManager ---------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    def ready(self, key: BlockKey) -> bool:
        with self._lock:
            return bool(self._answer.get(key)) or key in self._recent

    def holds(self, key: BlockKey) -> bool:
        with self._lock:
            return (
                key in self._writing
                or bool(self._answer.get(key))
                or key in self._recent
                or key in self._seen
            )

    def idle(self, key: BlockKey) -> bool:
        return self.ready(key)

    def pinned(self) -> int:
        return 0

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            if not self.ready(key):
                break
            n += 1
        return n

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        return [NOMINAL_SLOT] * len(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Nothing: reading a value is what makes it recent on the server."""

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Nothing: no pins (see the module docstring)."""

    def prepare_store(self, keys: Sequence[BlockKey]) -> PrepareStoreOutput | None:
        with self._lock:
            todo = [k for k in dict.fromkeys(keys) if k not in self._writing]
            self._writing.update(todo)
        return PrepareStoreOutput(todo, [NOMINAL_SLOT] * len(todo), [], [])

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        with self._lock:
            self._writing.difference_update(keys)
            if success:
                _remember(self._recent, keys, RECENT_STORES)
                _remember(self._seen, keys, SEEN)

    def remove(self, keys: Sequence[BlockKey]) -> list[int]:
        """Forget ``keys`` here; the server's copies are left alone (another engine may
        be rewriting them; its eviction takes the rest)."""
        with self._lock:
            for key in keys:
                self._answer.pop(key, None)
                self._recent.pop(key, None)
                self._seen.pop(key, None)
        return []

    def take_events(self) -> list[OffloadingEvent]:
        """None: what the server holds changes without us (other engines, eviction)."""
        return []

    def check(self) -> list[str]:
        """Nothing to cross-check: the books are the server's."""
        return []


def _remember(memory: dict[BlockKey, None], keys: Sequence[BlockKey], cap: int) -> None:
    """Add ``keys`` as the newest of ``memory``, forgetting the oldest past ``cap``."""
    for key in keys:
        memory.pop(key, None)
        memory[key] = None
    while len(memory) > cap:
        del memory[next(iter(memory))]
