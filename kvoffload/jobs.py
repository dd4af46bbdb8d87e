"""The Offloader's jobs: what runs on the lane threads, joining books and data path.

Each job takes an order from :mod:`kvoffload.books` (a write into a tier, a load plan, a
prefetch), moves its bytes through :mod:`kvoffload.datapath` and the tiers' backends,
and hands the outcome back to the books, queueing the cascade copies the books order
in return. It holds no state of its own beyond references to those parts: the facade
(:mod:`kvoffload.offloader`) submits jobs, the books keep the state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.books import Books
from kvoffload.config import TierConfig
from kvoffload.datapath import (
    DataPath,
    LayerProgress,
    LoadGate,
    Piece,
    StoreAbandonedError,
    StoreGate,
    groups,
)
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.plans import Copy, LoadPlan, Prefetch, Write
from kvoffload.tier import Tier
from kvoffload.transfer import JobResult, TransferWorker

logger = logging.getLogger(__name__)

DIRECT_MIN_BYTES = 1 << 20
"""Blocks from this size up are copied between a memory tier and the pool run by run
of consecutive slots however scattered; smaller ones only when the runs are few (one
call per run costs tens of microseconds on the host)."""


class Jobs:
    """Job bodies over ``tiers`` (see the module docstring); ``workers[t]`` is tier
    ``t``'s lanes."""

    def __init__(
        self,
        tiers: list[Tier],
        configs: list[TierConfig],
        books: Books,
        data: DataPath,
        workers: list[TransferWorker],
    ) -> None:
        self.tiers = tiers
        self.tier_configs = configs
        self._books = books
        self._data = data
        self._buffers = data.buffers
        self._workers = workers
        self.bpb = data.bpb

    # -- orders from the books -----------------------------------------------------------
    def queue(
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
                lambda w=w: self.write(w),  # type: ignore[misc]
                ignore_result,
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
    def write(self, w: Write, gate: StoreGate | None = None) -> int:
        """Fill the tier from the write's source, after reading out what it displaces;
        then settle the books and queue the next tier's copies.

        ``gate`` (an engine store's): entered before the engine's blocks are read and
        released once they are, so the engine can take them back before a slow tier
        has finished writing; a write whose gate was abandoned reads nothing and fails.

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
                    self._pack(w, into, gate)
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
                    self._pack(w, [(0, buf)], gate)
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
            if gate is not None:
                gate.release()
            if w.tier > 0 and n:  # a lower tier's write raised, or went through
                self._books.health(w.tier, written)
            has_buf = buf is not None and n > 0 and written
            orders, handed_on = self._books.settle_write(
                w,
                ok if written else [False] * n,
                failed=not written,
                demoted=demote_buf is not None,
                written_buf=has_buf,
            )
            self.queue(orders, buf if handed_on else None, demote_buf)
            if buf is not None and n and not handed_on:
                self._buffers.release(buf)
        return sum(ok) * bpb

    def _pack(self, w: Write, into: Sequence[Piece], gate: StoreGate | None) -> None:
        """Gather the engine's blocks of ``w`` into ``into``, unless the engine has
        stopped waiting for this store (``gate``)."""
        assert w.pool_ids is not None
        if gate is not None and not gate.enter():
            raise StoreAbandonedError(
                f"store of {len(w.keys)} blocks not begun by the engine's deadline "
                "(store_timeout_ms): abandoned, the engine has its blocks back"
            )
        self._data.pack(w.pool_ids, into, w.after)
        if gate is not None:
            gate.release()

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
        seconds = time.perf_counter() - t0
        nbytes = sum(ok) * self.bpb if ok is not None else 0
        self._books.count_read(t, seconds, nbytes)
        if t > 0:
            # A read slower than the load timeout failed whoever waited for it: it
            # counts against the tier, so a hanging disk trips the breaker too.
            self._books.health(t, ok is not None and seconds <= self._books.load_timeout_s)
        return ok

    def prefetch(self, p: Prefetch) -> int:
        """Job body: copy the blocks up (the write reads and verifies its source, drops
        what is corrupt from it, and makes the rest ready in the first tier)."""
        if not self._books.prefetch_starts(p):
            return 0  # cancelled before it ran
        t0 = time.perf_counter()
        nbytes = 0
        try:
            nbytes = self.write(p.write)
        finally:
            self._books.settle_prefetch(p, time.perf_counter() - t0)
        return nbytes

    def load(
        self,
        plan: LoadPlan,
        pool_ids: list[int],
        submitted: float,
        after: Any = None,
        *,
        layers: LayerProgress | None = None,
        gate: LoadGate | None = None,
    ) -> int:
        """Job body: read the plan's lower-tier runs into one staging buffer (checking
        each block), then copy the valid prefix into the pool in one go: memory-tier
        runs straight from their rows, the rest from the buffer. With ``layers`` the
        copy goes layer by layer, reporting each (a layer-wise load); ``layers`` is
        finished however the job ends, so nobody waits on it past the job. With
        ``gate``, nothing is copied into the pool once the engine has abandoned the
        load (it recomputes those blocks)."""
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
            if gate is not None and not gate.enter():
                valid = 0  # abandoned: the engine recomputes these blocks meanwhile
            valid = self._copy_in(pool_ids, copies, valid, from_memory, after, layers=layers)
            if buf is not None:
                handed_on = self._promote(plan, buf, valid, in_buf)
        finally:
            if layers is not None:
                layers.finish()
            orders = self._books.settle_load(plan, valid, corrupt, submitted)
            self.queue(orders)
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
        *,
        layers: LayerProgress | None = None,
    ) -> int:
        """Copy the pieces of the valid prefix into the pool; the prefix loaded (0 when
        the copy failed: the pool blocks' contents are then undefined). With ``layers``,
        layer by layer (:meth:`~kvoffload.datapath.DataPath.unpack_layers`)."""
        if not valid:
            return 0
        copies = [(pos, rows[: max(0, valid - pos)]) for pos, rows in copies if pos < valid]
        t0 = time.perf_counter()
        try:
            if layers is not None:
                self._data.unpack_layers(pool_ids[:valid], copies, after, layers.layer_done)
            else:
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
        if self._workers[0].submit_store(lambda: self.write(write), ignore_result) is None:
            self.write(write)  # the lane is full or closing: write it here
        return handed_on


def ignore_result(result: JobResult) -> None:
    """Cascade jobs report through the tiers' counters, not through results."""
