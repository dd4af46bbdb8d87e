"""The storage interface every tier implements, small and batched.

A backend owns a fixed number of equal-size *slots* and moves whole blocks between
them and contiguous ``uint8`` buffers of shape ``[n, layout.bytes_per_block]``. It
knows nothing of keys' order, eviction, pins or readiness: that is the manager's job.
Subclasses implement :meth:`write` and :meth:`read`; slot allocation, capacity and a
basic :meth:`check` come from this base class. Runs on the worker side.

Third-party backends subclass :class:`Backend`, set :attr:`Backend.config_model` to a
subclass of :class:`~kvoffload.config.TierConfig` if they take extra settings, and
register under the ``kvoffload.backends`` entry-point group. The contract tests in
:mod:`kvoffload.testing` say what "implements" means.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, final

import torch

from kvoffload.codec import CodecStats
from kvoffload.config import TierConfig
from kvoffload.exceptions import ConfigError, LayoutMismatchError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.slots import SlotAllocator


@dataclass(frozen=True, slots=True)
class RecoveredBlock:
    """A block a persistent backend found intact when it opened."""

    key: BlockKey
    slot: int
    atime: float
    """Last write or (approximately) last load, in seconds since the epoch."""
    charge: int = 0
    """Bytes it takes in a tier with a :meth:`Backend.budget` (0: the full charge)."""


@dataclass(frozen=True, slots=True)
class BackendStats:
    """What only a backend can say about its tier, read in one call (:meth:`Backend.stats`).

    The books count what they plan and settle; this is the rest: what the medium saw and
    what the codec did. One snapshot, so a report never mixes two moments."""

    counters: Mapping[str, int] = field(default_factory=dict)
    """Totals since the backend opened, by tier counter name: the counters of
    :data:`~kvoffload.metrics.TIER_METRICS` declared with ``source="backend"``
    (``round_trips``, ``server_errors``, and for a backend that may compress
    ``logical_bytes`` and ``stored_bytes``); other names are ignored. Left out, they
    read 0, but for ``logical_bytes`` and ``stored_bytes``, which then both read the
    books' ``bytes_written``: a backend that does not say it compresses stores raw."""
    codec: CodecStats | None = None
    """What the tier's codec did so far; ``None`` for a backend that never compresses."""
    held: tuple[int, int] | None = None
    """``(logical_bytes, stored_bytes)`` of the blocks held now: as the engine gave them,
    and as they sit in the tier (less when compressed). ``None``: the backend keeps no
    count (the tier then reports its manager's blocks times ``bytes_per_block``)."""


class Backend(ABC):
    """Fixed-size slots of one tier. Construct with ``(tier_config, layout)``."""

    config_model: ClassVar[type[TierConfig]] = TierConfig
    """Pydantic model of this backend's tier settings (the shared fields plus its own)."""
    persistent: ClassVar[bool] = False
    """Whether contents survive the process (and :meth:`recover` may return blocks)."""
    server_booked: ClassVar[bool] = False
    """Whether the medium keeps the books itself: a shared server that several engines
    write and that evicts on its own. The tier then gets a
    :class:`~kvoffload.server_manager.ServerBookedManager`, which asks :meth:`exists`
    at each lookup, instead of a local LRU; slots are nominal and values are
    addressed by key."""

    record_access: bool = True
    """Whether a read counts as a use: a persistent backend that keeps access times
    (recovery orders the LRU by them) refreshes a block's on a load. The maintenance
    tools turn it off before they scan a tier, since a scan is not a use."""

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.name = config.name
        num_slots = config.capacity // self.slot_bytes(layout)
        if num_slots <= 0:
            raise ConfigError(
                f"tier {config.name!r}: capacity = {config.capacity} bytes holds no block of "
                f"{self.slot_bytes(layout)} bytes; raise tiers[].capacity to at least that"
            )
        self.slots = SlotAllocator(self.slots_for(num_slots))
        self.slots.on_free = self.released
        self._packed_lock = threading.Lock()
        self._packed = [0, 0]  # logical, stored bytes of the blocks written so far

    def count_stored(self, logical: int, stored: int) -> None:
        """Count a completed write of ``logical`` bytes that took ``stored`` bytes,
        for a backend that may compress (its :meth:`stats` reports
        :meth:`stored_counters`). Thread-safe."""
        with self._packed_lock:
            self._packed[0] += logical
            self._packed[1] += stored

    def stored_counters(self) -> dict[str, int]:
        """``logical_bytes`` and ``stored_bytes`` counted by :meth:`count_stored`, for a
        compressing backend's :attr:`BackendStats.counters`."""
        with self._packed_lock:
            return {"logical_bytes": self._packed[0], "stored_bytes": self._packed[1]}

    # -- capacity and slots (shared) ----------------------------------------------
    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        """Bytes one slot takes in this tier (payload plus any header or padding)."""
        return layout.bytes_per_block

    def slots_for(self, full_slots: int) -> int:
        """How many slots to keep, given how many full-size blocks ``capacity`` holds.
        A tier with a :meth:`budget` keeps more (a block may take less than its full
        size); others exactly that many."""
        return full_slots

    def budget(self) -> tuple[int, int] | None:
        """``(byte_budget, full_charge)`` where this tier holds blocks by the bytes they
        take (compressed, or variable-size records), not by slots: its manager then
        admits and evicts by bytes, each block charged ``full_charge`` until
        :meth:`write` says what it took. ``None`` (the default): the slots bind.

        A backend that answers here may free what a slot holds in :meth:`released`:
        a budgeted manager frees a slot only once no I/O planned on it is in flight."""
        return None

    def released(self, slots: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Slots just freed (by the manager, or :meth:`free`): what they held is no
        longer wanted. Called from :meth:`SlotAllocator.free
        <kvoffload.slots.SlotAllocator.free>` on the books' thread, so it must be
        quick (memory work; any I/O deferred to the next write)."""

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes(self.layout)

    @final
    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots, or ``None`` when fewer are free.

        Final: the tier's manager allocates through the same :attr:`slots` object, so an
        override here would be bypassed; a backend that needs to know when a slot is
        reused learns it from :meth:`write`."""
        return self.slots.allocate(n)

    @final
    def free(self, slots: Sequence[int]) -> None:
        """Give slots back; their contents become garbage."""
        self.slots.free(slots)

    @final
    def is_allocated(self, slot: int) -> bool:
        return self.slots.is_allocated(slot)

    # -- data (per backend) -------------------------------------------------------
    @abstractmethod
    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        """Write row ``i`` of ``src`` (``uint8 [n, bytes_per_block]``) to ``slots[i]``,
        recording ``keys[i]``. Raises :class:`~kvoffload.exceptions.BackendError` on
        I/O failure; the caller then fails the store.

        Returns ``None`` (every block stored), or, from a tier with a :meth:`budget`,
        the bytes each block takes there: ``1..full_charge``, or 0 where it found no
        room for that block (not stored: the caller drops it, a miss)."""

    @abstractmethod
    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        """Read ``slots[i]`` into row ``i`` of ``dst``. Returns per-block validity:
        ``False`` where the slot does not hold ``keys[i]`` under this layout intact
        (the row's contents are then undefined and must be treated as a miss)."""

    def rows(self, start: int, n: int) -> torch.Tensor | None:
        """Slots ``start .. start + n - 1`` as a zero-copy, writable ``uint8 [n,
        bytes_per_block]`` view, where the medium is plain addressable memory (the
        ``cpu`` slab); ``None`` otherwise (the default). The data path then copies
        straight between the tier and the engine's blocks (and disk tiers read and write
        these rows directly), with no staging copy in between: a load reads rows pinned
        for it, and a store writes rows reserved for it, so bytes written there need no
        :meth:`write` call. Only a backend that keeps nothing but the bytes (no
        checksum, no index) may return rows."""
        return None

    @classmethod
    def existing_config(cls, config: TierConfig, *, write: bool) -> TierConfig | None:
        """The config that opens the tier already at ``config``'s location exactly as it
        was written (same geometry, read-only where possible), or ``None`` if there is
        none. Maintenance tools open tiers through it, so inspecting a tier under a
        config whose capacity changed can never reformat or shrink it."""
        return None

    @classmethod
    def stored_layout(cls, config: TierConfig) -> KVLayout | None:
        """The layout an existing tier's blocks were written under, read from its files
        without opening it for use (the maintenance tools open a tier with it when the
        config does not say). ``None``: this backend does not record it."""
        return None

    def recover(self) -> list[RecoveredBlock]:
        """Blocks found intact at open, oldest access first; their slots are already
        marked allocated. Called once, right after construction. Non-persistent
        backends hold nothing yet."""
        return []

    def discard(self, slots: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Forget what ``slots`` hold, so a reopen does not recover it (a block found
        corrupt on load, a block evicted for good). The slots' allocation is the
        manager's business, not touched here."""

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether the medium holds a value under each key (server-booked backends, in
        one batched round trip; the read still verifies). Others keep their books in
        the manager and need not answer."""
        raise NotImplementedError(f"{type(self).__name__} keeps no books of its own")

    def stats(self, *, held: bool = True) -> BackendStats:
        """Everything the backend counts itself, in one snapshot (:class:`BackendStats`).
        Read whenever the tier's stats are (every stats poll) and by the tools' reports,
        so it must be a few attribute reads: no I/O, no lock held for long. A backend
        that counts overrides it; the default says what :meth:`count_stored` counted
        (nothing, for a backend that never calls it). ``held=False``: leave
        :attr:`BackendStats.held` out (``None``), for the Offloader's mirror at every
        stats poll, which reads only the counters: a backend's count of the bytes it
        holds may scan its tables.

        Deprecated, kept for backends written before this method: their
        ``io_counters()``, ``codec_stats()`` and ``footprint()`` are still read here,
        in those fields' place."""
        counters: dict[str, int] = self.stored_counters() if self._packed[0] else {}
        legacy = [getattr(self, n, None) for n in ("io_counters", "codec_stats", "footprint")]
        io, codec, footprint = (hook() if callable(hook) else None for hook in legacy)
        return BackendStats({**counters, **(io or {})}, codec, footprint if held else None)

    def check(self) -> list[str]:
        """Consistency problems found (empty when consistent)."""
        return self.slots.check()

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release files and memory; the backend is unusable afterwards."""

    # -- helpers for subclasses ---------------------------------------------------
    def check_batch(
        self, slots: Sequence[int], keys: Sequence[BlockKey], buf: torch.Tensor
    ) -> None:
        """Raise :class:`~kvoffload.exceptions.LayoutMismatchError` unless ``buf`` is a
        ``uint8 [len(slots), bytes_per_block]`` batch with one key per slot. Call it
        first in ``write`` and ``read``: the contract tests require the rejection."""
        n = len(slots)
        want = (n, self.layout.bytes_per_block)
        if len(keys) != n or tuple(buf.shape) != want or buf.dtype != torch.uint8:
            raise LayoutMismatchError(
                f"tier {self.name!r}: expected {n} keys and a uint8 buffer of shape {want}, "
                f"got {len(keys)} keys and {buf.dtype} {tuple(buf.shape)}"
            )
