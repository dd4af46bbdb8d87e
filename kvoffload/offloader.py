"""The Offloader: the configured tiers as one store, moving blocks off the engine step.

Engines and the CLI call it; it owns the tiers (each a backend plus its manager) and
one :class:`~kvoffload.transfer.TransferWorker` per tier. It is a thin facade over two
parts with one role each: :mod:`kvoffload.books` decides what moves where (under one
lock that is never held while bytes move) and :mod:`kvoffload.datapath` moves the
bytes; :mod:`kvoffload.jobs` holds the job bodies that run on the lane threads, each
carrying out one order and returning one outcome. This module is the engine-facing
API over those parts, and the loop that joins them: an order goes to a lane, its job
returns an outcome, ``Books.settle`` books it and returns the next orders, which go to
their lanes (:meth:`Offloader._settle`). So a job takes the books' lock twice, once
planned and once settled.

Store path (``submit_store``). The engine's blocks are gathered from the
:class:`~kvoffload.blockpool.BlockPool` into the first tier, on that tier's store lane.
Each lower tier is fed from the tier above it, by its ``write_policy``:

- ``write_through``: as soon as a block lands in tier *t*, a copy into *t+1* is
  queued (the block is pinned in *t* until the copy has read it);
- ``on_evict``: when tier *t* evicts a block to make room, the write that reuses the
  slot first reads the old block, and a copy into *t+1* is queued from that buffer.

``admit_after_hits: N`` on a lower tier admits only blocks loaded at least N times;
under ``write_through`` such a block is copied down when its N-th load completes.

Load path (``prepare_load`` then ``submit_load``). The longest prefix held across all
tiers is found, each block in the fastest tier that holds it ready, and pinned there
for the whole transfer. Blocks found only in a lower tier are promoted: read into a
host staging buffer, scattered into the target pool blocks with the rest, and then
(after the load has reported, on the first tier's store lane) written into a
first-tier slot reserved at planning time. A block whose checksum, key or
layout does not match ends the prefix: it is dropped from its tier and is a miss.

Backpressure. Every tier's store lane is bounded by ``max_pending_stores`` jobs, and
optionally by ``max_store_delay_ms`` of expected queueing; a store that would exceed
either is dropped and counted, never waited for. Loads run on their own lane, so they
never queue behind stores, and copies into persistent tiers wait (briefly, bounded)
while loads are in flight, so the disk serves the engine's loads first.

Threading. The engine calls ``submit_*``, ``prepare_load``, ``lookup`` and
``get_finished`` from one thread; jobs run on lane threads. All manager calls happen
under the books' lock, which is held for O(blocks) bookkeeping only: never across a
read, write, gather or scatter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Final

from kvoffload.blockpool import BlockPool
from kvoffload.books import Books
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.datapath import DataPath, LayerProgress, LoadGate, StoreGate
from kvoffload.jobs import Jobs, LoadsInFlight, ignore_result
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingEvent
from kvoffload.metrics import BACKEND_METRICS, tier_state, tier_values
from kvoffload.plans import Copy, Outcome, Prefetch, Write, WriteOutcome
from kvoffload.plans import LoadPlan as LoadPlan
from kvoffload.plans import PrefetchStats as PrefetchStats
from kvoffload.plans import TierStats as TierStats
from kvoffload.tier import Tier, build_tiers
from kvoffload.transfer import JobResult, TransferWorker

logger = logging.getLogger(__name__)

MAX_INFLIGHT_LOADS: Final = 64
COPY_THREADS: Final = 2
"""Threads draining a lower tier's store lane. Its jobs are independent copies into
distinct slots, so two may run at once: one's fdatasync and bookkeeping overlap the
other's I/O, and the disk sees twice the queue depth. The first tier has one per
lane on a host pool and two on a GPU pool (see ``Offloader.__init__``)."""


class Offloader:
    """The tiered store. See the module docstring.

    ``pool`` is the engine's block pool (needed by ``submit_store`` / ``submit_load``);
    ``tiers`` may be passed pre-built (tests), otherwise they are built from
    ``config`` (persistent tiers recover their blocks). Close it to drain the queues and
    close the tiers.
    """

    def __init__(
        self,
        config: KVOffloadConfig,
        layout: KVLayout,
        pool: BlockPool | None = None,
        *,
        tiers: list[Tier] | None = None,
        events: bool = False,
    ) -> None:
        self.layout = layout
        self.pool = pool
        if pool is not None:
            pool.check_layout(layout)
        self.bpb = layout.bytes_per_block
        self.tier_configs: list[TierConfig] = config.resolved_tiers()
        self.tiers = tiers if tiers is not None else build_tiers(config, layout, events=events)
        self._data = DataPath(self.bpb, pool)
        self._closed = False
        self._workers: list[TransferWorker] = []
        self._books = Books(
            [t.manager for t in self.tiers],
            self.tier_configs,
            bytes_per_block=self.bpb,
            persistent=[t.backend.persistent for t in self.tiers],
            prefetch_max_inflight=config.prefetch_max_inflight,
            load_timeout_s=config.load_timeout_ms / 1e3,
            depth=lambda t: self._workers[t].pending("store"),
            discard=lambda t, slots: self.tiers[t].backend.discard(slots),
        )
        self.prefetch_stats: PrefetchStats = self._books.prefetch_stats
        try:
            for cfg in self.tier_configs:
                first = not self._workers
                self._workers.append(
                    TransferWorker(
                        max_inflight_stores=cfg.max_pending_stores,
                        max_inflight_loads=MAX_INFLIGHT_LOADS,
                        # The first tier: one thread per lane on a host pool (its copies
                        # use both cores already), two on a GPU, so that one job's
                        # Python runs while the other's copies are on the bus.
                        store_threads=COPY_THREADS if not first or self._data.cuda else 1,
                        load_threads=COPY_THREADS if first and self._data.cuda else 1,
                        name=f"kvoffload-{cfg.name}",
                    )
                )
        except BaseException:
            self.close()
            raise
        self._loads = LoadsInFlight()
        self._jobs = Jobs(
            self.tiers,
            self.tier_configs,
            self._data,
            load_timeout_s=config.load_timeout_ms / 1e3,
            loads=self._loads,
        )

    # -- engine-facing: lookup, store, load, poll --------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held ready by some tier."""
        return self._books.lookup(keys)

    def submit_store(
        self, keys: Sequence[BlockKey], pool_ids: Sequence[int], *, gate: StoreGate | None = None
    ) -> int | None:
        """Store pool blocks ``pool_ids`` under ``keys`` into the first tier (and from
        there down the chain). Returns a job id to poll, or ``None`` when the store was
        dropped (queue full) or no room could be made; the counts say which. Keys the
        tier already holds are skipped. The pool blocks must stay untouched until the
        job finishes, or, with ``gate`` (a :class:`~kvoffload.datapath.StoreGate`),
        until the gate says they were read (``gate.wait``), which may abandon the
        store if it has not begun by then."""
        if len(keys) != len(pool_ids):
            raise ValueError(f"submit_store: {len(keys)} keys but {len(pool_ids)} pool blocks")
        self._need_pool()
        write = self._books.plan_store(keys, pool_ids, time.perf_counter(), self._data.mark())
        if write is None:
            if gate is not None:
                gate.release()
            return None
        job = self._workers[0].submit_store(lambda: self._write(write, gate))
        if job is None:  # only when shut down: the books checked the depth
            self._books.abort_write(write)
        if job is None and gate is not None:
            gate.release()  # nothing will read the engine's blocks
        return job

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Find and pin the longest held prefix of ``keys``; reserve first-tier slots for
        the blocks to promote. Cheap (bookkeeping only); the plan must then be submitted
        or cancelled."""
        return self._books.plan_load(keys)

    def submit_load(
        self,
        plan: LoadPlan,
        pool_ids: Sequence[int],
        *,
        layers: LayerProgress | None = None,
        gate: LoadGate | None = None,
    ) -> int | None:
        """Load ``plan`` into pool blocks ``pool_ids`` (one per planned key) on the load
        lane. The job's result counts the blocks actually loaded (``nbytes //
        bytes_per_block``): a prefix of the plan, shorter if a block proved corrupt.
        ``None`` if the load lane is full (the plan is then cancelled: a miss).

        ``layers`` (a :class:`~kvoffload.datapath.LayerProgress` of the pool's layer
        count): copy into the pool layer by layer, reporting each, so that the engine
        can read layer N while layer N+1 is copied; it is finished when the job ends,
        whatever happens. The result still says which blocks loaded: a layer reported
        is no promise that its blocks are valid.

        ``gate`` (a :class:`~kvoffload.datapath.LoadGate`): lets the caller abandon the
        load when it can wait no longer (``gate.abandon()``); the job then copies
        nothing into the pool."""
        pool = self.pool
        if layers is not None and pool is not None and layers.num_layers != pool.num_layers:
            raise ValueError(
                f"submit_load: progress of {layers.num_layers} layers, "
                f"the pool has {pool.num_layers}"
            )
        if len(pool_ids) != plan.hits:
            raise ValueError(f"submit_load: plan of {plan.hits} blocks, {len(pool_ids)} pool ids")
        self._need_pool()
        if plan.settled or plan.submitted:
            raise ValueError("submit_load: this plan was already submitted or cancelled")
        plan.submitted = True
        now = time.perf_counter()
        ids = list(pool_ids)
        self._loads.begin()  # persistent-tier copies yield to it
        after = self._data.mark()
        job = self._workers[0].submit_load(lambda: self._load(plan, ids, now, after, layers, gate))
        if job is None:
            self._loads.end()
            self._books.cancel_load(plan)
            if layers is not None:
                layers.finish()
        return job

    def cancel_load(self, plan: LoadPlan) -> None:
        """Release a plan that will not be submitted (unpin; free promotion slots)."""
        self._books.cancel_load(plan)

    # -- verified claims: prefetch into the first tier, then pin -----------------------
    def claim(self, owner: Hashable, keys: Sequence[BlockKey]) -> LoadPlan | None:
        """Claim the longest prefix of ``keys`` that the first tier holds verified.

        Blocks of the prefix that only a lower tier holds are first *prefetched*: read,
        checked (checksum, key, layout) and written into first-tier slots, on that
        tier's load lane. While any of them is in flight this returns ``None`` ("not
        decided yet": ask again later, as vLLM's asynchronous lookup does); then it
        returns a plan pinned in the first tier only, whose load is a memory copy that
        cannot meet a corrupt disk block. A corrupt, lost or unreadable block ends the
        prefix before anyone has allocated for it. Several owners asking for the same
        blocks share one prefetch. Every owner must end with :meth:`release` (which
        also cancels prefetches nobody else waits for) and every returned plan with
        :meth:`submit_load`, :meth:`narrow` or :meth:`unclaim`.

        Prefetches are bounded by ``prefetch_max_inflight`` (and half the first tier):
        a claim that needs more waits for earlier ones to land. A claim settles after
        at most ``2 + len(keys) / budget`` prefetch rounds, whatever happens to the
        blocks meanwhile. With a persistent first tier there is nothing to prefetch
        into: the first tier's prefix is pinned as it is and verified at load."""
        plan, started = self._books.claim(owner, keys)
        for p in started:
            t = p.write.src_tier
            assert t is not None
            job = self._workers[t].submit_load(
                lambda p=p: self._prefetch(p),  # type: ignore[misc]
                ignore_result,
            )
            if job is None:
                self._books.prefetch_refused(p)
        return plan

    def narrow(self, plan: LoadPlan, start: int, stop: int) -> LoadPlan:
        """A plan for ``plan.keys[start:stop]`` (pinned), releasing ``plan`` quietly.
        For a claim of which the engine loads a part (its own cache has the start)."""
        return self._books.narrow(plan, start, stop)

    def unclaim(self, plan: LoadPlan) -> None:
        """Unpin a claimed plan that will not be loaded, counting nothing (no hit, no
        miss: the engine never asked to load it)."""
        self._books.unclaim(plan)

    def release(self, owner: Hashable) -> None:
        """Forget ``owner``'s pending claim; its prefetches that nobody else waits for
        and that have not started are cancelled (their reserved slots freed)."""
        self._books.release(owner)

    def held(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether some tier holds it ready: for hits that need blocks other
        than a prefix (a sliding window's, before a boundary)."""
        return self._books.held(keys)

    def locate(self, keys: Sequence[BlockKey]) -> list[int]:
        """For the longest prefix of ``keys`` some tier holds ready, as the books know
        now (no server asked): per key, the index of the fastest tier holding it."""
        return self._books.locate(keys)

    def resident(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` the first tier holds ready (no
        prefetch needed)."""
        return self._books.resident(keys)

    def clear_first_tier(self) -> int:
        """Drop every unpinned block of the first tier (a reset of the engine's
        external cache); how many. Lower tiers keep theirs."""
        return self._books.clear_first()

    def pinned(self) -> list[int]:
        """Blocks pinned by loads and claims, per tier (0 everywhere when idle)."""
        return self._books.pinned()

    def prefetches(self) -> tuple[int, int]:
        """Prefetch jobs in flight, and owners waiting on claims."""
        return self._books.prefetches()

    # -- the jobs' loop: order in, outcome out, settled, next orders queued ----------
    def _write(self, w: Write, gate: StoreGate | None = None) -> int:
        """Job body of a write (an engine store, a cascade copy, a promotion)."""
        return self._settle(self._jobs.write(w, gate))

    def _load(
        self,
        plan: LoadPlan,
        ids: list[int],
        submitted: float,
        after: object,
        layers: LayerProgress | None,
        gate: LoadGate | None,
    ) -> int:
        """Job body of a load."""
        try:
            out = self._jobs.load(plan, ids, submitted, after, layers=layers, gate=gate)
        finally:
            self._loads.end()
        return self._settle(out)

    def _prefetch(self, p: Prefetch) -> int:
        """Job body of a prefetch: its write up into the first tier (which reads and
        verifies the source, and drops what is corrupt from it), settled with the
        prefetch in one transaction."""
        if not self._books.prefetch_starts(p):
            return 0  # cancelled before it ran
        self._loads.begin()  # copies into persistent tiers wait for us too
        try:
            t0 = time.perf_counter()
            out = self._jobs.write(p.write)
            out.prefetch, out.seconds = p, time.perf_counter() - t0
        finally:
            self._loads.end()
        return self._settle(out)

    def _settle(self, out: Outcome) -> int:
        """Settle a job's outcome and queue the orders that come back; the job's bytes
        (or its exception, raised now that its books are straight)."""
        orders = self._books.settle(out)
        if isinstance(out, WriteOutcome):
            self._queue(orders, {"written": out.buf, "demoted": out.demoted})
            nbytes = sum(out.ok) * self.bpb
        else:
            self._queue(orders, {"loaded": out.buf})
            nbytes = out.valid * self.bpb
        if out.error is not None:
            raise out.error
        return nbytes

    def _queue(self, orders: list[Copy], sources: dict[str, object]) -> None:
        """Queue the books' orders on their tiers' store lanes, their bytes cut out of
        the settled job's buffers (``sources``). A copy the lane refuses is undone; a
        load's promotion is written here instead (it reserved its slots already)."""
        self._jobs.stage(orders, sources)
        for order in orders:
            w = order.write
            job = self._workers[w.tier].submit_store(
                lambda w=w: self._write(w),  # type: ignore[misc]
                ignore_result,
            )
            if job is not None:
                continue
            if order.source == "loaded":
                self._write(w)  # the lane is full or closing: write it here
            else:
                self._books.abort_write(w)
                self._jobs.release(w)

    def get_finished(self) -> list[JobResult]:
        """Results of store and load jobs finished since the last call (never blocks)."""
        return self._workers[0].get_finished()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until the given jobs finish (or ``timeout``) and take their results."""
        return self._workers[0].wait(job_ids, timeout)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queue, cascades included, is empty; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(w.pending("store") + w.pending("load") == 0 for w in self._workers):
                return True
            time.sleep(0.002)
        return False

    def close(self) -> None:
        """Run every queued job, stop the lanes, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Upper tiers first: their jobs may queue copies into the lower ones.
        for worker in self._workers:
            worker.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> list[str]:
        """Consistency problems of every tier's books and medium (empty when fine)."""
        with self._books.lock:
            return [
                f"{t.name}: {p}" for t in self.tiers for p in t.manager.check() + t.backend.check()
            ]

    @property
    def stats(self) -> list[TierStats]:
        """Every tier's live counters (the books' own objects, in tier order), with the
        counters the backends keep themselves (round trips, server errors) brought up
        to date first. Read field by field while the lanes run, a value may be a
        transaction behind; :meth:`counters` is the consistent snapshot."""
        with self._books.lock:
            self._pull_backend_counters()
        return self._books.stats

    def _pull_backend_counters(self) -> None:
        """Copy each backend's :meth:`~kvoffload.backend.Backend.io_counters` into its
        tier's stats (under the books' lock, so that two readers never write them out
        of order). One way only: the backend counts, the stats mirror it."""
        for tier, stats in zip(self.tiers, self._books.stats, strict=True):
            counts = tier.backend.io_counters()
            for name, value in counts.items():
                if name in BACKEND_METRICS:
                    setattr(stats, name, value)
            if "stored_bytes" not in counts:
                # A backend that never compresses (the cpu slab, most plugins) stores
                # what it was given: both are the books' bytes_written.
                stats.logical_bytes = stats.stored_bytes = stats.bytes_written
            # What the tier holds now, against what it could hold (blocks per GiB).
            manager = tier.manager
            held = len(manager) if isinstance(manager, LRUOffloadingManager) else None
            for name, value in tier_state(held, tier.backend.capacity_bytes).items():
                setattr(stats, name, value)

    def counters(self) -> tuple[dict[str, dict[str, int | float]], PrefetchStats]:
        """Every tier's counters (by tier name, see :func:`~kvoffload.metrics.tier_values`)
        and the prefetch counters, as one consistent snapshot. The lane threads (and
        the claims of a scheduler's thread) change them under the books' lock, several
        fields per transaction, so they are read under it too: read field by field from
        another thread (a stats poll), a snapshot could hold half a transaction."""
        with self._books.lock:
            self._pull_backend_counters()
            tiers = {t.name: tier_values(t) for t in self._books.stats}
            return tiers, replace(self.prefetch_stats)

    def take_events(self) -> list[tuple[Tier, OffloadingEvent]]:
        """Every tier's stored / removed records since the previous call, each with its
        tier (empty unless built with ``events=True``). The lane threads change the
        books under the lock, so the records are taken under it too."""
        with self._books.lock:
            return [(t, ev) for t in self.tiers for ev in t.manager.take_events()]

    def pending_stores(self) -> list[int]:
        """Store jobs queued or running, per tier."""
        return [w.pending("store") for w in self._workers]

    def _need_pool(self) -> None:
        if self.pool is None:
            raise ValueError("this Offloader has no block pool; pass pool= to store or load")
