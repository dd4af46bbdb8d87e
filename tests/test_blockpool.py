"""The block API and batched gather/scatter, over several layouts and dtypes."""

from __future__ import annotations

import pytest
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.exceptions import LayoutMismatchError
from kvoffload.layout import KVLayout

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _random_(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return t


def _pools(dtype: torch.dtype, num_blocks: int = 10) -> dict[str, tuple[list[torch.Tensor], int]]:
    """Per-layer tensors in the layouts engines use, with their block dimension."""
    layers, h, n, d = 3, 2, 4, 8
    return {
        # canonical: [B, 2, N, H, D]
        "canonical": ([torch.empty(num_blocks, 2, n, h, d, dtype=dtype) for _ in range(layers)], 0),
        # CUDA flash attention: [2, B, N, H, D], block dim 1, K and V far apart
        "flash": ([torch.empty(2, num_blocks, n, h, d, dtype=dtype) for _ in range(layers)], 1),
        # vLLM CPU (LBHNC): per-layer [B, H, N, 2*D] int8 views into one shared buffer
        "lbhnc": (_lbhnc_views(dtype, layers, num_blocks, h, n, d), 0),
    }


def _lbhnc_views(
    dtype: torch.dtype, layers: int, blocks: int, h: int, n: int, d: int
) -> list[torch.Tensor]:
    item = torch.empty((), dtype=dtype).element_size()
    c = 2 * d * item
    buf = torch.empty(layers * blocks * h * n * c, dtype=torch.int8)
    per_layer = blocks * h * n * c
    return [buf[i * per_layer : (i + 1) * per_layer].view(blocks, h, n, c) for i in range(layers)]


def _fill(caches: list[torch.Tensor], seed: int) -> None:
    """Random contents for every layer (int8 byte views get random bytes)."""
    for i, t in enumerate(caches):
        if t.dtype == torch.int8:
            gen = torch.Generator().manual_seed(seed + i)
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=gen))
        else:
            _random_(t, seed=seed + i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
def test_get_put_round_trip(kind: str, dtype: torch.dtype) -> None:
    caches, block_dim = _pools(dtype)[kind]
    _fill(caches, seed=0)
    pool = BlockPool(caches, block_dim=block_dim)
    kv = pool.get_kv_from_block(3)
    assert len(kv) == 3
    # copies, not views: changing them does not touch the pool
    before = [t.clone() for t in kv]
    kv[0].zero_()
    assert torch.equal(pool.get_kv_from_block(3)[0], before[0])
    pool.put_kv_into_block(7, before)
    after = pool.get_kv_from_block(7)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # block 7 in the engine's own tensors holds block 3's data
    for t in caches:
        assert torch.equal(t.select(block_dim, 7), t.select(block_dim, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
def test_gather_scatter_round_trip(kind: str, dtype: torch.dtype) -> None:
    src_caches, block_dim = _pools(dtype)[kind]
    _fill(src_caches, seed=10)
    src = BlockPool(src_caches, block_dim=block_dim)
    dst_caches, _ = _pools(dtype)[kind]
    for t in dst_caches:
        t.zero_()
    dst = BlockPool(dst_caches, block_dim=block_dim)
    ids = [9, 0, 4, 5]
    staging = src.gather(ids)
    assert staging.shape == (4, src.bytes_per_block)
    assert staging.dtype == torch.uint8
    # packed form: layer 0's bytes first, then layer 1's ...
    first_layer = src_caches[0].select(block_dim, 9).contiguous().view(-1).view(torch.uint8)
    assert torch.equal(staging[0, : src.layer_bytes[0]], first_layer)
    targets = [1, 2, 8, 6]
    dst.scatter(targets, staging)
    for s, d in zip(ids, targets, strict=True):
        for a, b in zip(src.get_kv_from_block(s), dst.get_kv_from_block(d), strict=True):
            assert torch.equal(a, b)
    # blocks not scattered into stay untouched
    assert all(t.select(block_dim, 0).count_nonzero() == 0 for t in dst_caches)


def test_gather_into_misaligned_buffer_still_correct() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    pool = BlockPool.allocate(layout, 6)
    for i, v in enumerate(pool._views):
        _random_(v, seed=i)
    raw = torch.zeros(3 * pool.bytes_per_block + 1, dtype=torch.uint8)
    out = raw[1:].view(3, pool.bytes_per_block)  # rows start at an odd address
    pool.gather([5, 1, 2], out)
    assert torch.equal(out, pool.gather([5, 1, 2]))
    other = BlockPool.allocate(layout, 6)
    other.scatter([0, 3, 4], out)
    assert torch.equal(other.gather([0, 3, 4]), out)


def test_allocate_matches_layout() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=32, dtype="bfloat16")
    pool = BlockPool.allocate(layout, 5)
    assert pool.num_blocks == 5
    assert pool.num_layers == 4
    assert pool.bytes_per_block == layout.bytes_per_block == 4 * 2 * 32 * 2 * 16 * 2
    pool.check_layout(layout)
    other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(LayoutMismatchError, match="bytes"):
        pool.check_layout(other)


def test_bad_inputs_are_rejected() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float16")
    pool = BlockPool.allocate(layout, 4)
    kv = pool.get_kv_from_block(0)
    with pytest.raises(LayoutMismatchError, match="expected 2 layer tensors"):
        pool.put_kv_into_block(1, kv[:1])
    with pytest.raises(LayoutMismatchError, match="layer 1"):
        pool.put_kv_into_block(1, [kv[0], kv[1].float()])
    with pytest.raises(IndexError):
        pool.get_kv_from_block(4)
    with pytest.raises(IndexError):
        pool.gather([0, 4])
    with pytest.raises(LayoutMismatchError, match="staging buffer"):
        pool.scatter([0], torch.zeros((1, pool.bytes_per_block + 1), dtype=torch.uint8))
    with pytest.raises(LayoutMismatchError, match="blocks"):
        BlockPool([torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(LayoutMismatchError, match="at least one"):
        BlockPool([])


def test_empty_batches() -> None:
    pool = BlockPool.allocate(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2), 2)
    assert pool.gather([]).shape == (0, pool.bytes_per_block)
    pool.scatter([], torch.empty((0, pool.bytes_per_block), dtype=torch.uint8))
