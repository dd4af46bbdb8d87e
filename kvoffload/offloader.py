"""The Offloader: the configured tiers as one store, moving blocks off the engine step.

Engines and the CLI call it; it owns the tiers (each a backend plus its manager) and
one :class:`~kvoffload.transfer.TransferWorker` per tier. It is a thin facade over two
parts with one role each: :mod:`kvoffload.books` decides what moves where (under one
lock that is never held while bytes move) and :mod:`kvoffload.datapath` moves the
bytes; :mod:`kvoffload.jobs` holds the job bodies that run on the lane threads, each
carrying out one order and returning one outcome. This module is the engine-facing
API over those parts; :mod:`kvoffload.lanes` is the loop that joins them: an order goes
to a lane, its job returns an outcome, ``Books.settle`` books it and returns the next
orders, which go to their lanes (:meth:`Lanes.settle <kvoffload.lanes.Lanes.settle>`).
So a job takes the books' lock twice, once planned and once settled.

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
read, write, gather, scatter or discard (a block dropped for good is forgotten on its
medium once the lock is released, its slot held back from new stores until then).
The facade never takes that lock itself: it asks the books for snapshots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvoffload.blockpool import BlockPool
from kvoffload.books import Books
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.datapath import DataPath, LayerProgress, LoadGate, StoreGate
from kvoffload.inflight import LoadsInFlight
from kvoffload.jobs import Jobs, ignore_result
from kvoffload.keys import BlockKey
from kvoffload.lanes import COPY_THREADS as COPY_THREADS
from kvoffload.lanes import MAX_INFLIGHT_LOADS as MAX_INFLIGHT_LOADS
from kvoffload.lanes import Lanes, open_workers
from kvoffload.layout import KVLayout
from kvoffload.manager import OffloadingEvent
from kvoffload.plans import LoadPlan as LoadPlan
from kvoffload.plans import PrefetchStats as PrefetchStats
from kvoffload.plans import TierStats as TierStats
from kvoffload.tier import Tier, build_tiers
from kvoffload.transfer import JobResult, TransferWorker

logger = logging.getLogger(__name__)


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
            open_workers(self.tier_configs, self._data.cuda, into=self._workers)
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
        self._lanes = Lanes(self._books, self._jobs, self._workers, self._loads, self.bpb)
        self._pull_lock = threading.Lock()  # one reader at a time mirrors the backends

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
        job = self._workers[0].submit_store(lambda: self._lanes.write(write, gate))
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
        job = self._workers[0].submit_load(
            lambda: self._lanes.load(plan, ids, now, after, layers, gate)
        )
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
                lambda p=p: self._lanes.prefetch(p),  # type: ignore[misc]
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
        cleared, discards = self._books.clear_first()
        self._books.discard(discards)  # the lock released; their slots wait for it
        return cleared

    def pinned(self) -> list[int]:
        """Blocks pinned by loads and claims, per tier (0 everywhere when idle)."""
        return self._books.pinned()

    def prefetches(self) -> tuple[int, int]:
        """Prefetch jobs in flight, and owners waiting on claims."""
        return self._books.prefetches()

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

    # -- snapshots of the books, each one transaction of theirs -----------------------
    def check(self) -> list[str]:
        """Consistency problems of every tier's books and medium (empty when fine)."""
        found = self._books.check([t.backend.check for t in self.tiers])
        return [f"{t.name}: {p}" for t, ps in zip(self.tiers, found, strict=True) for p in ps]

    @property
    def stats(self) -> list[TierStats]:
        """Every tier's live counters (the books' own objects, in tier order), with the
        counters the backends keep themselves (round trips, server errors) brought up
        to date first. Read field by field while the lanes run, a value may be a
        transaction behind; :meth:`counters` is the consistent snapshot."""
        with self._pull_lock:
            self._books.pull(*self._backend_counts())
        return self._books.stats

    def counters(self) -> tuple[dict[str, dict[str, int | float]], PrefetchStats]:
        """Every tier's counters (by tier name, see :func:`~kvoffload.metrics.tier_values`)
        and the prefetch counters, as one consistent snapshot. The lane threads (and
        the claims of a scheduler's thread) change them under the books' lock, several
        fields per transaction, so the books take them under it too: read field by
        field from another thread (a stats poll), a snapshot could hold half a
        transaction."""
        with self._pull_lock:
            return self._books.counters(*self._backend_counts())

    def _backend_counts(self) -> tuple[list[Mapping[str, int]], list[int]]:
        """Each backend's own counters and capacity, read outside the books' lock (the
        caller holds ``_pull_lock``, so two readers never mirror them out of order)."""
        backends = [t.backend for t in self.tiers]
        counters = [b.stats(held=False).counters for b in backends]
        return counters, [b.capacity_bytes for b in backends]

    def take_events(self) -> list[tuple[Tier, OffloadingEvent]]:
        """Every tier's stored / removed records since the previous call, each with its
        tier (empty unless built with ``events=True``), taken in one transaction."""
        taken = self._books.take_events()
        return [(t, ev) for t, evs in zip(self.tiers, taken, strict=True) for ev in evs]

    def ready_by_tier(self, keys: Sequence[BlockKey]) -> tuple[list[list[bool] | None], list[bool]]:
        """Per tier, per key: whether its books hold the block ready (``None`` for a
        tier whose books are its server's: ask the server); and per tier, whether its
        breaker bypasses it now. One snapshot, no server asked, nothing changed."""
        return self._books.ready_by_tier(keys)

    def blocks_by_tier(self) -> list[int | None]:
        """Per tier, the blocks its books hold (``None`` for a server's tier)."""
        return self._books.blocks()

    def probe_slot(self, t: int, key: BlockKey) -> list[int] | None:
        """Room in tier ``t`` for ``key``, as a store makes it (a free slot, else the
        least recent unpinned block evicted); ``None`` if there is none. The key is
        then being written: never found, loaded or evicted until
        :meth:`give_back_slot`."""
        taken = self._books.take_slot(t, key)
        if taken is None:
            return None
        slots, parked = taken
        if parked:  # a budgeted tier's extra victims: nothing reads them (no demotion)
            self.tiers[t].backend.released(parked)
        return slots

    def give_back_slot(self, t: int, key: BlockKey, slots: list[int]) -> None:
        """Forget ``key`` in tier ``t`` as a failed store would (no "stored" record),
        what its slot holds discarded first on a local medium (so a restart never
        recovers it; the slot is still the key's, so no store can be in it yet)."""
        backend = self.tiers[t].backend
        if not backend.server_booked:
            backend.discard(slots)
        self._books.give_back_slot(t, key)

    def pending_stores(self) -> list[int]:
        """Store jobs queued or running, per tier."""
        return [w.pending("store") for w in self._workers]

    def _need_pool(self) -> None:
        if self.pool is None:
            raise ValueError("this Offloader has no block pool; pass pool= to store or load")
