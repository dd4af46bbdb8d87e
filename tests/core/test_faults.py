"""Faults injected at run time into a real mmap tier (``kvoffload.testing.FaultyBackend``):
EIO on read or write, ENOSPC, short writes and latency spikes, while stores and loads
keep coming. Under each: nothing raises into the caller, every block that loads is
bit-exact, a failed store is counted and dropped, a failed read is a miss, the books
stay consistent, and once the disk recovers the tier takes and serves blocks again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import (
    BPB,
    LAYOUT,
    POOL,
    block_content,
    fill_pool,
    make_keys,
    store_and_settle,
    three_tiers,
)
from support.waiting import HANG_S, HeldBackend, returns, wait_until

from kvoffload import breaker as breaker_module
from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.datapath import LoadGate, StoreGate
from kvoffload.offloader import Offloader
from kvoffload.testing import Faults, FaultyBackend
from kvoffload.tier import build_tiers

FAULTS = {
    "read_error": Faults(read_error=0.5, seed=1),
    "write_error": Faults(write_error=0.5, seed=2),
    "enospc": Faults(enospc=0.5, seed=3),
    "short_write": Faults(short_write=0.5, seed=4),
    "slow": Faults(slow=0.5, slow_s=0.02, seed=5),
}


def _faulty(tmp: Path, faults: Faults) -> tuple[Offloader, FaultyBackend]:
    """cpu (8 blocks) -> mmap (write-through, faulty): most loads come from the disk.
    The circuit breaker is off here: every fault reaches the stack (it has a test of
    its own below)."""
    cpu, disk = three_tiers(tmp, cpu_blocks=8)[:2]
    config = load_config({"tiers": [cpu, {**disk, "breaker_errors": 0}]}, env={})
    tiers = build_tiers(config, LAYOUT)
    faulty = FaultyBackend(tiers[1].backend, faults)
    tiers[1].backend = faulty
    return Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL), tiers=tiers), faulty


def _round(off: Offloader, salt: int) -> tuple[int, int]:
    """Store 4 batches of 8 new blocks, then load every batch stored so far; returns
    (blocks asked for, blocks loaded). Asserts every loaded block is bit-exact."""
    assert off.pool is not None
    # Promotions queued by the last round's loads hold first-tier slots while they run;
    # with eight slots, a store meeting them finds no room and is rejected (counted).
    # Let them land first, so a round's misses are the faults' doing.
    off.drain(timeout=30)
    batches = [make_keys(8, salt * 100 + b) for b in range(4)]
    for batch in batches:
        ids = list(range(8))
        fill_pool(off.pool, batch, ids)
        job = off.submit_store(batch, ids)
        if job is not None:
            off.wait([job], timeout=30)  # a failed store is a result, never a raise
        off.drain(timeout=30)
    asked = loaded = 0
    for batch in batches:
        ids = list(range(8, 16))
        off.pool.scatter(ids, torch.zeros((8, BPB), dtype=torch.uint8))
        plan = off.prepare_load(batch)
        job = off.submit_load(plan, ids[: plan.hits])
        asked += len(batch)
        if job is None:
            continue
        (res,) = off.wait([job], timeout=30)
        n = res.nbytes // BPB if res.success else 0
        got = off.pool.gather(ids[:n])
        for i in range(n):
            assert torch.equal(got[i], block_content(batch[i])), f"block {i} of a load differs"
        loaded += n
        off.drain(timeout=30)  # the load's promotion, before the next plan
    return asked, loaded


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_the_stack_keeps_serving_under_injected_faults(tmp_path: Path, kind: str) -> None:
    off, faulty = _faulty(tmp_path, FAULTS[kind])
    with off:
        asked = loaded = 0
        for r in range(4):
            a, n = _round(off, r)
            asked, loaded = asked + a, loaded + n
        assert faulty.injected[kind] > 0, f"no {kind} was injected"
        assert off.check() == []
        disk = off.stats[1]
        if kind in ("write_error", "enospc", "short_write"):
            assert disk.store_errors > 0  # counted, and the blocks dropped
        if kind == "read_error":
            assert loaded < asked  # a failed read is a miss (of the rest of the prefix)
        # The disk recovers: new blocks reach it, and load back from it.
        faulty.enabled = False
        before = disk.blocks_stored
        a, n = _round(off, 99)
        assert disk.blocks_stored > before
        assert n == a  # every block of the recovered round loads, bit-exact
        assert off.check() == []
        assert off.pinned() == [0, 0]


class _BooksClock:
    """The breakers' clock (``kvoffload.breaker.time``), which the test moves forward: a
    back-off passes when the test says so, never because the machine was slow."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def perf_counter(self) -> float:
        return time.perf_counter()


def test_a_failing_tier_is_bypassed_then_probed_and_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """breaker_errors failures in a row trip the breaker: the tier gets no stores and
    serves no loads for the back-off (its faults stop being reached), then one
    success after the back-off closes it. The back-off is long enough that only a hang
    outlasts it; the books' clock is moved past it."""
    clock = _BooksClock()
    monkeypatch.setattr(breaker_module, "time", clock)
    faults = Faults(write_error=1.0, read_error=1.0, seed=9)
    lower = {"breaker_errors": 3, "breaker_backoff_ms": HANG_S * 1e3}
    config = load_config(
        {
            "tiers": [
                *three_tiers(tmp_path, cpu_blocks=8)[:1],
                {**three_tiers(tmp_path, 8)[1], **lower},
            ]
        },
        env={},
    )
    tiers = build_tiers(config, LAYOUT)
    faulty = FaultyBackend(tiers[1].backend, faults)
    tiers[1].backend = faulty
    with Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL), tiers=tiers) as off:
        disk = off.stats[1]
        for r in range(3):
            _round(off, r)
        assert disk.breaker_trips == 1
        tried = faulty.injected["write_error"]
        assert tried == 3  # three failures in a row, then no more tries
        assert disk.bypassed_stores > 0
        assert off.check() == []
        # The disk heals; within the back-off the tier stays bypassed.
        faulty.enabled = False
        before = disk.blocks_stored
        _round(off, 10)
        assert disk.blocks_stored == before
        clock.ahead += HANG_S  # the back-off passes: the next store is the probe
        asked, loaded = _round(off, 11)
        assert disk.blocks_stored > before  # probed, closed, written
        assert loaded == asked
        assert disk.breaker_trips == 1
        assert off.check() == []


def _hanging(tmp: Path, tiers: list[dict[str, Any]]) -> tuple[Offloader, HeldBackend]:
    """``tiers`` with the last one wrapped; every read and write of it hangs while the
    test holds it (:meth:`HeldBackend.holding`), until the test has checked what must
    not wait for it; ``load_timeout_ms`` 200."""
    config = load_config({"tiers": tiers, "load_timeout_ms": 200}, env={})
    built = build_tiers(config, LAYOUT)
    held = HeldBackend(built[-1].backend)
    built[-1].backend = held
    pool = BlockPool.allocate(LAYOUT, POOL)
    return Offloader(config, LAYOUT, pool, tiers=built), held


def test_a_claim_stops_waiting_for_a_hanging_tier_after_the_load_timeout(tmp_path: Path) -> None:
    """The request's prefix is only on a disk whose reads hang until the test lets
    them go: the claim settles after load_timeout_ms (200 ms: counted ``late``) for
    what the first tier holds, while the read still hangs; the late prefetch counts as
    a failure for the breaker, and it lands for the next request."""
    cpu, disk = three_tiers(tmp_path, cpu_blocks=8)[:2]
    off, held = _hanging(tmp_path, [cpu, {**disk, "breaker_errors": 1}])
    with off:
        wanted, other = make_keys(8, 1), make_keys(8, 2)
        store_and_settle(off, wanted, list(range(8)))
        store_and_settle(off, other, list(range(8)))  # pushes `wanted` out of the 8-block cpu tier
        assert off.lookup(wanted) == 8  # on the disk
        with held.holding():
            assert off.claim("r1", wanted) is None  # prefetching, hanging
            # A claim that waited for the hung read would never settle before the
            # release below.
            plan = wait_until(lambda: off.claim("r1", wanted), "the claim settled", poll=0.01)
            assert held.outlasted == 0, "the claim waited for the hung read"
            assert off.prefetch_stats.late == 1  # settled by the load timeout
            assert plan.hits == 0  # nothing of it up top yet: recompute
            off.unclaim(plan)
            off.release("r1")
            assert held.held["read"] >= 1
        assert off.drain(timeout=30)  # the hung read ends, after the timeout
        assert off.stats[1].breaker_trips == 1
        # The late prefetch landed: a hit up top. It held 4 blocks (the budget: half
        # the first tier); the rest would need the disk, which the breaker bypasses.
        again = off.claim("r2", wanted)
        assert again is not None
        assert again.hits == 4
        off.unclaim(again)
        off.release("r2")
        assert off.check() == []
        assert off.pinned() == [0, 0]


def test_an_abandoned_load_never_copies_into_the_engines_blocks(tmp_path: Path) -> None:
    """A step's load from a disk first tier that hangs: the engine abandons it through
    its gate while the read still hangs; when the read returns, the job copies nothing
    into the pool (the engine is recomputing those blocks) and reports nothing
    loaded."""
    disk = three_tiers(tmp_path, cpu_blocks=8)[1]
    off, held = _hanging(tmp_path, [disk])
    with off:
        assert off.pool is not None
        keys = make_keys(8, 3)
        store_and_settle(off, keys, list(range(8)))
        ids = list(range(16, 24))
        sentinel = torch.full((8, BPB), 7, dtype=torch.uint8)
        off.pool.scatter(ids, sentinel)
        plan = off.prepare_load(keys)
        assert plan.hits == 8
        gate = LoadGate()
        with held.holding():
            job = off.submit_load(plan, ids, gate=gate)
            assert job is not None
            assert off.wait([job], timeout=0.2) == []  # still reading
            assert gate.abandon()
            assert not gate.enter()  # what the job will find
        (res,) = off.wait([job], timeout=30)
        assert res.nbytes == 0
        assert torch.equal(off.pool.gather(ids), sentinel)  # untouched
        assert held.held["read"] == 1
        plan = off.prepare_load(keys)  # the blocks are still held, and load normally
        gate = LoadGate()
        job = off.submit_load(plan, ids, gate=gate)
        assert job is not None
        (res,) = off.wait([job], timeout=30)
        assert res.nbytes == 8 * BPB
        assert not gate.abandon()  # the copy began: too late to abandon
        got = off.pool.gather(ids)
        assert all(torch.equal(got[i], block_content(keys[i])) for i in range(8))
        assert off.check() == []


def test_a_store_into_a_hanging_tier_gives_the_engine_its_blocks_back_once_read(
    tmp_path: Path,
) -> None:
    """A disk as the only tier, its writes hanging until the test lets them go: the
    engine gets its blocks back as soon as the store has read them, while the write
    still hangs, and what is stored is what was read, whatever the engine writes into
    its blocks afterwards. A store queued behind the hung one has not begun by its
    deadline: it is abandoned, reads nothing and stores nothing."""
    disk = three_tiers(tmp_path, cpu_blocks=8)[1]
    off, held = _hanging(tmp_path, [disk])
    with off:
        assert off.pool is not None
        zeros = torch.zeros((8, BPB), dtype=torch.uint8)
        keys, ids = make_keys(8, 5), list(range(8))
        fill_pool(off.pool, keys, ids)
        gate = StoreGate()
        with held.holding():
            job = off.submit_store(keys, ids, gate=gate)
            assert job is not None
            # Read, not abandoned, while the write hangs: a gate that waited for the
            # write would not open before the release below.
            assert returns(lambda: gate.wait(HANG_S), "the engine's blocks back") is False
            assert held.outlasted == 0, "the engine's blocks came back only after the write"
            assert off.wait([job], timeout=0) == []  # still writing
            off.pool.scatter(ids, zeros)  # the engine reuses its blocks at once
            later, later_ids = make_keys(8, 6), list(range(8, 16))
            fill_pool(off.pool, later, later_ids)
            late = StoreGate()
            late_job = off.submit_store(later, later_ids, gate=late)
            assert late_job is not None
            assert late.wait(0.2) is True  # queued behind the hung write: abandoned
            off.pool.scatter(later_ids, zeros)
        results = {r.job_id: r for r in off.wait([job, late_job], timeout=30)}
        assert results[job].success
        assert not results[late_job].success
        assert "store_timeout_ms" in str(results[late_job].error)
        assert held.held["write"] == 1
        assert off.drain(timeout=30)
        plan = off.prepare_load(keys)
        assert plan.hits == 8
        load = off.submit_load(plan, list(range(16, 24)))
        assert load is not None
        (res,) = off.wait([load], timeout=30)
        assert res.nbytes == 8 * BPB
        got = off.pool.gather(list(range(16, 24)))
        assert all(torch.equal(got[i], block_content(keys[i])) for i in range(8))
        assert off.prepare_load(later).hits == 0  # nothing of the abandoned store
        assert off.stats[0].store_errors == 8
        assert off.check() == []
