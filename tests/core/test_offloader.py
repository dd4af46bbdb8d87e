"""The Offloader over real tiers (cpu, mmap files, LMDB): cascade, promotion, pins,
admission, backpressure and corruption, every loaded block compared bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import (
    BPB,
    LAYOUT,
    POOL,
    assert_pool_holds,
    corrupt_mmap_payload,
    fill_pool,
    make_keys,
    make_offloader,
    store_and_settle,
    three_tiers,
)
from support.waiting import HANG_S, HeldBackend, returns

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.tier import build_tiers


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool.allocate(LAYOUT, POOL)


@pytest.fixture
def three(tmp_path: Path, pool: BlockPool) -> Iterator[Offloader]:
    off = make_offloader(three_tiers(tmp_path, cpu_blocks=16), pool)
    yield off
    off.close()


def _load(off: Offloader, keys: list[BlockKey], ids: list[int]) -> int:
    plan = off.prepare_load(keys)
    job = off.submit_load(plan, ids[: plan.hits])
    assert job is not None
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error
    return res.nbytes // BPB


def _held(off: Offloader, tier: int, keys: list[BlockKey]) -> int:
    return sum(off.tiers[tier].manager.state(k) is not None for k in keys)


def test_store_then_load_from_cpu_is_bit_exact(three: Offloader, pool: BlockPool) -> None:
    keys = make_keys(8)
    store_and_settle(three, keys, list(range(8)))
    pool.scatter(list(range(8, 16)), torch.zeros(8, BPB, dtype=torch.uint8))
    assert _load(three, keys, list(range(8, 16))) == 8
    assert_pool_holds(pool, keys, list(range(8, 16)))
    assert three.stats[0].hits == 8
    assert three.stats[1].hits == three.stats[2].hits == 0
    assert three.check() == []


def test_write_through_reaches_every_tier(three: Offloader) -> None:
    keys = make_keys(10)
    store_and_settle(three, keys, list(range(10)))
    assert three.drain()
    assert [_held(three, t, keys) for t in range(3)] == [10, 10, 10]
    assert [s.blocks_stored for s in three.stats] == [10, 10, 10]


@pytest.mark.parametrize("lower_tier", [1, 2])
def test_block_evicted_from_cpu_loads_from_below_and_is_promoted(
    tmp_path: Path, pool: BlockPool, lower_tier: int
) -> None:
    # A 16-block CPU tier, 40 blocks stored: the first ones leave the CPU tier.
    tiers = three_tiers(tmp_path, cpu_blocks=16)
    if lower_tier == 2:  # a tiny mmap tier, so only LMDB still holds the oldest blocks
        tiers[1]["capacity"] = 8 * (BPB + 4096)
    with make_offloader(tiers, pool) as off:
        keys = make_keys(40)
        for i in range(0, 40, 8):
            store_and_settle(off, keys[i : i + 8], list(range(8)))
            assert off.drain()
        first = keys[:8]
        assert _held(off, 0, first) == 0
        assert _held(off, lower_tier, first) == 8
        if lower_tier == 2:
            assert _held(off, 1, first) == 0
        pool.scatter(list(range(8)), torch.zeros(8, BPB, dtype=torch.uint8))
        assert _load(off, first, list(range(8, 16))) == 8
        assert_pool_holds(pool, first, list(range(8, 16)))
        assert off.stats[lower_tier].hits == 8
        assert off.stats[0].promotions == 8
        # Promoted: the next load of the same prefix is served by the CPU tier (the
        # promotion is written on the CPU tier's store lane, after the load is done).
        assert _held(off, 0, first) == 8
        assert off.drain()
        assert _load(off, first, list(range(16, 24))) == 8
        assert_pool_holds(pool, first, list(range(16, 24)))
        assert off.stats[0].hits == 8
        assert off.drain()
        assert off.check() == []


def test_prefix_split_across_tiers_loads_in_order(tmp_path: Path, pool: BlockPool) -> None:
    with make_offloader(three_tiers(tmp_path, cpu_blocks=16), pool) as off:
        keys = make_keys(24)
        store_and_settle(off, keys[:12], list(range(12)))
        assert off.drain()
        store_and_settle(off, keys[12:24], list(range(12)))  # evicts keys[:8] from the CPU tier
        assert off.drain()
        assert _held(off, 0, keys[:8]) == 0
        assert _load(off, keys, list(range(24, 48))) == 24
        assert_pool_holds(pool, keys, list(range(24, 48)))
        assert off.stats[1].hits == 8
        assert off.stats[0].hits == 16


def test_on_evict_writes_only_what_the_cpu_tier_evicts(tmp_path: Path, pool: BlockPool) -> None:
    tiers = three_tiers(tmp_path, cpu_blocks=16, ssd={"write_policy": "on_evict"}, db={})
    tiers[2]["write_policy"] = "on_evict"
    with make_offloader(tiers, pool) as off:
        keys = make_keys(24)
        store_and_settle(off, keys[:16], list(range(16)))
        assert off.drain()
        assert _held(off, 1, keys) == 0  # nothing evicted yet, nothing written below
        store_and_settle(off, keys[16:], list(range(8)))
        assert off.drain()
        assert _held(off, 0, keys[:8]) == 0
        assert _held(off, 1, keys[:8]) == 8  # exactly the evicted ones
        assert off.stats[1].blocks_stored == 8
        pool.scatter(list(range(8)), torch.zeros(8, BPB, dtype=torch.uint8))
        assert _load(off, keys[:8], list(range(32, 40))) == 8
        assert_pool_holds(pool, keys[:8], list(range(32, 40)))


def test_admit_after_hits_keeps_one_shot_blocks_off_the_ssd(
    tmp_path: Path, pool: BlockPool
) -> None:
    tiers = three_tiers(tmp_path, cpu_blocks=32, ssd={"admit_after_hits": 2})
    with make_offloader(tiers, pool) as off:
        hot, cold = make_keys(4, salt=1), make_keys(4, salt=2)
        store_and_settle(off, hot + cold, list(range(8)))
        assert off.drain()
        assert _held(off, 1, hot + cold) == 0
        assert off.stats[1].not_admitted == 8
        _load(off, hot, list(range(8, 12)))
        assert off.drain()
        assert _held(off, 1, hot) == 0  # one load is not enough
        _load(off, hot, list(range(8, 12)))
        assert off.drain()
        assert _held(off, 1, hot) == 4
        assert _held(off, 1, cold) == 0


def test_pins_hold_while_a_load_is_planned(tmp_path: Path, pool: BlockPool) -> None:
    with make_offloader(three_tiers(tmp_path, cpu_blocks=16), pool) as off:
        keys = make_keys(8)
        store_and_settle(off, keys, list(range(8)))
        plan = off.prepare_load(keys)
        assert plan.hits == 8
        # 24 more blocks through a 16-block tier: everything unpinned is evicted.
        for i in range(3):
            more = make_keys(8, salt=10 + i)
            store_and_settle(off, more, list(range(8, 16)))
            assert off.drain()  # write-through copies pin their source until done
        assert _held(off, 0, keys) == 8
        job = off.submit_load(plan, list(range(16, 24)))
        assert job is not None
        (res,) = off.wait([job], timeout=30)
        assert res.nbytes == 8 * BPB
        assert_pool_holds(pool, keys, list(range(16, 24)))
        assert all(off.tiers[0].manager.state(k).ref_cnt == 0 for k in keys)  # type: ignore[union-attr]


def test_cancelled_plan_releases_pins_and_promotion_slots(tmp_path: Path, pool: BlockPool) -> None:
    with make_offloader(three_tiers(tmp_path, cpu_blocks=16), pool) as off:
        keys = make_keys(24)
        for i in range(0, 24, 8):
            store_and_settle(off, keys[i : i + 8], list(range(8)))
        plan = off.prepare_load(keys[:16])  # keys[:8] only below: promoted
        assert plan.hits == 16
        assert len(plan.promote_keys) == 8
        assert len(plan.promote_evicted) == 8  # keys[16:] made room
        off.cancel_load(plan)
        with pytest.raises(ValueError, match="already submitted or cancelled"):
            off.submit_load(plan, list(range(16)))
        assert off.check() == []
        for tier in off.tiers:
            for key in keys:
                state = tier.manager.state(key)
                assert state is None or state.ref_cnt == 0


def test_corrupt_block_below_is_a_miss_and_dropped(tmp_path: Path, pool: BlockPool) -> None:
    tiers = three_tiers(tmp_path, cpu_blocks=8)
    tiers = tiers[:2]  # cpu -> mmap only
    with make_offloader(tiers, pool) as off:
        keys = make_keys(16)
        store_and_settle(off, keys[:8], list(range(8)))
        store_and_settle(off, keys[8:], list(range(8)))
        assert off.drain()
        victim = keys[3]  # in mmap only now
        corrupt_mmap_payload(off, victim)
        assert _load(off, keys, list(range(16, 32))) == 3
        assert_pool_holds(pool, keys[:3], list(range(16, 19)))
        assert off.stats[1].corrupt_blocks == 1
        assert off.tiers[1].manager.state(victim) is None  # dropped: a miss from now on
        assert off.lookup(keys) == 3


def test_slow_tier_drops_stores_and_never_blocks_the_caller(
    tmp_path: Path, pool: BlockPool
) -> None:
    """The mmap tier's writes hang until the test has made all 40 stores (its queue
    holds 2 jobs): its copies are dropped and counted, and every engine store is
    submitted and lands in the cpu tier meanwhile. A submit or a cpu store that waited
    for the hung tier would wait for a write released only after the last of them:
    they would never all return (a hang, caught by the guard)."""
    tiers = three_tiers(tmp_path, cpu_blocks=512, ssd={"max_pending_stores": 2})[:2]
    tiers[0]["max_pending_stores"] = 64
    config = load_config({"tiers": tiers}, env={})
    built = build_tiers(config, LAYOUT)
    ssd = HeldBackend(built[1].backend, reads=False)
    built[1].backend = ssd
    with Offloader(config, LAYOUT, pool, tiers=built) as off, ssd.holding():

        def store_all() -> None:
            for r in range(40):
                keys = make_keys(8, salt=100 + r)
                fill_pool(pool, keys, list(range(8)))
                job = off.submit_store(keys, list(range(8)))
                assert job is not None
                (res,) = off.wait([job], timeout=HANG_S)
                assert res.success

        returns(store_all, "40 stores while the tier below hangs")
        assert ssd.outlasted == 0, "a store waited for the hung tier"
        assert ssd.held["write"] >= 1  # the tier's copies were hanging meanwhile
        engine, lower = off.stats
        assert engine.blocks_stored == 320
        assert engine.dropped_stores == 0
        assert lower.blocks_stored == 0  # nothing written yet: all of it hangs
        # Two jobs taken (running or queued), every later copy dropped.
        assert lower.dropped_stores == 320 - 8 * off.pending_stores()[1] > 0


def test_close_with_jobs_in_flight_does_not_hang(tmp_path: Path, pool: BlockPool) -> None:
    tiers = three_tiers(tmp_path, cpu_blocks=64, ssd={"write_throttle": 8_000_000})[:2]
    off = make_offloader(tiers, pool)
    for r in range(6):
        keys = make_keys(8, salt=200 + r)
        fill_pool(pool, keys, list(range(8)))
        assert off.submit_store(keys, list(range(8))) is not None
    returns(off.close, "close with jobs in flight")
    off.close()  # idempotent
    # Reopened, the mmap tier holds what was written before close, all intact.
    with make_offloader(tiers, pool) as again:
        assert len(again.tiers[1].manager) > 0
        assert again.check() == []


def test_events_are_recorded_only_when_asked(tmp_path: Path, pool: BlockPool) -> None:
    """Undrained event records would grow with every block ever stored: an Offloader
    records none unless built with ``events=True`` (the vLLM connector with KV events
    on), and then every tier's stores show up once, with their tier."""
    keys = make_keys(4)
    quiet = make_offloader(three_tiers(tmp_path / "a", cpu_blocks=16), pool)
    try:
        store_and_settle(quiet, keys, list(range(4)))
        assert quiet.take_events() == []
    finally:
        quiet.close()
    cfg = load_config({"tiers": three_tiers(tmp_path / "b", cpu_blocks=16)}, env={})
    loud = Offloader(cfg, LAYOUT, pool, events=True)
    try:
        store_and_settle(loud, keys, list(range(4)))
        stored: dict[str, list[BlockKey]] = {}
        for tier, ev in loud.take_events():
            assert not ev.removed
            stored.setdefault(tier.name, []).extend(ev.keys)
        assert stored == {"cpu": keys, "ssd": keys, "db": keys}  # write-through
        assert loud.take_events() == []
    finally:
        loud.close()


def test_no_backend_call_runs_under_the_books_lock(tmp_path: Path, pool: BlockPool) -> None:
    """The books' lock is held for bookkeeping only: each backend's reads, writes,
    discards and own counters run with it released, the discard of a block found
    corrupt (on the lane that settled its load) and of the first tier's reset (on the
    caller's thread) included. The scenario is sequential (each step drained before
    the next), so a lock held during a call would be the caller's own."""
    tiers = three_tiers(tmp_path, cpu_blocks=8)[:2]  # cpu -> mmap
    with make_offloader(tiers, pool) as off:
        calls: list[tuple[str, str, bool]] = []
        for tier in off.tiers:
            for name in ("read", "write", "discard", "stats"):
                real = getattr(tier.backend, name)

                def checked(
                    *args: Any, _real: Any = real, _call: Any = (tier.name, name), **kw: Any
                ) -> Any:
                    calls.append((*_call, off._books.lock.locked()))
                    return _real(*args, **kw)

                setattr(tier.backend, name, checked)
        keys = make_keys(16)
        store_and_settle(off, keys[:8], list(range(8)))
        store_and_settle(off, keys[8:], list(range(8)))
        victim = keys[3]  # in mmap only now
        corrupt_mmap_payload(off, victim)
        assert _load(off, keys, list(range(16, 32))) == 3
        assert off.drain()
        assert off.stats[1].corrupt_blocks == 1
        off.counters()
        assert off.clear_first_tier() > 0
        assert off.check() == []
        assert ("ssd", "discard", False) in calls
        assert ("cpu", "discard", False) in calls
        assert ("ssd", "read", False) in calls
        assert ("ssd", "write", False) in calls
        assert [c for c in calls if c[2]] == []
