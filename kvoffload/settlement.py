"""How the books settle a job's outcome: one transaction, and the next orders.

A write's outcome (:class:`~kvoffload.plans.WriteOutcome`) makes its blocks ready or
drops them, unpins its source and feeds the cascade; a load's
(:class:`~kvoffload.plans.LoadOutcome`) unpins its plan, writes up what it promoted,
drops what proved corrupt and counts hits and misses. Both first book the job's
:class:`~kvoffload.plans.Tally` (I/O counters, breakers). What comes back are orders:
the next tier's copies, a load's promotion, and the discards of blocks dropped for
good (:class:`~kvoffload.plans.Discard`, carried out after the lock is released;
their slots are held back until then, :mod:`kvoffload.withheld`). Kept apart from
:mod:`kvoffload.books`, which owns it and calls it under its lock only, so that the
books' module is their entry points and this one is what settling does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from kvoffload.breaker import Breakers
from kvoffload.cascade import Cascade
from kvoffload.claims import Claims
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingManager
from kvoffload.plans import (
    Copy,
    Discard,
    LoadOutcome,
    LoadPlan,
    Order,
    Tally,
    TierStats,
    Write,
    WriteOutcome,
)
from kvoffload.withheld import Withheld


@dataclass(eq=False, repr=False)
class Settlement:
    """Settles outcomes into the books' parts (see the module docstring). It only
    holds references to the books' own parts, hence a plain record of them (compared
    by identity and shown as an object, as before)."""

    managers: Sequence[OffloadingManager]
    stats: Sequence[TierStats]
    bpb: int
    """Bytes per block: what a block read or written adds to the byte counters."""
    _: KW_ONLY
    breakers: Breakers
    cascade: Cascade
    claims: Claims
    withheld: Withheld

    def apply(self, tally: Tally) -> None:
        """A job's I/O into the counters and the breakers."""
        for t, seconds, nbytes in tally.reads:
            stats = self.stats[t]
            stats.read_seconds += seconds
            stats.bytes_read += nbytes
        for t, seconds in tally.writes:
            self.stats[t].write_seconds += seconds
        for t, ok in tally.health:
            self.breakers.health(t, ok)

    def write(self, out: WriteOutcome) -> list[Order]:
        """A finished write: ready or dropped, unpin the source (dropping what it
        found corrupt there), then the cascade orders for the next tier
        (:meth:`Cascade.after_write <kvoffload.cascade.Cascade.after_write>`)."""
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
        self.cascade.timed(w.tier, elapsed)
        orders: list[Order] = []
        if w.src_tier is not None:
            self.managers[w.src_tier].complete_load(w.keys)
            if out.corrupt:  # they leave their tier for good
                orders += self.drop_corrupt(w.src_tier, out.corrupt)
        return self.cascade.after_write(out, stored) + orders

    def load_job(self, out: LoadOutcome) -> list[Order]:
        """A finished load job: its promotion first (the valid promoted blocks in its
        staging buffer), then unpin, touch the loaded prefix, drop corrupt blocks,
        count hits, and the admission-triggered copies."""
        plan = out.plan
        orders: list[Order] = []
        if out.buf is not None and out.error is None:
            write = self._promotion(plan, out.valid, out.staged)
            if write is not None:
                orders.append(Copy(write, "loaded"))
        orders += self.load(plan, out.valid, out.corrupt)
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
        self.cascade.ready_demotion(write)
        return write

    def load(self, plan: LoadPlan, valid: int, corrupt: dict[int, list[BlockKey]]) -> list[Order]:
        """Settle ``plan``, of which the first ``valid`` blocks loaded: unpin, drop the
        ``corrupt`` blocks per tier, count hits and misses."""
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
        orders: list[Order] = []
        for t, bad in corrupt.items():
            orders += self.drop_corrupt(t, bad)
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
        return [*self.cascade.count_hits(loaded), *orders]

    def unpin(self, plan: LoadPlan) -> None:
        """Settle a plan without a load: unpin, count nothing."""
        if plan.settled:
            return
        plan.settled = True
        if plan.promote_keys:
            self.managers[0].complete_store(plan.promote_keys, success=False)
            plan.promote_keys = []
        for run in plan.runs:
            self.managers[run.tier].complete_load(plan.keys[run.start : run.stop])

    def drop_corrupt(self, t: int, keys: Sequence[BlockKey]) -> list[Discard]:
        """Drop blocks a read found invalid, so they stay misses after a restart (the
        order that forgets them on the medium). One pinned by another reader is left
        to that reader, which will find it invalid too."""
        manager = self.managers[t]
        if manager.server_booked:  # most likely evicted by the server after the lookup
            manager.remove(keys)
            self.stats[t].lost_blocks += len(keys)
            return []
        self.stats[t].corrupt_blocks += len(keys)
        order = self.withheld.drop(t, [k for k in keys if manager.idle(k)])
        return [] if order is None else [order]

    def abort_write(self, w: Write) -> None:
        """Undo a write that never ran."""
        self.managers[w.tier].complete_store(w.keys, success=False)
        if w.src_tier is not None:
            self.managers[w.src_tier].complete_load(w.keys)

    def undo_cancelled(self) -> None:
        """Undo the writes of the prefetches the claims just cancelled."""
        for w in self.claims.cancelled():
            self.abort_write(w)
