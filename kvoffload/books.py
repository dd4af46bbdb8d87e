"""The Offloader's books: what moves where, decided under one lock, on keys and slots.

The Offloader's rule is that its lock is held for bookkeeping only, never while bytes
move and never across I/O. This module is that bookkeeping's entry points: planning
loads and stores, verified claims and their prefetches (:mod:`kvoffload.claims`),
settling outcomes (:mod:`kvoffload.settlement`), the cascade into lower tiers with
admission and backpressure (:mod:`kvoffload.cascade`), the breakers
(:mod:`kvoffload.breaker`), and the snapshots the facade reads (counters, checks,
events, what each tier holds). It sees tiers only through
:class:`~kvoffload.manager.OffloadingManager` and does not import torch: what it
decides comes out as *orders* (a :class:`Write` into a tier, a :class:`LoadPlan`, a
:class:`Discard`) that carry everything their job needs, and each job's outcome
(:class:`~kvoffload.plans.WriteOutcome`, :class:`~kvoffload.plans.LoadOutcome`) comes
back to :meth:`Books.settle`, which books it in one transaction and returns the next
orders. Data flows one way: books -> orders -> jobs -> outcomes -> books; a job never
calls in here. So cascade and admission can be tested on plain keys, with no thread
and no tensor (``tests/core/test_books.py``), and a job takes the lock twice: once planned,
once settled.

Every public method takes the lock itself, and is one transaction. No backend is
called under it but through the allocator's ``on_free`` hook (memory work only) and
the medium's own consistency check (:meth:`Books.check`): a block dropped for good is
forgotten on its medium by a :class:`Discard` order, run after the lock is released
(:meth:`Books.discard`), its slot held back from new stores until then
(:mod:`kvoffload.withheld`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvoffload.breaker import Breakers
from kvoffload.cascade import HIT_COUNTS as HIT_COUNTS
from kvoffload.cascade import HIT_COUNTS_MIN as HIT_COUNTS_MIN
from kvoffload.cascade import HIT_COUNTS_PER_BLOCK as HIT_COUNTS_PER_BLOCK
from kvoffload.cascade import Cascade
from kvoffload.cascade import hit_counts_bound as hit_counts_bound
from kvoffload.claims import Claims
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent, OffloadingManager
from kvoffload.metrics import tier_values
from kvoffload.mirror import held, mirror
from kvoffload.plans import (
    Discard,
    LoadOutcome,
    LoadPlan,
    Order,
    Outcome,
    Prefetch,
    PrefetchStats,
    Run,
    TierStats,
    Write,
)
from kvoffload.settlement import Settlement
from kvoffload.withheld import Withheld

logger = logging.getLogger(__name__)

CHECK_WAIT_S = 5.0
"""Longest :meth:`Books.check` waits for discards in flight (their slots held back)."""


class Books:
    """Bookkeeping of every tier (see the module docstring).

    ``depth(t)`` is the number of store jobs queued or running for tier ``t`` (for
    backpressure); ``discard(t, slots)`` forgets blocks on tier ``t``'s medium (blocks
    found corrupt, or cleared), called by :meth:`discard` outside the lock."""

    def __init__(
        self,
        managers: Sequence[OffloadingManager],
        configs: Sequence[TierConfig],
        *,
        bytes_per_block: int,
        persistent: Sequence[bool],
        prefetch_max_inflight: int,
        load_timeout_s: float = 10.0,
        depth: Callable[[int], int],
        discard: Callable[[int, list[int]], None] | None = None,
    ) -> None:
        self.managers = list(managers)
        self.configs = list(configs)
        self.bpb = bytes_per_block
        self.persistent = list(persistent)
        self._discard = discard
        self.lock = threading.Lock()
        first = self.managers[0].capacity
        budget = max(1, min(prefetch_max_inflight // bytes_per_block, first // 2))
        self.load_timeout_s = load_timeout_s
        # Tiers whose books are their server's: asked before each lookup.
        self._server_booked = [t for t, m in enumerate(self.managers) if m.server_booked]
        self.stats = [
            TierStats(c.name, c.backend, m.capacity, "first" if i == 0 else c.write_policy)
            for i, (m, c) in enumerate(zip(self.managers, self.configs, strict=True))
        ]
        below = len(self.managers) > 1 and not self.persistent[0]
        self.claims = Claims(self.managers, self.stats[0], budget, load_timeout_s, below=below)
        self.prefetch_stats = self.claims.stats
        self.breakers = Breakers(self.configs, self.stats)
        self.cascade = Cascade(self.managers, self.configs, self.stats, self.breakers, depth)
        self.withheld = Withheld(self.managers, self.lock)
        self._settle = Settlement(
            self.managers,
            self.stats,
            bytes_per_block,
            breakers=self.breakers,
            cascade=self.cascade,
            claims=self.claims,
            withheld=self.withheld,
        )

    # -- lookups and plans ---------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held ready by some tier."""
        self._ask_servers(keys)
        with self.lock:
            return len(self._locate(keys))

    def held(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some tier holds it ready (one question to the servers for
        all of them)."""
        self._ask_servers(keys)
        with self.lock:
            return [len(self._locate([key])) == 1 for key in keys]

    def locate(self, keys: Sequence[BlockKey]) -> list[int]:
        """For the longest prefix of ``keys`` held ready: the fastest tier holding each
        key (no server asked: what the books know now)."""
        with self.lock:
            return self._locate(keys)

    def resident(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` the first tier holds ready."""
        with self.lock:
            return self.managers[0].lookup(keys)

    def clear_first(self) -> tuple[int, list[Discard]]:
        """Drop every block the first tier holds that nobody has pinned: how many, and
        the order that forgets them on the medium (for :meth:`discard`, once this has
        returned; their slots serve no store before)."""
        with self.lock:
            manager = self.managers[0]
            idle = [k for k in manager.held_keys() if manager.idle(k)]
            order = self.withheld.drop(0, idle)
            return len(idle), [] if order is None else [order]

    def _ask_servers(self, keys: Sequence[BlockKey], owner: Hashable = None) -> None:
        """Before a lookup: ask each tier whose books are its server's which of the
        keys past the first tier's prefix it holds (a network round trip, so outside
        the lock; an answer that goes stale meanwhile costs a miss at read time, never
        data). Skipped while ``owner``'s claim still waits on prefetches (it will not
        look yet), and for tiers whose breaker is open. A failed answer feeds the
        breaker."""
        if not self._server_booked:
            return
        with self.lock:
            if owner is not None and self.claims.waiting(owner):
                return
            rest = keys[self.managers[0].lookup(keys) :]
            asked = [t for t in self._server_booked if not self.bypassed(t)]
        if not rest or not asked:
            return
        answers = [(t, self.managers[t].refresh(rest)) for t in asked]
        with self.lock:
            for t, ok in answers:
                self.breakers.health(t, ok)

    def _locate(self, keys: Sequence[BlockKey]) -> list[int]:
        """For the longest held prefix: the index of the fastest tier holding each key."""
        # The first tier's ready prefix in one batched call (the usual whole answer).
        located = [0] * self.managers[0].lookup(keys)
        if len(located) == len(keys) or len(self.managers) == 1:
            return located
        for key in keys[len(located) :]:
            for t, manager in enumerate(self.managers):
                if manager.ready(key) and not self.bypassed(t):
                    located.append(t)
                    break
            else:
                break
        return located

    def plan_store(
        self, keys: Sequence[BlockKey], pool_ids: Sequence[int], now: float, after: Any = None
    ) -> Write | None:
        """The first tier's write of an engine store, slots reserved; ``None`` when the
        store is dropped (queue full or too slow) or no room could be made (counted)."""
        with self.lock:
            if not self.cascade.accepts(0, len(keys)):
                return None
            out = self.managers[0].prepare_store(keys)
            if out is None:
                self.stats[0].rejected_stores += len(keys)
                return None
            self.stats[0].evictions += len(out.evicted)
            self.claims.left_first_tier(out.evicted)
            if len(out.keys_to_store) == len(keys):  # all new, none repeated: same order
                ids = list(pool_ids)
            else:
                row = {k: i for i, k in enumerate(keys)}
                ids = [pool_ids[row[k]] for k in out.keys_to_store]
            write = Write(
                0,
                out.keys_to_store,
                out.slots,
                pool_ids=ids,
                evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
                submitted=now,
                after=after,
            )
            self.cascade.ready_demotion(write)
            return write

    def plan_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Find and pin the longest held prefix of ``keys``, each block in the fastest
        tier holding it; reserve first-tier slots for the blocks to promote."""
        self._ask_servers(keys)
        with self.lock:
            located = self._locate(keys)
            plan = LoadPlan(list(keys[: len(located)]), [], len(keys))
            for i, t in enumerate(located):
                if plan.runs and plan.runs[-1].tier == t:
                    plan.runs[-1].stop = i + 1
                else:
                    plan.runs.append(Run(t, i, i + 1, []))
            for run in plan.runs:
                run.slots = self.managers[run.tier].prepare_load(plan.keys[run.start : run.stop])
            lower = [k for k, t in zip(plan.keys, located, strict=True) if t > 0]
            if lower:
                out = self.managers[0].prepare_store(lower)
                if out is not None:  # no room up top: load from below without promoting
                    plan.promote_keys, plan.promote_slots = out.keys_to_store, out.slots
                    plan.promote_evicted = list(zip(out.evicted, out.evicted_slots, strict=True))
                    self.stats[0].evictions += len(out.evicted)
                    self.claims.left_first_tier(out.evicted)
            return plan

    def cancel_load(self, plan: LoadPlan) -> None:
        """Release a plan that will not be (or could not be) loaded; a miss."""
        with self.lock:
            if not plan.settled:
                self._settle.load(plan, valid=0, corrupt={})

    # -- verified claims (kvoffload/claims.py, under this lock) -------------------------
    def claim(
        self, owner: Hashable, keys: Sequence[BlockKey]
    ) -> tuple[LoadPlan | None, list[Prefetch]]:
        """The claim of ``Offloader.claim`` (see there), and the prefetches it started:
        the caller queues each on its source tier's load lane (or hands it back with
        :meth:`prefetch_refused`)."""
        self._ask_servers(keys, owner)
        with self.lock:
            bypassed = [t for t in range(1, len(self.managers)) if self.bypassed(t)]
            plan, started = self.claims.claim(owner, keys, bypassed)
            for p in started:
                self.cascade.ready_demotion(p.write)
            self._settle.undo_cancelled()
            return plan, started

    def prefetch_refused(self, p: Prefetch) -> None:
        """A prefetch whose job could not be queued: undo it (its owners ask again)."""
        with self.lock:
            self.claims.refused(p)
            self._settle.undo_cancelled()

    def narrow(self, plan: LoadPlan, start: int, stop: int) -> LoadPlan:
        """A plan for ``plan.keys[start:stop]`` (pinned), releasing ``plan`` quietly."""
        with self.lock:
            if plan.settled:
                raise ValueError("narrow: this plan was already submitted or cancelled")
            stop = min(stop, plan.hits)
            start = min(max(0, start), stop)
            keys = plan.keys[start:stop]
            part = LoadPlan(keys, [], len(keys))
            for run in plan.runs:
                lo, hi = max(run.start, start), min(run.stop, stop)
                if lo < hi:
                    slots = self.managers[run.tier].prepare_load(plan.keys[lo:hi])
                    part.runs.append(Run(run.tier, lo - start, hi - start, slots))
            self._settle.unpin(plan)
            return part

    def unclaim(self, plan: LoadPlan) -> None:
        """Unpin a claimed plan that will not be loaded, counting nothing."""
        with self.lock:
            self._settle.unpin(plan)

    def release(self, owner: Hashable) -> None:
        """Forget ``owner``'s pending claim; cancel its prefetches that nobody else
        waits for and that have not started (their reserved slots freed)."""
        with self.lock:
            self.claims.release(owner)
            self._settle.undo_cancelled()

    def prefetch_starts(self, p: Prefetch) -> bool:
        """A prefetch job begins: ``False`` if it was cancelled meanwhile (skip it)."""
        with self.lock:
            return self.claims.starts(p)

    # -- outcomes ----------------------------------------------------------------------
    def settle(self, out: Outcome) -> list[Order]:
        """Book a job's outcome in one transaction (:mod:`kvoffload.settlement`): its
        I/O counters and the breakers (its :class:`~kvoffload.plans.Tally`), then a
        write's blocks ready or dropped and its source unpinned (and its prefetch
        settled), or a load's plan unpinned, its corrupt blocks dropped and its hits
        counted. Returns the next orders: the next tier's copies (``write_through``,
        ``on_evict``, ``admit_after_hits``), a load's promotion of the blocks it read
        from below, and the discards of blocks dropped for good (for :meth:`discard`,
        once this has returned)."""
        with self.lock:
            self._settle.apply(out.tally)
            if isinstance(out, LoadOutcome):
                return self._settle.load_job(out)
            orders = self._settle.write(out)
            if out.prefetch is not None:
                self.claims.settle(out.prefetch, out.seconds)
            return orders

    def discard(self, orders: Iterable[Discard]) -> None:
        """Carry out discard orders, outside the lock (call it holding nothing): each
        tier's medium forgets the blocks, then their slots, held back until now, go
        back to the free list (a second short transaction). A medium that fails to
        forget is logged: its slots are freed all the same, as a write into one
        replaces what it held."""
        for order in orders:
            try:
                if self._discard is not None:
                    self._discard(order.tier, order.slots)
            except Exception:
                logger.warning(
                    "tier %s: discard of %d blocks failed; a restart may find them (and "
                    "check them)",
                    self.configs[order.tier].name,
                    len(order.slots),
                    exc_info=True,
                )
            finally:
                with self.lock:
                    self.withheld.release(order)

    def abort_write(self, w: Write) -> None:
        """Undo a write that never ran (its job was refused)."""
        with self.lock:
            self._settle.abort_write(w)

    def bypassed(self, t: int) -> bool:
        """Whether tier ``t``'s breaker is open now (call under the lock)."""
        return self.breakers.bypassed(t)

    # -- snapshots, each one transaction -----------------------------------------------
    def pinned(self) -> list[int]:
        with self.lock:
            return [m.pinned() for m in self.managers]

    def prefetches(self) -> tuple[int, int]:
        with self.lock:
            return self.claims.counts()

    def check(self, media: Sequence[Callable[[], list[str]]]) -> list[list[str]]:
        """Per tier, the consistency problems of its books and of its medium (each
        tier's ``media`` check, run under the lock because it reads the slot allocator
        the books change: a diagnostic, no I/O of its own). Waits first, briefly, for
        discards in flight, whose held-back slots the allocator counts used and no
        block holds."""
        with self.lock:
            if not self.withheld.settled(CHECK_WAIT_S):
                logger.warning("check: discards still in flight after %.0f s", CHECK_WAIT_S)
            return [m.check() + c() for m, c in zip(self.managers, media, strict=True)]

    def pull(self, io: Sequence[Mapping[str, int]], capacity_bytes: Sequence[int]) -> None:
        """Bring the stats up to date with what the backends count themselves (each
        tier's :meth:`~kvoffload.backend.Backend.stats` counters, read by the caller
        outside the lock) and with what each tier holds now."""
        with self.lock:
            self._pull(io, capacity_bytes)

    def counters(
        self, io: Sequence[Mapping[str, int]], capacity_bytes: Sequence[int]
    ) -> tuple[dict[str, dict[str, int | float]], PrefetchStats]:
        """:meth:`pull`, then every tier's counters (by tier name) and the prefetch
        counters, as one consistent snapshot."""
        with self.lock:
            self._pull(io, capacity_bytes)
            tiers = {s.name: tier_values(s) for s in self.stats}
            return tiers, replace(self.prefetch_stats)

    def _pull(self, io: Sequence[Mapping[str, int]], capacity_bytes: Sequence[int]) -> None:
        for args in zip(self.stats, io, capacity_bytes, self.managers, strict=True):
            mirror(*args)

    def take_events(self) -> list[list[OffloadingEvent]]:
        """Per tier, its stored / removed records since the previous call."""
        with self.lock:
            return [m.take_events() for m in self.managers]

    def ready_by_tier(self, keys: Sequence[BlockKey]) -> tuple[list[list[bool] | None], list[bool]]:
        """Per tier, per key, whether the tier's books hold the block ready (``None``
        for a tier whose books are its server's: ask it), and per tier whether its
        breaker bypasses it now; one transaction."""
        with self.lock:
            ready = [None if m.server_booked else [m.ready(k) for k in keys] for m in self.managers]
            return ready, [self.bypassed(t) for t in range(len(self.managers))]

    def blocks(self) -> list[int | None]:
        """Per tier, the blocks its books hold (``None`` for a server's books)."""
        with self.lock:
            return [held(m) for m in self.managers]

    def take_slot(self, t: int, key: BlockKey) -> tuple[list[int], list[int]] | None:
        """Room in tier ``t`` for ``key`` as a store makes it: its slots, and the
        victims' slots it does not reuse (a budgeted tier's, for ``Backend.released``);
        ``None`` if there is none. The key is then being written until given back."""
        with self.lock:
            out = self.managers[t].prepare_store([key])
        if out is None or not out.keys_to_store:
            return None
        return list(out.slots), [s for s in out.evicted_slots if s not in out.slots]

    def give_back_slot(self, t: int, key: BlockKey) -> None:
        """Forget ``key`` in tier ``t`` as a failed store would (no "stored" record)."""
        with self.lock:
            self.managers[t].complete_store([key], success=False)
