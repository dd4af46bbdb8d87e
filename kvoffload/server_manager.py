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
a store sees them), and a bounded memory of blocks the server said it had or that this
process stored there: those are not written back when a hit promoted from the server
is copied down again. The server's word is the newest, so an answer that a block is
missing wipes every memory of it (unless this process stored it after the question
left): the server evicted it, and the next time the engine computes it, it is written
again. Without that, a block the server once held would never be stored again by this
process, and the hottest prefixes of a replica under server eviction would silently
stop being shared (issue 23). A memory left stale without a lookup in between costs a
miss later, never data. Slots are nominal: the backend addresses values by key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput

logger = logging.getLogger(__name__)

_V = TypeVar("_V")

NOMINAL_SLOT = 0
"""The slot handed out for every block: the backend ignores slots."""
RECENT_STORES = 4096
"""Blocks this process stored that a lookup counts as held before the server's next
answer about them (bounded: older ones are the server's word only)."""
SEEN = 65536
"""Blocks the server reported or this process stored, remembered so that they are not
written again; forgotten as soon as the server reports them missing."""


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
        self._stores = 0
        """Successful store batches so far: orders a store against a question."""
        self._recent: dict[BlockKey, int] = {}  # -> its store's number; bounded
        self._seen: dict[BlockKey, None] = {}  # insertion-ordered, bounded

    # -- asking the server ---------------------------------------------------------------
    def refresh(self, keys: Sequence[BlockKey]) -> bool:
        """Ask the server which of ``keys`` it holds (one batched round trip per node);
        the answer serves :meth:`ready` and :meth:`lookup` until the next call, and
        replaces what the manager remembered of those keys: one reported missing is
        forgotten (see the module docstring), unless this process stored it after the
        question was sent (the answer is older than that store). ``False`` when the
        server could not answer: then nothing counts as held."""
        with self._lock:
            asked_at = self._stores
        try:
            found = self._store.exists(keys) if keys else []
        except BackendError as exc:
            logger.debug("tier %s: lookup of %d keys failed: %s", self.name, len(keys), exc)
            with self._lock:
                self._answer = {}
            return False
        answer = dict(zip(keys, found, strict=True))
        with self._lock:
            held: list[BlockKey] = []
            for key, there in answer.items():
                if self._recent.get(key, -1) > asked_at:
                    continue  # stored after the question left: newer than the answer
                self._recent.pop(key, None)
                if there:
                    held.append(key)
                else:
                    self._seen.pop(key, None)
            self._answer = answer
            _remember(self._seen, held, SEEN, None)
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
                self._stores += 1
                _remember(self._recent, keys, RECENT_STORES, self._stores)
                _remember(self._seen, keys, SEEN, None)

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


def _remember(memory: dict[BlockKey, _V], keys: Sequence[BlockKey], cap: int, value: _V) -> None:
    """Add ``keys`` (each with ``value``) as the newest of ``memory``, forgetting the
    oldest past ``cap``."""
    for key in keys:
        memory.pop(key, None)
        memory[key] = value
    while len(memory) > cap:
        del memory[next(iter(memory))]
