"""The device lane on a GPU: recorded CUDA graphs pack and unpack bit-exactly, for job
sizes that fill a static size exactly, need padding, or span several chunks, and a
busy compute stream does not reorder them. Deselected without CUDA."""

from __future__ import annotations

import pytest
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.devicelane import DeviceLane
from kvoffload.layout import KVLayout

pytestmark = pytest.mark.cuda  # deselected without CUDA (tests/conftest.py)

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16, namespace="lane")
BLOCKS = 512


def _pool() -> BlockPool:
    pool = BlockPool.allocate(LAYOUT, BLOCKS, device="cuda")
    pool.scatter(
        list(range(BLOCKS)),
        torch.randint(0, 256, (BLOCKS, pool.bytes_per_block), dtype=torch.uint8, device="cuda"),
    )
    return pool


def _pinned(n: int, bpb: int) -> torch.Tensor:
    return torch.zeros((n, bpb), dtype=torch.uint8, pin_memory=True)


@pytest.mark.parametrize("graphs", [True, False])
def test_round_trips_through_recorded_graphs(graphs: bool) -> None:
    pool = _pool()
    store, load = DeviceLane(pool, "store", graphs=graphs), DeviceLane(pool, "load", graphs=graphs)
    store.chunk = load.chunk = 64  # several chunks per job below
    reference = pool.gather(list(range(BLOCKS))).cpu()
    gen = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 9, 63, 64, 65, 200, 200, 200):  # repeats: replayed, not recorded
        src = torch.randperm(BLOCKS // 2, generator=gen)[:n].tolist()
        dst = [BLOCKS // 2 + b for b in torch.randperm(BLOCKS // 2, generator=gen)[:n].tolist()]
        rows = _pinned(n, pool.bytes_per_block)
        store.run(src, [(0, rows[: n // 2]), (n // 2, rows[n // 2 :])])
        assert torch.equal(rows, reference[src])
        before = pool.gather(list(range(BLOCKS))).cpu()
        load.run(dst, [(0, rows)])
        after = pool.gather(list(range(BLOCKS))).cpu()
        assert torch.equal(after[dst], reference[src])
        others = [b for b in range(BLOCKS) if b not in set(dst)]
        assert torch.equal(after[others], before[others])  # padding wrote nobody else
    sizes = [s for lane in (store, load) for t in lane._threads for s in t.sizes.values()]
    recorded = [s.graph is not None for s in sizes]
    assert any(recorded) == graphs
    assert 0 < store.device_bytes() <= 2 * 64 * pool.bytes_per_block + 4096


def test_a_store_waits_for_the_kernel_the_engine_queued_before_it() -> None:
    pool = _pool()
    lane = DeviceLane(pool, "store")
    ids = list(range(64))
    for _ in range(3):  # record the graph first
        lane.run(ids, [(0, _pinned(64, pool.bytes_per_block))])
    a = torch.randn(4096, 4096, device="cuda")
    for value in range(1, 6):
        for _ in range(20):
            a = a @ a / 4096  # keep the engine's stream busy
        for view in pool._views:
            view[:64].fill_(value)  # queued after the matmuls
        after = torch.cuda.current_stream().record_event()
        rows = _pinned(64, pool.bytes_per_block)
        lane.run(ids, [(0, rows)], after)
        assert torch.equal(rows, pool.gather(ids).cpu())
