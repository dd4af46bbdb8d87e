"""What the Offloader's books hand out and take back: orders and outcomes as data.

:mod:`kvoffload.books` decides; these are its decisions (a :class:`LoadPlan`, a
:class:`Write` into a tier, a :class:`Prefetch`, a cascade :class:`Copy`, a
:class:`Discard`), what a job
reports back (a :class:`WriteOutcome`, a :class:`LoadOutcome`, each with the
:class:`Tally` of its I/O) and the books' counters (:class:`TierStats`,
:class:`PrefetchStats`). One order in, one outcome out: a job
(:mod:`kvoffload.jobs`) carries out an order using nothing but what the order says,
and its outcome is settled by the books in one transaction. They live apart from both
so that the jobs, the books and the engine-facing facade can hold and pass them
without reaching into each other, and so that each module keeps one role.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Final

from kvoffload.keys import BlockKey
from kvoffload.metrics import LatencySamples, TierCounters

LATENCY_SAMPLES: Final = 8192
"""Latency samples kept per tier and direction (the most recent ones): enough for a
p99 of the last minute or so of jobs. At 100,000 the six deques of a three-tier
stress grew by about 0.9 MB a minute for a quarter of an hour (the soak's "leak",
2026-11-26)."""


@dataclass
class TierStats(TierCounters):
    """Counters of one tier since the Offloader started (read under its lock).

    The counters themselves, with their meaning, are declared once in
    :class:`~kvoffload.metrics.TierCounters`, whence every output takes them; this
    class adds what only the books keep: latency samples, recent ones and a histogram
    of all (:class:`~kvoffload.metrics.LatencySamples`)."""

    store_latency_s: LatencySamples = field(
        default_factory=lambda: LatencySamples(maxlen=LATENCY_SAMPLES)
    )
    """Submit-to-done time of store jobs into this tier."""
    load_latency_s: LatencySamples = field(
        default_factory=lambda: LatencySamples(maxlen=LATENCY_SAMPLES)
    )
    """Submit-to-done time of loads whose slowest tier was this one."""


@dataclass
class PrefetchStats:
    """Counters of the prefetches that :meth:`Books.claim` runs (read under the
    lock)."""

    prefetched: int = 0
    """Blocks read from a lower tier, verified, and written into the first tier."""
    hits: int = 0
    """Prefetched blocks later loaded into the engine."""
    wasted: int = 0
    """Prefetched blocks that left the first tier unloaded, and blocks of prefetches
    cancelled before they ran."""
    failed: int = 0
    """Blocks a prefetch could not bring up: corrupt (also counted in the tier's
    ``corrupt_blocks``), unreadable, or no room in the first tier."""
    seconds: float = 0.0
    """Wall time of prefetch jobs, from start to verified landing."""
    late: int = 0
    """Claims that stopped waiting for their prefetches after ``load_timeout_ms``
    and settled for the prefix already in the first tier."""


@dataclass(slots=True)
class Run:
    """Consecutive prefix positions ``[start, stop)`` held by one tier."""

    tier: int
    start: int
    stop: int
    slots: list[int]


@dataclass
class LoadPlan:
    """A pinned load: what :meth:`Books.plan_load` or :meth:`Books.claim` found and
    reserved. Hand it to ``Offloader.submit_load``, or give it back with
    ``Offloader.cancel_load``; until then its blocks cannot be evicted."""

    keys: list[BlockKey]
    """The held prefix (``len(keys)`` is the hit length)."""
    runs: list[Run]
    requested: int
    """Keys asked for (the prefix, then the first miss and everything after it)."""
    promote_keys: list[BlockKey] = field(default_factory=list)
    promote_slots: list[int] = field(default_factory=list)
    promote_evicted: list[tuple[BlockKey, int]] = field(default_factory=list)
    """First-tier blocks evicted to make room for the promotions (for ``on_evict``)."""
    settled: bool = False
    submitted: bool = False
    """Handed to ``Offloader.submit_load`` (checked by the engine's thread, which alone
    submits and cancels, so without the books' lock)."""

    @property
    def hits(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class Write:
    """An order: write ``keys`` into ``slots`` of ``tier``. Where the bytes come from,
    and what the slots held before."""

    tier: int
    keys: list[BlockKey]
    slots: list[int]
    pool_ids: list[int] | None = None
    """Source: these pool blocks (an engine store)."""
    src_tier: int | None = None
    src_slots: list[int] | None = None
    """Source: these slots of ``src_tier``, pinned by this write (write-through)."""
    buf: Any = None
    """Source: a staging buffer the data path owns (demotion, promotion, write-through
    from the bytes just written), released by the write."""
    rows: list[int] | None = None
    """For an order whose ``buf`` the data path still has to cut: the rows of the
    source buffer that hold ``keys``, in order."""
    evicted: list[tuple[BlockKey, int]] = field(default_factory=list)
    """Blocks this write's slots held; when :attr:`demote`, narrowed to those the next
    tier admits, to be read first and demoted (``on_evict``)."""
    demote: bool = False
    """Whether the next tier wants ``evicted`` (read them before overwriting)."""
    released: list[int] = field(default_factory=list)
    """Slots of blocks this write displaced that it does not reuse (a budgeted tier
    evicts by bytes, so it may displace more blocks than it writes): once any
    demotion has read them, the job tells the backend (``Backend.released``), so
    their space serves this very write."""
    submitted: float = 0.0
    after: Any = None
    """The engine's event to wait for before reading its blocks (CUDA)."""


@dataclass(eq=False)
class Prefetch:
    """One prefetch job: a run of blocks copied from a lower tier into first-tier
    slots reserved for them, verified on the way (the write's source read)."""

    write: Write
    waiters: set[Hashable] = field(default_factory=set)
    started: bool = False
    done: bool = False


@dataclass(slots=True)
class Copy:
    """An order from :meth:`Books.settle`: ``write``, whose bytes are the settled
    write's own buffer (``source="written"``), its demotion buffer (``"demoted"``), a
    settled load's staging buffer (``"loaded"``: the promotion of the blocks it read
    from below), or ``write.src_tier`` (``"tier"``)."""

    write: Write
    source: str


@dataclass(slots=True)
class Discard:
    """An order from the books: forget what ``slots`` of ``tier`` hold on its medium
    (blocks found corrupt, or dropped for good), so that a restart does not recover
    them. Carried out after the books' lock is released (``Books.discard``): for a
    disk that is I/O (an LMDB write transaction, a slab's headers). The books have
    dropped the blocks already but hold their slots back from every new store until
    the order has run, so it can never erase a block written after it (an LMDB
    record is keyed by slot, a slab's header sits at its slot)."""

    tier: int
    slots: list[int]


Order = Copy | Discard
"""What :meth:`Books.settle` hands back: the next tier's copies, and discards."""


@dataclass(slots=True)
class Tally:
    """What a job's I/O did, for the counters and the circuit breakers, in the order it
    happened: the books apply it when they settle the job (one transaction, instead of
    one per read or write)."""

    reads: list[tuple[int, float, int]] = field(default_factory=list)
    """``(tier, seconds, bytes valid)`` per read."""
    writes: list[tuple[int, float]] = field(default_factory=list)
    """``(tier, seconds)`` per write into a tier's medium."""
    health: list[tuple[int, bool]] = field(default_factory=list)
    """``(tier, ok)`` per read or write of a lower tier: feeds its breaker."""


@dataclass(slots=True)
class WriteOutcome:
    """How a :class:`Write` went. Buffers travel with it for the next orders (the
    written bytes for a write-through copy, the displaced blocks for a demotion); the
    books see only whether they are there."""

    write: Write
    ok: list[bool]
    """Per key of the write: it landed."""
    failed: bool = False
    """The write raised: nothing landed (:attr:`error` says why)."""
    buf: Any = None
    """A staging buffer holding the written bytes (row ``i``: ``write.keys[i]``), when
    they went through one and landed."""
    demoted: Any = None
    """The buffer the displaced blocks were read into (row ``i``: ``evicted[i]``)."""
    evicted: list[BlockKey] = field(default_factory=list)
    """The displaced blocks read into :attr:`demoted`, in row order."""
    corrupt: list[BlockKey] = field(default_factory=list)
    """Source blocks the read found invalid: dropped from ``write.src_tier``."""
    charges: list[int] | None = None
    """Per key of the write, the bytes it took in a tier with a byte budget
    (:meth:`~kvoffload.backend.Backend.write`'s answer); ``None``: full size."""
    unplaced: int = 0
    """Blocks the tier found no room for as it wrote (a charge of 0), not stored."""
    tally: Tally = field(default_factory=Tally)
    prefetch: Prefetch | None = None
    """The prefetch this write was the job of (its books settled with it)."""
    seconds: float = 0.0
    """The prefetch job's wall time."""
    error: BaseException | None = None
    """What the job raised, re-raised once the outcome is settled."""


@dataclass(slots=True)
class LoadOutcome:
    """How a load of a :class:`LoadPlan` went: the valid prefix loaded into the pool,
    the blocks found corrupt, and the staging buffer its lower-tier reads went
    through (``staged[i]``: block ``i`` is in row ``i``), for the promotion."""

    plan: LoadPlan
    submitted: float
    valid: int = 0
    corrupt: dict[int, list[BlockKey]] = field(default_factory=dict)
    buf: Any = None
    staged: list[bool] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    error: BaseException | None = None


Outcome = WriteOutcome | LoadOutcome
"""What :meth:`Books.settle` takes."""
