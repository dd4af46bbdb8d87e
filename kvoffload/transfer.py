"""The transfer worker: moves KV bytes between tiers off the engine's step.

Runs on the worker side, next to the KV tensors. The engine thread (or an asyncio
connector) hands it *jobs*: a ``fn: Callable[[], int]`` that does one transfer (gather
from the block pool and ``Backend.write``, or ``Backend.read`` and scatter) and returns
the bytes moved. The interface is submit / poll / wait:

- ``submit_store(fn)`` / ``submit_load(fn)``: queue a job and return its id at once, or
  ``None`` when that direction already has ``max_inflight_*`` jobs queued or running
  ("can't" is a value: the caller counts a dropped store, or a miss);
- ``get_finished()``: drain the :class:`JobResult` of every job finished so far;
- ``wait(job_ids, timeout)``: block until the given jobs finish and take their results;
- ``run_store(fn)`` / ``run_load(fn)``: the same for asyncio callers, awaited.

Each result is delivered exactly once: through ``get_finished`` or ``wait`` for jobs
submitted with ``submit_*``, through the awaited coroutine for jobs run with
``run_*``. A job that raises becomes a failed result; no exception from a job ever
reaches the caller's thread.

Ordering: each direction is one *lane*, a FIFO queue drained by its own thread, so jobs
of one direction run and finish in submission order (a load lane that reorders would
scatter blocks of a prefix out of order; a store lane that reorders could let a later
write of a slot land before an earlier one). The one exception is opt-in:
``store_threads=N`` drains the store lane with N threads, for owners whose store jobs
are independent of each other (the Offloader's copies into a disk tier, each into its
own slots): jobs then start in order but may finish out of order, and N of them keep
the disk's queue N times deeper. ``load_threads=N`` does the same for loads whose jobs
are independent (each into its own blocks): on a GPU, one job's bookkeeping then runs
while the other's copies are on the bus. Stores and loads have separate lanes, so
a load, which the engine is waiting for, never queues behind a burst of stores, which
nobody is waiting for.

Why threads and not an asyncio loop: the jobs are blocking syscalls (``pwritev``,
``preadv``, ``fdatasync``, LMDB transactions) and torch copies, all of which release
the GIL. A thread per lane runs them directly; an event loop would have to hand each
one to an executor thread anyway (``aiofiles`` does exactly that), adding a loop hop
and a future per job for no concurrency gained. The asyncio face (``run_*``) is only a
bridge for callers who live in a loop: the job still runs on the lane thread, and its
result is passed back with ``loop.call_soon_threadsafe``.

CUDA: this module does not touch streams or events. The hook is the job itself: on a
GPU worker, ``fn`` queues its device<->host copies on its direction's CUDA stream
(:mod:`kvoffload.datapath`) and waits for an event recorded after them before
returning, so that "finished" means the bytes have landed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Literal, get_args

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]
DIRECTIONS: Final[tuple[Direction, ...]] = get_args(Direction)

TransferFn = Callable[[], int]
"""A job: does one transfer, blocking, and returns the number of bytes it moved."""

REJECTED_ERROR: Final = "rejected: queue full"
CANCELLED_ERROR: Final = "cancelled: worker shut down"


@dataclass(frozen=True, slots=True)
class JobResult:
    """How one job ended."""

    job_id: int
    direction: Direction
    success: bool
    nbytes: int
    """Bytes the job reported moving; 0 when it failed."""
    seconds: float
    """Time the job's ``fn`` ran on its lane (queueing excluded); 0.0 if it never ran."""
    error: str | None
    """``"ExcType: message"`` for a job that raised, else one of :data:`REJECTED_ERROR`
    and :data:`CANCELLED_ERROR`; ``None`` on success."""


@dataclass(frozen=True, slots=True)
class LaneStats:
    """Counters of one direction since the worker started.

    ``submitted`` counts accepted jobs only, so at any time
    ``submitted == succeeded + failed + pending``. Jobs cancelled by
    ``shutdown(wait=False)`` count as failed; submissions refused because the lane was
    full or the worker shut down count as ``rejected``.
    """

    submitted: int = 0
    rejected: int = 0
    succeeded: int = 0
    failed: int = 0
    nbytes: int = 0
    """Bytes moved by succeeded jobs."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """A consistent snapshot of both lanes' counters."""

    store: LaneStats
    load: LaneStats


@dataclass(slots=True)
class _Job:
    job_id: int
    fn: TransferFn
    on_done: Callable[[JobResult], None] | None
    """Set for jobs of the asyncio face: their result goes there, not to ``_finished``."""


@dataclass(slots=True)
class _Lane:
    """One direction: its FIFO queue, its thread and its counters (all under the worker's
    lock)."""

    direction: Direction
    max_inflight: int
    work: threading.Condition
    """Signalled when a job is queued or the worker shuts down."""
    queue: deque[_Job]
    threads: list[threading.Thread] = field(default_factory=list)
    inflight: int = 0  # queued + running
    submitted: int = 0
    rejected: int = 0
    succeeded: int = 0
    failed: int = 0
    nbytes: int = 0

    def stats(self) -> LaneStats:
        return LaneStats(self.submitted, self.rejected, self.succeeded, self.failed, self.nbytes)


def _resolve(fut: asyncio.Future[JobResult], result: JobResult) -> None:
    # Runs on the event loop. The awaiting task may have been cancelled meanwhile; the
    # job ran anyway (a thread cannot be interrupted) and its result is dropped.
    if not fut.done():
        fut.set_result(result)


class TransferWorker:
    """Two FIFO lanes (stores, loads), one thread each. See the module docstring.

    Thread-safe: every method may be called from any thread. One lock guards the queues,
    counters and finished results; it is held only for O(1) bookkeeping, never while a
    job runs, so submitting never waits for a transfer.
    """

    def __init__(
        self,
        *,
        max_inflight_stores: int = 64,
        max_inflight_loads: int = 64,
        store_threads: int = 1,
        load_threads: int = 1,
        name: str = "kvoffload-transfer",
    ) -> None:
        for arg, value in (
            ("max_inflight_stores", max_inflight_stores),
            ("max_inflight_loads", max_inflight_loads),
            ("store_threads", store_threads),
            ("load_threads", load_threads),
        ):
            if value < 1:
                raise ValueError(f"TransferWorker: {arg} = {value}; it must be at least 1")
        self.name = name
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        """Signalled whenever a job finishes (for :meth:`wait`)."""
        self._ids = itertools.count(1)
        self._closed = False
        self._outstanding: set[int] = set()  # ids queued or running, from both lanes
        self._finished: dict[int, JobResult] = {}  # job id -> result, in finishing order
        self._warned: set[type[BaseException]] = set()  # exception types already logged
        self._lanes: dict[Direction, _Lane] = {
            direction: _Lane(direction, limit, threading.Condition(self._lock), deque())
            for direction, limit in zip(
                DIRECTIONS, (max_inflight_stores, max_inflight_loads), strict=True
            )
        }
        try:
            for lane in self._lanes.values():
                for k in range(store_threads if lane.direction == "store" else load_threads):
                    # Daemon: a worker the owner forgot to shut down must not keep the
                    # process alive. Stores interrupted that way are torn writes, which
                    # the disk tiers' checksummed headers already reject on reopen.
                    thread = threading.Thread(
                        target=self._run_lane,
                        args=(lane,),
                        name=f"{name}-{lane.direction}-{k}",
                        daemon=True,
                    )
                    thread.start()
                    lane.threads.append(thread)  # only once started: shutdown() joins it
        except BaseException:
            # "can't start new thread" for the second lane must not leak the first.
            self.shutdown(wait=False)
            raise

    # -- submit / poll / wait -----------------------------------------------------
    def submit_store(
        self, fn: TransferFn, on_done: Callable[[JobResult], None] | None = None
    ) -> int | None:
        """Queue a store job; its id, or ``None`` if the store lane is full or shut down
        (the caller drops the store).

        With ``on_done``, the result is passed to it on the lane thread (outside the
        worker's lock) instead of being kept for :meth:`get_finished` / :meth:`wait`:
        for jobs nobody polls, such as a tier cascade's internal copies."""
        return self._submit("store", fn, on_done)

    def submit_load(
        self, fn: TransferFn, on_done: Callable[[JobResult], None] | None = None
    ) -> int | None:
        """Queue a load job; its id, or ``None`` if the load lane is full or shut down
        (the caller treats the blocks as a miss). ``on_done`` as in :meth:`submit_store`."""
        return self._submit("load", fn, on_done)

    def get_finished(self) -> list[JobResult]:
        """Take the results of all jobs finished since the last call (never blocks).

        Within one direction, results come in submission order (for the store lane,
        only with ``store_threads=1``). Results already taken by
        :meth:`wait`, and those of ``run_*`` jobs, are not repeated here."""
        with self._lock:
            results = list(self._finished.values())
            self._finished.clear()
        return results

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until every job in ``job_ids`` has finished, or ``timeout`` seconds pass;
        take and return the results of those that finished, in the order asked.

        Taking means each result is delivered once: what ``wait`` returns will not come
        out of :meth:`get_finished`, and an id whose result was already taken (or that
        was never submitted) is not waited for and yields nothing. Do not wait from
        inside a job on a job of the same lane: that lane is busy running the waiter.
        """
        wanted = list(dict.fromkeys(job_ids))  # dedupe, keep order
        deadline = None if timeout is None else time.monotonic() + timeout
        k = 0  # wanted[:k] are no longer outstanding
        with self._lock:
            while True:
                # Ids are never reused, so a finished id stays finished and the scan
                # only moves forward: O(len(wanted)) in all, however often we wake.
                while k < len(wanted) and wanted[k] not in self._outstanding:
                    k += 1
                if k == len(wanted):
                    break
                if deadline is None:
                    self._done.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._done.wait(remaining)
            return [self._finished.pop(i) for i in wanted if i in self._finished]

    def pending(self, direction: Direction) -> int:
        """Jobs of ``direction`` queued or running."""
        lane = self._lane(direction)
        with self._lock:
            return lane.inflight

    def stats(self) -> TransferStats:
        """Counters of both lanes, taken together under the lock."""
        with self._lock:
            return TransferStats(self._lanes["store"].stats(), self._lanes["load"].stats())

    # -- asyncio face -------------------------------------------------------------
    async def run_store(self, fn: TransferFn) -> JobResult:
        """Run a store job on the store lane and await its result without blocking the
        event loop. A full lane gives a failed result with :data:`REJECTED_ERROR`."""
        return await self._run_async("store", fn)

    async def run_load(self, fn: TransferFn) -> JobResult:
        """Run a load job on the load lane and await its result without blocking the
        event loop. A full lane gives a failed result with :data:`REJECTED_ERROR`."""
        return await self._run_async("load", fn)

    async def _run_async(self, direction: Direction, fn: TransferFn) -> JobResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[JobResult] = loop.create_future()

        def deliver(result: JobResult) -> None:  # on the lane thread
            try:
                loop.call_soon_threadsafe(_resolve, fut, result)
            except RuntimeError:
                # The loop closed while the job ran: nobody is left to await it.
                logger.debug(
                    "%s job %d finished after its event loop closed", direction, result.job_id
                )

        job_id = self._submit(direction, fn, deliver)
        if job_id is None:
            # A fresh id, so results stay unique; it was never queued, so ``wait`` on it
            # returns at once.
            with self._lock:
                rejected_id = next(self._ids)
            return JobResult(rejected_id, direction, False, 0, 0.0, REJECTED_ERROR)
        return await fut

    # -- shutdown -----------------------------------------------------------------
    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting jobs and join the lane threads; later submissions get ``None``.

        ``wait=True`` runs every queued job first. ``wait=False`` finishes queued jobs
        at once as failed results with :data:`CANCELLED_ERROR` (delivered like any
        result); a job already running cannot be interrupted, so the join still waits
        for it. Idempotent. It blocks, so asyncio callers should run it with
        ``asyncio.to_thread``.
        """
        cancelled: list[tuple[_Lane, _Job]] = []
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                if not wait:
                    cancelled.extend((lane, job) for job in lane.queue)
                    lane.queue.clear()
                lane.work.notify_all()
        for lane, job in cancelled:
            self._publish(
                lane,
                job,
                JobResult(job.job_id, lane.direction, False, 0, 0.0, CANCELLED_ERROR),
                None,
            )
        current = threading.current_thread()
        for lane in self._lanes.values():
            for thread in lane.threads:
                # A job calling shutdown() runs on a lane thread, which cannot join itself.
                if thread is not current:
                    thread.join()

    def __enter__(self) -> TransferWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(wait=True)

    # -- internals ----------------------------------------------------------------
    def _lane(self, direction: Direction) -> _Lane:
        lane = self._lanes.get(direction)
        if lane is None:
            raise ValueError(
                f"unknown transfer direction {direction!r}; expected one of {DIRECTIONS}"
            )
        return lane

    def _submit(
        self, direction: Direction, fn: TransferFn, on_done: Callable[[JobResult], None] | None
    ) -> int | None:
        lane = self._lane(direction)
        with self._lock:
            if self._closed or lane.inflight >= lane.max_inflight:
                lane.rejected += 1
                return None
            job_id = next(self._ids)
            lane.queue.append(_Job(job_id, fn, on_done))
            lane.inflight += 1
            lane.submitted += 1
            self._outstanding.add(job_id)
            lane.work.notify()
        return job_id

    def _run_lane(self, lane: _Lane) -> None:
        """The lane thread: run queued jobs one at a time, in order, until shut down and
        drained."""
        while True:
            with self._lock:
                while not lane.queue and not self._closed:
                    lane.work.wait()
                if not lane.queue:
                    return  # shut down, nothing left
                job = lane.queue.popleft()
            result, exc = self._execute(lane.direction, job)
            self._publish(lane, job, result, exc)

    @staticmethod
    def _execute(direction: Direction, job: _Job) -> tuple[JobResult, BaseException | None]:
        start = time.perf_counter()
        try:
            nbytes = job.fn()
            if not isinstance(nbytes, int):
                raise TypeError(f"transfer job returned {type(nbytes).__name__}, not int bytes")
        except BaseException as exc:
            # This is the boundary that swallows tier errors: everything, BaseException
            # included, becomes a failed result, because a lane thread that died would
            # leave every later job of its direction (and any wait() on them) hanging.
            seconds = time.perf_counter() - start
            error = f"{type(exc).__name__}: {exc}"
            return JobResult(job.job_id, direction, False, 0, seconds, error), exc
        seconds = time.perf_counter() - start
        return JobResult(job.job_id, direction, True, nbytes, seconds, None), None

    def _publish(
        self, lane: _Lane, job: _Job, result: JobResult, exc: BaseException | None
    ) -> None:
        """Count a finished job and hand its result to whoever will take it."""
        first_of_type = False
        with self._lock:
            lane.inflight -= 1
            if result.success:
                lane.succeeded += 1
                lane.nbytes += result.nbytes
            else:
                lane.failed += 1
            if exc is not None and type(exc) not in self._warned:
                self._warned.add(type(exc))
                first_of_type = True
            if job.on_done is None:
                self._finished[job.job_id] = result
            # Discarded only now, after the result is in ``_finished``, so a waiter never
            # sees the job as neither outstanding nor finished.
            self._outstanding.discard(job.job_id)
            self._done.notify_all()
        if first_of_type:
            # Once per exception type: a failing tier fails every job, and one traceback
            # says what thousands of identical lines would.
            logger.warning(
                "%s: %s job %d failed: %s (further %s failures are counted, not logged)",
                self.name,
                lane.direction,
                job.job_id,
                result.error,
                type(exc).__name__,
                exc_info=exc,
            )
        if job.on_done is not None:
            # Outside the lock: the callback reaches into an event loop.
            job.on_done(result)
