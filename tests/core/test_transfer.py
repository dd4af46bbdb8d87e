"""The transfer worker with real threads: per-lane order, load priority, bounded
queues, failures as results, exactly-once delivery, shutdown and the asyncio face."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from support.waiting import HANG_S, returns, wait_until

from kvoffload.transfer import (
    CANCELLED_ERROR,
    REJECTED_ERROR,
    Direction,
    JobResult,
    TransferWorker,
)

NAME = "kvoffload-transfer-test"
BLOCK = 4096


# Thread checks compare sets, not counts: a thread left by an earlier test may end
# while this one runs, which must not read as a leak, or hide one.
def _worker_threads(name: str = NAME) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


@pytest.fixture
def worker() -> Iterator[TransferWorker]:
    baseline = set(threading.enumerate())
    w = TransferWorker(name=NAME)
    yield w
    w.shutdown(wait=True)
    assert _worker_threads() == []
    assert set(threading.enumerate()) <= baseline  # nothing started here is left


def _submit(w: TransferWorker, direction: Direction, fn: Callable[[], int]) -> int | None:
    return w.submit_store(fn) if direction == "store" else w.submit_load(fn)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets blocked jobs go at teardown (before ``worker``'s shutdown joins them), so a
    failing assertion fails fast instead of hanging on the join."""
    event = threading.Event()
    yield event
    event.set()


@contextlib.contextmanager
def _releasing(event: threading.Event) -> Iterator[threading.Event]:
    """:func:`release` for a worker made in the test body: list it after the worker."""
    try:
        yield event
    finally:
        event.set()


def _blocked(release: threading.Event, started: threading.Event | None = None) -> Callable[[], int]:
    """A job that holds its lane until ``release`` is set."""

    def fn() -> int:
        if started is not None:
            started.set()
        assert release.wait(HANG_S), "test never released the job"
        return BLOCK

    return fn


def _sleeping(seconds: float, nbytes: int = BLOCK) -> Callable[[], int]:
    def fn() -> int:
        time.sleep(seconds)
        return nbytes

    return fn


def _drain(w: TransferWorker, n: int) -> list[JobResult]:
    """Poll ``get_finished`` until ``n`` results came out (the engine's way to consume)."""
    results: list[JobResult] = []

    def all_out() -> bool:
        results.extend(w.get_finished())
        return len(results) >= n

    wait_until(all_out, f"{n} results out of get_finished", poll=0.001)
    return results


# -- ordering and priority ------------------------------------------------------------
@pytest.mark.parametrize("direction", ["store", "load"])
def test_jobs_of_one_direction_run_and_report_in_submission_order(
    worker: TransferWorker, direction: Direction
) -> None:
    rng = random.Random(7)
    ran: list[int] = []

    def job(i: int, delay: float) -> Callable[[], int]:
        def fn() -> int:
            time.sleep(delay)  # uneven durations: a pool would finish these out of order
            ran.append(i)
            return i

        return fn

    ids = [_submit(worker, direction, job(i, rng.uniform(0, 0.003))) for i in range(50)]
    assert None not in ids
    results = _drain(worker, 50)

    assert ran == list(range(50))
    assert [r.job_id for r in results] == ids
    assert [r.nbytes for r in results] == list(range(50))
    assert all(r.success and r.direction == direction for r in results)


def test_load_does_not_queue_behind_a_long_store(
    worker: TransferWorker, release: threading.Event
) -> None:
    """A load submitted while a store runs, which ends only once the test releases it
    (after the load's result is in), finishes first: a load queued behind the store
    would never finish before the release."""
    done: list[str] = []
    started = threading.Event()

    def long_store() -> int:
        started.set()
        assert release.wait(HANG_S), "test never released the store"
        done.append("store")
        return BLOCK

    def load() -> int:
        done.append("load")
        return BLOCK

    store_id = worker.submit_store(long_store)
    assert store_id is not None
    assert started.wait(HANG_S)
    load_id = worker.submit_load(load)
    assert load_id is not None

    loaded = worker.wait([load_id], timeout=HANG_S)
    assert loaded, "the load waited for the store (a hang)"
    assert loaded[0].success
    # The store lane is still busy with the job submitted first.
    assert worker.pending("store") == 1
    assert done == ["load"]

    release.set()
    [store_result] = worker.wait([store_id], timeout=HANG_S)
    assert store_result.success
    assert done == ["load", "store"]


# -- bounded in-flight -------------------------------------------------------------------
def test_full_lane_rejects_without_blocking_and_counts_it() -> None:
    # prepare 4 stores that hold the lane (1 running + 3 queued) -> the 5th..10th are
    # refused; loads have their own bound and still go through.
    started = threading.Event()
    with (
        TransferWorker(max_inflight_stores=4, max_inflight_loads=2, name=NAME) as w,
        _releasing(threading.Event()) as release,
    ):
        accepted = [w.submit_store(_blocked(release, started))]
        assert started.wait(HANG_S)
        accepted += [w.submit_store(_blocked(release)) for _ in range(3)]
        # "Can't" is answered at once: a submit that waited for room would wait for
        # `release`, which comes only after these checks.
        refused = returns(
            lambda: [w.submit_store(_blocked(release)) for _ in range(6)], "submits to a full lane"
        )
        assert None not in accepted
        assert refused == [None] * 6
        assert w.pending("store") == 4

        load_id = w.submit_load(lambda: BLOCK)
        assert load_id is not None
        assert w.wait([load_id], timeout=HANG_S)[0].success

        stats = w.stats()
        assert (stats.store.submitted, stats.store.rejected) == (4, 6)
        assert (stats.load.submitted, stats.load.rejected) == (1, 0)

        release.set()
        results = w.wait([i for i in accepted if i is not None], timeout=HANG_S)
        assert [r.success for r in results] == [True] * 4
        assert w.pending("store") == 0
        # Room again once the lane drained.
        assert w.submit_store(lambda: 0) is not None
    stats = w.stats()
    assert (stats.store.submitted, stats.store.succeeded, stats.store.failed) == (5, 5, 0)
    assert stats.store.nbytes == 4 * BLOCK


# -- failures are results ------------------------------------------------------------
def test_raising_job_becomes_a_failed_result_and_the_lane_keeps_going(
    worker: TransferWorker, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> int:
        raise OSError(28, "No space left on device")

    def not_bytes() -> int:
        return None  # type: ignore[return-value]  # a buggy job, on purpose

    caplog.set_level(logging.WARNING, logger="kvoffload.transfer")
    ids = [worker.submit_store(broken) for _ in range(3)]
    ids += [worker.submit_store(not_bytes), worker.submit_store(lambda: BLOCK)]
    results = worker.wait([i for i in ids if i is not None], timeout=HANG_S)  # no exception

    assert len(results) == 5
    for r in results[:3]:
        assert not r.success
        assert r.nbytes == 0
        assert r.error == "OSError: [Errno 28] No space left on device"
    assert not results[3].success
    assert results[3].error is not None
    assert results[3].error.startswith("TypeError: ")
    assert results[4].success
    assert results[4].nbytes == BLOCK

    # One warning per exception type, not one per failed job.
    warned = [r for r in caplog.records if r.name == "kvoffload.transfer"]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.WARNING]
    assert "OSError" in warned[0].getMessage()
    assert "TypeError" in warned[1].getMessage()
    stats = worker.stats()
    assert (stats.store.succeeded, stats.store.failed) == (1, 4)
    assert _worker_threads() != []  # both lanes still alive


def test_bad_arguments_are_caller_errors() -> None:
    with pytest.raises(ValueError, match="max_inflight_loads = 0"):
        TransferWorker(max_inflight_loads=0, name=NAME)
    assert _worker_threads() == []  # nothing was started
    with TransferWorker(name=NAME) as w, pytest.raises(ValueError, match="sideways"):
        w.pending("sideways")  # type: ignore[arg-type]


# -- wait / get_finished: exactly once ---------------------------------------------------
def test_wait_with_timeout_returns_only_finished_jobs(
    worker: TransferWorker, release: threading.Event
) -> None:
    fast = worker.submit_load(lambda: 1)
    slow = worker.submit_store(_blocked(release))
    assert fast is not None
    assert slow is not None

    # `slow` ends only once released below: the wait can only have ended by its timeout
    # (a wait that ignored the timeout would never end).
    results = returns(lambda: worker.wait([fast, slow], timeout=0.2), "wait with a timeout")
    assert [r.job_id for r in results] == [fast]
    assert worker.pending("store") == 1  # `slow` still runs

    assert worker.get_finished() == []  # fast was taken by wait
    release.set()
    assert [r.job_id for r in _drain(worker, 1)] == [slow]
    # Both already delivered: nothing left to wait for, and wait does not block (with
    # no timeout, a wait that blocked would never end).
    assert returns(lambda: worker.wait([fast, slow]), "wait for delivered jobs") == []


def test_each_result_is_delivered_once_through_wait_or_get_finished() -> None:
    with TransferWorker(max_inflight_stores=200, max_inflight_loads=200, name=NAME) as w:
        _deliver_each_once(w)


def _deliver_each_once(worker: TransferWorker) -> None:
    rng = random.Random(3)
    ids: list[int] = []
    for i in range(200):
        job_id = _submit(worker, rng.choice(["store", "load"]), _sleeping(0, i))
        assert job_id is not None
        ids.append(job_id)
    waited = worker.wait(ids[::3] + ids[::3], timeout=HANG_S)  # duplicates asked once
    polled = _drain(worker, len(ids) - len(waited))
    time.sleep(0.05)
    late = worker.get_finished()

    delivered = [r.job_id for r in waited + polled + late]
    assert sorted(delivered) == sorted(ids)
    assert [r.job_id for r in waited] == ids[::3]


def test_concurrent_submitters_keep_the_books_consistent(worker: TransferWorker) -> None:
    # 4 threads x 100 jobs, a third of which fail; every accepted job is delivered once
    # and the counters add up.
    accepted: list[int] = []
    lock = threading.Lock()

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(100):
            fail = rng.random() < 1 / 3

            def fn(fail: bool = fail) -> int:
                if fail:
                    raise RuntimeError("tier went away")
                return BLOCK

            job_id = _submit(worker, rng.choice(["store", "load"]), fn)
            if job_id is not None:
                with lock:
                    accepted.append(job_id)

    threads = [threading.Thread(target=submitter, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = worker.wait(accepted, timeout=HANG_S)

    assert sorted(r.job_id for r in results) == sorted(accepted)
    assert worker.get_finished() == []
    stats = worker.stats()
    for lane in (stats.store, stats.load):
        assert lane.submitted == lane.succeeded + lane.failed
        assert lane.nbytes == lane.succeeded * BLOCK
    assert stats.store.submitted + stats.load.submitted == len(accepted)
    assert stats.store.rejected + stats.load.rejected == 400 - len(accepted)
    assert sum(not r.success for r in results) == stats.store.failed + stats.load.failed


def test_nbytes_and_seconds_are_reported(worker: TransferWorker) -> None:
    """The result's ``seconds`` span the job's run (as the job measured it itself)."""
    ran: list[float] = []

    def slow() -> int:
        t0 = time.perf_counter()
        time.sleep(0.05)
        ran.append(time.perf_counter() - t0)
        return 3 * BLOCK

    job_id = worker.submit_load(slow)
    assert job_id is not None
    [r] = worker.wait([job_id], timeout=HANG_S)
    assert (r.job_id, r.direction, r.success, r.nbytes, r.error) == (
        job_id,
        "load",
        True,
        3 * BLOCK,
        None,
    )
    assert r.seconds >= ran[0] > 0
    assert worker.stats().load.nbytes == 3 * BLOCK


# -- shutdown ----------------------------------------------------------------------------
def test_shutdown_waiting_finishes_queued_jobs_and_leaves_no_threads() -> None:
    baseline = set(threading.enumerate())
    ran: list[int] = []

    def job(i: int) -> Callable[[], int]:
        def fn() -> int:
            time.sleep(0.02)
            ran.append(i)
            return BLOCK

        return fn

    w = TransferWorker(name=NAME)
    assert len(_worker_threads()) == 2
    ids = [w.submit_store(job(i)) for i in range(5)] + [w.submit_load(job(i)) for i in range(5, 8)]
    w.shutdown(wait=True)

    assert _worker_threads() == []
    assert set(threading.enumerate()) <= baseline  # nothing started here is left
    assert sorted(ran) == list(range(8))
    results = w.get_finished()
    assert sorted(r.job_id for r in results) == sorted(i for i in ids if i is not None)
    assert all(r.success for r in results)

    assert w.submit_store(lambda: 0) is None
    assert w.submit_load(lambda: 0) is None
    assert w.stats().store.rejected == 1
    w.shutdown(wait=True)  # twice is fine
    w.shutdown(wait=False)


def test_shutdown_without_waiting_cancels_queued_jobs_as_failed_results() -> None:
    baseline = set(threading.enumerate())
    release, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def queued(i: int) -> Callable[[], int]:
        def fn() -> int:
            ran.append(i)
            return BLOCK

        return fn

    w = TransferWorker(name=NAME)
    running = w.submit_store(_blocked(release, started))
    assert running is not None
    assert started.wait(HANG_S)
    ids = [w.submit_store(queued(i)) for i in range(4)]

    def release_once_cancelled() -> None:
        # The running job cannot be interrupted: it ends once shutdown has cancelled
        # the queued ones (1 job left in flight), never before.
        try:
            wait_until(lambda: w.pending("store") == 1, "the queued jobs cancelled")
        finally:
            release.set()

    releaser = threading.Thread(target=release_once_cancelled)
    releaser.start()
    w.shutdown(wait=False)
    releaser.join()

    assert ran == []  # cancelled jobs never ran
    results = {r.job_id: r for r in w.get_finished()}
    assert results[running].success
    for job_id in ids:
        assert job_id is not None
        r = results.pop(job_id)
        assert (r.success, r.nbytes, r.seconds, r.error) == (False, 0, 0.0, CANCELLED_ERROR)
    assert list(results) == [running]
    stats = w.stats().store
    assert (stats.submitted, stats.succeeded, stats.failed) == (5, 1, 4)
    assert w.pending("store") == 0
    assert _worker_threads() == []
    assert set(threading.enumerate()) <= baseline  # nothing started here is left
    assert w.submit_store(lambda: 0) is None
    w.shutdown(wait=False)


def test_store_threads_run_independent_stores_side_by_side_and_shut_down() -> None:
    """With ``store_threads=2`` a second store starts while the first still runs (the
    first waits for it; on one thread it would time out), and both threads join."""
    second_started = threading.Event()

    def first() -> int:
        if not second_started.wait(timeout=HANG_S):
            raise TimeoutError("the second store never started")
        return 1

    def second() -> int:
        second_started.set()
        return 2

    w = TransferWorker(store_threads=2, name=NAME)
    assert len(_worker_threads()) == 3  # two store threads, one load thread
    a, b = w.submit_store(first), w.submit_store(second)
    assert a is not None
    assert b is not None
    results = {r.job_id: r for r in w.wait([a, b], timeout=HANG_S)}
    assert results[a].success, results[a].error
    assert results[b].success
    w.shutdown(wait=True)
    assert _worker_threads() == []
    with pytest.raises(ValueError, match="store_threads = 0"):
        TransferWorker(store_threads=0)


def test_context_manager_shuts_down_on_exit() -> None:
    with TransferWorker(name=NAME) as w:
        job_id = w.submit_store(_sleeping(0.05))
    assert _worker_threads() == []
    [r] = w.get_finished()
    assert (r.job_id, r.success) == (job_id, True)


# -- asyncio face --------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_run_store_and_run_load_return_results(worker: TransferWorker) -> None:
    stored = await worker.run_store(lambda: BLOCK)
    loaded = await worker.run_load(lambda: 2 * BLOCK)
    assert (stored.direction, stored.success, stored.nbytes) == ("store", True, BLOCK)
    assert (loaded.direction, loaded.success, loaded.nbytes) == ("load", True, 2 * BLOCK)

    def broken() -> int:
        raise ValueError("bad slot")

    failed = await worker.run_load(broken)
    assert (failed.success, failed.error) == (False, "ValueError: bad slot")
    # Delivered to the awaiting coroutine, so not again to the poller.
    assert worker.get_finished() == []


@pytest.mark.asyncio
async def test_concurrent_awaits_all_complete() -> None:
    with TransferWorker(name=NAME) as w:
        runs = [
            w.run_store(_sleeping(0.005, i)) if i % 2 else w.run_load(_sleeping(0.005, i))
            for i in range(20)
        ]
        results = await asyncio.gather(*runs)
    assert [r.nbytes for r in results] == list(range(20))
    assert all(r.success for r in results)
    assert len({r.job_id for r in results}) == 20
    assert w.get_finished() == []


@pytest.mark.asyncio
async def test_event_loop_keeps_running_while_a_job_runs(worker: TransferWorker) -> None:
    """The job ends only once the event loop has ticked 3 times: a ``run_store`` that
    blocked the loop while the job ran would leave it waiting (until it gives up and
    fails)."""
    ticks = 0
    ticked = threading.Event()
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.01)
            ticks += 1
            if ticks == 3:
                ticked.set()

    def job() -> int:
        if not ticked.wait(HANG_S):
            raise TimeoutError("the event loop did not run while the job ran")
        return BLOCK

    task = asyncio.create_task(ticker())
    result = await worker.run_store(job)
    stop.set()
    await task
    assert result.success, result.error
    assert ticks >= 3


@pytest.mark.asyncio
async def test_run_on_a_full_lane_returns_a_rejected_result() -> None:
    started = threading.Event()
    with (
        TransferWorker(max_inflight_loads=1, name=NAME) as w,
        _releasing(threading.Event()) as release,
    ):
        first = asyncio.ensure_future(w.run_load(_blocked(release, started)))
        assert await asyncio.to_thread(started.wait, HANG_S)
        rejected = await w.run_load(lambda: BLOCK)
        release.set()
        accepted = await first
    assert (rejected.success, rejected.nbytes, rejected.error) == (False, 0, REJECTED_ERROR)
    assert rejected.job_id != accepted.job_id
    assert accepted.success
    assert w.stats().load.rejected == 1
    after = await w.run_store(lambda: BLOCK)
    assert after.error == REJECTED_ERROR  # shut down: refused, not raised
