"""Load or recompute (connectors/vllm/costs.py): the arithmetic, on a clock of our own.

A block of 32 tokens; the engine prefills 3,200 tokens/s (10 ms per block); the cpu
tier reads 1 GB/s and a disk tier either 100 MB/s or 1 MB/s. A 1 MB block then costs
1 ms from the cpu tier, 11 ms or 1,001 ms from the disk: the first is worth loading
only at 10 ms of recompute if the disk is fast enough, the second never.
"""

from __future__ import annotations

import pytest
from kvoffload.connectors.vllm.costs import MIN_READ_BYTES, STALE_S, Costs

BLOCK = 1_000_000
MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _costs(disk_bytes_per_s: float, clock: Clock | None = None) -> Costs:
    costs = Costs(block_tokens=32, block_bytes=BLOCK, clock=clock or Clock())
    costs.prefill(3_200, 1.0)
    costs.reads([(0, 0.0), (0, 0.0)])
    costs.reads([(1000 * MB, 1.0), (int(disk_bytes_per_s), 1.0)])
    return costs


def test_without_estimates_every_hit_loads_whole() -> None:
    costs = Costs(block_tokens=32, block_bytes=BLOCK)
    assert costs.worth([0, 0, 1, 1]) == 4
    costs.prefill(3_200, 1.0)  # a prefill rate, but no tier measured yet
    assert costs.worth([0, 1, 1]) == 3


def test_a_slow_tier_is_recomputed_and_the_cpu_prefix_kept() -> None:
    costs = _costs(1 * MB)
    assert costs.worth([0, 0, 1, 1, 1]) == 2
    assert costs.worth([1, 1]) == 0
    assert costs.worth([0, 0, 0]) == 3


def test_a_tier_faster_than_prefill_is_loaded() -> None:
    costs = _costs(200 * MB)  # 5 ms + 1 ms per block against 10 ms of recompute
    assert costs.worth([0, 1, 1, 1]) == 4


def test_a_slow_block_is_kept_when_what_follows_pays_for_it() -> None:
    """The claim is a prefix: the part that saves the most in total, not the part
    before the first losing block."""
    costs = _costs(1 * MB)
    prefill, rates = costs.estimates()
    assert prefill == pytest.approx(3_200)
    assert rates[1] == pytest.approx(1 * MB)
    # One 1,001 ms block then many 1 ms ones: 9 ms saved each, 111 of them pay it back.
    assert costs.worth([1] + [0] * 200) == 201
    assert costs.worth([1] + [0] * 100) == 0


def test_decode_steps_and_small_reads_are_not_samples() -> None:
    costs = Costs(block_tokens=32, block_bytes=BLOCK)
    costs.prefill(8, 0.001)  # a decode step of 8 requests
    assert costs.estimates() == (None, {})
    costs.reads([(0, 0.0)])
    costs.reads([(MIN_READ_BYTES - 1, 0.5)])
    assert costs.estimates() == (None, {})
    costs.reads([(MIN_READ_BYTES * 4, 1.0)])  # the small read counts with the next
    assert costs.estimates()[1][0] == pytest.approx(MIN_READ_BYTES * 4)


def test_the_average_moves_toward_new_samples() -> None:
    costs = Costs(block_tokens=32, block_bytes=BLOCK)
    costs.prefill(1_000, 1.0)
    costs.prefill(2_000, 1.0)
    prefill = costs.estimates()[0]
    assert prefill is not None
    assert 1_000 < prefill < 2_000


def test_a_stale_estimate_is_forgotten_so_a_recovered_tier_is_measured_again() -> None:
    clock = Clock()
    costs = _costs(1 * MB, clock)
    assert costs.worth([1, 1]) == 0
    clock.now += STALE_S + 1
    assert costs.worth([1, 1]) == 2  # nothing known: loaded, and so measured again
    costs.prefill(3_200, 1.0)
    costs.reads([(2000 * MB, 2.0), (int(1 * MB + 500 * MB), 2.0)])
    assert costs.worth([1, 1]) == 2  # the disk reads 500 MB/s now: worth it


def test_a_wait_bounds_a_tier_never_measured() -> None:
    """A read of a tier not measured yet that has run 2 s for 1 MB: the tier reads at
    most 0.5 MB/s, so its blocks (2 s each) are computed (10 ms each) from now on."""
    costs = Costs(block_tokens=32, block_bytes=BLOCK)
    costs.prefill(3_200, 1.0)
    assert costs.recompute_seconds(3) == pytest.approx(0.03)
    assert costs.worth([1, 1]) == 2  # not measured: loaded
    costs.bound(1, BLOCK, 2.0)
    assert costs.worth([1, 1]) == 0
    costs.bound(1, BLOCK, 0.001)  # a bound above the estimate lowers nothing
    assert costs.estimates()[1][1] == pytest.approx(BLOCK / 2.0)
    costs.bound(0, BLOCK, 2.0)  # the cpu tier is never bounded (nothing waits on it)
    assert 0 not in costs.estimates()[1]


def test_no_recompute_time_before_the_prefill_is_measured() -> None:
    assert Costs(block_tokens=32, block_bytes=BLOCK).recompute_seconds(4) is None
