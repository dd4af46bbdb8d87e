"""The Offloader's jobs with no books at all: real tiers (cpu, mmap), a real pool, and
orders written by hand. Each job moves one order's bytes and returns one outcome:
what landed, what proved corrupt, the I/O it did (for the counters and breakers) and
the buffers the next orders may take over. Bit for bit, and every buffer back."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import (
    BPB,
    LAYOUT,
    assert_pool_holds,
    block_content,
    fill_pool,
    make_keys,
    three_tiers,
)

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.datapath import DataPath, StoreGate
from kvoffload.exceptions import BackendError
from kvoffload.jobs import Jobs, LoadsInFlight
from kvoffload.keys import BlockKey
from kvoffload.plans import Copy, LoadPlan, Run, Write
from kvoffload.tier import Tier, build_tiers


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool.allocate(LAYOUT, 32)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[list[Tier]]:
    config = load_config({"tiers": three_tiers(tmp_path, cpu_blocks=16)[:2]}, env={})
    built = build_tiers(config, LAYOUT)
    yield built
    for tier in built:
        tier.close()


def _jobs(tiers: list[Tier], pool: BlockPool, tmp_path: Path) -> Jobs:
    config = load_config({"tiers": three_tiers(tmp_path, cpu_blocks=16)[:2]}, env={})
    return Jobs(tiers, config.resolved_tiers(), DataPath(BPB, pool), load_timeout_s=10.0)


def _lent(jobs: Jobs) -> int:
    """Staging buffers out on loan (0 once every outcome has been staged)."""
    return len(jobs._buffers._lent)


def _tier_holds(tier: Tier, slots: list[int], keys: list[BlockKey]) -> None:
    buf = torch.empty(len(keys), BPB, dtype=torch.uint8)
    assert tier.backend.read(slots, keys, buf) == [True] * len(keys)
    for i, key in enumerate(keys):
        assert torch.equal(buf[i], block_content(key)), f"block {i} differs"


def _stored(jobs: Jobs, pool: BlockPool, keys: list[BlockKey]) -> list[int]:
    """An engine store into the cpu tier, then its copy into mmap; the slots (same
    numbers in both)."""
    n = len(keys)
    slots = list(range(n))
    fill_pool(pool, keys, list(range(n)))
    out = jobs.write(Write(0, keys, slots, pool_ids=list(range(n))))
    assert out.error is None
    assert out.ok == [True] * n
    jobs.stage([], {"written": out.buf, "demoted": out.demoted})
    out = jobs.write(Write(1, keys, slots, src_tier=0, src_slots=slots))
    assert out.error is None
    assert out.ok == [True] * n
    return slots


def test_a_store_and_its_copy_down_report_what_landed_and_their_io(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path
) -> None:
    jobs = _jobs(tiers, pool, tmp_path)
    keys = make_keys(6)
    fill_pool(pool, keys, list(range(6)))
    gate = StoreGate()
    out = jobs.write(Write(0, keys, list(range(6)), pool_ids=list(range(6))), gate)
    assert out.error is None
    assert not out.failed
    assert out.ok == [True] * 6
    assert gate.released()  # the engine may reuse its blocks
    assert out.buf is None  # gathered straight into the cpu tier's rows
    assert [t for t, _ in out.tally.writes] == [0]
    assert out.tally.health == []  # the first tier has no breaker
    _tier_holds(tiers[0], list(range(6)), keys)

    down = jobs.write(Write(1, keys, list(range(6)), src_tier=0, src_slots=list(range(6))))
    assert down.error is None
    assert down.ok == [True] * 6
    assert down.corrupt == []
    assert [t for t, _ in down.tally.writes] == [1]
    assert down.tally.health == [(1, True)]
    _tier_holds(tiers[1], list(range(6)), keys)
    jobs.stage([], {"written": down.buf, "demoted": down.demoted})
    assert _lent(jobs) == 0


def test_a_load_from_below_reads_checks_and_hands_its_buffer_on(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path
) -> None:
    jobs = _jobs(tiers, pool, tmp_path)
    keys = make_keys(4)
    slots = _stored(jobs, pool, keys)
    plan = LoadPlan(keys, [Run(1, 0, 4, slots)], 4)
    ids = list(range(16, 20))
    out = jobs.load(plan, ids, 0.0)
    assert out.error is None
    assert (out.valid, out.corrupt, out.staged) == (4, {}, [True] * 4)
    assert [(t, n) for t, _, n in out.tally.reads] == [(1, 4 * BPB)]
    assert out.tally.health == [(1, True)]
    assert_pool_holds(pool, keys, ids)
    assert not plan.settled  # the books settle it, not the job
    # The promotion the books would order: rows 0..3, which take the buffer over.
    promotion = Write(0, keys, [8, 9, 10, 11], rows=[0, 1, 2, 3])
    jobs.stage([Copy(promotion, "loaded")], {"loaded": out.buf})
    assert promotion.buf is not None
    assert promotion.buf.data_ptr() == out.buf.data_ptr()
    up = jobs.write(promotion)
    assert up.ok == [True] * 4
    _tier_holds(tiers[0], [8, 9, 10, 11], keys)
    jobs.stage([], {"written": up.buf, "demoted": up.demoted})
    assert _lent(jobs) == 0


def _corrupt(tier: Tier, slot: int) -> None:
    backend: Any = tier.backend
    path, at = backend.payload_at(slot)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 64, at + 100)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_corrupt_block_ends_the_loaded_prefix_and_is_reported(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path
) -> None:
    jobs = _jobs(tiers, pool, tmp_path)
    keys = make_keys(5)
    slots = _stored(jobs, pool, keys)
    _corrupt(tiers[1], slots[2])
    out = jobs.load(LoadPlan(keys, [Run(1, 0, 5, slots)], 5), list(range(16, 21)), 0.0)
    assert out.valid == 2
    assert out.corrupt == {1: [keys[2]]}
    assert_pool_holds(pool, keys[:2], [16, 17])
    # A copy up from the corrupt source (a prefetch's write) reports it the same way.
    up = jobs.write(Write(0, keys, list(range(8, 13)), src_tier=1, src_slots=slots))
    assert up.ok == [True, True, False, True, True]
    assert up.corrupt == [keys[2]]
    jobs.stage([], {"loaded": out.buf})
    jobs.stage([], {"written": up.buf, "demoted": up.demoted})
    assert _lent(jobs) == 0


def test_a_write_reads_the_blocks_it_displaces_first_when_told(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path
) -> None:
    """``on_evict``: the order names the displaced blocks to demote (the books decided
    which); the job reads them out before overwriting their slots."""
    jobs = _jobs(tiers, pool, tmp_path)
    old = make_keys(3)
    fill_pool(pool, old, [0, 1, 2])
    jobs.write(Write(0, old, [0, 1, 2], pool_ids=[0, 1, 2]))
    new = make_keys(3, salt=1)
    fill_pool(pool, new, [3, 4, 5])
    w = Write(0, new, [0, 1, 2], pool_ids=[3, 4, 5], evicted=list(zip(old, [0, 1, 2], strict=True)))
    w.demote = True
    out = jobs.write(w)
    assert out.ok == [True] * 3
    assert out.evicted == old
    assert out.demoted is not None
    for i, key in enumerate(old):
        assert torch.equal(out.demoted[i], block_content(key))
    _tier_holds(tiers[0], [0, 1, 2], new)
    # The demotion the books would order takes the buffer; it lands in mmap.
    demotion = Write(1, old, [5, 6, 7], rows=[0, 1, 2])
    jobs.stage([Copy(demotion, "demoted")], {"written": out.buf, "demoted": out.demoted})
    down = jobs.write(demotion)
    assert down.ok == [True] * 3
    _tier_holds(tiers[1], [5, 6, 7], old)
    jobs.stage([], {"written": down.buf, "demoted": down.demoted})
    assert _lent(jobs) == 0


def test_a_failed_write_returns_its_error_in_the_outcome(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job never raises past its outcome: the caller settles it, then raises."""
    jobs = _jobs(tiers, pool, tmp_path)
    keys = make_keys(3)
    fill_pool(pool, keys, [0, 1, 2])
    jobs.write(Write(0, keys, [0, 1, 2], pool_ids=[0, 1, 2]))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise BackendError("disk gone")

    monkeypatch.setattr(tiers[1].backend, "write", broken)
    out = jobs.write(Write(1, keys, [0, 1, 2], src_tier=0, src_slots=[0, 1, 2]))
    assert isinstance(out.error, BackendError)
    assert out.failed
    assert out.ok == [False] * 3
    assert out.buf is None
    assert out.tally.health == [(1, False)]
    assert _lent(jobs) == 0


def test_staging_cuts_rows_and_releases_what_no_order_took(
    tiers: list[Tier], pool: BlockPool, tmp_path: Path
) -> None:
    jobs = _jobs(tiers, pool, tmp_path)
    written = jobs._buffers.acquire(4)
    demoted = jobs._buffers.acquire(3)
    written.copy_(torch.arange(4, dtype=torch.uint8)[:, None].expand(4, BPB))
    picky = Write(1, make_keys(2), [0, 1], rows=[3, 1])  # not leading rows: a copy
    jobs.stage([Copy(picky, "written")], {"written": written, "demoted": demoted})
    assert picky.buf is not None
    assert [int(picky.buf[i, 0]) for i in range(2)] == [3, 1]
    assert _lent(jobs) == 1  # both sources released, the order's copy lent
    jobs.release(picky)
    assert picky.buf is None
    assert _lent(jobs) == 0


def test_copies_into_a_persistent_tier_wait_briefly_for_loads() -> None:
    loads = LoadsInFlight()
    loads.wait(timeout=5)  # none in flight: no wait
    loads.begin()
    assert loads.active == 1
    loads.wait(timeout=0.01)  # bounded
    loads.end()
    assert loads.active == 0
