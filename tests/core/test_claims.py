"""Verified claims (``Offloader.claim``): lower-tier blocks are prefetched into the cpu
tier and checked before a hit is claimed, so a corrupt disk block shortens the claim
instead of failing a load. Real cpu, mmap and LMDB tiers; every load bit-exact."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from support.blocks import (
    BPB,
    LAYOUT,
    assert_pool_holds,
    corrupt_mmap_payload,
    make_keys,
    make_offloader,
    store_and_settle,
    three_tiers,
)
from support.waiting import HANG_S, wait_until

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.offloader import LoadPlan, Offloader


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool.allocate(LAYOUT, 64)


def _claim(off: Offloader, owner: object, keys: list[BlockKey]) -> LoadPlan:
    """Ask until the claim is decided, as vLLM's scheduler does step after step."""
    return wait_until(lambda: off.claim(owner, keys), "the claim decided", poll=0.001)


def _load(off: Offloader, plan: LoadPlan, ids: list[int]) -> int:
    job = off.submit_load(plan, ids[: plan.hits])
    assert job is not None
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error
    return res.nbytes // BPB


def _cold(tmp_path: Path, pool: BlockPool, n: int, cpu_blocks: int = 32) -> tuple[Any, list[Any]]:
    """An Offloader whose first ``n`` keys were stored, then evicted from the cpu tier
    (so only the mmap tier holds them)."""
    off = make_offloader(three_tiers(tmp_path, cpu_blocks=cpu_blocks)[:2], pool)
    keys = make_keys(n)
    store_and_settle(off, keys, list(range(n)))
    filler = make_keys(cpu_blocks, salt=9)
    for i in range(0, cpu_blocks, 8):
        store_and_settle(off, filler[i : i + 8], list(range(8)))
    assert off.tiers[0].manager.lookup(keys) == 0
    assert off.lookup(keys) == n
    return off, keys


def test_claim_prefetches_from_disk_then_loads_from_cpu_only(
    tmp_path: Path, pool: BlockPool
) -> None:
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        assert off.claim("r1", keys) is None  # prefetch started: not decided yet
        plan = _claim(off, "r1", keys)
        assert plan.hits == 12
        assert {r.tier for r in plan.runs} == {0}  # the load reads the cpu tier only
        assert off.pinned() == [12, 0]
        assert _load(off, plan, list(range(20, 32))) == 12
        assert_pool_holds(pool, keys, list(range(20, 32)))
        assert off.pinned() == [0, 0]
        ps = off.prefetch_stats
        assert (ps.prefetched, ps.hits, ps.wasted, ps.failed) == (12, 12, 0, 0)
        # The disk served these blocks (through the cpu tier): the hits are its own.
        assert [(s.hits, s.misses) for s in off.stats] == [(0, 12), (12, 0)]
        assert ps.seconds > 0
        assert off.stats[1].bytes_read >= 12 * BPB
        assert off.check() == []


@pytest.mark.parametrize("where", [3, 0, 11])
def test_corrupt_disk_block_shortens_the_claim_before_any_load(
    tmp_path: Path, pool: BlockPool, where: int
) -> None:
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        corrupt_mmap_payload(off, keys[where])
        plan = _claim(off, "r1", keys)
        assert plan.hits == where  # decided short: nothing after the bad block claimed
        assert _load(off, plan, list(range(20, 32))) == where  # and all of it loads
        assert_pool_holds(pool, keys[:where], list(range(20, 20 + where)))
        assert off.stats[1].corrupt_blocks == 1
        assert off.tiers[1].manager.state(keys[where]) is None  # dropped for good
        assert off.prefetch_stats.failed == 1
        # The blocks after it were valid: they are up top now, but not claimable as a
        # prefix (the chain is broken at the bad block).
        assert off.tiers[0].manager.lookup(keys) == where
        assert off.pinned() == [0, 0]
        assert off.check() == []


def test_owners_share_one_prefetch_and_an_aborted_one_releases_everything(
    tmp_path: Path, pool: BlockPool
) -> None:
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        assert off.claim("a", keys) is None
        assert off.claim("b", keys[:8]) is None  # waits on the same prefetch
        assert off.prefetches()[0] == 1
        off.release("a")  # aborted: b still waits, so the prefetch goes on
        plan = _claim(off, "b", keys[:8])
        assert plan.hits == 8
        part = off.narrow(plan, 2, 6)  # the engine's own cache had the first two
        assert part.keys == keys[2:6]
        assert off.pinned() == [4, 0]
        assert _load(off, part, list(range(40, 44))) == 4
        assert_pool_holds(pool, keys[2:6], list(range(40, 44)))
        assert off.prefetch_stats.prefetched == 12
        assert off.prefetch_stats.hits == 4
        assert off.pinned() == [0, 0]
        assert off.prefetches() == (0, 0)
        assert off.check() == []


def test_a_thousand_aborted_claims_leak_nothing(tmp_path: Path, pool: BlockPool) -> None:
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        for i in range(1000):
            plan = off.claim(i, keys[: 1 + i % 12])
            if plan is not None and i % 3 == 0:
                off.unclaim(plan)  # decided, then the request went away
            elif plan is not None:
                off.unclaim(off.narrow(plan, 0, plan.hits // 2))
            off.release(i)
        assert off.drain()
        assert off.pinned() == [0, 0]
        assert off.prefetches() == (0, 0)
        assert off._books.claims.inflight_blocks == 0
        assert off.check() == []
        # The tiers still serve the blocks.
        plan = _claim(off, "last", keys)
        assert plan.hits == 12
        assert _load(off, plan, list(range(20, 32))) == 12
        assert_pool_holds(pool, keys, list(range(20, 32)))


def test_a_cancelled_prefetch_frees_its_reserved_slots(tmp_path: Path, pool: BlockPool) -> None:
    """A prefetch nobody waits for any more and that has not started is cancelled:
    its cpu slots are freed and its source blocks unpinned."""
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        # Keep the ssd tier's load lane busy until the claim is released, so the
        # prefetch cannot start before.
        busy_until = threading.Event()
        busy = off._workers[1].submit_load(lambda: int(busy_until.wait(HANG_S)))
        assert busy is not None
        try:
            assert off.claim("r", keys) is None
            off.release("r")
        finally:
            busy_until.set()
        assert off.prefetch_stats.wasted == 12
        assert off.prefetches() == (0, 0)
        assert off.pinned() == [0, 0]
        assert off.tiers[0].manager.lookup(keys) == 0
        assert off.drain()
        assert off.check() == []


def test_prefetches_are_bounded_by_the_budget(tmp_path: Path, pool: BlockPool) -> None:
    """With room for 4 blocks in flight, a 12-block claim is prefetched in rounds."""
    tiers = three_tiers(tmp_path, cpu_blocks=32)[:2]
    cfg = load_config({"tiers": tiers, "prefetch_max_inflight": 4 * BPB}, env={})
    off = Offloader(cfg, LAYOUT, pool)
    keys = make_keys(12)
    store_and_settle(off, keys, list(range(12)))
    for i in range(0, 32, 8):
        store_and_settle(off, make_keys(8, salt=100 + i), list(range(8)))
    with off:
        seen = 0

        def decided() -> LoadPlan | None:
            nonlocal seen
            seen = max(seen, off._books.claims.inflight_blocks)
            return off.claim("r", keys)

        plan = wait_until(decided, "the claim decided", poll=0.0005)
        assert plan.hits == 12
        assert seen <= 4
        assert _load(off, plan, list(range(20, 32))) == 12
        assert_pool_holds(pool, keys, list(range(20, 32)))


def test_lmdb_blocks_are_prefetched_and_verified_too(tmp_path: Path, pool: BlockPool) -> None:
    tiers = three_tiers(tmp_path, cpu_blocks=16)
    tiers = [tiers[0], tiers[2]]  # cpu -> lmdb
    off = make_offloader(tiers, pool)
    keys = make_keys(10)
    store_and_settle(off, keys, list(range(10)))
    for i in range(0, 16, 8):
        store_and_settle(off, make_keys(8, salt=50 + i), list(range(8)))
    with off:
        assert off.tiers[0].manager.lookup(keys) == 0
        plan = _claim(off, "r", keys)
        assert plan.hits == 10
        assert _load(off, plan, list(range(20, 30))) == 10
        assert_pool_holds(pool, keys, list(range(20, 30)))
        assert off.check() == []


def test_a_prefetch_counts_as_a_use_of_the_disk_block(tmp_path: Path, pool: BlockPool) -> None:
    """The disk tier's LRU sees a prefetch: the blocks just copied up become its most
    recently used, so the next disk eviction takes a colder block, not the prefix a
    request is about to load (and whose cpu copy may soon be evicted again)."""
    off, keys = _cold(tmp_path, pool, 12)
    with off:
        disk = off.tiers[1].manager
        order = [k for k, _ in disk.policy.items()]
        assert order.index(keys[0]) < order.index(keys[11])  # stored first: coldest
        plan = _claim(off, "r1", keys[:4])
        off.unclaim(plan)
        order = [k for k, _ in disk.policy.items()]
        assert set(order[-4:]) == set(keys[:4]), "prefetched blocks are the disk tier's most recent"
