"""The hit path's phase timings and the measured in-step / background choice
(``connectors/vllm/hitpath.py``), on a clock the test moves."""

from __future__ import annotations

import pytest
from kvoffload.connectors.vllm.hitpath import FALLBACK_ASYNC_BYTES, MIN_COPY_BYTES, HitPath

MIB = 1024**2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _path(clock: Clock, async_min_bytes: float | None = None) -> HitPath:
    return HitPath(block_bytes=MIB, first_tier="cpu", async_min_bytes=async_min_bytes, clock=clock)


def test_an_in_step_hit_is_timed_lookup_schedule_and_its_step() -> None:
    clock = Clock()
    path = _path(clock)
    path.looked("r")
    clock.now = 0.5
    path.looked("r")  # asked again (a prefetch still running): the first one counts
    clock.now = 1.0
    path.answered("r", background=False)
    clock.now = 3.0
    path.step_sent(["r"], {"r": 5, "a": 1})
    clock.now = 10.0
    path.step_done((), None)
    assert path.take() == {
        "hits_timed": 1,
        "hit_lookup_seconds": 1.0,
        "hit_schedule_seconds": 2.0,
        "hit_step_seconds": 7.0,
    }
    assert path.take() == {}  # deltas: nothing new


def test_a_background_hit_is_timed_through_its_load_and_requeue() -> None:
    clock = Clock()
    path = _path(clock)
    path.looked("r")
    clock.now = 1.0
    path.answered("r", background=True)
    clock.now = 2.0
    path.step_sent(["r"], {"a": 1})  # its load goes out; it computes nothing
    clock.now = 4.0
    path.step_done({"r"}, None)  # finished_recving
    clock.now = 5.0
    path.step_sent([], {"r": 5, "a": 1})
    clock.now = 9.0
    path.step_done((), None)
    assert path.take() == {
        "hits_timed": 1,
        "hit_lookup_seconds": 1.0,
        "hit_schedule_seconds": 1.0,
        "hit_load_seconds": 2.0,
        "hit_requeue_seconds": 1.0,
        "hit_step_seconds": 4.0,
    }


def test_a_background_hit_not_yet_received_is_not_computing() -> None:
    """A step scheduled before the load is received (vLLM would not schedule it, but
    a stale id must not start its step phase) leaves the hit untimed until it is."""
    clock = Clock()
    path = _path(clock)
    path.looked("r")
    path.answered("r", background=True)
    path.step_sent(["r"], {})
    path.step_sent([], {"r": 1})
    path.step_done((), None)
    path.step_done((), None)
    assert path.take() == {}


def test_a_forgotten_hit_is_never_booked() -> None:
    clock = Clock()
    path = _path(clock)
    path.looked("r")
    path.answered("r", background=False)
    path.forget("r")  # aborted before its step
    path.step_sent(["r"], {"r": 5})
    path.step_done((), None)
    assert path.take() == {}


def _measured(path: HitPath, clock: Clock, *, step_s: float, running: int, bps: float) -> None:
    """One step of ``step_s`` with ``running`` requests, whose output reports an
    in-step load at ``bps``."""
    path.step_sent([], {f"q{i}": 1 for i in range(running)})
    clock.now += step_s
    stats = {"blocks_loaded_in_step": 4, "in_step_load_seconds": 4 * MIB / bps}
    path.step_done((), stats)


def test_the_choice_weighs_every_request_of_the_step_against_one_step() -> None:
    """In the step when (running + 1) x copy <= step: 4 running, a 100 ms step and
    1,000 MiB/s: up to 20 MiB (5 x 20 ms = 100 ms) in the step, more in the background."""
    clock = Clock()
    path = _path(clock)
    _measured(path, clock, step_s=0.1, running=4, bps=1000 * MIB)
    assert path.step_s == pytest.approx(0.1)
    assert path.running == 4
    assert path.background(19 * MIB) is False
    assert path.background(21 * MIB) is True
    assert path.take() == {"loads_placed_in_step": 1, "loads_placed_in_background": 1}


def test_before_both_estimates_the_fixed_fallback_decides() -> None:
    clock = Clock()
    path = _path(clock)
    assert path.background(FALLBACK_ASYNC_BYTES - 1) is False
    assert path.background(FALLBACK_ASYNC_BYTES) is True
    # A step alone is not enough: no copy rate yet.
    path.step_sent([], {"a": 1})
    clock.now = 1.0  # a slow step would put even a large hit in the step
    path.step_done((), None)
    assert path.background(FALLBACK_ASYNC_BYTES) is True
    assert path.take() == {}  # nothing placed by measurement


def test_the_first_tiers_store_rate_stands_in_until_a_load_is_measured() -> None:
    clock = Clock()
    path = _path(clock)
    path.step_sent([], {"a": 1})
    clock.now = 1.0
    path.step_done((), {"tier.cpu.bytes_written": 64 * MIB, "tier.cpu.write_seconds": 0.5})
    path.running = 0  # an idle engine
    # 128 MiB/s, a 1 s step: 128 MiB fits, a byte more does not.
    assert path.background(128 * MIB) is False
    assert path.background(128 * MIB + 1) is True
    _measured(path, clock, step_s=1.0, running=0, bps=1024 * MIB)
    assert path.background(512 * MIB) is False  # the load's own rate now


def test_too_small_a_sample_is_no_rate() -> None:
    clock = Clock()
    path = _path(clock)
    path.step_sent([], {})
    clock.now = 1.0
    small = MIN_COPY_BYTES // MIB - 1 if MIN_COPY_BYTES > MIB else 0
    path.step_done((), {"blocks_loaded_in_step": small, "in_step_load_seconds": 1e-6})
    assert path.copy_bps is None


def test_a_fixed_threshold_overrides_the_measurement() -> None:
    clock = Clock()
    path = _path(clock, async_min_bytes=2 * MIB)
    _measured(path, clock, step_s=10.0, running=0, bps=1024 * MIB)
    assert path.background(2 * MIB - 1) is False
    assert path.background(2 * MIB) is True
    assert path.take() == {}


def test_prefill_steps_count_only_until_a_decode_step_is_timed() -> None:
    clock = Clock()
    path = _path(clock)
    path.step_sent([], {"a": 2048})  # a prefill chunk: 3 s
    clock.now = 3.0
    path.step_done((), None)
    assert path.step_s == pytest.approx(3.0)
    path.step_sent([], {"a": 1, "b": 1})  # a decode step: 50 ms
    clock.now = 3.05
    path.step_done((), None)
    path.step_sent([], {"a": 1, "c": 2048})  # another prefill: not the streams' step
    clock.now = 6.05
    path.step_done((), None)
    assert path.step_s == pytest.approx(0.05)


def test_asynchronous_scheduling_times_a_step_from_the_previous_output() -> None:
    """A step scheduled while the previous one runs is timed from that one's output,
    not from its scheduling (which would count both)."""
    clock = Clock()
    path = _path(clock)
    path.step_sent([], {"a": 1})  # step 1 at 0
    clock.now = 0.01
    path.step_sent([], {"a": 1})  # step 2, scheduled ahead
    clock.now = 0.1
    path.step_done((), None)  # step 1 done: 0.1
    clock.now = 0.2
    path.step_done((), None)  # step 2 done: 0.1 since step 1, not 0.19
    assert path.step_s == pytest.approx(0.1)


def test_a_hit_that_ends_in_its_first_step_is_still_booked() -> None:
    """A one-token request ends (``request_finished``) while vLLM processes its step's
    output, before it asks for the scheduler side's stats: its timing is kept."""
    clock = Clock()
    path = _path(clock)
    path.looked("r")
    clock.now = 1.0
    path.answered("r", background=False)
    clock.now = 2.0
    path.step_sent(["r"], {"r": 5})
    clock.now = 4.0
    path.forget("r")
    path.step_done((), None)
    assert path.take() == {
        "hits_timed": 1,
        "hit_lookup_seconds": 1.0,
        "hit_schedule_seconds": 1.0,
        "hit_step_seconds": 2.0,
    }


def test_a_measured_background_load_weighs_what_it_cost() -> None:
    """Once a background hit is measured, its wait (load + requeue) and how much
    longer the step carrying it took replace the one-step guess: a hit that one step
    sends to the background loads in the step when the background proved dearer."""
    clock = Clock()
    path = _path(clock)
    _measured(path, clock, step_s=0.1, running=4, bps=1000 * MIB)
    assert path.background(21 * MIB) is True  # 5 x 21 ms > one 100 ms step
    path.looked("r")
    path.answered("r", background=True)
    running = {f"q{i}": 1 for i in range(4)}
    path.step_sent(["r"], running)
    clock.now += 0.16  # the step carrying the background load: 60 ms longer
    path.step_done({"r"}, None)
    path.step_sent([], {**running, "r": 5})
    clock.now += 0.01
    path.step_done((), None)
    assert path.extra_s == pytest.approx(0.06)
    assert path.wait_s == pytest.approx(0.16)
    assert path.step_s == pytest.approx(0.1)  # decode steps only: r's prefill is not one
    # 5 x 21 ms = 105 ms <= 160 ms + 4 x 60 ms
    assert path.background(21 * MIB) is False
    assert path.background(90 * MIB) is True  # 5 x 90 ms = 450 ms > 400 ms


def test_a_step_that_scheduled_nothing_is_no_sample() -> None:
    """vLLM steps with nothing scheduled while requests wait (a lookup, a background
    load): such a step's millisecond is not the engine's step."""
    clock = Clock()
    path = _path(clock)
    path.step_sent([], {"a": 1})
    clock.now = 0.05
    path.step_done((), None)
    path.step_sent([], {})
    clock.now = 0.051
    path.step_done((), None)
    assert path.step_s == pytest.approx(0.05)
