"""The scheduler side's questions answered without blocking it (connectors/vllm/answers.py).

A stand-in for the worker's books (its lookups can be made to hang, as one stuck in a
Redis round trip or a frozen disk does) behind a real :class:`Answers`, used directly
(the single-process scheduler) and through a real books server on a real Unix socket
(the multi-process one). No assertion is on elapsed time: each waits, with a hang
guard (``support.waiting``), for the answer the design promises, and the order of the
books' calls shows that nothing outlives its request.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kvoffload.connectors.vllm.answers import Answers
from kvoffload.connectors.vllm.remote import BooksServer, RemoteBooks
from support.waiting import HOLD_LIMIT_S, returns, wait_until

DEADLINE_S = HOLD_LIMIT_S
"""How long a stuck lookup stays stuck (the test frees it sooner), and the remote
scheduler's own deadline (never reached): longer than the hang guards, so that a
call that waited for a stuck lookup is caught as a hang."""


class _Books:
    """The worker's books: a lookup answers 4 at once, or, for a request in
    ``stuck``, once ``free`` is set; every call is logged in order."""

    def __init__(self) -> None:
        self.free = threading.Event()
        self.stuck: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.counters: dict[str, float] = {}
        self._lock = threading.Lock()

    def _log(self, op: str, req_id: str) -> None:
        with self._lock:
            self.calls.append((op, req_id))

    def lookup(self, req_id: str, keys: list[Any]) -> int | None:
        if req_id in self.stuck:
            self.free.wait(DEADLINE_S)
        self._log("lookup", req_id)
        return 4

    def prefetch(self, req_id: str, keys: list[Any]) -> int:
        self._log("prefetch", req_id)
        return 0

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        self._log("plan", req_id)
        return n

    def release(self, req_id: str) -> int:
        self._log("release", req_id)
        return 0

    def sources(self, req_id: str) -> int:
        return 2

    def reset(self) -> int:
        return 0

    def bump(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n


@pytest.fixture
def books() -> Iterator[tuple[_Books, Answers]]:
    stub = _Books()
    answers = Answers(stub, timeout_s=0.2)
    yield stub, answers
    stub.free.set()
    answers.close()


def _until(ask: Any, want: Any) -> list[Any]:
    """Ask until the answer is ``want``; every answer on the way."""
    seen: list[Any] = []

    def answered() -> bool:
        seen.append(ask())
        return bool(seen[-1] == want)

    try:
        wait_until(answered, f"an answer {want!r}", poll=0.01)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; answers: {seen[-5:]}") from None
    return seen


def _wait_for(cond: Any, what: str) -> None:
    wait_until(cond, what, poll=0.01)


def test_a_lookup_is_answered(books: tuple[_Books, Answers]) -> None:
    stub, answers = books
    seen = _until(lambda: answers.lookup("a", []), 4)
    assert set(seen) <= {None, 4}  # "not decided yet" at most, until answered
    assert stub.calls == [("lookup", "a")]
    assert answers.plan(1, "a", 0, 4) == 4
    assert answers.sources("a") == 2
    assert "lookups_given_up" not in stub.counters


def test_a_stuck_lookup_is_a_miss_and_its_late_claim_is_released(
    books: tuple[_Books, Answers],
) -> None:
    """The books hang in a lookup: the scheduler hears "not yet", then a miss after
    ``timeout_s``, and goes on; when the lookup ends at last, the claim it made is
    released right after it, never left pinned."""
    stub, answers = books
    stub.stuck.add("s")
    seen = _until(lambda: answers.lookup("s", []), 0)
    assert set(seen[:-1]) == {None}
    assert stub.counters["lookups_given_up"] == 1
    # Meanwhile another request's lookup waits behind the stuck one: "not yet", then a
    # miss too; questions that need no lookup are answered at once (the stuck lookup
    # is freed only after them).
    assert _until(lambda: answers.lookup("b", []), 0)[-1] == 0
    assert returns(lambda: answers.plan(2, "c", 0, 3), "a plan, a lookup stuck") == 3
    assert returns(lambda: answers.sources("c"), "the sources, a lookup stuck") == 2
    stub.free.set()
    _wait_for(
        lambda: ("release", "s") in stub.calls and ("release", "b") in stub.calls,
        "both late claims released",
    )
    for req in ("s", "b"):
        assert stub.calls.index(("lookup", req)) < stub.calls.index(("release", req))
    # Healthy again: the next lookup is answered.
    assert _until(lambda: answers.lookup("d", []), 4)[-1] == 4


def test_a_release_during_its_lookup_comes_after_it(books: tuple[_Books, Answers]) -> None:
    """A request aborted while its lookup runs: the release waits for the lookup, so
    the claim that lookup makes is the one released."""
    stub, answers = books
    stub.stuck.add("r")
    assert returns(lambda: answers.lookup("r", []), "a lookup, the books stuck") is None
    returns(lambda: answers.release("r"), "a release, its lookup stuck")
    assert ("release", "r") not in stub.calls
    stub.free.set()
    _wait_for(lambda: ("release", "r") in stub.calls, "the release after the lookup")
    assert stub.calls == [("lookup", "r"), ("release", "r")]


def test_a_prefetch_on_arrival_never_waits(books: tuple[_Books, Answers]) -> None:
    """A prefetch on arrival, while the lookup thread is stuck, is queued behind the
    stuck lookup, not waited for: the lookup is freed only after it returned."""
    stub, answers = books
    stub.stuck.add("p")
    # The lookup thread is now stuck.
    assert returns(lambda: answers.lookup("p", []), "a lookup, the books stuck") is None
    assert returns(lambda: answers.prefetch("q", []), "a prefetch, a lookup stuck") == 0
    stub.free.set()
    _wait_for(lambda: ("prefetch", "q") in stub.calls, "the queued prefetch")


def test_through_the_books_server_the_scheduler_never_times_out(
    books: tuple[_Books, Answers],
) -> None:
    """Multi-process: the books server answers through :class:`Answers`, so a lookup
    stuck in a tier leaves the server free to answer; the scheduler's own deadline
    (``RemoteBooks.timeouts``) is never reached, the lookup is a miss all the same."""
    stub, answers = books
    stub.stuck.add("s")
    engine_id = f"answers-{uuid.uuid4().hex[:8]}"
    server = BooksServer(SimpleNamespace(answer=answers.answer), engine_id, 0)  # type: ignore[arg-type]
    remote = RemoteBooks(engine_id, 1, timeout_s=DEADLINE_S)
    try:
        assert _until(lambda: remote.lookup("s", []), 0)[-1] == 0
        assert remote.sources("s") == 2
        assert remote.timeouts == 0
        assert stub.counters["lookups_given_up"] == 1
    finally:
        stub.free.set()
        for conn in remote.conns:
            conn.close()
        server.close()
