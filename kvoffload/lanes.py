"""The lanes: each tier's transfer threads, and the loop that joins the books and the jobs.

An order goes to a lane; its job (:mod:`kvoffload.jobs`) returns an outcome;
``Books.settle`` books it and returns the next orders, which go to their lanes
(:meth:`Lanes.settle`): the next tier's copies to that tier's store lane, their bytes
cut out of the settled job's buffers, and the discards of blocks dropped for good
carried out right there, on the lane that settled them, once the books' lock is
released. So a job takes the books' lock twice, once planned and once settled, and
never holds it across I/O. The Offloader (:mod:`kvoffload.offloader`) submits the
engine's stores and loads and the claims' prefetches through here.
"""

from __future__ import annotations

import time
from typing import Final

from kvoffload.books import Books
from kvoffload.config import TierConfig
from kvoffload.datapath import LayerProgress, LoadGate, StoreGate
from kvoffload.inflight import LoadsInFlight
from kvoffload.jobs import Jobs, ignore_result
from kvoffload.plans import Copy, Discard, LoadPlan, Outcome, Prefetch, Write, WriteOutcome
from kvoffload.transfer import TransferWorker

MAX_INFLIGHT_LOADS: Final = 64
COPY_THREADS: Final = 2
"""Threads draining a lower tier's store lane. Its jobs are independent copies into
distinct slots, so two may run at once: one's fdatasync and bookkeeping overlap the
other's I/O, and the disk sees twice the queue depth. The first tier has one per
lane on a host pool and two on a GPU pool (see :func:`open_workers`)."""


def open_workers(configs: list[TierConfig], cuda: bool, into: list[TransferWorker]) -> None:
    """One :class:`~kvoffload.transfer.TransferWorker` per tier, appended to ``into``
    as each starts (so the caller can shut down those that did if one fails)."""
    for cfg in configs:
        first = not into
        into.append(
            TransferWorker(
                max_inflight_stores=cfg.max_pending_stores,
                max_inflight_loads=MAX_INFLIGHT_LOADS,
                # The first tier: one thread per lane on a host pool (its copies use
                # both cores already), two on a GPU, so that one job's Python runs
                # while the other's copies are on the bus.
                store_threads=COPY_THREADS if not first or cuda else 1,
                load_threads=COPY_THREADS if first and cuda else 1,
                name=f"kvoffload-{cfg.name}",
            )
        )


class Lanes:
    """The job bodies as the lanes run them, each settled and its orders queued (see
    the module docstring). ``workers[t]`` is tier ``t``'s lane pair."""

    def __init__(
        self,
        books: Books,
        jobs: Jobs,
        workers: list[TransferWorker],
        loads: LoadsInFlight,
        bytes_per_block: int,
    ) -> None:
        self._books = books
        self._jobs = jobs
        self._workers = workers
        self._loads = loads
        self.bpb = bytes_per_block

    def write(self, w: Write, gate: StoreGate | None = None) -> int:
        """Job body of a write (an engine store, a cascade copy, a promotion)."""
        return self.settle(self._jobs.write(w, gate))

    def load(
        self,
        plan: LoadPlan,
        ids: list[int],
        submitted: float,
        after: object,
        layers: LayerProgress | None,
        gate: LoadGate | None,
    ) -> int:
        """Job body of a load (begun in :class:`LoadsInFlight` by its submitter)."""
        try:
            out = self._jobs.load(plan, ids, submitted, after, layers=layers, gate=gate)
        finally:
            self._loads.end()
        return self.settle(out)

    def prefetch(self, p: Prefetch) -> int:
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
        return self.settle(out)

    def settle(self, out: Outcome) -> int:
        """Settle a job's outcome and carry out the orders that come back: discards
        first, here (the books' lock released; their slots wait for them), then the
        copies, queued; the job's bytes (or its exception, raised now that its books
        are straight)."""
        orders = self._books.settle(out)
        self._books.discard([o for o in orders if isinstance(o, Discard)])
        copies = [o for o in orders if isinstance(o, Copy)]
        if isinstance(out, WriteOutcome):
            self.queue(copies, {"written": out.buf, "demoted": out.demoted})
            nbytes = sum(out.ok) * self.bpb
        else:
            self.queue(copies, {"loaded": out.buf})
            nbytes = out.valid * self.bpb
        if out.error is not None:
            raise out.error
        return nbytes

    def queue(self, orders: list[Copy], sources: dict[str, object]) -> None:
        """Queue copies on their tiers' store lanes, their bytes cut out of the settled
        job's buffers (``sources``). A copy the lane refuses is undone; a load's
        promotion is written here instead (it reserved its slots already)."""
        self._jobs.stage(orders, sources)
        for order in orders:
            w = order.write
            job = self._workers[w.tier].submit_store(
                lambda w=w: self.write(w),  # type: ignore[misc]
                ignore_result,
            )
            if job is not None:
                continue
            if order.source == "loaded":
                self.write(w)  # the lane is full or closing: write it here
            else:
                self._books.abort_write(w)
                self._jobs.release(w)
