"""The Offloader with a CUDA block pool: bit-exact round trips for both block layouts,
through a pinned cpu tier and a real mmap tier, and the stream ordering the data path
promises (a store sees the kernels queued before it; a load lands after them), checked
while the compute stream is kept busy. Deselected without CUDA (CI has none); run on the
GPU machine, see docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

pytestmark = pytest.mark.cuda  # deselected without CUDA (tests/conftest.py)

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16, namespace="gpu")
BPB = LAYOUT.bytes_per_block  # 256 KiB
POOL = 256


def _keys(n: int, salt: int = 0) -> list[BlockKey]:
    keys, parent = [], ROOT_KEY
    for i in range(n):
        parent = chain_key(parent, f"{salt}:{i}".encode())
        keys.append(parent)
    return keys


def _pool(flash: bool) -> tuple[BlockPool, list[torch.Tensor]]:
    """A CUDA pool in the canonical ``[B, 2, N, H, D]`` layout or flash-attention's
    ``[2, B, N, H, D]`` (``block_dim=1``)."""
    shape = list(LAYOUT.layer_block_shape)  # [2, N, H, D]
    shape = [2, POOL, *shape[1:]] if flash else [POOL, *shape]
    caches = [
        torch.zeros(shape, dtype=LAYOUT.torch_dtype, device="cuda")
        for _ in range(LAYOUT.num_layers)
    ]
    return BlockPool(caches, block_dim=1 if flash else 0), caches


def _offloader(tmp: Path, pool: BlockPool, *, cpu_blocks: int, mmap: bool) -> Offloader:
    tiers: list[dict[str, Any]] = [{"name": "cpu", "backend": "cpu", "capacity": cpu_blocks * BPB}]
    if mmap:
        tiers.append(
            {
                "name": "ssd",
                "backend": "mmap",
                "capacity": 4 * cpu_blocks * (BPB + 4096),
                "path": str(tmp / "m"),
            }
        )
    return Offloader(load_config({"tiers": tiers}, env={}), LAYOUT, pool)


def _content(ids: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (len(ids), BPB), dtype=torch.uint8, device="cuda", generator=gen)


def _busy(n: int = 30) -> None:
    """Queue ~tens of milliseconds of matmuls on the current (compute) stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)


def _wait(off: Offloader, job: int | None) -> int:
    assert job is not None
    (res,) = off.wait([job], timeout=60)
    assert res.success, res.error
    return res.nbytes // BPB


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_round_trip_through_the_cpu_tier_is_bit_exact(tmp_path: Path, flash: bool) -> None:
    pool, _ = _pool(flash)
    ids = list(range(0, 128))
    want = _content(ids, 1)
    pool.scatter(ids, want)
    keys = _keys(len(ids))
    with _offloader(tmp_path, pool, cpu_blocks=160, mmap=False) as off:
        assert _wait(off, off.submit_store(keys, ids)) == len(ids)
        pool.scatter(ids, torch.zeros_like(want))
        targets = list(range(128, 256))
        plan = off.prepare_load(keys)
        assert plan.hits == len(keys)
        assert _wait(off, off.submit_load(plan, targets)) == len(ids)
        assert torch.equal(pool.gather(targets), want)
        assert off.check() == []


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_disk_blocks_are_prefetched_through_pinned_memory_bit_exact(
    tmp_path: Path, flash: bool
) -> None:
    """cpu -> mmap (write-through), the cpu tier then flushed by other blocks; a claim
    prefetches from the disk straight into the slab, the load copies to the GPU."""
    pool, _ = _pool(flash)
    ids = list(range(64))
    want = _content(ids, 2)
    pool.scatter(ids, want)
    keys = _keys(64)
    with _offloader(tmp_path, pool, cpu_blocks=64, mmap=True) as off:
        assert _wait(off, off.submit_store(keys, ids)) == 64
        assert off.drain()  # the copies down have read the cpu tier
        other = _keys(64, salt=1)
        assert _wait(off, off.submit_store(other, list(range(64, 128)))) == 64
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
        assert _wait(off, off.submit_load(plan, targets)) == 64
        assert torch.equal(pool.gather(targets), want)
        off.release("r")
        assert off.pinned() == [0, 0]


def test_busy_compute_stream_never_yields_a_bad_block(tmp_path: Path) -> None:
    """Each round queues a matmul loop, then writes the blocks with a kernel, and
    submits their store at once: a store that did not wait for the engine's stream
    would read the old bytes. Then it queues a loop and a kernel that overwrites the
    load's target blocks, and submits the load: a load that did not wait would be
    overwritten. Slots and staging buffers are recycled round after round."""
    pool, _ = _pool(False)
    bad = 0
    with _offloader(tmp_path, pool, cpu_blocks=96, mmap=False) as off:
        for rnd in range(12):
            ids = list(range(0, 64))
            targets = list(range(64 + (rnd % 3) * 64, 128 + (rnd % 3) * 64))
            want = _content(ids, 100 + rnd)
            _busy()
            pool.scatter(ids, want)  # queued after the matmuls
            keys = _keys(64, salt=100 + rnd)
            assert _wait(off, off.submit_store(keys, ids)) == 64
            plan = off.prepare_load(keys)
            assert plan.hits == 64
            _busy()
            pool.scatter(targets, torch.zeros_like(want))  # must land before the load
            assert _wait(off, off.submit_load(plan, targets)) == 64
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
    pool, _ = _pool(False)
    kernel = pool._layer_copy()
    assert kernel is not None
    ids = torch.randperm(POOL)[:100].tolist()
    pool.scatter(list(range(POOL)), _content(list(range(POOL)), 7))
    index = pool.device_index(ids)
    by_kernel = torch.empty((len(ids), BPB), dtype=torch.uint8, device="cuda")
    by_torch = torch.empty_like(by_kernel)
    pool.pack(index, by_kernel)
    pool._gather_team(index, by_torch)
    assert torch.equal(by_kernel, by_torch)
    fresh = _content(ids, 8)
    pool.unpack(index, fresh)
    back = torch.empty_like(fresh)
    pool._gather_team(index, back)
    assert torch.equal(back, fresh)
    flash, _ = _pool(True)
    assert flash._layer_copy() is None
