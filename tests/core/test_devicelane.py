"""The device lane's chunking, padding and piece cutting, run on a host pool: the same
code a CUDA pool runs, without a stream or graphs (those run in tests/gpu). A wrong
cut, a padded index that writes a foreign block, or a chunk that reads another's index
rows shows up as a byte mismatch here."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.devicelane import MIN_ROWS, DeviceLane, chunk_rows, size_for
from kvoffload.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=32, dtype="bfloat16")
BLOCKS = 64


def _pool() -> BlockPool:
    pool = BlockPool.allocate(LAYOUT, BLOCKS)
    gen = torch.Generator().manual_seed(7)
    pool.scatter(
        list(range(BLOCKS)),
        torch.randint(0, 256, (BLOCKS, pool.bytes_per_block), dtype=torch.uint8, generator=gen),
    )
    return pool


def _pieces(rows: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """``rows`` cut at ``cuts`` into pieces, as the slab's runs of consecutive slots."""
    bounds = [0, *cuts, rows.shape[0]]
    return [(a, rows[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


def test_sizes_are_powers_of_two_within_a_chunk() -> None:
    assert chunk_rows(2**16) == 512  # 32 MiB
    assert chunk_rows(2**20) == 32
    assert chunk_rows(3 * 2**20) == MIN_ROWS  # never fewer rows than that
    assert [size_for(n, 512) for n in (1, MIN_ROWS, MIN_ROWS + 1, 100, 512)] == [
        MIN_ROWS,
        MIN_ROWS,
        2 * MIN_ROWS,
        128,
        512,
    ]
    assert size_for(1, 4) == 4  # never past the chunk


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("n", [1, 3, 9, 30, 41])
def test_store_packs_exactly_the_blocks_into_the_pieces(chunk: int, n: int) -> None:
    pool = _pool()
    lane = DeviceLane(pool, "store")
    lane.chunk = chunk
    ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(n))[:n].tolist()
    out = torch.zeros((n, pool.bytes_per_block), dtype=torch.uint8)
    lane.run(ids, _pieces(out, [c for c in (2, 5, 17, 33) if c < n]))
    assert torch.equal(out, pool.gather(ids))


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("n", [1, 3, 9, 30, 41])
def test_load_writes_exactly_the_blocks_and_nothing_else(chunk: int, n: int) -> None:
    pool = _pool()
    before = pool.gather(list(range(BLOCKS)))
    lane = DeviceLane(pool, "load")
    lane.chunk = chunk
    ids = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(100 + n))[:n].tolist()
    src = torch.randint(0, 256, (n, pool.bytes_per_block), dtype=torch.uint8)
    lane.run(ids, _pieces(src, [c for c in (1, 6, 20) if c < n]))
    assert torch.equal(pool.gather(ids), src)
    others = [b for b in range(BLOCKS) if b not in set(ids)]
    assert torch.equal(pool.gather(others), before[others])  # padding wrote nobody else


def test_bad_ids_raise_before_anything_is_queued() -> None:
    pool = _pool()
    before = pool.gather(list(range(BLOCKS)))
    lane = DeviceLane(pool, "load")
    src = torch.zeros((2, pool.bytes_per_block), dtype=torch.uint8)
    with pytest.raises(IndexError):
        lane.run([0, BLOCKS], [(0, src)])
    assert torch.equal(pool.gather(list(range(BLOCKS))), before)
    with pytest.raises(ValueError, match="direction"):
        DeviceLane(pool, "sideways")
