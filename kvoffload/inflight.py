"""Loads in flight, so that copies into a persistent tier let the engine's loads go first.

A copy down into a disk tier competes with the engine's loads for the same disk; the
engine waits on a load, nobody waits on a copy. So a load (or a prefetch) says when it
begins and ends, and a copy into a persistent tier waits, briefly and bounded, while
any is running (:meth:`LoadsInFlight.wait`). A courtesy between lanes, not
bookkeeping: its own small lock, not the books'.
"""

from __future__ import annotations

import threading
from typing import Final

LOAD_PRIORITY_WAIT_S: Final = 0.02
"""Longest a copy into a persistent tier waits for in-flight loads to finish."""


class LoadsInFlight:
    """Loads (and prefetches) running now, so that a copy into a persistent tier can
    let the disk serve them first (:meth:`wait`, bounded). Its own small lock, not the
    books': it is a courtesy between lanes, not bookkeeping."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0

    def begin(self) -> None:
        with self._cond:
            self._active += 1

    def end(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def wait(self, timeout: float = LOAD_PRIORITY_WAIT_S) -> None:
        """Wait while loads are in flight, ``timeout`` at most."""
        if not self._active:  # a hint read without the lock: at worst one wait skipped
            return
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0, timeout)

    @property
    def active(self) -> int:
        return self._active
