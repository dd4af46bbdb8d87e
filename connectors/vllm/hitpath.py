"""The hit path, timed phase by phase, and where each hit loads: in the step or behind it.

A tier hit reaches its first token through five phases, all seen from the scheduler
side (vLLM's scheduler thread), each summed into a counter (``hit_<phase>_seconds``,
with ``hits_timed`` the hits that reached their first step's output):

- ``lookup``: its first lookup to the last, whose hit vLLM allocated blocks for (the
  worker's claim, with the prefetches from a lower tier it waits for, the books' round
  trips, and any steps the request waited for free blocks in vLLM's pool);
- ``schedule``: that answer to the step that carries its load (vLLM's allocation and
  the plan: normally the same scheduler call);
- ``load``: a background load, from that step to the step output reporting it received
  (``finished_recving``); an in-step load has none here: its copy is inside its step,
  timed on the worker (``in_step_load_seconds``, ``layer_wait_seconds``);
- ``requeue``: a background load, from received to the step that computes the request;
- ``step``: the step that computes it, scheduling to output (its first token).

The choice, per hit, when ``async_load_min_bytes`` is not set: the one that delays
the requests least in total, by measurement.

- In the step, the copy delays every request of that step: ``(running + 1) x copy``.
- In the background, the arrival waits for its load and its requeue (``wait``: the
  measured ``load`` + ``requeue`` of earlier background hits, one step until there is
  one), and each running request for whatever the load adds to the steps it runs in
  (``extra``: how much longer a step carrying a background load took than a plain
  one; 0 until measured). On a GPU the copy is DMA and ``extra`` stays near 0; on a
  CPU engine the copy takes cores from the forward pass, and ``extra`` says how much.

So a hit loads in the step when ``(running + 1) x copy <= wait + running x extra``.
``copy`` is the hit's bytes over the measured in-step copy rate (the worker's
``blocks_loaded_in_step`` over its waits; before any in-step load, the first tier's
store rate: the same copy the other way); ``running`` the requests of the latest step;
a step is a moving average of the engine's decode steps (one token per request: what
the running requests see), of any step carrying no load until there is one. Until the
copy rate and a step are measured, :data:`FALLBACK_ASYNC_BYTES` decides.

Kept apart from :mod:`.scheduler` because it is bookkeeping on times and numbers:
testable with a fake clock and no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

PHASES: Final = ("lookup", "schedule", "load", "requeue", "step")
"""The phases of a hit, in order (module docstring)."""

HIT_COUNTERS: Final[dict[str, str]] = {
    "hits_timed": "Tier hits timed from their first lookup to their first step's output.",
    "hit_lookup_seconds": "Of the timed hits, seconds from the first lookup to the last, "
    "whose hit vLLM allocated blocks for (claim, prefetches from lower tiers, the books' "
    "round trips, and steps spent waiting for free blocks in vLLM's pool).",
    "hit_schedule_seconds": "Of the timed hits, seconds from the answer to the step that "
    "carried the load.",
    "hit_load_seconds": "Of the timed hits loaded in the background, seconds from the step "
    "that carried the load to the step output reporting it received.",
    "hit_requeue_seconds": "Of the timed hits loaded in the background, seconds from "
    "received to the step that computed the request.",
    "hit_step_seconds": "Of the timed hits, seconds of the step that computed the request "
    "(scheduled to output: its first token).",
    "loads_placed_in_step": "Hits placed in the step by measurement (async_load_min_bytes "
    "unset): (running + 1) x copy <= step.",
    "loads_placed_in_background": "Hits placed in the background by measurement.",
}
"""The scheduler side's counters (name: Prometheus help text), reported with vLLM's
connector stats beside the worker's (:data:`.metrics.COUNTERS` includes them)."""

FALLBACK_ASYNC_BYTES: Final = 8 * 1024**2
"""Before the step time and the copy rate are measured: a hit of this many bytes or
more loads in the background (the former fixed default; 8 MiB loaded in 0.85 ms in the
step on a 2-core VM, docs/benchmarks.md)."""
ALPHA: Final = 0.3
"""Weight of a new sample in the step-time and copy-rate estimates."""
MIN_COPY_BYTES: Final = 1 << 20
"""Least bytes copied in one report for a copy-rate sample (less is mostly overhead)."""


@dataclass
class _Hit:
    looked: float
    answered: float | None = None
    sent: float | None = None
    background: bool = False
    received: float | None = None
    computed: float | None = None
    """When the step that computes it was scheduled."""


@dataclass
class _Step:
    sent: float
    background: bool
    """It carried a background load."""
    in_step: bool
    """It carried a load in the step (so it is no plain step either)."""
    decode: bool
    """Every request it scheduled computes one token: the step the running requests
    see when nothing arrives (a prefill chunk's step says nothing about them)."""
    empty: bool
    """It scheduled nothing (vLLM steps while requests wait for loads or lookups):
    no sample of a step."""
    computing: list[_Hit]
    """Timed hits this step computes (their first step): held here, since a request
    of one token ends (``request_finished``) before vLLM asks for the step's stats."""


class HitPath:
    """One engine's hit timings and load placement (see the module docstring). Called
    from vLLM's scheduler thread only: no lock."""

    def __init__(
        self,
        *,
        block_bytes: int,
        first_tier: str,
        async_min_bytes: float | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.block_bytes = block_bytes
        self.first_tier = first_tier
        self.async_min_bytes = async_min_bytes
        """A fixed threshold (``async_load_min_bytes``), or ``None``: placed by measurement."""
        self._clock = clock
        self._hits: dict[str, _Hit] = {}
        self._steps: list[_Step] = []
        self._last_done: float | None = None
        self.step_s: float | None = None
        """Moving average of a step carrying no load, scheduling to output: a decode
        step (one token per request) once there has been one, else any."""
        self._any_step_s: float | None = None
        self._decode_s: float | None = None
        self.wait_s: float | None = None
        """Moving average of a background hit's ``load`` + ``requeue``."""
        self.extra_s: float | None = None
        """Moving average of how much longer a step carrying a background load took."""
        self.copy_bps: float | None = None
        """Moving average of the in-step copy rate, bytes per second."""
        self._store_bps: float | None = None
        self.running = 0
        """Requests in the latest step scheduled."""
        self._counts: dict[str, float] = dict.fromkeys(HIT_COUNTERS, 0)
        self._reported: dict[str, float] = dict.fromkeys(HIT_COUNTERS, 0)

    # -- the choice --------------------------------------------------------------------
    def background(self, nbytes: int) -> bool:
        """Whether a hit of ``nbytes`` (on one rank) loads in the background."""
        if self.async_min_bytes is not None:
            return nbytes >= self.async_min_bytes
        rate = self.copy_bps or self._store_bps
        if self.step_s is None or not rate:
            return nbytes >= FALLBACK_ASYNC_BYTES
        wait = self.wait_s if self.wait_s is not None else self.step_s
        extra = self.extra_s or 0.0
        copy = nbytes / rate
        in_step = (self.running + 1) * copy <= wait + self.running * extra
        self._counts["loads_placed_in_step" if in_step else "loads_placed_in_background"] += 1
        return not in_step

    # -- the timeline ------------------------------------------------------------------
    def looked(self, req_id: str) -> None:
        """A lookup of ``req_id`` (its first starts its timeline)."""
        if req_id not in self._hits:
            self._hits[req_id] = _Hit(self._clock())

    def answered(self, req_id: str, background: bool) -> None:
        """The lookup answered a hit that loads in the background or not."""
        hit = self._hits.get(req_id)
        if hit is not None:
            hit.answered = self._clock()
            hit.background = background

    def forget(self, req_id: str) -> None:
        """``req_id`` ended, or its lookup answered no hit: stop timing it."""
        self._hits.pop(req_id, None)

    def step_sent(self, loads: Iterable[str], scheduled: Mapping[str, int]) -> None:
        """A step is scheduled: with ``loads`` (request ids) in its metadata, and
        ``scheduled`` (request id: tokens to compute)."""
        now = self._clock()
        self.running = len(scheduled)
        background = in_step = False
        for req_id in loads:
            hit = self._hits.get(req_id)
            if hit is not None and hit.answered is not None and hit.sent is None:
                hit.sent = now
                background = background or hit.background
                in_step = in_step or not hit.background
        computing = []
        for req_id in scheduled:
            hit = self._hits.get(req_id)
            if hit is None or hit.sent is None or hit.computed is not None:
                continue
            if hit.background and hit.received is None:
                continue
            hit.computed = now
            computing.append(hit)
            del self._hits[req_id]  # timed from here by its step
        tokens = sum(scheduled.values())
        decode = tokens <= len(scheduled)
        self._steps.append(_Step(now, background, in_step, decode, tokens == 0, computing))
        del self._steps[:-8]  # a step whose output never came back

    def step_done(self, received: Iterable[str], stats: Mapping[str, float] | None) -> None:
        """The oldest step in flight has its output: ``received`` are the background
        loads it reports done, ``stats`` the worker's counters since the previous one."""
        now = self._clock()
        for req_id in received:
            hit = self._hits.get(req_id)
            if hit is not None and hit.received is None:
                hit.received = now
        if stats:
            self._copy_sample(stats)
        if not self._steps:
            return
        step = self._steps.pop(0)
        # With asynchronous scheduling a step is scheduled while the previous one runs:
        # the time since the previous output is then its own; when idle, it is not.
        start = step.sent
        if self._last_done is not None and self._last_done > start:
            start = self._last_done
        seconds = now - start
        self._last_done = now
        if not step.empty:
            self._time_step(step, seconds)
        for hit in step.computing:
            self._book(hit, now)

    def _time_step(self, step: _Step, seconds: float) -> None:
        """A step that computed something took ``seconds``: a plain step's time, or,
        carrying a background load, what the load added to it."""
        if not step.background and not step.in_step:
            self._any_step_s = _average(self._any_step_s, seconds)
            if step.decode:
                self._decode_s = _average(self._decode_s, seconds)
            self.step_s = self._decode_s if self._decode_s is not None else self._any_step_s
        elif step.background and step.decode and self.step_s is not None:
            self.extra_s = _average(self.extra_s, max(0.0, seconds - self.step_s))

    def _book(self, hit: _Hit, done: float) -> None:
        assert hit.answered is not None
        assert hit.sent is not None
        assert hit.computed is not None
        c = self._counts
        c["hits_timed"] += 1
        c["hit_lookup_seconds"] += hit.answered - hit.looked
        c["hit_schedule_seconds"] += hit.sent - hit.answered
        if hit.background and hit.received is not None:
            c["hit_load_seconds"] += hit.received - hit.sent
            c["hit_requeue_seconds"] += hit.computed - hit.received
            self.wait_s = _average(self.wait_s, hit.computed - hit.sent)
        c["hit_step_seconds"] += done - hit.computed

    def _copy_sample(self, stats: Mapping[str, float]) -> None:
        """The in-step copy rate from the worker's counters; the first tier's store
        rate stands in until an in-step load is measured."""
        blocks = stats.get("blocks_loaded_in_step", 0)
        seconds = stats.get("in_step_load_seconds", 0) + stats.get("layer_wait_seconds", 0)
        nbytes = blocks * self.block_bytes
        if nbytes >= MIN_COPY_BYTES and seconds > 0:
            self.copy_bps = _average(self.copy_bps, nbytes / seconds)
        written = stats.get(f"tier.{self.first_tier}.bytes_written", 0)
        wrote_s = stats.get(f"tier.{self.first_tier}.write_seconds", 0)
        if written >= MIN_COPY_BYTES and wrote_s > 0:
            self._store_bps = _average(self._store_bps, written / wrote_s)

    def take(self) -> dict[str, float]:
        """The counters since the previous call (those that moved)."""
        delta = {k: v - self._reported[k] for k, v in self._counts.items()}
        self._reported = dict(self._counts)
        return {k: v for k, v in delta.items() if v}


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - ALPHA) * old + ALPHA * sample
