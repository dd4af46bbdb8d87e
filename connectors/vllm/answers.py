"""The scheduler side's questions, answered without ever blocking the scheduler.

A lookup may wait on a tier: the shared (Redis) tier is asked which blocks it holds,
a network round trip bounded only by its ``socket_timeout_ms`` (2 s by default), and a
tier stuck in I/O holds the books' thread as long. Asked inline, that wait would be the
scheduler's: every request of the engine would stall behind one lookup. So lookups
(and prefetches on arrival) run on one thread of their own, and the scheduler waits
for an answer only :data:`INLINE_WAIT_S`. A lookup not answered by then is "not decided
yet" (``None``: vLLM asks again at its next step, the request waiting meanwhile), and
one not answered within ``timeout_s`` (``books_timeout_ms``) is a miss: the request is
computed, and the claim the late lookup makes is released when it ends. A tier that
hangs costs its requests their hits, never the engine its steps.

The other questions (``plan``, ``release``, ``sources``, ``reset``) touch only the
books in memory and are answered at once; a release of a request whose lookup is
still running is done right after that lookup (on its thread), so the claim the
lookup makes cannot outlive the request.

One instance per engine rank, used by the scheduler in the worker's process
(single-process mode) and by the books server for a scheduler in another process
(:mod:`.remote`): in both, the questions are answered the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvoffload.keys import BlockKey

logger = logging.getLogger(__name__)

INLINE_WAIT_S: Final = 0.005
"""Longest the scheduler waits for a lookup in its step before it asks again later."""


class Books(Protocol):
    """What answers the questions, in the worker's memory (:class:`~.shared.Shared`)."""

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None: ...
    def prefetch(self, req_id: str, keys: list[BlockKey]) -> int: ...
    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int: ...
    def release(self, req_id: str) -> int: ...
    def sources(self, req_id: str) -> int: ...
    def reset(self) -> int: ...
    def bump(self, name: str, n: float = 1) -> None: ...


@dataclass
class _Asked:
    future: Future[int | None]
    since: float


class Answers:
    """The questions of :class:`~.shared.Shared`'s scheduler-facing API, answered
    without blocking (see the module docstring)."""

    def __init__(self, shared: Books, timeout_s: float) -> None:
        self.shared = shared
        self.timeout_s = timeout_s
        self._lock = threading.RLock()  # re-entered by callbacks of done futures
        self._asked: dict[str, _Asked] = {}
        """Lookups still running or not yet taken, by request."""
        self._last: dict[str, Future[Any]] = {}
        """The latest lookup or prefetch submitted per request (a release follows it)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-lookup")
        self._running_since: float | None = None
        """When the lookup thread's current job began (``None``: idle)."""
        self._warned = False

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        """``req_id``'s verified hit (pinned), ``None`` while undecided, 0 (a miss)
        once it has waited ``timeout_s``. Each question counts as a lookup
        (``lookups``), answered now or not."""
        self.shared.bump("lookups")
        with self._lock:
            asked = self._asked.get(req_id)
            # Wait in the step only for a new lookup, and only while the thread is not
            # stuck (its current job has run less than the wait): behind quick jobs (a
            # prefetch on arrival) it is answered in this step, behind a job hanging
            # in a tier it is not waited for at all.
            since = self._running_since
            stuck = since is not None and _now() - since > INLINE_WAIT_S
            wait = INLINE_WAIT_S if asked is None and not stuck else 0.0
            if asked is None:
                asked = _Asked(self._submit(req_id, self.shared.lookup, req_id, keys), _now())
                self._asked[req_id] = asked
        try:
            value = asked.future.result(timeout=wait)
        except FutureTimeout:
            if _now() - asked.since < self.timeout_s:
                return None
            self._give_up(req_id, asked)
            return 0
        finally:
            if asked.future.done():
                with self._lock:
                    if self._asked.get(req_id) is asked:
                        del self._asked[req_id]
        return value

    def _give_up(self, req_id: str, asked: _Asked) -> None:
        """A lookup past its time: a miss now, its claim released when it ends."""
        with self._lock:
            if self._asked.get(req_id) is asked:
                del self._asked[req_id]
        self.shared.bump("lookups_given_up")
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvoffload: a lookup of request %s took over %.0f ms (books_timeout_ms): "
                "computed instead; a tier may be hanging (counted in lookups_given_up)",
                req_id,
                self.timeout_s * 1e3,
            )
        asked.future.add_done_callback(lambda _: self.shared.release(req_id))

    def prefetch(self, req_id: str, keys: list[BlockKey]) -> int:
        """Start ``req_id``'s prefetch on arrival; returns at once."""
        self._submit(req_id, self.shared.prefetch, req_id, keys)
        return 0

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        return self.shared.plan(plan_id, req_id, start, n)

    def release(self, req_id: str) -> int:
        """Forget ``req_id``'s claim now, or right after its lookup still running."""
        with self._lock:
            self._asked.pop(req_id, None)
            last = self._last.pop(req_id, None)
        if last is not None and not last.done():
            # On the lookup thread, after it: the callback runs before the next job.
            last.add_done_callback(lambda _: self.shared.release(req_id))
            return 0
        return self.shared.release(req_id)

    def sources(self, req_id: str) -> int:
        return self.shared.sources(req_id)

    def reset(self) -> int:
        return self.shared.reset()

    def answer(self, op: str, arg: Any) -> int | None:
        """One question from the scheduler side, by name."""
        if op == "lookup":
            return self.lookup(*arg)
        if op == "plan":
            return self.plan(*arg)
        if op == "release":
            return self.release(arg)
        if op == "sources":
            return self.sources(arg)
        if op == "prefetch":
            return self.prefetch(*arg)
        if op == "reset":
            return self.reset()
        raise ValueError(f"kvoffload books: unknown question {op!r}")

    def _submit(self, req_id: str, fn: Any, *args: Any) -> Future[Any]:
        with self._lock:
            future: Future[Any] = self._pool.submit(self._timed, fn, *args)
            self._last[req_id] = future
        future.add_done_callback(lambda f: self._forget(req_id, f))
        return future

    def _timed(self, fn: Any, *args: Any) -> Any:
        """Run one job on the lookup thread, noting since when it runs."""
        self._running_since = _now()
        try:
            return fn(*args)
        finally:
            self._running_since = None

    def _forget(self, req_id: str, future: Future[Any]) -> None:
        with self._lock:
            if self._last.get(req_id) is future:
                del self._last[req_id]

    def close(self) -> None:
        """Stop the lookup thread (a lookup stuck in a tier is left to end on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _now() -> float:
    return time.monotonic()
