"""Waiting without a speed claim (issue 30): no test asserts on elapsed time.

CI is a loaded 2-core machine, where any step may take seconds, so a test never
fails because something took long. Where a bound matters it asserts an ordering or a
count: what must not wait for a party is checked while that party is still held,
and the test releases it only afterwards, so a call that waited for it would not
return late: it would not return at all. What catches that is a hang guard, a
timeout (:data:`HANG_S`) no working run comes near on the slowest machine:

- :func:`wait_until`: poll for a condition;
- :func:`returns`: a call that must not block, made on a thread;
- :class:`HeldBackend`: a tier whose reads or writes hang until the test releases
  them (in place of a sleep that a slow enough machine could outlast).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Final, TypeVar

import torch

from kvoffload.backend import Backend
from kvoffload.keys import BlockKey
from kvoffload.testing import Faults, FaultyBackend

T = TypeVar("T")

HANG_S: Final = 60.0
"""The hang guards' timeout: only a hang reaches it, never a slow machine."""

HOLD_LIMIT_S: Final = 2 * HANG_S
"""How long a :class:`HeldBackend` call waits for its release before it goes on
anyway (and counts it): longer than any hang guard, so that a guard waiting on it
fires first, and finite, so that a failed test's lanes still end."""


def wait_until(
    predicate: Callable[[], T | None], what: str, timeout: float = HANG_S, poll: float = 0.005
) -> T:
    """Call ``predicate`` every ``poll`` seconds until it returns something true, and
    return that. A hang guard, not a speed claim: the ``AssertionError`` after
    ``timeout`` seconds says that ``what`` never came, not that it came late."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: still not true after {timeout:g} s (a hang)")
        time.sleep(poll)


def returns(call: Callable[[], T], what: str, timeout: float = HANG_S) -> T:
    """``call()``'s value (or its exception), the call made on a daemon thread. A hang
    guard: an ``AssertionError`` if it is still running after ``timeout`` seconds,
    which is meant for a call that, if it blocked at all, would block for good (on a
    party the test releases only later)."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"returns: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{what}: still blocked after {timeout:g} s (a hang)")
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


class HeldBackend(FaultyBackend):
    """``inner`` whose reads (``reads``) and writes (``writes``), while the test holds
    them (:meth:`hold`, :meth:`holding`), wait for :meth:`release`: a disk that hangs
    exactly until the test has checked what must not wait for it.

    :attr:`held` counts the calls that waited, by kind (``"read"``, ``"write"``).
    A held call goes on by itself only after :data:`HOLD_LIMIT_S`, counted in
    :attr:`outlasted`: a test that asserts ``outlasted == 0`` before it releases shows
    that nothing it checked waited for the hold (whatever had, would have let a held
    call run out first). Otherwise the inner backend's own, with ``faults`` injected
    on top (none by default)."""

    def __init__(
        self,
        inner: Backend,
        *,
        reads: bool = True,
        writes: bool = True,
        faults: Faults | None = None,
    ) -> None:
        super().__init__(inner, faults if faults is not None else Faults())
        self.hold_reads = reads
        self.hold_writes = writes
        self.held: Counter[str] = Counter()
        self.outlasted = 0
        self._open = threading.Event()
        self._open.set()
        self._count = threading.Lock()

    def hold(self) -> None:
        """From now on, reads and writes (as chosen) wait for :meth:`release`."""
        self._open.clear()

    def release(self) -> None:
        """Let every held call go on, and the next ones through."""
        self._open.set()

    @contextlib.contextmanager
    def holding(self) -> Iterator[HeldBackend]:
        """Held inside the block, released when it ends, however it ends."""
        self.hold()
        try:
            yield self
        finally:
            self.release()

    def _wait(self, kind: str) -> None:
        if self._open.is_set():
            return
        with self._count:
            self.held[kind] += 1
        if not self._open.wait(HOLD_LIMIT_S):
            with self._count:
                self.outlasted += 1

    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        if self.hold_writes:
            self._wait("write")
        return super().write(slots, keys, src)

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        if self.hold_reads:
            self._wait("read")
        return super().read(slots, keys, dst)
