"""The Offloader's jobs: what runs on the lane threads, moving one order's bytes.

Each job takes one order from :mod:`kvoffload.books` (a :class:`~kvoffload.plans.Write`
into a tier, a :class:`~kvoffload.plans.LoadPlan`), moves its bytes through
:mod:`kvoffload.datapath` and the tiers' backends, and returns one outcome
(:class:`~kvoffload.plans.WriteOutcome`, :class:`~kvoffload.plans.LoadOutcome`): what
landed, what proved corrupt, its I/O's times and health, and the buffers the next
orders may take over. It never calls the books: the order carries everything it needs,
and the facade (:mod:`kvoffload.offloader`) hands the outcome to ``Books.settle`` and
queues the orders that come back (:meth:`Jobs.stage` cuts their bytes out of the
outcome's buffers). So a job runs, and is tested, on real tiers and a real pool with
no books at all (``tests/core/test_jobs.py``). It holds no state of its own beyond
references to those parts, and :class:`~kvoffload.inflight.LoadsInFlight`, through
which copies into a persistent tier let the engine's loads go first; cutting the
buffers the next orders take over is :mod:`kvoffload.staging`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

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
from kvoffload.inflight import LOAD_PRIORITY_WAIT_S as LOAD_PRIORITY_WAIT_S
from kvoffload.inflight import LoadsInFlight
from kvoffload.keys import BlockKey
from kvoffload.plans import Copy, LoadOutcome, LoadPlan, Tally, Write, WriteOutcome
from kvoffload.staging import Staging
from kvoffload.tier import Tier
from kvoffload.transfer import JobResult

logger = logging.getLogger(__name__)

DIRECT_MIN_BYTES = 1 << 20
"""Blocks from this size up are copied between a memory tier and the pool run by run
of consecutive slots however scattered; smaller ones only when the runs are few (one
call per run costs tens of microseconds on the host)."""


class Jobs:
    """Job bodies over ``tiers`` (see the module docstring). A read slower than
    ``load_timeout_s`` counts as a failure of its tier (for the breaker)."""

    def __init__(
        self,
        tiers: list[Tier],
        configs: list[TierConfig],
        data: DataPath,
        *,
        load_timeout_s: float = 10.0,
        loads: LoadsInFlight | None = None,
    ) -> None:
        self.tiers = tiers
        self.tier_configs = configs
        self._data = data
        self._buffers = data.buffers
        self.staging = Staging(data.buffers)
        self.load_timeout_s = load_timeout_s
        self.loads = loads if loads is not None else LoadsInFlight()
        self.bpb = data.bpb

    # -- the next orders' bytes (kvoffload/staging.py) ---------------------------------
    def stage(self, orders: list[Copy], sources: dict[str, Any]) -> None:
        """Give each order its rows of an outcome's buffers (:meth:`Staging.stage
        <kvoffload.staging.Staging.stage>`), releasing those no order took over."""
        self.staging.stage(orders, sources)

    def release(self, w: Write) -> None:
        """Release the buffer of an order that will not run."""
        self.staging.release(w)

    # -- the store path (job bodies run on lane threads) -------------------------------
    def write(self, w: Write, gate: StoreGate | None = None) -> WriteOutcome:
        """Fill the tier from the write's source, after reading out what it displaces
        (``w.evicted``, when ``w.demote``); the outcome, whatever happened (an exception
        is in ``error``, for the caller to raise once it is settled).

        ``gate`` (an engine store's): entered before the engine's blocks are read and
        released once they are, so the engine can take them back before a slow tier
        has finished writing; a write whose gate was abandoned reads nothing and fails.

        One copy where the tier or the source is plain memory (:meth:`_pieces`): the
        engine's blocks are gathered straight into the tier's rows, a prefetch reads
        straight into them, and a copy down reads straight out of the tier above.
        Otherwise the bytes go through one staging buffer, which the outcome hands on
        (``buf``) for a write-through copy into the next tier."""
        n = len(w.keys)
        out = WriteOutcome(w, [True] * n)
        try:
            self._write(w, gate, out)
        except BaseException as exc:  # settled all the same, then raised by the caller
            out.error = exc
            out.failed = True
            out.ok = [False] * n
            if out.buf is not None:
                self._buffers.release(out.buf)
                out.buf = None
        finally:
            if gate is not None:
                gate.release()
        if w.tier > 0 and n:  # a lower tier's write raised, or went through
            out.tally.health.append((w.tier, not out.failed))
        return out

    def _write(self, w: Write, gate: StoreGate | None, out: WriteOutcome) -> None:
        tier, bpb = self.tiers[w.tier], self.bpb
        n = len(w.keys)
        if n and tier.backend.persistent and w.tier > 0:
            self.loads.wait()
        buf: torch.Tensor | None = w.buf
        w.buf = None
        if buf is not None:
            out.buf = buf  # the outcome owns it from here on
        into = self._pieces(w.tier, w.slots) if buf is None and n else None
        src_tier = w.src_tier if w.pool_ids is None else None
        out_of = (
            self._pieces(src_tier, w.src_slots)
            if buf is None and n and into is None and src_tier is not None
            else None
        )
        if into is not None or out_of is not None:
            # Straight into (or out of) a tier's rows: read what they displace first.
            self._read_evicted(w, out)
            if w.released:
                tier.backend.released(w.released)
            t0 = time.perf_counter()
            if into is not None and w.pool_ids is not None:
                self._pack(w, into, gate)
            elif into is not None:
                assert w.src_tier is not None
                assert w.src_slots is not None
                got = self._read_pieces(w.src_tier, w.src_slots, w.keys, into, out.tally)
                self._verified(out, got)
            else:
                assert out_of is not None
                for pos, rows in out_of:
                    count = rows.shape[0]
                    sizes = tier.backend.write(
                        w.slots[pos : pos + count], w.keys[pos : pos + count], rows
                    )
                    self._charged(out, range(pos, pos + count), sizes)
            seconds = time.perf_counter() - t0
            if into is None:
                seconds += self._throttle(w.tier, n * bpb, seconds)
            out.tally.writes.append((w.tier, seconds))
            return
        if buf is None and n:
            buf = out.buf = self._buffers.acquire(n)
            if w.pool_ids is not None:
                self._pack(w, [(0, buf)], gate)
            else:
                assert w.src_tier is not None
                assert w.src_slots is not None
                got = self._read(w.src_tier, w.src_slots, w.keys, buf, out.tally)
                self._verified(out, got)
        self._read_evicted(w, out)
        if w.released:  # read (if wanted) above: their space may serve this write
            tier.backend.released(w.released)
        good = [i for i in range(n) if out.ok[i]]
        if good:
            assert buf is not None
            src = buf if len(good) == n else buf[torch.tensor(good)]
            t0 = time.perf_counter()
            sizes = tier.backend.write(
                [w.slots[i] for i in good], [w.keys[i] for i in good], src.contiguous()
            )
            self._charged(out, good, sizes)
            seconds = time.perf_counter() - t0
            seconds += self._throttle(w.tier, len(good) * bpb, seconds)
            out.tally.writes.append((w.tier, seconds))

    @staticmethod
    def _charged(out: WriteOutcome, positions: Iterable[int], got: list[int] | None) -> None:
        """A budgeted tier's answer to a write of the keys at ``positions``: their
        charges into the outcome, and a block it found no room for (0) not landed."""
        if got is None:
            return
        if out.charges is None:
            out.charges = [0] * len(out.write.keys)
        for i, size in zip(positions, got, strict=True):
            out.charges[i] = size
            if size <= 0:
                out.ok[i] = False
                out.unplaced += 1

    @staticmethod
    def _verified(out: WriteOutcome, got: list[bool] | None) -> None:
        """The source read's per-block validity into the outcome (``None``: an I/O
        error, every block lost but none proven corrupt)."""
        keys = out.write.keys
        out.ok = got if got is not None else [False] * len(keys)
        if got is not None:
            out.corrupt = [k for k, good in zip(keys, got, strict=True) if not good]

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
        self,
        t: int,
        slots: Sequence[int],
        keys: Sequence[BlockKey],
        into: Sequence[Piece],
        tally: Tally,
    ) -> list[bool] | None:
        """Read ``slots`` of tier ``t`` straight into ``into``'s rows: per-block
        validity, or ``None`` after an I/O error (as :meth:`_read`)."""
        ok: list[bool] = []
        for pos, rows in into:
            count = rows.shape[0]
            got = self._read(t, slots[pos : pos + count], keys[pos : pos + count], rows, tally)
            if got is None:
                return None
            ok.extend(got)
        return ok

    def _read_evicted(self, w: Write, out: WriteOutcome) -> None:
        """Read the blocks a write displaces that the next tier takes (``w.evicted``,
        when ``w.demote``: decided when the write was planned), before the write
        overwrites their slots, into ``out.demoted`` (those read: ``out.evicted``);
        nothing if there are none, or none could be read."""
        if not w.demote or not w.evicted:
            return
        keys = [k for k, _ in w.evicted]
        buf = self._buffers.acquire(len(keys))
        try:
            got = self._read(w.tier, [s for _, s in w.evicted], keys, buf, out.tally)
        except BaseException:
            self._buffers.release(buf)
            raise
        ok = got if got is not None else [False] * len(keys)
        if not all(ok):
            keys = [k for k, good in zip(keys, ok, strict=True) if good]
            if not keys:
                self._buffers.release(buf)
                return
            demote = self.staging.cut(buf, [i for i, good in enumerate(ok) if good], keep=False)
            self._buffers.release(buf)
            buf = demote
        out.demoted, out.evicted = buf, keys

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
        tally: Tally,
    ) -> list[bool] | None:
        """Read into ``buf``: per-block validity, or ``None`` after an I/O error (a
        miss, but no proof the stored blocks are bad, so they are not dropped). Its
        time, bytes and health go into ``tally``."""
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
        tally.reads.append((t, seconds, nbytes))
        if t > 0:
            # A read slower than the load timeout failed whoever waited for it: it
            # counts against the tier, so a hanging disk trips the breaker too.
            tally.health.append((t, ok is not None and seconds <= self.load_timeout_s))
        return ok

    def load(
        self,
        plan: LoadPlan,
        pool_ids: list[int],
        submitted: float,
        after: Any = None,
        *,
        layers: LayerProgress | None = None,
        gate: LoadGate | None = None,
    ) -> LoadOutcome:
        """Job body: read the plan's lower-tier runs into one staging buffer (checking
        each block), then copy the valid prefix into the pool in one go: memory-tier
        runs straight from their rows, the rest from the buffer. With ``layers`` the
        copy goes layer by layer, reporting each (a layer-wise load); ``layers`` is
        finished however the job ends, so nobody waits on it past the job. With
        ``gate``, nothing is copied into the pool once the engine has abandoned the
        load (it recomputes those blocks). The outcome, whatever happened (an exception
        is in ``error``); its staging buffer (``buf``) goes on to the promotion of the
        blocks read from below."""
        out = LoadOutcome(plan, submitted)
        try:
            self._load(out, pool_ids, after, layers, gate)
        except BaseException as exc:  # settled all the same, then raised by the caller
            out.error = exc
        finally:
            if layers is not None:
                layers.finish()
        return out

    def _load(
        self,
        out: LoadOutcome,
        pool_ids: list[int],
        after: Any,
        layers: LayerProgress | None,
        gate: LoadGate | None,
    ) -> None:
        plan, n = out.plan, out.plan.hits
        direct = [self._pieces(run.tier, run.slots) for run in plan.runs]
        staged = out.staged = [False] * n  # positions read into the staging buffer
        for run, pieces in zip(plan.runs, direct, strict=True):
            if pieces is None:
                staged[run.start : run.stop] = [True] * (run.stop - run.start)
        buf = out.buf = self._buffers.acquire(n) if any(staged) else None
        copies: list[Piece] = []
        from_memory: list[tuple[int, int]] = []  # (tier, blocks) copied from rows
        valid = 0
        for run, pieces in zip(plan.runs, direct, strict=True):
            if pieces is not None:  # one copy: the tier's memory -> the pool
                copies.extend((run.start + pos, rows) for pos, rows in pieces)
                from_memory.append((run.tier, run.stop - run.start))
                valid = run.stop
                continue
            assert buf is not None
            keys = plan.keys[run.start : run.stop]
            part = self._read(run.tier, run.slots, keys, buf[run.start : run.stop], out.tally)
            if part is None:
                break  # an I/O error: the prefix ends here
            bad = [k for k, good in zip(keys, part, strict=True) if not good]
            good_stop = run.start + part.index(False) if bad else run.stop
            if good_stop > run.start:
                copies.append((run.start, buf[run.start : good_stop]))
            valid = good_stop
            if bad:
                out.corrupt.setdefault(run.tier, []).extend(bad)
                break
        if gate is not None and not gate.enter():
            valid = 0  # abandoned: the engine recomputes these blocks meanwhile
        out.valid = self._copy_in(pool_ids, copies, valid, from_memory, after, out.tally, layers)

    def _copy_in(
        self,
        pool_ids: list[int],
        copies: list[Piece],
        valid: int,
        from_memory: list[tuple[int, int]],
        after: Any,
        tally: Tally,
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
                tally.reads.append((t, seconds, count * self.bpb))
        return valid


def ignore_result(result: JobResult) -> None:
    """Cascade jobs report through the tiers' counters, not through results."""
