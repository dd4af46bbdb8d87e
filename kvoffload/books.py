"""The Offloader's books: what moves where, decided under one lock, on keys and slots.

The Offloader's rule is that its lock is held for bookkeeping only, never while bytes
move. This module is that bookkeeping on its own: planning loads and stores, admission
(``admit_after_hits``), backpressure (``max_pending_stores``, ``max_store_delay_ms``),
the cascade into lower tiers (``write_through``, ``on_evict``), verified claims and
their prefetches, and the counters. It sees tiers only through
:class:`~kvoffload.manager.OffloadingManager` and does not import torch: what it decides
comes out as *orders* (a :class:`Write` into a tier, a :class:`LoadPlan`) that carry
everything their job needs, and each job's outcome (:class:`~kvoffload.plans.WriteOutcome`,
:class:`~kvoffload.plans.LoadOutcome`) comes back to :meth:`Books.settle`, which books
it in one transaction (counters, breakers, the managers' completion, prefetches) and
returns the next orders (cascade copies, a load's promotion). Data flows one way:
books -> orders -> jobs -> outcomes -> books; a job never calls in here. So cascade and
admission can be tested on plain keys, with no thread and no tensor
(``tests/test_books.py``), and a job takes the lock twice: once planned, once settled.

Every public method takes the lock itself, and is one transaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

from kvoffload.claims import Claims
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingManager
from kvoffload.plans import (
    Copy,
    LoadOutcome,
    LoadPlan,
    Outcome,
    Prefetch,
    Run,
    Tally,
    TierStats,
    Write,
    WriteOutcome,
)

logger = logging.getLogger(__name__)

HIT_COUNTS: Final = 1 << 20
"""Most keys whose load count the admission filter remembers (least recent forgotten),
whatever the tiers hold; the bound in force is usually :func:`hit_counts_bound`."""

HIT_COUNTS_PER_BLOCK: Final = 4
"""Load counts remembered per block the tiers can hold together (see
:func:`hit_counts_bound`)."""

HIT_COUNTS_MIN: Final = 4096
"""Load counts remembered at least, however small the tiers."""


def hit_counts_bound(capacities: Sequence[int]) -> int:
    """How many keys the admission filter's load counts remember, for tiers holding
    ``capacities`` blocks: :data:`HIT_COUNTS_PER_BLOCK` per block they hold together
    (at least :data:`HIT_COUNTS_MIN`, at most :data:`HIT_COUNTS`).

    A count matters only while its block is held somewhere or may soon be computed
    again: beyond a few times what the whole hierarchy holds, the least recently loaded
    keys are long gone from every tier. Every distinct block loaded adds an entry (~150
    bytes with its key), so a flat 2^20 cap (~150 MiB) let a long run's memory grow
    linearly for hours: about 2 MiB a minute under ``kvoffload stress``'s multi-turn
    soak (tests/test_soak.py), whose tiers hold 320 blocks."""
    return min(HIT_COUNTS, max(HIT_COUNTS_MIN, HIT_COUNTS_PER_BLOCK * sum(capacities)))


class Books:
    """Bookkeeping of every tier (see the module docstring).

    ``depth(t)`` is the number of store jobs queued or running for tier ``t`` (for
    backpressure); ``discard(t, slots)`` forgets blocks on tier ``t``'s medium (blocks
    found corrupt, so a restart does not recover them)."""

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
        discard: Callable[[int, list[int]], None],
    ) -> None:
        self.managers = list(managers)
        self.configs = list(configs)
        self.bpb = bytes_per_block
        self.persistent = list(persistent)
        self._depth = depth
        self._discard = discard
        self.lock = threading.Lock()
        self._hit_counts: OrderedDict[BlockKey, int] = OrderedDict()
        # Bounded by what the tiers hold, not by a flat 2^20 (see hit_counts_bound).
        self._hit_counts_cap = hit_counts_bound([m.capacity for m in self.managers])
        # Load counts serve only the admission filter: without one, nobody counts them.
        self._counting = any(c.admit_after_hits for c in self.configs)
        self._job_seconds = [0.0] * len(self.managers)  # moving average per store job
        # Circuit breaker per tier: failed reads or writes in a row, and until when
        # (time.monotonic) the tier is bypassed after they reached breaker_errors.
        self._failures = [0] * len(self.managers)
        self._bypass_until = [0.0] * len(self.managers)
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

    def clear_first(self) -> int:
        """Drop every block the first tier holds that nobody has pinned; how many."""
        with self.lock:
            manager = self.managers[0]
            idle = [k for k in manager.held_keys() if manager.idle(k)]
            self._discard(0, manager.remove(idle))
            return len(idle)

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
                self._health(t, ok)

    def plan_store(
        self, keys: Sequence[BlockKey], pool_ids: Sequence[int], now: float, after: Any = None
    ) -> Write | None:
        """The first tier's write of an engine store, slots reserved; ``None`` when the
        store is dropped (queue full or too slow) or no room could be made (counted)."""
        with self.lock:
            if not self._accepts(0, len(keys)):
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
            self._ready_demotion(write)
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
                self._settle_load(plan, valid=0, corrupt={})

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
                self._ready_demotion(p.write)
            self._undo_cancelled()
            return plan, started

    def prefetch_refused(self, p: Prefetch) -> None:
        """A prefetch whose job could not be queued: undo it (its owners ask again)."""
        with self.lock:
            self.claims.refused(p)
            self._undo_cancelled()

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
            self._unpin(plan)
            return part

    def unclaim(self, plan: LoadPlan) -> None:
        """Unpin a claimed plan that will not be loaded, counting nothing."""
        with self.lock:
            self._unpin(plan)

    def release(self, owner: Hashable) -> None:
        """Forget ``owner``'s pending claim; cancel its prefetches that nobody else
        waits for and that have not started (their reserved slots freed)."""
        with self.lock:
            self.claims.release(owner)
            self._undo_cancelled()

    def prefetch_starts(self, p: Prefetch) -> bool:
        """A prefetch job begins: ``False`` if it was cancelled meanwhile (skip it)."""
        with self.lock:
            return self.claims.starts(p)

    # -- outcomes ----------------------------------------------------------------------
    def settle(self, out: Outcome) -> list[Copy]:
        """Book a job's outcome in one transaction: its I/O counters and the breakers
        (its :class:`~kvoffload.plans.Tally`), then a write's blocks ready or dropped
        and its source unpinned (and its prefetch settled), or a load's plan unpinned,
        its corrupt blocks dropped and its hits counted. Returns the next orders: the
        next tier's copies (``write_through``, ``on_evict``, ``admit_after_hits``) and a
        load's promotion of the blocks it read from below."""
        with self.lock:
            self._apply(out.tally)
            if isinstance(out, LoadOutcome):
                return self._settle_load_job(out)
            orders = self._settle_write(out)
            if out.prefetch is not None:
                self.claims.settle(out.prefetch, out.seconds)
            return orders

    def abort_write(self, w: Write) -> None:
        """Undo a write that never ran (its job was refused)."""
        with self.lock:
            self._abort_write(w)

    def bypassed(self, t: int) -> bool:
        """Whether tier ``t``'s breaker is open now (call under the lock)."""
        return t > 0 and time.monotonic() < self._bypass_until[t]

    # -- introspection -----------------------------------------------------------------
    def pinned(self) -> list[int]:
        with self.lock:
            return [m.pinned() for m in self.managers]

    def prefetches(self) -> tuple[int, int]:
        with self.lock:
            return self.claims.counts()

    # -- under the lock ----------------------------------------------------------------
    def _apply(self, tally: Tally) -> None:
        """A job's I/O into the counters and the breakers."""
        for t, seconds, nbytes in tally.reads:
            stats = self.stats[t]
            stats.read_seconds += seconds
            stats.bytes_read += nbytes
        for t, seconds in tally.writes:
            self.stats[t].write_seconds += seconds
        for t, ok in tally.health:
            self._health(t, ok)

    def _health(self, t: int, ok: bool) -> None:
        """A read or write of tier ``t`` succeeded or failed (an I/O error, not a block
        found invalid): feeds the tier's circuit breaker. Enough failures in a row
        (``breaker_errors``) bypass the tier for ``breaker_backoff_ms``; when that has
        passed, the next operation is the probe: a success closes the breaker, a
        failure trips it again at once (the count is still over the limit)."""
        if ok:
            self._failures[t] = 0
            self.stats[t].breaker_open = 0
            return
        self._failures[t] += 1
        cfg = self.configs[t]
        now = time.monotonic()
        tripped = cfg.breaker_errors and self._failures[t] >= cfg.breaker_errors
        if tripped:  # open, or probed and failed again: open until a success
            self.stats[t].breaker_open = 1
        if tripped and now >= self._bypass_until[t]:
            self._bypass_until[t] = now + cfg.breaker_backoff_ms / 1e3
            self.stats[t].breaker_trips += 1
            logger.warning(
                "tier %s: %d failed reads or writes in a row; bypassing it for %.1f s",
                self.configs[t].name,
                self._failures[t],
                cfg.breaker_backoff_ms / 1e3,
            )

    def _settle_write(self, out: WriteOutcome) -> list[Copy]:
        """A finished write: ready or dropped, unpin the source, then the cascade
        orders for the next tier. A write whose bytes sit in a buffer (``out.buf``)
        hands it to the write-through copy, instead of the copy reading the blocks
        back from this tier; displaced blocks read into ``out.demoted`` go down
        (``on_evict``)."""
        w, ok = out.write, out.ok
        manager, stats = self.managers[w.tier], self.stats[w.tier]
        if all(ok):
            stored, lost = w.keys, []
        else:
            stored = [k for k, good in zip(w.keys, ok, strict=True) if good]
            lost = [k for k, good in zip(w.keys, ok, strict=True) if not good]
            manager.complete_store(lost, success=False)
        if out.charges is not None:  # what each block took in a budgeted tier
            took = [c for c, good in zip(out.charges, ok, strict=True) if good]
            manager.charge(stored, took, unplaced=out.unplaced)
        manager.complete_store(stored, success=True)
        if out.failed:
            stats.store_errors += len(w.keys)
        stats.rejected_stores += out.unplaced  # no room found as it wrote
        stats.blocks_stored += len(stored)
        stats.bytes_written += len(stored) * self.bpb
        elapsed = time.perf_counter() - w.submitted
        stats.store_latency_s.append(elapsed)
        avg = self._job_seconds[w.tier]
        self._job_seconds[w.tier] = elapsed if avg == 0.0 else 0.8 * avg + 0.2 * elapsed
        if w.src_tier is not None:
            self.managers[w.src_tier].complete_load(w.keys)
            if out.corrupt:  # they leave their tier for good
                self._drop_corrupt(w.src_tier, out.corrupt)
        orders: list[Copy] = []
        nxt = w.tier + 1
        if nxt < len(self.managers):
            if out.demoted is not None:
                copy = self._plan_copy(nxt, out.evicted, buffered=True)
                if copy is not None:
                    orders.append(Copy(copy, "demoted"))
            if stored and self.configs[nxt].write_policy == "write_through":
                admitted = self._admitted(nxt, stored)
                if admitted and out.buf is not None:
                    row = {k: i for i, k in enumerate(w.keys)}
                    rows = [row[k] for k in admitted]
                    copy = self._plan_copy(nxt, admitted, buffered=True, rows=rows)
                    if copy is not None:
                        orders.append(Copy(copy, "written"))
                elif admitted:
                    copy = self._plan_copy(nxt, admitted, src_tier=w.tier)
                    if copy is not None:
                        orders.append(Copy(copy, "tier"))
        return orders

    def _settle_load_job(self, out: LoadOutcome) -> list[Copy]:
        """A finished load job: its promotion first (the valid promoted blocks in its
        staging buffer), then unpin, touch the loaded prefix, drop corrupt blocks,
        count hits, and the admission-triggered copies."""
        plan = out.plan
        orders: list[Copy] = []
        if out.buf is not None and out.error is None:
            write = self._promotion(plan, out.valid, out.staged)
            if write is not None:
                orders.append(Copy(write, "loaded"))
        orders += self._settle_load(plan, out.valid, out.corrupt)
        deepest = max((r.tier for r in plan.runs), default=0)
        self.stats[deepest].load_latency_s.append(time.perf_counter() - out.submitted)
        return orders

    def _promotion(self, plan: LoadPlan, valid: int, staged: list[bool]) -> Write | None:
        """The first-tier write of a load's promoted blocks that are valid and in the
        staging buffer (``write.rows``: their rows in it); the other reserved
        promotion slots are freed."""
        if not plan.promote_keys:
            return None
        pos = {k: i for i, k in enumerate(plan.keys)}
        rows = [pos[k] for k in plan.promote_keys]
        # Only blocks that went through the buffer can be written from it: one copied
        # straight from a memory tier into the pool is not promoted (it is fast where it
        # is).
        keep = [i for i, r in enumerate(rows) if r < valid and staged[r]]
        write = Write(
            0,
            [plan.promote_keys[i] for i in keep],
            [plan.promote_slots[i] for i in keep],
            rows=[rows[i] for i in keep],
            evicted=plan.promote_evicted,
            submitted=time.perf_counter(),
        )
        kept = set(keep)
        dropped = [plan.promote_keys[i] for i in range(len(rows)) if i not in kept]
        plan.promote_keys = []
        self.managers[0].complete_store(dropped, success=False)
        self.stats[0].promotions += len(keep)
        self._ready_demotion(write)
        return write

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

    def _accepts(self, t: int, n: int) -> bool:
        """Whether tier ``t`` takes a new store job now; counts the drop if not."""
        cfg = self.configs[t]
        if self.bypassed(t):
            self.stats[t].bypassed_stores += n
            return False
        depth = self._depth(t)
        full = depth >= cfg.max_pending_stores
        if not full and cfg.max_store_delay_ms is not None:
            full = depth * self._job_seconds[t] * 1e3 > cfg.max_store_delay_ms
        if full:
            self.stats[t].dropped_stores += n
        return not full

    def _admitted(self, t: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        need = self.configs[t].admit_after_hits
        if need == 0:
            return list(keys)
        counts = self._hit_counts
        admitted = [k for k in keys if counts.get(k, 0) >= need]
        self.stats[t].not_admitted += len(keys) - len(admitted)
        return admitted

    def _ready_demotion(self, w: Write) -> None:
        """Decide, as ``w`` is planned, which of its displaced blocks go down: the next
        tier's (``on_evict``) admitted ones. ``w.evicted`` is narrowed to them and
        ``w.demote`` says whether there are any, so the job reads exactly those before
        overwriting their slots, and asks nobody. Also which displaced slots the write
        does not reuse (``w.released``: a budgeted tier's parked victims)."""
        if len(w.evicted) > len(w.slots):  # a budgeted tier's victims beyond its slots
            reused = set(w.slots)
            w.released = [slot for _, slot in w.evicted if slot not in reused]
        nxt = w.tier + 1
        if not (
            w.evicted and nxt < len(self.managers) and self.configs[nxt].write_policy == "on_evict"
        ):
            w.demote = False
            return
        admitted = set(self._admitted(nxt, [k for k, _ in w.evicted]))
        if len(admitted) < len(w.evicted):
            w.evicted = [e for e in w.evicted if e[0] in admitted]
        w.demote = bool(w.evicted)

    def _plan_copy(
        self,
        t: int,
        keys: list[BlockKey],
        *,
        src_tier: int | None = None,
        buffered: bool = False,
        rows: list[int] | None = None,
    ) -> Write | None:
        """A copy of ``keys`` into tier ``t``: from a buffer whose row ``rows[i]``
        (default ``i``) holds ``keys[i]`` (``write.rows`` then says which rows to take),
        or from ``src_tier``, where the blocks are pinned until the copy has read them.
        Keys the tier already holds, or is writing, are left out; ``None`` when nothing
        is left, or the tier refuses (counted)."""
        manager = self.managers[t]
        keep = [i for i, k in enumerate(keys) if not manager.holds(k)]
        picked = [(rows[i] if rows is not None else i) for i in keep]
        keys = [keys[i] for i in keep]
        if not keys:
            return None
        if not self._accepts(t, len(keys)):  # counts the drop
            return None
        out = manager.prepare_store(keys)
        if out is None:
            self.stats[t].rejected_stores += len(keys)
            return None
        if out.keys_to_store != keys:  # repeated keys were merged
            first = {k: picked[i] for i, k in reversed(list(enumerate(keys)))}
            picked = [first[k] for k in out.keys_to_store]
        self.stats[t].evictions += len(out.evicted)
        write = Write(
            t,
            out.keys_to_store,
            out.slots,
            rows=picked if buffered else None,
            evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
            submitted=time.perf_counter(),
        )
        self._ready_demotion(write)
        if src_tier is not None:
            write.src_tier = src_tier
            write.src_slots = self.managers[src_tier].prepare_load(out.keys_to_store)
        return write

    def _abort_write(self, w: Write) -> None:
        self.managers[w.tier].complete_store(w.keys, success=False)
        if w.src_tier is not None:
            self.managers[w.src_tier].complete_load(w.keys)

    def _undo_cancelled(self) -> None:
        """Undo the writes of the prefetches the claims just cancelled."""
        for w in self.claims.cancelled():
            self._abort_write(w)

    def _drop_corrupt(self, t: int, keys: Sequence[BlockKey]) -> None:
        """Drop blocks a read found invalid, so they stay misses after a restart. One
        pinned by another reader is left to that reader, which will find it invalid
        too."""
        manager = self.managers[t]
        if manager.server_booked:  # most likely evicted by the server after the lookup
            manager.remove(keys)
            self.stats[t].lost_blocks += len(keys)
            return
        free = [k for k in keys if manager.idle(k)]
        if free:
            self._discard(t, manager.remove(free))
        self.stats[t].corrupt_blocks += len(keys)

    def _settle_load(
        self, plan: LoadPlan, valid: int, corrupt: dict[int, list[BlockKey]]
    ) -> list[Copy]:
        if plan.settled:
            return []
        plan.settled = True
        if plan.promote_keys:  # never written: cancelled, or the job failed early
            self.managers[0].complete_store(plan.promote_keys, success=False)
            plan.promote_keys = []
        loaded = plan.keys[:valid]
        for run in plan.runs:
            manager = self.managers[run.tier]
            keys = plan.keys[run.start : run.stop]
            manager.complete_load(keys)
            manager.touch(keys[: max(0, valid - run.start)])
        for t, bad in corrupt.items():
            self._drop_corrupt(t, bad)
        # Each requested block is a hit in the tier that served it and a miss in every
        # tier above; one not served is a miss in every tier. A block a claim prefetched
        # from a lower tier was served by that tier (through the first).
        prefetched = self.claims.loaded(loaded)
        reached = plan.requested
        for t, stats in enumerate(self.stats):
            served = sum(max(0, min(r.stop, valid) - r.start) for r in plan.runs if r.tier == t)
            served += prefetched.get(t, 0) - (sum(prefetched.values()) if t == 0 else 0)
            stats.hits += served
            stats.misses += reached - served
            reached -= served
        return self._count_hits(loaded)

    def _unpin(self, plan: LoadPlan) -> None:
        """Settle a plan without a load: unpin, count nothing."""
        if plan.settled:
            return
        plan.settled = True
        if plan.promote_keys:
            self.managers[0].complete_store(plan.promote_keys, success=False)
            plan.promote_keys = []
        for run in plan.runs:
            self.managers[run.tier].complete_load(plan.keys[run.start : run.stop])

    def _count_hits(self, loaded: Sequence[BlockKey]) -> list[Copy]:
        """Remember load counts for the admission filter; write-through copies of
        blocks that just reached a lower tier's ``admit_after_hits``."""
        if not loaded or not self._counting:
            return []
        counts = self._hit_counts
        for key in loaded:
            counts[key] = counts.get(key, 0) + 1
            counts.move_to_end(key)
        while len(counts) > self._hit_counts_cap:
            counts.popitem(last=False)
        orders: list[Copy] = []
        for t in range(1, len(self.managers)):
            cfg = self.configs[t]
            if cfg.admit_after_hits and cfg.write_policy == "write_through":
                ready = [k for k in loaded if counts[k] == cfg.admit_after_hits]
                src = self.managers[t - 1]
                ready = [k for k in ready if src.ready(k)]
                if ready:
                    copy = self._plan_copy(t, ready, src_tier=t - 1)
                    if copy is not None:
                        orders.append(Copy(copy, "tier"))
        return orders
