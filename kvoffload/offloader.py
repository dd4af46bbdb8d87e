"""The Offloader: the configured tiers as one store, moving blocks off the engine step.

Engines and the CLI call it; it owns the tiers (each a backend plus its manager) and
one :class:`~kvoffload.transfer.TransferWorker` per tier. It is a thin facade over two
parts with one role each: :mod:`kvoffload.books` decides what moves where (under one
lock that is never held while bytes move) and :mod:`kvoffload.datapath` moves the
bytes. This module runs the jobs that join them: orders from the books go to the
lanes, the data path and the backends, and outcomes go back to the books.

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
from typing import Any, Final

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.books import Books, Copy, Prefetch, Write
from kvoffload.books import LoadPlan as LoadPlan
from kvoffload.books import PrefetchStats as PrefetchStats
from kvoffload.books import TierStats as TierStats
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.datapath import DataPath, Piece, groups
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.manager import OffloadingEvent
from kvoffload.tier import Tier, build_tiers
from kvoffload.transfer import JobResult, TransferWorker

logger = logging.getLogger(__name__)

MAX_INFLIGHT_LOADS: Final = 64
DIRECT_MIN_BYTES: Final = 1 << 20
"""Blocks from this size up are copied between a memory tier and the pool run by run
of consecutive slots however scattered; smaller ones only when the runs are few (one
call per run costs tens of microseconds on the host)."""
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
        self._buffers = self._data.buffers
        self._closed = False
        self._workers: list[TransferWorker] = []
        self._books = Books(
            [t.manager for t in self.tiers],
            self.tier_configs,
            bytes_per_block=self.bpb,
            persistent=[t.backend.persistent for t in self.tiers],
            prefetch_max_inflight=config.prefetch_max_inflight,
            depth=lambda t: self._workers[t].pending("store"),
            discard=lambda t, slots: self.tiers[t].backend.discard(slots),
        )
        self.stats: list[TierStats] = self._books.stats
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

    # -- engine-facing: lookup, store, load, poll --------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` held ready by some tier."""
        return self._books.lookup(keys)

    def submit_store(self, keys: Sequence[BlockKey], pool_ids: Sequence[int]) -> int | None:
        """Store pool blocks ``pool_ids`` under ``keys`` into the first tier (and from
        there down the chain). Returns a job id to poll, or ``None`` when the store was
        dropped (queue full) or no room could be made; the counts say which. Keys the
        tier already holds are skipped. The pool blocks must stay untouched until the
        job finishes."""
        if len(keys) != len(pool_ids):
            raise ValueError(f"submit_store: {len(keys)} keys but {len(pool_ids)} pool blocks")
        self._need_pool()
        write = self._books.plan_store(keys, pool_ids, time.perf_counter(), self._data.mark())
        if write is None:
            return None
        job = self._workers[0].submit_store(lambda: self._run_write(write))
        if job is None:  # only when shut down: the books checked the depth
            self._books.abort_write(write)
        return job

    def prepare_load(self, keys: Sequence[BlockKey]) -> LoadPlan:
        """Find and pin the longest held prefix of ``keys``; reserve first-tier slots for
        the blocks to promote. Cheap (bookkeeping only); the plan must then be submitted
        or cancelled."""
        return self._books.plan_load(keys)

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
        self._books.load_submitted(plan)
        after = self._data.mark()
        job = self._workers[0].submit_load(lambda: self._run_load(plan, ids, now, after))
        if job is None:
            self._books.cancel_load(plan, submitted=True)
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
            job = self._workers[t].submit_load(lambda p=p: self._run_prefetch(p), _ignore_result)  # type: ignore[misc]
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

    def check(self) -> list[str]:
        """Consistency problems of every tier's books and medium (empty when fine)."""
        with self._books.lock:
            return [
                f"{t.name}: {p}" for t in self.tiers for p in t.manager.check() + t.backend.check()
            ]

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

    # -- orders from the books -----------------------------------------------------------
    def _queue(
        self,
        orders: list[Copy],
        written: torch.Tensor | None = None,
        demoted: torch.Tensor | None = None,
    ) -> None:
        """Queue cascade copies on their tiers' store lanes. An order whose bytes are in
        the written or the demotion buffer gets its rows cut from it; this call owns
        both buffers (an order takes one over, or it is released here)."""
        sources = {"written": written, "demoted": demoted}
        for order in orders:
            w = order.write
            src = sources.get(order.source)
            if src is not None:
                assert w.rows is not None
                w.buf = self._cut(src, w.rows, keep=True)
                if w.buf.data_ptr() == src.data_ptr():
                    sources[order.source] = None  # taken over by the order
                    src = None
            job = self._workers[w.tier].submit_store(
                lambda w=w: self._run_write(w),  # type: ignore[misc]
                _ignore_result,
            )
            if job is None:
                self._books.abort_write(w)
                if w.buf is not None:
                    self._buffers.release(w.buf)
        for left in sources.values():
            if left is not None:
                self._buffers.release(left)

    def _cut(self, buf: torch.Tensor, rows: list[int], *, keep: bool) -> torch.Tensor:
        """``buf``'s ``rows``, in that order: ``buf``'s own leading rows when they are
        (``keep``: the order takes ``buf`` over), else a copy (``buf`` stays with the
        caller, who releases it)."""
        if keep and rows == list(range(len(rows))):
            return buf[: len(rows)]
        sub = self._buffers.acquire(len(rows))
        torch.index_select(buf, 0, torch.tensor(rows, dtype=torch.int64), out=sub)
        return sub

    # -- the store path (job bodies run on lane threads) -------------------------------
    def _run_write(self, w: Write) -> int:
        """Fill the tier from the write's source, after reading out what it displaces;
        then settle the books and queue the next tier's copies.

        One copy where the tier or the source is plain memory (:meth:`_pieces`): the
        engine's blocks are gathered straight into the tier's rows, a prefetch reads
        straight into them, and a copy down reads straight out of the tier above.
        Otherwise the bytes go through one staging buffer."""
        tier, bpb = self.tiers[w.tier], self.bpb
        n = len(w.keys)
        buf: torch.Tensor | None = w.buf
        demote_buf: torch.Tensor | None = None
        ok = [True] * n
        written = False
        try:
            if n and tier.backend.persistent and w.tier > 0:
                self._books.yield_to_loads()
            into = self._pieces(w.tier, w.slots) if buf is None and n else None
            src_tier = w.src_tier if w.pool_ids is None else None
            out_of = (
                self._pieces(src_tier, w.src_slots)
                if buf is None and n and into is None and src_tier is not None
                else None
            )
            if into is not None or out_of is not None:
                # Straight into (or out of) a tier's rows: read what they displace first.
                demote_buf = self._read_evicted(w)
                t0 = time.perf_counter()
                if into is not None and w.pool_ids is not None:
                    self._data.pack(w.pool_ids, into, w.after)
                elif into is not None:
                    assert w.src_tier is not None
                    assert w.src_slots is not None
                    got = self._read_pieces(w.src_tier, w.src_slots, w.keys, into)
                    ok = got if got is not None else [False] * n
                    if got is not None:
                        w.corrupt = [k for k, good in zip(w.keys, got, strict=True) if not good]
                else:
                    assert out_of is not None
                    for pos, rows in out_of:
                        count = rows.shape[0]
                        tier.backend.write(
                            w.slots[pos : pos + count], w.keys[pos : pos + count], rows
                        )
                seconds = time.perf_counter() - t0
                if into is None:
                    seconds += self._throttle(w.tier, n * bpb, seconds)
                self._books.count_write(w.tier, seconds)
                written = True
                return sum(ok) * bpb
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
            demote_buf = self._read_evicted(w)
            good = [i for i in range(n) if ok[i]]
            if good:
                assert buf is not None
                src = buf if len(good) == n else buf[torch.tensor(good)]
                t0 = time.perf_counter()
                tier.backend.write(
                    [w.slots[i] for i in good], [w.keys[i] for i in good], src.contiguous()
                )
                seconds = time.perf_counter() - t0
                seconds += self._throttle(w.tier, len(good) * bpb, seconds)
                self._books.count_write(w.tier, seconds)
            written = True
        finally:
            has_buf = buf is not None and n > 0 and written
            orders, handed_on = self._books.settle_write(
                w,
                ok if written else [False] * n,
                failed=not written,
                demoted=demote_buf is not None,
                written_buf=has_buf,
            )
            self._queue(orders, buf if handed_on else None, demote_buf)
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

    def _read_evicted(self, w: Write) -> torch.Tensor | None:
        """Read the blocks a write displaces, for ``on_evict`` demotion (before the
        write overwrites their slots); ``None`` if the next tier does not want them (or
        they cannot be read). Narrows ``w.evicted`` to the blocks read."""
        if not w.demote:
            return None
        w.evicted = self._books.admitted_demotions(w)
        if not w.evicted:
            return None
        keys = [k for k, _ in w.evicted]
        buf = self._buffers.acquire(len(keys))
        got = self._read(w.tier, [s for _, s in w.evicted], keys, buf)
        ok = got if got is not None else [False] * len(keys)
        if not all(ok):
            w.evicted = [e for e, good in zip(w.evicted, ok, strict=True) if good]
            if not w.evicted:
                self._buffers.release(buf)
                return None
            demote = self._cut(buf, [i for i, good in enumerate(ok) if good], keep=False)
            self._buffers.release(buf)
            buf = demote
        return buf

    def _throttle(self, t: int, nbytes: int, seconds: float) -> float:
        rate = self.tier_configs[t].write_throttle
        if rate is None:
            return 0.0
        extra = nbytes / rate - seconds
        if extra > 0:
            time.sleep(extra)
            return extra
        return 0.0

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
        nbytes = sum(ok) * self.bpb if ok is not None else 0
        self._books.count_read(t, time.perf_counter() - t0, nbytes)
        return ok

    def _run_prefetch(self, p: Prefetch) -> int:
        """Job body: copy the blocks up (the write reads and verifies its source, drops
        what is corrupt from it, and makes the rest ready in the first tier)."""
        if not self._books.prefetch_starts(p):
            return 0  # cancelled before it ran
        t0 = time.perf_counter()
        nbytes = 0
        try:
            nbytes = self._run_write(p.write)
        finally:
            self._books.settle_prefetch(p, time.perf_counter() - t0)
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
            valid = self._copy_in(pool_ids, copies, valid, from_memory, after)
            if buf is not None:
                handed_on = self._promote(plan, buf, valid, in_buf)
        finally:
            orders = self._books.settle_load(plan, valid, corrupt, submitted)
            self._queue(orders)
            if buf is not None and not handed_on:
                self._buffers.release(buf)
        return valid * self.bpb

    def _copy_in(
        self,
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
            for t, count in from_memory:
                self._books.count_read(t, seconds, count * self.bpb)
        return valid

    def _promote(self, plan: LoadPlan, buf: torch.Tensor, valid: int, in_buf: list[bool]) -> bool:
        """Queue the write of the valid promoted blocks into their reserved first-tier
        slots, on the first tier's store lane: the load is done once the blocks are in
        the pool, and the engine must not wait for a copy it does not need. The blocks
        are in the staging buffer now and nowhere else fast: when they are its leading
        rows (all of a load from below, the usual case) the write takes the buffer over
        (``True``: the caller must not release it); otherwise they are copied out."""
        write = self._books.promotion(plan, valid, in_buf)
        if write is None:
            return False
        handed_on = False
        if write.keys:
            assert write.rows is not None
            write.buf = self._cut(buf, write.rows, keep=True)
            handed_on = write.buf.data_ptr() == buf.data_ptr()
        if self._workers[0].submit_store(lambda: self._run_write(write), _ignore_result) is None:
            self._run_write(write)  # the lane is full or closing: write it here
        return handed_on


def _ignore_result(result: JobResult) -> None:
    """Cascade jobs report through the tiers' counters, not through results."""
