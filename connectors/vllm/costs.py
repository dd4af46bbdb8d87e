"""Load or recompute: which part of a hit is worth loading, by measurement.

A hit is only worth loading if the load beats recomputing it. From the cpu tier it
always does (a memory copy against a forward pass); from a slow disk, a throttled
volume or a distant shared tier it may not: SGLang HiCache users measured an L3 hit at
2.45 s against 1.73 s of recompute (sgl-project/sglang#26305), and neither HiCache,
LMCache nor Dynamo decides it by measurement. This module keeps two running estimates,
fed by what the worker side sees anyway:

- the engine's prefill throughput (tokens per second), from each step's scheduled
  tokens over the time from its scheduling to its output, which the scheduler side
  measures (a forward pass timed on the worker would be its launch alone on a GPU,
  whose kernels run on after it returns);
- each tier's read throughput (bytes per second), from the Offloader's per-tier
  ``bytes_read`` / ``read_seconds`` counters (prefetches from the lower tiers and
  loads from the cpu tier are both reads);

and answers one question: of a prefix whose blocks sit in these tiers, how long a part
to claim. A block in a lower tier costs its read there plus the copy from the cpu tier;
the part claimed is the prefix that saves the most time over recomputing it (so a cheap
cpu-tier start followed by a slow-tier tail keeps the start). Until both estimates
exist a hit is loaded whole: the choice only ever drops a load it has measured to lose.

An estimate not refreshed for :data:`STALE_S` is forgotten, so a tier that was slow
(and so is no longer read) is measured again by the next load from it, once a while,
instead of being skipped forever after it recovers.

Kept apart from :mod:`.shared` (which applies it to lookups) because it is arithmetic
on numbers: testable without an Offloader, a thread or vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

ALPHA: Final = 0.3
"""Weight of a new sample in an estimate (exponential moving average)."""
STALE_S: Final = 60.0
"""An estimate older than this is dropped (measured again by the next load)."""
MIN_READ_BYTES: Final = 1 << 16
"""Least bytes read in one interval for a tier sample (less is mostly overhead)."""


class Costs:
    """The running estimates of one engine's worker side, and the choice they make.

    Updated from the worker's thread (:meth:`prefill`, :meth:`reads`) and read from the
    thread answering lookups (:meth:`worth`), hence the lock."""

    def __init__(
        self,
        *,
        block_tokens: int,
        block_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._prefill: tuple[float, float] | None = None
        """(tokens per second, when measured)."""
        self._tiers: dict[int, tuple[float, float]] = {}
        """Per tier: (bytes per second read, when measured)."""
        self._seen: dict[int, tuple[int, float]] = {}
        """Per tier: the (bytes_read, read_seconds) counters at the previous sample."""

    def prefill(self, tokens: int, seconds: float) -> None:
        """One step's forward pass computed ``tokens`` in ``seconds``. Steps of less
        than a block are decode steps, whose rate says nothing about a prefill's."""
        if tokens < self.block_tokens or seconds <= 0:
            return
        now = self._clock()
        with self._lock:
            self._prefill = (_average(self._prefill, tokens / seconds, now), now)

    def reads(self, counters: Sequence[tuple[int, float]]) -> None:
        """The tiers' cumulative (``bytes_read``, ``read_seconds``), in tier order: each
        tier's reads since the previous call are one sample of its throughput."""
        now = self._clock()
        with self._lock:
            for t, (nbytes, seconds) in enumerate(counters):
                before = self._seen.get(t)
                if before is not None:
                    dbytes, dseconds = nbytes - before[0], seconds - before[1]
                    if dbytes < MIN_READ_BYTES or dseconds <= 0:
                        continue  # too little read since: keep the older counters
                    self._tiers[t] = (_average(self._tiers.get(t), dbytes / dseconds, now), now)
                self._seen[t] = (nbytes, seconds)

    def estimates(self) -> tuple[float | None, dict[int, float]]:
        """The current estimates: prefill tokens per second, each tier's bytes per
        second (stale ones dropped)."""
        now = self._clock()
        with self._lock:
            prefill = _fresh(self._prefill, now)
            tiers = {t: v for t, e in self._tiers.items() if (v := _fresh(e, now)) is not None}
        return prefill, tiers

    def recompute_seconds(self, blocks: int) -> float | None:
        """How long the engine would take to compute ``blocks`` blocks (``None`` until
        its prefill is measured)."""
        prefill, _ = self.estimates()
        return None if prefill is None else blocks * self.block_tokens / prefill

    def bound(self, t: int, nbytes: int, seconds: float) -> None:
        """Reading ``nbytes`` from tier ``t`` has taken over ``seconds`` and is not done:
        its rate is at most ``nbytes / seconds``. An estimate above that is lowered to
        it (a read that completes later is a sample again)."""
        if t <= 0 or seconds <= 0:
            return
        now = self._clock()
        with self._lock:
            rate = _fresh(self._tiers.get(t), now)
            bounded = nbytes / seconds
            if rate is None or rate > bounded:
                self._tiers[t] = (bounded, now)

    def worth(self, tiers: Sequence[int]) -> int:
        """How many blocks of a prefix held in ``tiers`` (per block, the tier index;
        0 is the cpu tier) to load: the prefix saving the most time over recomputing
        it, the whole one when a rate is not measured yet."""
        prefill, rates = self.estimates()
        if prefill is None or not tiers:
            return len(tiers)
        recompute = self.block_tokens / prefill
        first = rates.get(0)
        copy = self.block_bytes / first if first else 0.0
        best, best_saved, saved = 0, 0.0, 0.0
        for i, t in enumerate(tiers):
            if t == 0:
                load = copy
            else:
                rate = rates.get(t)
                if rate is None:  # not measured (or stale): load it, and so measure it
                    return len(tiers)
                load = self.block_bytes / rate + copy
            saved += recompute - load
            if saved >= best_saved:
                best, best_saved = i + 1, saved
        return best


def _average(old: tuple[float, float] | None, sample: float, now: float) -> float:
    """A moving average of ``sample`` onto ``old`` (restarted when it is stale)."""
    value = _fresh(old, now)
    return sample if value is None else (1 - ALPHA) * value + ALPHA * sample


def _fresh(estimate: tuple[float, float] | None, now: float) -> float | None:
    """The value of ``estimate`` (value, when) unless it is older than :data:`STALE_S`."""
    if estimate is None or now - estimate[1] > STALE_S:
        return None
    return estimate[0]


MAX_STEPS_IN_FLIGHT: Final = 4
"""Steps scheduled and not yet done that the prefill timing tracks (vLLM's asynchronous
scheduling keeps one ahead; more means a step's output never came back to us)."""


class PrefillClock:
    """The scheduler side's prefill samples for :meth:`Costs.prefill`: each step timed
    from its scheduling to its output. That is its whole cost, its forward pass and the
    device's synchronisation included, and no idle time (a forward pass timed on the
    worker would be its launch alone on a GPU, and the gap between two steps'
    scheduling holds the idle time before a new request). Called from vLLM's scheduler
    thread only: no lock."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._in_flight: list[tuple[float, int]] = []
        """Steps scheduled whose output is not in yet: when, and their tokens."""
        self._sample: tuple[int, float] | None = None
        """The last step timed as a prefill sample, for the next step's metadata."""

    def scheduled(self, tokens: int) -> tuple[int, float] | None:
        """Note a step of ``tokens`` scheduled now, and hand over the last step timed,
        if it was a prefill sample, for the worker side (its estimates live there,
        beside the lookups that use them)."""
        self._in_flight.append((time.perf_counter(), tokens))
        del self._in_flight[:-MAX_STEPS_IN_FLIGHT]
        sample, self._sample = self._sample, None
        return sample

    def done(self) -> None:
        """A step's output is in. With asynchronous scheduling a step is scheduled
        before the previous one's output is in: the oldest step scheduled is the one
        done. Steps of less than a block (decodes) are no prefill sample."""
        if not self._in_flight:
            return
        scheduled, tokens = self._in_flight.pop(0)
        if tokens >= self.block_size:
            self._sample = (tokens, time.perf_counter() - scheduled)
