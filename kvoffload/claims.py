"""Verified claims and their prefetches: the part of the books that brings lower-tier
blocks up into the first tier, checked, before a hit is claimed.

Part of :mod:`kvoffload.books`, under its lock: every method here is called by a
:class:`~kvoffload.books.Books` method that holds it. Kept apart because it is a role of
its own (owners waiting, prefetches in flight and their budget, the prefetch counters)
and the books' store and load planning reads better without it. It knows the books
only by what they hand it (the tiers' managers, the first tier's counters, the tiers
bypassed now) and hands back what the books must finish: the writes of cancelled
prefetches to undo (:meth:`Claims.cancelled`), and the demotion of the blocks a new
prefetch displaces (the books decide admission). It never calls back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingManager
from kvoffload.plans import LoadPlan, Prefetch, PrefetchStats, Run, TierStats, Write


@dataclass
class _Claim:
    """An owner (a request) whose claim waits for prefetches."""

    waits: list[Prefetch] = field(default_factory=list)
    rounds: int = 0
    since: float = 0.0
    """When it began waiting for :attr:`waits` (``time.monotonic``)."""


class Claims:
    """Owners waiting on prefetches, prefetches in flight, and the prefetch counters.
    ``budget``: blocks in flight at most (``prefetch_max_inflight``, and half the first
    tier). ``managers``: every tier's, the first one's ``first_stats`` counted here too
    (evictions and promotions by prefetches); ``below``: whether there is a tier to
    prefetch from (more than one, and a first tier that is not persistent)."""

    def __init__(
        self,
        managers: Sequence[OffloadingManager],
        first_stats: TierStats,
        budget: int,
        timeout_s: float = 10.0,
        *,
        below: bool,
    ) -> None:
        self._managers = list(managers)
        self._first_stats = first_stats
        self._below = below
        self._cancelled: list[Write] = []
        self.budget = budget
        self.timeout_s = timeout_s
        self.stats = PrefetchStats()
        # Keys in flight to the first tier, owners waiting, and keys prefetched but not
        # loaded yet (for the hit / wasted counts).
        self._inflight: dict[BlockKey, Prefetch] = {}
        self._claims: dict[Hashable, _Claim] = {}
        self._prefetched: OrderedDict[BlockKey, int] = OrderedDict()  # key -> source tier
        self.inflight_blocks = 0

    def claim(
        self, owner: Hashable, keys: Sequence[BlockKey], bypassed: Collection[int] = ()
    ) -> tuple[LoadPlan | None, list[Prefetch]]:
        """See :meth:`Books.claim`; no prefetch from the tiers in ``bypassed``. The
        books finish each new prefetch's demotion."""
        max_rounds = 2 + -(-len(keys) // self.budget)
        cl = self._claims.get(owner)
        if cl is not None and any(not p.done for p in cl.waits):
            if time.monotonic() - cl.since < self.timeout_s:
                return None, []
            # Late (a slow or hanging tier): settle for what is up top now. The
            # prefetches already running land for whoever asks next.
            self._detach(owner, cl)
            cl.rounds = max_rounds
            self.stats.late += 1
        if cl is None:
            cl = self._claims[owner] = _Claim()
        cl.waits = []
        first = self._managers[0]
        ready = first.lookup(keys)
        if self._below and cl.rounds < max_rounds:
            waits, started, starved = self._start(keys, ready, bypassed)
            if started:
                cl.rounds += 1
            if waits or starved:
                cl.waits = waits
                cl.since = time.monotonic()
                for p in waits:
                    p.waiters.add(owner)
                return None, started
        del self._claims[owner]
        slots = first.prepare_load(keys[:ready])
        runs = [Run(0, 0, ready, slots)] if ready else []
        return LoadPlan(list(keys[:ready]), runs, len(keys)), []

    def waiting(self, owner: Hashable) -> bool:
        """Whether ``owner``'s claim waits on prefetches still running (and the claim
        will answer "not yet" without looking)."""
        cl = self._claims.get(owner)
        return cl is not None and any(not p.done for p in cl.waits)

    def refused(self, p: Prefetch) -> None:
        """See :meth:`Books.prefetch_refused`."""
        if p.done:
            return
        p.done = True
        self._landed(p, [])
        self._cancelled.append(p.write)
        self.stats.failed += len(p.write.keys)

    def release(self, owner: Hashable) -> None:
        """See :meth:`Books.release`."""
        cl = self._claims.pop(owner, None)
        if cl is not None:
            self._detach(owner, cl)

    def _detach(self, owner: Hashable, cl: _Claim) -> None:
        """``owner`` no longer waits for ``cl``'s prefetches: cancel those nobody else
        waits for and that have not started."""
        for p in cl.waits:
            p.waiters.discard(owner)
            if not p.waiters and not p.started and not p.done:
                p.done = True
                self._landed(p, [])
                self._cancelled.append(p.write)
                self.stats.wasted += len(p.write.keys)
        cl.waits = []

    def starts(self, p: Prefetch) -> bool:
        """Whether a prefetch job may run (``False``: cancelled meanwhile)."""
        if p.done:
            return False
        p.started = True
        return True

    def cancelled(self) -> list[Write]:
        """The writes of prefetches cancelled since the last call, for the books to
        undo (free their reserved slots, unpin their sources)."""
        writes, self._cancelled = self._cancelled, []
        return writes

    def settle(self, p: Prefetch, seconds: float) -> None:
        """A prefetch job ended (its write already settled)."""
        first = self._managers[0]
        landed = [k for k in p.write.keys if first.ready(k)]
        p.done = True
        self._landed(p, landed)
        # A prefetch is a use of the source block: keep it warm in its tier, so the disk
        # copy outlives the cpu copy that a hit will soon evict.
        assert p.write.src_tier is not None
        self._managers[p.write.src_tier].touch(landed)
        self.stats.prefetched += len(landed)
        self._first_stats.promotions += len(landed)
        self.stats.failed += len(p.write.keys) - len(landed)
        self.stats.seconds += seconds

    def counts(self) -> tuple[int, int]:
        """Prefetch jobs in flight, and owners waiting on claims."""
        return len({id(p) for p in self._inflight.values()}), len(self._claims)

    def left_first_tier(self, keys: Iterable[BlockKey]) -> None:
        """Count prefetched blocks evicted up top before any load used them."""
        if self._prefetched:
            for key in keys:
                if key in self._prefetched:
                    del self._prefetched[key]
                    self.stats.wasted += 1

    def loaded(self, keys: Iterable[BlockKey]) -> dict[int, int]:
        """Count prefetched blocks that a load used; returns how many came from each
        source tier (their hits are that tier's: the disk served them, through the
        first tier)."""
        sources: dict[int, int] = {}
        if self._prefetched:
            for key in keys:
                t = self._prefetched.pop(key, None)
                if t is not None:
                    self.stats.hits += 1
                    sources[t] = sources.get(t, 0) + 1
        return sources

    def _start(
        self, keys: Sequence[BlockKey], ready: int, bypassed: Collection[int]
    ) -> tuple[list[Prefetch], list[Prefetch], bool]:
        """Plan prefetches for the blocks after the first tier's ready prefix that a
        lower tier holds. Returns the prefetches this prefix waits for (new and already
        in flight), the new ones, and whether some could not start for want of budget
        while others are in flight (then: wait too)."""
        first = self._managers[0]
        waits: dict[int, Prefetch] = {}
        want: list[tuple[int, BlockKey]] = []
        for key in keys[ready:]:
            inflight = self._inflight.get(key)
            if inflight is not None:
                waits[id(inflight)] = inflight
                continue
            if first.holds(key):
                if first.ready(key):
                    continue  # ready up top already
                break  # being written by a store: not claimable yet
            below = next(
                (
                    t
                    for t in range(1, len(self._managers))
                    if self._managers[t].ready(key) and t not in bypassed
                ),
                None,
            )
            if below is None:
                break
            want.append((below, key))
        room = self.budget - self.inflight_blocks
        starved = len(want) > room and self.inflight_blocks > 0
        want = want[: max(0, room)]
        started: list[Prefetch] = []
        i = 0
        while i < len(want):  # one job per run of consecutive blocks from one tier
            t = want[i][0]
            j = i
            while j < len(want) and want[j][0] == t:
                j += 1
            p = self._prefetch(t, [k for _, k in want[i:j]])
            if p is None:
                break
            waits[id(p)] = p
            started.append(p)
            i = j
        return list(waits.values()), started, starved

    def _prefetch(self, t: int, keys: list[BlockKey]) -> Prefetch | None:
        """Reserve first-tier slots for ``keys`` (held by tier ``t``) and pin them in
        ``t``; ``None`` when the first tier has no room."""
        out = self._managers[0].prepare_store(keys)
        if out is None:
            self.stats.failed += len(keys)
            return None
        self._first_stats.evictions += len(out.evicted)
        self.left_first_tier(out.evicted)
        write = Write(
            0,
            out.keys_to_store,
            out.slots,
            src_tier=t,
            src_slots=self._managers[t].prepare_load(out.keys_to_store),
            evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
            submitted=time.perf_counter(),
        )
        p = Prefetch(write)
        for key in write.keys:
            self._inflight[key] = p
        self.inflight_blocks += len(write.keys)
        return p

    def _landed(self, p: Prefetch, landed: Sequence[BlockKey]) -> None:
        """A prefetch ended: out of flight; ``landed`` are the keys now ready up top."""
        for key in p.write.keys:
            if self._inflight.get(key) is p:
                del self._inflight[key]
        self.inflight_blocks -= len(p.write.keys)
        for key in landed:
            assert p.write.src_tier is not None
            self._prefetched[key] = p.write.src_tier
            self._prefetched.move_to_end(key)
        while len(self._prefetched) > self._managers[0].capacity:
            self._prefetched.popitem(last=False)
