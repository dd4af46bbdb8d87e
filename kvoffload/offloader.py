"""The Offloader: the configured tiers as one store, moving blocks off the engine step.

Engines and the CLI call it; it owns the tiers (each a backend plus its manager) and
one :class:`~kvoffload.transfer.TransferWorker` per tier, and keeps the books under
one lock that is never held while bytes move.

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
under ``self._lock``, which is held for O(blocks) bookkeeping only: never across a
read, write, gather or scatter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.datapath import DataPath, Piece, groups
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.manager import OffloadingEvent
from kvoffload.tier import Tier, build_tiers
from kvoffload.transfer import JobResult, TransferWorker

logger = logging.getLogger(__name__)

LATENCY_SAMPLES: Final = 100_000
"""Latency samples kept per tier and direction (the most recent ones)."""
LOAD_PRIORITY_WAIT_S: Final = 0.02
"""Longest a copy into a persistent tier waits for in-flight loads to finish."""
HIT_COUNTS: Final = 1 << 20
"""Keys whose load count the admission filter remembers (least recent forgotten)."""
MAX_INFLIGHT_LOADS: Final = 64
DIRECT_MIN_BYTES: Final = 1 << 20
"""Blocks from this size up are copied from a memory tier into the pool group by group
of consecutive slots however scattered; smaller ones only when the groups are few
(one call per group costs tens of microseconds)."""
COPY_THREADS: Final = 2
"""Threads draining a lower tier's store lane. Its jobs are independent copies into
distinct slots, so two may run at once: one's fdatasync and bookkeeping overlap the
other's I/O, and the disk sees twice the queue depth. The first tier has one per
lane on a host pool and two on a GPU pool (see ``Offloader.__init__``)."""


@dataclass
class TierStats:
    """Counters of one tier since the Offloader started (read under its lock)."""

    name: str
    backend: str
    capacity_blocks: int
    write_policy: str
    hits: int = 0
    """Blocks loaded from this tier (the fastest tier holding each)."""
    misses: int = 0
    """Requested blocks this tier did not serve: found lower down, or nowhere."""
    blocks_stored: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    evictions: int = 0
    dropped_stores: int = 0
    """Blocks not stored because this tier's store queue was full or too slow."""
    rejected_stores: int = 0
    """Blocks not stored because no room could be made (every candidate pinned)."""
    not_admitted: int = 0
    """Blocks kept out by ``admit_after_hits``."""
    store_errors: int = 0
    """Blocks whose write raised (an I/O error): not stored."""
    corrupt_blocks: int = 0
    """Blocks a load found invalid (checksum, key or layout): dropped, served as misses."""
    promotions: int = 0
    """Blocks copied up into this tier by a load (first tier only)."""
    store_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    """Submit-to-done time of store jobs into this tier."""
    load_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))
    """Submit-to-done time of loads whose slowest tier was this one."""


@dataclass
class PrefetchStats:
    """Counters of the prefetches that :meth:`Offloader.claim` runs (read under the
    Offloader's lock)."""

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


@dataclass(eq=False)
class _Prefetch:
    """One prefetch job: a run of blocks copied from a lower tier into first-tier
    slots reserved for them, verified on the way (the write's source read)."""

    write: _Write
    waiters: set[Hashable] = field(default_factory=set)
    started: bool = False
    done: bool = False


@dataclass
class _Claim:
    """An owner (a request) whose claim waits for prefetches."""

    waits: list[_Prefetch] = field(default_factory=list)
    rounds: int = 0


@dataclass(slots=True)
class _Run:
    """Consecutive prefix positions ``[start, stop)`` held by one tier."""

    tier: int
    start: int
    stop: int
    slots: list[int]


@dataclass
class LoadPlan:
    """A pinned load: what :meth:`Offloader.prepare_load` found and reserved.

    Hand it to :meth:`Offloader.submit_load`, or give it back with
    :meth:`Offloader.cancel_load`; until then its blocks cannot be evicted."""

    keys: list[BlockKey]
    """The held prefix (``len(keys)`` is the hit length)."""
    runs: list[_Run]
    requested: int
    """Keys asked for (the prefix, then the first miss and everything after it)."""
    promote_keys: list[BlockKey] = field(default_factory=list)
    promote_slots: list[int] = field(default_factory=list)
    promote_evicted: list[tuple[BlockKey, int]] = field(default_factory=list)
    """First-tier blocks evicted to make room for the promotions (for ``on_evict``)."""
    settled: bool = False

    @property
    def hits(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class _Write:
    """One write into a tier: where the bytes come from, and what it displaces."""

    tier: int
    keys: list[BlockKey]
    slots: list[int]
    pool_ids: list[int] | None = None
    """Source: these pool blocks (an engine store)."""
    src_tier: int | None = None
    src_slots: list[int] | None = None
    """Source: these slots of ``src_tier``, pinned by this write (write-through)."""
    buf: torch.Tensor | None = None
    """Source: this staging buffer, released by the write (demotion, promotion)."""
    evicted: list[tuple[BlockKey, int]] = field(default_factory=list)
    """Blocks this write's slots held, to be read first and demoted (``on_evict``)."""
    submitted: float = 0.0
    after: Any = None
    """The engine's event to wait for before reading its blocks (CUDA; see
    :meth:`DataPath.mark`)."""
    corrupt: list[BlockKey] = field(default_factory=list)
    """Source blocks the read found invalid: dropped from ``src_tier`` when settled."""


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
        self._lock = threading.Lock()
        self._loads_done = threading.Condition(self._lock)
        self._loads_active = 0
        self._hit_counts: OrderedDict[BlockKey, int] = OrderedDict()
        self._data = DataPath(self.bpb, pool)
        self._buffers = self._data.buffers
        self._job_seconds = [0.0] * len(self.tiers)  # moving average per store job
        self._closed = False
        # Prefetches (see ``claim``): keys in flight to the first tier, owners waiting,
        # and keys prefetched but not loaded yet (for the hit / wasted counts).
        self._inflight: dict[BlockKey, _Prefetch] = {}
        self._claims: dict[Hashable, _Claim] = {}
        self._prefetched: OrderedDict[BlockKey, None] = OrderedDict()
        self._prefetch_blocks = 0
        first = self.tiers[0].manager.capacity
        self._prefetch_budget = max(1, min(config.prefetch_max_inflight // self.bpb, first // 2))
        self.prefetch_stats = PrefetchStats()
        self.stats = [
            TierStats(
                t.name,
                c.backend,
                t.manager.capacity,
                "first" if i == 0 else c.write_policy,
            )
            for i, (t, c) in enumerate(zip(self.tiers, self.tier_configs, strict=True))
        ]
        self._workers: list[TransferWorker] = []
        try:
            for cfg in self.tier_configs:
                self._workers.append(
                    TransferWorker(
                        max_inflight_stores=cfg.max_pending_stores,
                        max_inflight_loads=MAX_INFLIGHT_LOADS,
                        # The first tier: one thread on a host pool (its copies use
                        # both cores already), two on a GPU, so that one job's Python
                        # runs while the other's copies are on the bus.
                        store_threads=COPY_THREADS if self._workers or self._data.cuda else 1,
                        load_threads=COPY_THREADS if not self._workers and self._data.cuda else 1,
                        name=f"kvoffload-{cfg.name}",
                    )
                )
        except BaseException:
            self.close()
            raise

    # -- engine-facing: lookup, store, load, poll --------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held ready by some tier."""
        with self._lock:
            return len(self._locate(keys))

    def submit_store(self, keys: Sequence[BlockKey], pool_ids: Sequence[int]) -> int | None:
        """Store pool blocks ``pool_ids`` under ``keys`` into the first tier (and from
        there down the chain). Returns a job id to poll, or ``None`` when the store was
        dropped (queue full) or no room could be made; the counts say which. Keys the
        tier already holds are skipped. The pool blocks must stay untouched until the
        job finishes."""
        if len(keys) != len(pool_ids):
            raise ValueError(f"submit_store: {len(keys)} keys but {len(pool_ids)} pool blocks")
        self._need_pool()
        now = time.perf_counter()
        tier, stats = self.tiers[0], self.stats[0]
        with self._lock:
            if not self._accepts(0, len(keys)):
                return None
            out = tier.manager.prepare_store(keys)
            if out is None:
                stats.rejected_stores += len(keys)
                return None
            stats.evictions += len(out.evicted)
            self._left_first_tier(out.evicted)
            row = {k: i for i, k in enumerate(keys)}
            write = _Write(
                0,
                out.keys_to_store,
                out.slots,
                pool_ids=[pool_ids[row[k]] for k in out.keys_to_store],
                evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
                submitted=now,
                after=self._data.mark(),
            )
            job = self._workers[0].submit_store(lambda: self._run_write(write))
            if job is None:  # only when shut down: _accepts checked the depth
                self._abort_write(write)
            return job

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Find and pin the longest held prefix of ``keys``; reserve first-tier slots for
        the blocks to promote. Cheap (bookkeeping only); the plan must then be submitted
        or cancelled."""
        with self._lock:
            located = self._locate(keys)
            plan = LoadPlan(list(keys[: len(located)]), [], len(keys))
            for i, t in enumerate(located):
                if plan.runs and plan.runs[-1].tier == t:
                    plan.runs[-1].stop = i + 1
                else:
                    plan.runs.append(_Run(t, i, i + 1, []))
            for run in plan.runs:
                run.slots = self.tiers[run.tier].manager.prepare_load(
                    plan.keys[run.start : run.stop]
                )
            lower = [k for k, t in zip(plan.keys, located, strict=True) if t > 0]
            if lower:
                out = self.tiers[0].manager.prepare_store(lower)
                if out is not None:  # no room up top: load from below without promoting
                    plan.promote_keys, plan.promote_slots = out.keys_to_store, out.slots
                    plan.promote_evicted = list(zip(out.evicted, out.evicted_slots, strict=True))
                    self.stats[0].evictions += len(out.evicted)
                    self._left_first_tier(out.evicted)
            return plan

    def submit_load(self, plan: LoadPlan, pool_ids: Sequence[int]) -> int | None:
        """Load ``plan`` into pool blocks ``pool_ids`` (one per planned key) on the load
        lane. The job's result counts the blocks actually loaded (``nbytes //
        bytes_per_block``): a prefix of the plan, shorter if a block proved corrupt.
        ``None`` if the load lane is full (the plan is then cancelled: a miss)."""
        if len(pool_ids) != plan.hits:
            raise ValueError(f"submit_load: plan of {plan.hits} blocks, {len(pool_ids)} pool ids")
        self._need_pool()
        now = time.perf_counter()
        ids = list(pool_ids)
        with self._lock:
            if plan.settled:
                raise ValueError("submit_load: this plan was already submitted or cancelled")
            self._loads_active += 1
            after = self._data.mark()
            job = self._workers[0].submit_load(lambda: self._run_load(plan, ids, now, after))
            if job is None:
                self._loads_active -= 1
                self._settle_load(plan, valid=0, corrupt={})
            return job

    def cancel_load(self, plan: LoadPlan) -> None:
        """Release a plan that will not be submitted (unpin; free promotion slots)."""
        with self._lock:
            if not plan.settled:
                self._settle_load(plan, valid=0, corrupt={})

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
        with self._lock:
            cl = self._claims.get(owner)
            if cl is not None and any(not p.done for p in cl.waits):
                return None
            if cl is None:
                cl = self._claims[owner] = _Claim()
            cl.waits = []
            first = self.tiers[0].manager
            ready = first.lookup(keys)
            max_rounds = 2 + -(-len(keys) // self._prefetch_budget)
            below = len(self.tiers) > 1 and not self.tiers[0].backend.persistent
            if below and cl.rounds < max_rounds:
                waits, started, starved = self._start_prefetches(keys, ready)
                if started:
                    cl.rounds += 1
                if waits or starved:
                    cl.waits = waits
                    for p in waits:
                        p.waiters.add(owner)
                    return None
            del self._claims[owner]
            slots = first.prepare_load(keys[:ready])
            runs = [_Run(0, 0, ready, slots)] if ready else []
            return LoadPlan(list(keys[:ready]), runs, len(keys))

    def narrow(self, plan: LoadPlan, start: int, stop: int) -> LoadPlan:
        """A plan for ``plan.keys[start:stop]`` (pinned), releasing ``plan`` quietly.
        For a claim of which the engine loads a part (its own cache has the start)."""
        with self._lock:
            if plan.settled:
                raise ValueError("narrow: this plan was already submitted or cancelled")
            stop = min(stop, plan.hits)
            start = min(max(0, start), stop)
            keys = plan.keys[start:stop]
            part = LoadPlan(keys, [], len(keys))
            for run in plan.runs:
                lo, hi = max(run.start, start), min(run.stop, stop)
                if lo < hi:
                    slots = self.tiers[run.tier].manager.prepare_load(plan.keys[lo:hi])
                    part.runs.append(_Run(run.tier, lo - start, hi - start, slots))
            self._unpin(plan)
            return part

    def unclaim(self, plan: LoadPlan) -> None:
        """Unpin a claimed plan that will not be loaded, counting nothing (no hit, no
        miss: the engine never asked to load it)."""
        with self._lock:
            self._unpin(plan)

    def release(self, owner: Hashable) -> None:
        """Forget ``owner``'s pending claim; its prefetches that nobody else waits for
        and that have not started are cancelled (their reserved slots freed)."""
        with self._lock:
            cl = self._claims.pop(owner, None)
            if cl is None:
                return
            for p in cl.waits:
                p.waiters.discard(owner)
                if not p.waiters and not p.started and not p.done:
                    p.done = True
                    self._prefetch_landed(p, [])
                    self._abort_write(p.write)
                    self.prefetch_stats.wasted += len(p.write.keys)

    def pinned(self) -> list[int]:
        """Blocks pinned by loads and claims, per tier (0 everywhere when idle)."""
        with self._lock:
            return [t.manager.pinned() for t in self.tiers]

    def prefetches(self) -> tuple[int, int]:
        """Prefetch jobs in flight, and owners waiting on claims."""
        with self._lock:
            return len({id(p) for p in self._inflight.values()}), len(self._claims)

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
        with self._lock:
            return [
                f"{t.name}: {p}" for t in self.tiers for p in t.manager.check() + t.backend.check()
            ]

    def take_events(self) -> list[tuple[Tier, OffloadingEvent]]:
        """Every tier's stored / removed records since the previous call, each with its
        tier (empty unless built with ``events=True``). The lane threads change the
        books under the lock, so the records are taken under it too."""
        with self._lock:
            return [(t, ev) for t in self.tiers for ev in t.manager.take_events()]

    def pending_stores(self) -> list[int]:
        """Store jobs queued or running, per tier."""
        return [w.pending("store") for w in self._workers]

    # -- planning (under the lock) ----------------------------------------------------
    def _locate(self, keys: Sequence[BlockKey]) -> list[int]:
        """For the longest held prefix: the index of the fastest tier holding each key."""
        managers = [t.manager for t in self.tiers]
        located: list[int] = []
        for key in keys:
            for t, manager in enumerate(managers):
                state = manager.state(key)
                if state is not None and state.ref_cnt >= 0:
                    located.append(t)
                    break
            else:
                break
        return located

    def _start_prefetches(
        self, keys: Sequence[BlockKey], ready: int
    ) -> tuple[list[_Prefetch], bool, bool]:
        """Queue prefetches for the blocks after the first tier's ready prefix that a
        lower tier holds (under the lock). Returns the prefetches this prefix waits for
        (new and already in flight), whether any was started, and whether some could
        not start for want of budget while others are in flight (then: wait too)."""
        first = self.tiers[0].manager
        waits: dict[int, _Prefetch] = {}
        want: list[tuple[int, BlockKey]] = []
        for key in keys[ready:]:
            inflight = self._inflight.get(key)
            if inflight is not None:
                waits[id(inflight)] = inflight
                continue
            state = first.state(key)
            if state is not None:
                if state.ref_cnt >= 0:
                    continue  # ready up top already
                break  # being written by a store: not claimable yet
            below = next(
                (
                    t
                    for t in range(1, len(self.tiers))
                    if (s := self.tiers[t].manager.state(key)) is not None and s.ref_cnt >= 0
                ),
                None,
            )
            if below is None:
                break
            want.append((below, key))
        room = self._prefetch_budget - self._prefetch_blocks
        starved = len(want) > room and self._prefetch_blocks > 0
        want = want[: max(0, room)]
        started = False
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
            started = True
            i = j
        return list(waits.values()), started, starved

    def _prefetch(self, t: int, keys: list[BlockKey]) -> _Prefetch | None:
        """Reserve first-tier slots for ``keys`` (held by tier ``t``), pin them in
        ``t`` and queue the copy on ``t``'s load lane (under the lock); ``None`` when
        the first tier has no room or the lane is full."""
        out = self.tiers[0].manager.prepare_store(keys)
        if out is None:
            self.prefetch_stats.failed += len(keys)
            return None
        self.stats[0].evictions += len(out.evicted)
        self._left_first_tier(out.evicted)
        write = _Write(
            0,
            out.keys_to_store,
            out.slots,
            src_tier=t,
            src_slots=self.tiers[t].manager.prepare_load(out.keys_to_store),
            evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
            submitted=time.perf_counter(),
        )
        p = _Prefetch(write)
        job = self._workers[t].submit_load(lambda: self._run_prefetch(p), _ignore_result)
        if job is None:
            self._abort_write(write)
            self.prefetch_stats.failed += len(keys)
            return None
        for key in write.keys:
            self._inflight[key] = p
        self._prefetch_blocks += len(write.keys)
        return p

    def _prefetch_landed(self, p: _Prefetch, landed: Sequence[BlockKey]) -> None:
        """Books for a prefetch that ended (under the lock): out of flight; ``landed``
        are the keys now ready up top."""
        for key in p.write.keys:
            if self._inflight.get(key) is p:
                del self._inflight[key]
        self._prefetch_blocks -= len(p.write.keys)
        for key in landed:
            self._prefetched[key] = None
            self._prefetched.move_to_end(key)
        while len(self._prefetched) > self.tiers[0].manager.capacity:
            self._prefetched.popitem(last=False)

    def _left_first_tier(self, keys: Iterable[BlockKey]) -> None:
        """Count prefetched blocks evicted up top before any load used them (under the
        lock)."""
        if self._prefetched:
            for key in keys:
                if key in self._prefetched:
                    del self._prefetched[key]
                    self.prefetch_stats.wasted += 1

    def _accepts(self, t: int, n: int) -> bool:
        """Whether tier ``t`` takes a new store job now; counts the drop if not."""
        cfg = self.tier_configs[t]
        depth = self._workers[t].pending("store")
        full = depth >= cfg.max_pending_stores
        if not full and cfg.max_store_delay_ms is not None:
            full = depth * self._job_seconds[t] * 1e3 > cfg.max_store_delay_ms
        if full:
            self.stats[t].dropped_stores += n
        return not full

    def _admitted(self, t: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        need = self.tier_configs[t].admit_after_hits
        if need == 0:
            return list(keys)
        counts = self._hit_counts
        admitted = [k for k in keys if counts.get(k, 0) >= need]
        self.stats[t].not_admitted += len(keys) - len(admitted)
        return admitted

    def _need_pool(self) -> None:
        if self.pool is None:
            raise ValueError("this Offloader has no block pool; pass pool= to store or load")

    # -- the store path (job bodies run on lane threads) -------------------------------
    def _run_write(self, w: _Write) -> int:
        """Fill the tier from the write's source, after reading out what it displaces;
        then settle the books and queue the next tier's copies.

        One copy where the tier or the source is plain memory (:meth:`_pieces`): the
        engine's blocks are gathered straight into the tier's rows, a prefetch reads
        straight into them, and a copy down reads straight out of the tier above.
        Otherwise the bytes go through one staging buffer."""
        tier, bpb = self.tiers[w.tier], self.bpb
        n = len(w.keys)
        buf = w.buf
        demote_buf: torch.Tensor | None = None
        ok = [True] * n
        written = False
        try:
            if n and self.tiers[w.tier].backend.persistent and w.tier > 0:
                self._yield_to_loads()
            into = self._pieces(w.tier, w.slots) if buf is None and n else None
            src_tier = w.src_tier if w.pool_ids is None else None
            out_of = (
                self._pieces(src_tier, w.src_slots)
                if buf is None and n and into is None and src_tier is not None
                else None
            )
            if into is not None:
                # Straight into the tier's rows: read out what they hold first.
                if w.evicted:
                    demote_buf = self._read_evicted(w)
                t0 = time.perf_counter()
                if w.pool_ids is not None:
                    self._data.pack(w.pool_ids, into, w.after)
                else:
                    assert w.src_tier is not None
                    assert w.src_slots is not None
                    got = self._read_pieces(w.src_tier, w.src_slots, w.keys, into)
                    ok = got if got is not None else [False] * n
                    if got is not None:
                        w.corrupt = [k for k, good in zip(w.keys, got, strict=True) if not good]
                with self._lock:
                    self.stats[w.tier].write_seconds += time.perf_counter() - t0
                written = True
                return sum(ok) * bpb
            if out_of is not None:
                # Straight out of the tier above's rows (pinned there by this write).
                if w.evicted:
                    demote_buf = self._read_evicted(w)
                t0 = time.perf_counter()
                for pos, rows in out_of:
                    count = rows.shape[0]
                    tier.backend.write(w.slots[pos : pos + count], w.keys[pos : pos + count], rows)
                seconds = time.perf_counter() - t0
                seconds += self._throttle(w.tier, n * bpb, seconds)
                with self._lock:
                    self.stats[w.tier].write_seconds += seconds
                written = True
                return n * bpb
            if buf is None and n:
                buf = self._buffers.acquire(n)
                if w.pool_ids is not None:
                    self._data.pack(w.pool_ids, [(0, buf)], w.after)
                else:
                    assert w.src_tier is not None
                    assert w.src_slots is not None
                    got = self._read(w.src_tier, w.src_slots, w.keys, buf)
                    ok = got if got is not None else [False] * n
                    if got is not None:
                        w.corrupt = [k for k, good in zip(w.keys, got, strict=True) if not good]
            if w.evicted:
                demote_buf = self._read_evicted(w)
            good = [i for i in range(n) if ok[i]]
            if good:
                src = buf if len(good) == n else buf[torch.tensor(good)]  # type: ignore[index]
                assert src is not None
                t0 = time.perf_counter()
                tier.backend.write(
                    [w.slots[i] for i in good], [w.keys[i] for i in good], src.contiguous()
                )
                seconds = time.perf_counter() - t0
                seconds += self._throttle(w.tier, len(good) * bpb, seconds)
                with self._lock:
                    self.stats[w.tier].write_seconds += seconds
            written = True
        finally:
            with self._lock:
                handed_on = self._settle_write(
                    w,
                    ok if written else [False] * n,
                    demote_buf,
                    failed=not written,
                    buf=buf if written and n else None,
                )
            if buf is not None and n and not handed_on:
                self._buffers.release(buf)
        return sum(ok) * bpb

    def _pieces(self, t: int | None, slots: Sequence[int] | None) -> list[Piece] | None:
        """Tier ``t``'s ``slots`` as rows of its memory, one piece per run of
        consecutive slots; ``None`` when the tier is not plain memory, or (small blocks
        on a host pool) when the runs are so many that one call per run would cost more
        than one staging copy."""
        if t is None or not slots:
            return None
        backend = self.tiers[t].backend
        if backend.rows(slots[0], 1) is None:
            return None
        runs = groups(slots)
        few = len(runs) <= max(1, len(slots) // 8)
        if not (few or self._data.cuda or self.bpb >= DIRECT_MIN_BYTES):
            return None
        pieces: list[Piece] = []
        for pos, first, count in runs:
            rows = backend.rows(first, count)
            assert rows is not None
            pieces.append((pos, rows))
        return pieces

    def _read_pieces(
        self, t: int, slots: Sequence[int], keys: Sequence[BlockKey], into: Sequence[Piece]
    ) -> list[bool] | None:
        """Read ``slots`` of tier ``t`` straight into ``into``'s rows: per-block
        validity, or ``None`` after an I/O error (as :meth:`_read`)."""
        ok: list[bool] = []
        for pos, rows in into:
            count = rows.shape[0]
            got = self._read(t, slots[pos : pos + count], keys[pos : pos + count], rows)
            if got is None:
                return None
            ok.extend(got)
        return ok

    def _read_evicted(self, w: _Write) -> torch.Tensor | None:
        """Read the blocks a write displaces, for ``on_evict`` demotion; ``None`` if the
        next tier does not want them (or fails to read)."""
        nxt = w.tier + 1
        if nxt >= len(self.tiers) or self.tier_configs[nxt].write_policy != "on_evict":
            return None
        keys = [k for k, _ in w.evicted]
        with self._lock:
            keys = self._admitted(nxt, keys)
        if not keys:
            return None
        slot_of = dict(w.evicted)
        w.evicted = [(k, slot_of[k]) for k in keys]
        buf = self._buffers.acquire(len(keys))
        got = self._read(w.tier, [slot_of[k] for k in keys], keys, buf)
        ok = got if got is not None else [False] * len(keys)
        if not all(ok):
            w.evicted = [e for e, good in zip(w.evicted, ok, strict=True) if good]
            if not w.evicted:
                self._buffers.release(buf)
                return None
            rows = torch.tensor([i for i, good in enumerate(ok) if good])
            demote = self._buffers.acquire(len(rows))
            torch.index_select(buf, 0, rows, out=demote)
            self._buffers.release(buf)
            buf = demote
        return buf

    def _settle_write(
        self,
        w: _Write,
        ok: list[bool],
        demote_buf: torch.Tensor | None,
        *,
        failed: bool,
        buf: torch.Tensor | None,
    ) -> bool:
        """Books for a finished write (under the lock): ready or dropped, unpin the
        source, then queue write-through copies and demotions into the next tier.

        ``buf`` holds the bytes just written (row ``i`` for ``w.keys[i]``): a
        write-through copy takes it over instead of reading the blocks back from this
        tier, so the copy neither pins them nor costs a read. Returns whether it did
        (the caller then must not release ``buf``)."""
        tier, stats = self.tiers[w.tier], self.stats[w.tier]
        stored = [k for k, good in zip(w.keys, ok, strict=True) if good]
        lost = [k for k, good in zip(w.keys, ok, strict=True) if not good]
        tier.manager.complete_store(stored, success=True)
        tier.manager.complete_store(lost, success=False)
        if failed:
            stats.store_errors += len(w.keys)
        stats.blocks_stored += len(stored)
        stats.bytes_written += len(stored) * self.bpb
        elapsed = time.perf_counter() - w.submitted
        stats.store_latency_s.append(elapsed)
        avg = self._job_seconds[w.tier]
        self._job_seconds[w.tier] = elapsed if avg == 0.0 else 0.8 * avg + 0.2 * elapsed
        if w.src_tier is not None:
            src = self.tiers[w.src_tier]
            src.manager.complete_load(w.keys)
            if w.corrupt:  # they leave their tier for good
                self._drop_corrupt(w.src_tier, w.corrupt)
        nxt = w.tier + 1
        handed_on = False
        if nxt < len(self.tiers):
            if demote_buf is not None:
                keys = [k for k, _ in w.evicted]
                self._queue_copy(nxt, keys, buf=demote_buf)
            if stored and self.tier_configs[nxt].write_policy == "write_through":
                admitted = self._admitted(nxt, stored)
                if admitted and buf is not None:
                    row = {k: i for i, k in enumerate(w.keys)}
                    self._queue_copy(nxt, admitted, buf=buf, rows=[row[k] for k in admitted])
                    handed_on = True
                elif admitted:
                    self._queue_copy(nxt, admitted, src_tier=w.tier)
        elif demote_buf is not None:
            self._buffers.release(demote_buf)
        return handed_on

    def _queue_copy(
        self,
        t: int,
        keys: list[BlockKey],
        *,
        src_tier: int | None = None,
        buf: torch.Tensor | None = None,
        rows: list[int] | None = None,
    ) -> None:
        """Queue a copy of ``keys`` into tier ``t`` (under the lock): from ``buf``, whose
        row ``rows[i]`` (default ``i``) holds ``keys[i]`` and which this call takes over,
        or from ``src_tier``, where the blocks are pinned until the copy has read them.
        Keys the tier already holds, or is writing, are left out."""
        manager = self.tiers[t].manager
        keep = [i for i, k in enumerate(keys) if manager.state(k) is None]
        keys = [keys[i] for i in keep]
        if buf is not None:
            picked = [(rows[i] if rows is not None else i) for i in keep]
            buf = self._pick_rows(buf, picked)
        if not keys:
            return
        out = None
        if self._accepts(t, len(keys)):  # counts the drop when not
            out = manager.prepare_store(keys)
            if out is None:
                self.stats[t].rejected_stores += len(keys)
        if out is None:
            if buf is not None:
                self._buffers.release(buf)
            return
        if buf is not None and out.keys_to_store != keys:  # repeated keys were merged
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            buf = self._pick_rows(buf, [first[k] for k in out.keys_to_store])
        self.stats[t].evictions += len(out.evicted)
        write = _Write(
            t,
            out.keys_to_store,
            out.slots,
            buf=buf,
            evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
            submitted=time.perf_counter(),
        )
        if src_tier is not None:
            write.src_tier = src_tier
            write.src_slots = self.tiers[src_tier].manager.prepare_load(out.keys_to_store)
        job = self._workers[t].submit_store(lambda: self._run_write(write), _ignore_result)
        if job is None:
            self._abort_write(write)

    def _pick_rows(self, buf: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """``buf``'s ``rows``, in that order, as a buffer of their own (``buf`` itself
        when they are its leading rows); ``buf`` is released otherwise. Copies under
        the lock only when some blocks were left out, which is rare and small."""
        if rows == list(range(len(rows))):
            if rows:
                return buf[: len(rows)]
            self._buffers.release(buf)
            return None
        sub = self._buffers.acquire(len(rows))
        torch.index_select(buf, 0, torch.tensor(rows), out=sub)
        self._buffers.release(buf)
        return sub

    def _abort_write(self, w: _Write) -> None:
        """Undo a write that never ran (under the lock)."""
        self.tiers[w.tier].manager.complete_store(w.keys, success=False)
        if w.src_tier is not None:
            self.tiers[w.src_tier].manager.complete_load(w.keys)
        if w.buf is not None:
            self._buffers.release(w.buf)

    def _throttle(self, t: int, nbytes: int, seconds: float) -> float:
        rate = self.tier_configs[t].write_throttle
        if rate is None:
            return 0.0
        extra = nbytes / rate - seconds
        if extra > 0:
            time.sleep(extra)
            return extra
        return 0.0

    def _yield_to_loads(self) -> None:
        with self._lock:
            if self._loads_active:
                self._loads_done.wait_for(lambda: self._loads_active == 0, LOAD_PRIORITY_WAIT_S)

    # -- the load path ------------------------------------------------------------------
    def _read(
        self,
        t: int,
        slots: Sequence[int],
        keys: Sequence[BlockKey],
        buf: torch.Tensor,
    ) -> list[bool] | None:
        """Read into ``buf``: per-block validity, or ``None`` after an I/O error (a
        miss, but no proof the stored blocks are bad, so they are not dropped)."""
        t0 = time.perf_counter()
        ok: list[bool] | None
        try:
            ok = self.tiers[t].backend.read(slots, keys, buf)
        except BackendError:
            logger.warning(
                "tier %s: read of %d blocks failed; a miss", self.tiers[t].name, len(keys)
            )
            ok = None
        seconds = time.perf_counter() - t0
        with self._lock:
            stats = self.stats[t]
            stats.read_seconds += seconds
            stats.bytes_read += sum(ok) * self.bpb if ok is not None else 0
        return ok

    def _drop_corrupt(self, t: int, keys: Sequence[BlockKey]) -> None:
        """Drop blocks a read found invalid (under the lock), so they stay misses after
        a restart. One pinned by another reader is left to that reader, which will find
        it invalid too."""
        manager = self.tiers[t].manager
        free = [k for k in keys if (s := manager.state(k)) is not None and s.ref_cnt == 0]
        if free:
            self.tiers[t].drop(free)
        self.stats[t].corrupt_blocks += len(keys)

    def _run_prefetch(self, p: _Prefetch) -> int:
        """Job body: copy the blocks up (the write reads and verifies its source, drops
        what is corrupt from it, and makes the rest ready in the first tier)."""
        with self._lock:
            if p.done:  # cancelled before it ran
                return 0
            p.started = True
            self._loads_active += 1  # copies into persistent tiers wait for us too
        t0 = time.perf_counter()
        nbytes = 0
        try:
            nbytes = self._run_write(p.write)
        finally:
            with self._lock:
                self._loads_active -= 1
                self._loads_done.notify_all()
                first = self.tiers[0].manager
                landed = [
                    k for k in p.write.keys if (s := first.state(k)) is not None and s.ref_cnt >= 0
                ]
                p.done = True
                self._prefetch_landed(p, landed)
                # A prefetch is a use of the source block: keep it warm in its tier, so
                # the disk copy outlives the cpu copy that a hit will soon evict.
                self.tiers[p.write.src_tier].manager.touch(landed)
                stats = self.prefetch_stats
                stats.prefetched += len(landed)
                self.stats[0].promotions += len(landed)
                stats.failed += len(p.write.keys) - len(landed)
                stats.seconds += time.perf_counter() - t0
        return nbytes

    def _run_load(
        self, plan: LoadPlan, pool_ids: list[int], submitted: float, after: Any = None
    ) -> int:
        """Job body: read the plan's lower-tier runs into one staging buffer (checking
        each block), then copy the valid prefix into the pool in one go: memory-tier
        runs straight from their rows, the rest from the buffer."""
        n = plan.hits
        buf: torch.Tensor | None = None
        corrupt: dict[int, list[BlockKey]] = {}
        valid = 0
        handed_on = False
        try:  # everything after the plan was pinned: the finally settles it
            direct = [self._pieces(run.tier, run.slots) for run in plan.runs]
            in_buf = [False] * n  # positions read into the staging buffer
            for run, pieces in zip(plan.runs, direct, strict=True):
                if pieces is None:
                    in_buf[run.start : run.stop] = [True] * (run.stop - run.start)
            buf = self._buffers.acquire(n) if any(in_buf) else None
            copies: list[Piece] = []
            from_memory: list[tuple[int, int]] = []  # (tier, blocks) copied from rows
            for run, pieces in zip(plan.runs, direct, strict=True):
                if pieces is not None:  # one copy: the tier's memory -> the pool
                    copies.extend((run.start + pos, rows) for pos, rows in pieces)
                    from_memory.append((run.tier, run.stop - run.start))
                    valid = run.stop
                    continue
                assert buf is not None
                keys = plan.keys[run.start : run.stop]
                part = self._read(run.tier, run.slots, keys, buf[run.start : run.stop])
                if part is None:
                    break  # an I/O error: the prefix ends here
                bad = [k for k, good in zip(keys, part, strict=True) if not good]
                good_stop = run.start + part.index(False) if bad else run.stop
                if good_stop > run.start:
                    copies.append((run.start, buf[run.start : good_stop]))
                valid = good_stop
                if bad:
                    corrupt.setdefault(run.tier, []).extend(bad)
                    break
            valid = self._copy_in(plan, pool_ids, copies, valid, from_memory, after)
            if buf is not None:
                handed_on = self._promote(plan, buf, valid, in_buf)
        finally:
            with self._lock:
                self._loads_active -= 1
                self._loads_done.notify_all()
                self._settle_load(plan, valid, corrupt)
                deepest = max((r.tier for r in plan.runs), default=0)
                self.stats[deepest].load_latency_s.append(time.perf_counter() - submitted)
            if buf is not None and not handed_on:
                self._buffers.release(buf)
        return valid * self.bpb

    def _copy_in(
        self,
        plan: LoadPlan,
        pool_ids: list[int],
        copies: list[Piece],
        valid: int,
        from_memory: list[tuple[int, int]],
        after: Any,
    ) -> int:
        """Copy the pieces of the valid prefix into the pool; the prefix loaded (0 when
        the copy failed: the pool blocks' contents are then undefined)."""
        if not valid:
            return 0
        copies = [(pos, rows[: max(0, valid - pos)]) for pos, rows in copies if pos < valid]
        t0 = time.perf_counter()
        try:
            self._data.unpack(pool_ids[:valid], copies, after)
        except (BackendError, RuntimeError, IndexError) as exc:
            logger.warning("load of %d blocks failed (%s); a miss", valid, exc)
            return 0
        if from_memory:
            seconds = (time.perf_counter() - t0) / len(from_memory)
            with self._lock:
                for t, count in from_memory:
                    stats = self.stats[t]
                    stats.read_seconds += seconds
                    stats.bytes_read += count * self.bpb
        return valid

    def _promote(self, plan: LoadPlan, buf: torch.Tensor, valid: int, in_buf: list[bool]) -> bool:
        """Queue the write of the valid promoted blocks into their reserved first-tier
        slots, on the first tier's store lane: the load is done once the blocks are in
        the pool, and the engine must not wait for a copy it does not need. The blocks
        are in the staging buffer now and nowhere else fast: when they are its leading
        rows (all of a load from below, the usual case) the write takes the buffer over
        (``True``: the caller must not release it); otherwise they are copied out."""
        if not plan.promote_keys:
            return False
        pos = {k: i for i, k in enumerate(plan.keys)}
        rows = [pos[k] for k in plan.promote_keys]
        # Only blocks that went through the buffer can be written from it: one copied
        # straight from a memory tier into the pool is not promoted (it is fast where
        # it is).
        keep = [i for i, r in enumerate(rows) if r < valid and in_buf[r]]
        write = _Write(
            0,
            [plan.promote_keys[i] for i in keep],
            [plan.promote_slots[i] for i in keep],
            evicted=plan.promote_evicted,
            submitted=time.perf_counter(),
        )
        handed_on = False
        if keep and [rows[i] for i in keep] == list(range(len(keep))):
            write.buf = buf[: len(keep)]
            handed_on = True
        elif keep:
            write.buf = self._buffers.acquire(len(keep))
            torch.index_select(buf, 0, torch.tensor([rows[i] for i in keep]), out=write.buf)
        kept = set(keep)
        dropped = [plan.promote_keys[i] for i in range(len(rows)) if i not in kept]
        plan.promote_keys = []
        with self._lock:
            self.tiers[0].manager.complete_store(dropped, success=False)
            self.stats[0].promotions += len(keep)
        if self._workers[0].submit_store(lambda: self._run_write(write), _ignore_result) is None:
            self._run_write(write)  # the lane is full or closing: write it here
        return handed_on

    def _settle_load(self, plan: LoadPlan, valid: int, corrupt: dict[int, list[BlockKey]]) -> None:
        """Books for a finished or cancelled load (under the lock): unpin, touch the
        loaded prefix, drop corrupt blocks, count hits; admission-triggered copies."""
        if plan.settled:
            return
        plan.settled = True
        if plan.promote_keys:  # never written: cancelled, or the job failed early
            self.tiers[0].manager.complete_store(plan.promote_keys, success=False)
            plan.promote_keys = []
        loaded = plan.keys[:valid]
        for run in plan.runs:
            tier = self.tiers[run.tier]
            keys = plan.keys[run.start : run.stop]
            tier.manager.complete_load(keys)
            tier.manager.touch(keys[: max(0, valid - run.start)])
        for t, bad in corrupt.items():
            self._drop_corrupt(t, bad)
        if self._prefetched:
            for key in loaded:
                if key in self._prefetched:
                    del self._prefetched[key]
                    self.prefetch_stats.hits += 1
        # Each requested block is a hit in the tier that served it and a miss in every
        # tier above; one not served is a miss in every tier.
        reached = plan.requested
        for t, stats in enumerate(self.stats):
            served = sum(max(0, min(r.stop, valid) - r.start) for r in plan.runs if r.tier == t)
            stats.hits += served
            stats.misses += reached - served
            reached -= served
        self._count_hits(loaded)

    def _unpin(self, plan: LoadPlan) -> None:
        """Settle a plan without a load (under the lock): unpin, count nothing."""
        if plan.settled:
            return
        plan.settled = True
        if plan.promote_keys:
            self.tiers[0].manager.complete_store(plan.promote_keys, success=False)
            plan.promote_keys = []
        for run in plan.runs:
            self.tiers[run.tier].manager.complete_load(plan.keys[run.start : run.stop])

    def _count_hits(self, loaded: Sequence[BlockKey]) -> None:
        """Remember load counts for the admission filter; queue write-through copies of
        blocks that just reached a lower tier's ``admit_after_hits``."""
        if not loaded:
            return
        counts = self._hit_counts
        for key in loaded:
            counts[key] = counts.get(key, 0) + 1
            counts.move_to_end(key)
        while len(counts) > HIT_COUNTS:
            counts.popitem(last=False)
        for t in range(1, len(self.tiers)):
            cfg = self.tier_configs[t]
            if cfg.admit_after_hits and cfg.write_policy == "write_through":
                ready = [k for k in loaded if counts[k] == cfg.admit_after_hits]
                src = self.tiers[t - 1].manager
                ready = [k for k in ready if (s := src.state(k)) is not None and s.ref_cnt >= 0]
                if ready:
                    self._queue_copy(t, ready, src_tier=t - 1)


def _ignore_result(result: JobResult) -> None:
    """Cascade jobs report through the tiers' counters, not through results."""
