"""The offloading-manager interface: which blocks a tier holds, and in which slots.

Runs on the scheduler side (in vLLM: the engine-core process), one manager per tier.
It only does bookkeeping; bytes are moved by a :class:`~kvoffload.backend.Backend`.
Every operation is two-phase with explicit readiness, so a block is never loaded
while it is being written, nor evicted while it is being read:

- ``lookup(keys)``: how many leading keys are ready to load;
- ``prepare_load(keys)``: pin them and return their slots;
- ``touch(keys)``: mark them recently used;
- ``complete_load(keys)``: unpin them;
- ``prepare_store(keys)``: pick slots for the keys not yet held, evicting to make
  room, or return ``None`` when there is no room ("can't" is a value, not an error);
- ``complete_store(keys, success)``: make them ready, or drop them;
- ``take_events()``: the stored / removed events since the last call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.keys import BlockKey


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What :meth:`OffloadingManager.prepare_store` decided."""

    keys_to_store: list[BlockKey]
    """Keys the caller must write, in call order (keys already held are left out)."""
    slots: list[int]
    """Store spec: the slot for each of ``keys_to_store``."""
    evicted: list[BlockKey]
    """Keys evicted to make room; their slots may be among ``slots``."""
    evicted_slots: list[int] = field(default_factory=list)
    """The slot each of ``evicted`` held, so a caller that demotes evicted blocks to a
    lower tier can read them before the new stores overwrite those slots."""


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks that became loadable (``removed=False``) or stopped being so."""

    keys: tuple[BlockKey, ...]
    tier: str
    removed: bool


class OffloadingManager(ABC):
    """Bookkeeping of one tier. See the module docstring for the protocol."""

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` that is ready to load."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready blocks against eviction and return their slots."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark blocks recently used; ``keys[0]`` ends up the most recent, because a
        prefix is worth more than the blocks that depend on it."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin blocks pinned by :meth:`prepare_load`."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockKey]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not yet held; ``None`` if room cannot be made.

        Never evicts pinned blocks, blocks being written, or blocks named in ``keys``.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """Finish stores begun by :meth:`prepare_store`: make ready, or drop and free."""

    def charge(  # noqa: B027
        self, keys: Sequence[BlockKey], sizes: Sequence[int], *, unplaced: int = 0
    ) -> None:
        """The bytes each of ``keys`` (being written) took, as its lane reported them,
        and how many of the job's blocks found no room, for a tier whose backend has a
        byte budget; others ignore it."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """Drain the stored / removed events recorded since the last call."""

    # -- queries the Offloader's books plan with -------------------------------------
    @property
    @abstractmethod
    def capacity(self) -> int:
        """Blocks this tier can hold."""

    @abstractmethod
    def ready(self, key: BlockKey) -> bool:
        """Whether ``key`` is held and loadable (stored, not being written)."""

    @abstractmethod
    def holds(self, key: BlockKey) -> bool:
        """Whether ``key`` is held at all: ready, or being written."""

    @abstractmethod
    def idle(self, key: BlockKey) -> bool:
        """Whether ``key`` is ready and pinned by no load (so it may be removed)."""

    @abstractmethod
    def pinned(self) -> int:
        """Blocks pinned by loads now (for health checks)."""

    @abstractmethod
    def remove(self, keys: Sequence[BlockKey]) -> list[int]:
        """Drop idle blocks for good (found corrupt); their freed slots."""

    def held_keys(self) -> list[BlockKey]:
        """Every key held (for a reset of the whole tier). Books kept on a shared server
        list none: that server's other clients own its blocks too."""
        return []

    @abstractmethod
    def check(self) -> list[str]:
        """Consistency problems of the books (empty when consistent)."""

    # -- tiers whose books live on their server ------------------------------------------
    @property
    def server_booked(self) -> bool:
        """Whether the books are the medium's own (a shared server): a lookup must then
        :meth:`refresh` first. Local books answer from memory."""
        return False

    def refresh(self, keys: Sequence[BlockKey]) -> bool:
        """Ask the medium which of ``keys`` it holds, before a lookup's per-key
        questions (:meth:`ready`, :meth:`lookup`); ``False`` if it could not answer.
        Called without the Offloader's lock held: it may wait on the network. Local
        books have nothing to ask."""
        return True
