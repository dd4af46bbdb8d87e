"""A backend wrapper that injects faults, for testing what the stack does under them.

Wrap any backend (built-in or third-party) to make its reads and writes fail the way
disks fail while an engine serves: EIO on read or write, ENOSPC, short writes (part
of a batch lands, then the write fails), latency spikes and hangs. Each fault has a
probability per call, drawn from a seeded generator, and :attr:`FaultyBackend.enabled`
turns them all off (the disk "recovers") and on again. :attr:`FaultyBackend.injected`
counts what was injected, so a test can check that a fault it expected did happen.

Used by ``tests/core/test_faults.py``; usable with ``Offloader(..., tiers=...)``::

    tiers = build_tiers(config, layout)
    tiers[1].backend = FaultyBackend(tiers[1].backend, Faults(write_error=0.3))

The wrapper is for persistent tiers (memory does not fail this way), and offers no
``rows``: the data path then stages through a buffer, as it does for every disk tier.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvoffload.backend import Backend, BackendStats, RecoveredBlock
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey


@dataclass
class Faults:
    """Probability of each fault per call (0 to 1), and the delays it injects."""

    read_error: float = 0.0
    """``read`` raises EIO."""
    write_error: float = 0.0
    """``write`` raises EIO before writing anything."""
    enospc: float = 0.0
    """``write`` raises ENOSPC before writing anything."""
    short_write: float = 0.0
    """``write`` writes the first half of the batch, then raises EIO."""
    slow: float = 0.0
    """The call first sleeps :attr:`slow_s` (a latency spike)."""
    slow_s: float = 0.05
    hang: float = 0.0
    """The call first sleeps :attr:`hang_s` (a hang, past any sensible timeout)."""
    hang_s: float = 2.0
    read_hang: float = 0.0
    """``read`` first sleeps :attr:`hang_s` (a disk whose reads hang, its writes not)."""
    seed: int = 0


class FaultyBackend(Backend):
    """``inner`` with :class:`Faults` injected into its reads and writes; everything
    else (slots, recovery, discard, close) is the inner backend's own."""

    persistent: ClassVar[bool] = True

    def __init__(self, inner: Backend, faults: Faults) -> None:
        # Not Backend.__init__: the slots, config and layout are the inner backend's.
        self.inner = inner
        self.config = inner.config
        self.layout = inner.layout
        self.name = inner.name
        self.slots = inner.slots
        self.faults = faults
        self.enabled = True
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    def _draw(self, kind: str, p: float) -> bool:
        if not self.enabled or p <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < p
            if hit:
                self.injected[kind] += 1
        return hit

    def _delays(self) -> None:
        if self._draw("hang", self.faults.hang):
            time.sleep(self.faults.hang_s)
        elif self._draw("slow", self.faults.slow):
            time.sleep(self.faults.slow_s)

    def _fail(self, code: int, what: str) -> BackendError:
        return BackendError(f"tier {self.name!r}: {what}: [Errno {code}] {os.strerror(code)}")

    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        self._delays()
        if self._draw("enospc", self.faults.enospc):
            raise self._fail(errno.ENOSPC, "write (injected)")
        if self._draw("write_error", self.faults.write_error):
            raise self._fail(errno.EIO, "write (injected)")
        if len(slots) > 1 and self._draw("short_write", self.faults.short_write):
            half = len(slots) // 2
            self.inner.write(slots[:half], keys[:half], src[:half])
            raise self._fail(errno.EIO, f"short write (injected) after {half} of {len(slots)}")
        return self.inner.write(slots, keys, src)

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self._delays()
        if self._draw("read_hang", self.faults.read_hang):
            time.sleep(self.faults.hang_s)
        if self._draw("read_error", self.faults.read_error):
            raise self._fail(errno.EIO, "read (injected)")
        return self.inner.read(slots, keys, dst)

    def recover(self) -> list[RecoveredBlock]:
        return self.inner.recover()

    def budget(self) -> tuple[int, int] | None:
        return self.inner.budget()

    def released(self, slots: Sequence[int]) -> None:
        self.inner.released(slots)

    def discard(self, slots: Sequence[int]) -> None:
        self.inner.discard(slots)

    def check(self) -> list[str]:
        return self.inner.check()

    def stats(self, *, held: bool = True) -> BackendStats:
        return self.inner.stats(held=held)

    def close(self) -> None:
        self.inner.close()
