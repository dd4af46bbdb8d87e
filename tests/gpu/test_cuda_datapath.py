"""The Offloader with a CUDA block pool: bit-exact round trips for both block layouts,
through a pinned cpu tier and a real mmap tier, and the stream ordering the data path
promises (a store sees the kernels queued before it; a load lands after them), checked
while the compute stream is kept busy. Deselected without CUDA (CI has none); run on the
GPU machine, see docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.blocks import make_keys
from support.cuda import BPB, POOL, busy, cuda_content, cuda_offloader, cuda_pool, wait_blocks

pytestmark = pytest.mark.cuda  # deselected without CUDA (tests/conftest.py)


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_round_trip_through_the_cpu_tier_is_bit_exact(tmp_path: Path, flash: bool) -> None:
    pool, _ = cuda_pool(flash)
    ids = list(range(0, 128))
    want = cuda_content(ids, 1)
    pool.scatter(ids, want)
    keys = make_keys(len(ids))
    with cuda_offloader(tmp_path, pool, cpu_blocks=160, mmap=False) as off:
        assert wait_blocks(off, off.submit_store(keys, ids)) == len(ids)
        pool.scatter(ids, torch.zeros_like(want))
        targets = list(range(128, 256))
        plan = off.prepare_load(keys)
        assert plan.hits == len(keys)
        assert wait_blocks(off, off.submit_load(plan, targets)) == len(ids)
        assert torch.equal(pool.gather(targets), want)
        assert off.check() == []


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_disk_blocks_are_prefetched_through_pinned_memory_bit_exact(
    tmp_path: Path, flash: bool
) -> None:
    """cpu -> mmap (write-through), the cpu tier then flushed by other blocks; a claim
    prefetches from the disk straight into the slab, the load copies to the GPU."""
    pool, _ = cuda_pool(flash)
    ids = list(range(64))
    want = cuda_content(ids, 2)
    pool.scatter(ids, want)
    keys = make_keys(64)
    with cuda_offloader(tmp_path, pool, cpu_blocks=64, mmap=True) as off:
        assert wait_blocks(off, off.submit_store(keys, ids)) == 64
        assert off.drain()  # the copies down have read the cpu tier
        other = make_keys(64, salt=1)
        assert wait_blocks(off, off.submit_store(other, list(range(64, 128)))) == 64
        assert off.drain()
        assert off.tiers[0].manager.lookup(keys) == 0
        plan = None
        for _ in range(10_000):
            plan = off.claim("r", keys)
            if plan is not None:
                break
            torch.cuda.synchronize()
        assert plan is not None
        assert plan.hits == 64
        targets = list(range(128, 192))
        assert wait_blocks(off, off.submit_load(plan, targets)) == 64
        assert torch.equal(pool.gather(targets), want)
        off.release("r")
        assert off.pinned() == [0, 0]


def test_busy_compute_stream_never_yields_a_bad_block(tmp_path: Path) -> None:
    """Each round queues a matmul loop, then writes the blocks with a kernel, and
    submits their store at once: a store that did not wait for the engine's stream
    would read the old bytes. Then it queues a loop and a kernel that overwrites the
    load's target blocks, and submits the load: a load that did not wait would be
    overwritten. Slots and staging buffers are recycled round after round."""
    pool, _ = cuda_pool(False)
    bad = 0
    with cuda_offloader(tmp_path, pool, cpu_blocks=96, mmap=False) as off:
        for rnd in range(12):
            ids = list(range(0, 64))
            targets = list(range(64 + (rnd % 3) * 64, 128 + (rnd % 3) * 64))
            want = cuda_content(ids, 100 + rnd)
            busy()
            pool.scatter(ids, want)  # queued after the matmuls
            keys = make_keys(64, salt=100 + rnd)
            assert wait_blocks(off, off.submit_store(keys, ids)) == 64
            plan = off.prepare_load(keys)
            assert plan.hits == 64
            busy()
            pool.scatter(targets, torch.zeros_like(want))  # must land before the load
            assert wait_blocks(off, off.submit_load(plan, targets)) == 64
            got = pool.gather(targets)
            bad += sum(not torch.equal(got[i], want[i]) for i in range(64))
        assert off.check() == []
    assert bad == 0


def test_one_launch_copy_writes_what_the_per_layer_ops_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton pack and unpack (kvoffload/cudacopy.py) against the per-layer torch
    ops, on random block ids; the flash layout (K and V of a block apart) is left to
    the torch ops."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KVOFFLOAD_CUDA_COPY", "kernel")
    pool, _ = cuda_pool(False)
    kernel = pool._layer_copy()
    assert kernel is not None
    ids = torch.randperm(POOL)[:100].tolist()
    pool.scatter(list(range(POOL)), cuda_content(list(range(POOL)), 7))
    index = pool.device_index(ids)
    by_kernel = torch.empty((len(ids), BPB), dtype=torch.uint8, device="cuda")
    by_torch = torch.empty_like(by_kernel)
    pool.pack(index, by_kernel)
    pool._gather_team(index, by_torch)
    assert torch.equal(by_kernel, by_torch)
    fresh = cuda_content(ids, 8)
    pool.unpack(index, fresh)
    back = torch.empty_like(fresh)
    pool._gather_team(index, back)
    assert torch.equal(back, fresh)
    flash, _ = cuda_pool(True)
    assert flash._layer_copy() is None
