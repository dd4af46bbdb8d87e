"""The host pool's flat copy: every layer as rows of one tensor, one indexed copy per
batch (``BlockPool._flat``). Bytes must round-trip exactly whatever the layout, by
either strategy."""

from __future__ import annotations

import pytest
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.hostcopy import QUEUE_MIN_BYTES, Chooser, page_aligned_empty


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes in a page-aligned allocation of its own (vLLM's per-layer caches are
    large allocations, so page-aligned; small mallocs need not be)."""
    gen = torch.Generator().manual_seed(seed)
    numel = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = page_aligned_empty(1, numel).view(-1)
    raw.copy_(torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen))
    return raw.view(dtype).view(shape)


def _smollm2(blocks: int) -> list[torch.Tensor]:
    """vLLM 0.32 CPU attention's cache of SmolLM2-135M: 30 layers of [B, 3, 32, 128]."""
    return [_random((blocks, 3, 32, 128), torch.bfloat16, i) for i in range(30)]


def _mla(blocks: int) -> list[torch.Tensor]:
    """MLA-like: one factor per layer, [B, 32, 576]."""
    return [_random((blocks, 32, 576), torch.bfloat16, 100 + i) for i in range(4)]


def _hybrid(blocks: int) -> BlockPool:
    """A hybrid model's pool as ``connectors.vllm.groups.pool_from_vllm`` builds it: one
    ``uint8 [blocks, page]`` row view per shared layer address, pages of several sizes
    (an attention page and a larger Mamba state page), allocated apart."""
    pages = (8192, 8192, 20480)
    return BlockPool(
        [_random((blocks, page), torch.uint8, 200 + i) for i, page in enumerate(pages)]
    )


POOLS = {
    "smollm2": lambda n: BlockPool(_smollm2(n)),
    "mla": lambda n: BlockPool(_mla(n)),
    "hybrid": _hybrid,
}


@pytest.mark.parametrize("kind", sorted(POOLS))
@pytest.mark.parametrize("choice", [0, 1])
def test_flat_round_trip(kind: str, choice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Chooser, "pick", lambda self: choice)
    pool = POOLS[kind](64)
    assert pool._flat is not None
    n = max(4, -(-QUEUE_MIN_BYTES // pool.bytes_per_block))  # a batch that chooses
    n = min(n, 30)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    want = torch.cat(
        [
            torch.cat([t.reshape(-1).view(torch.uint8) for t in pool.get_kv_from_block(b)])
            for b in src
        ]
    )
    packed = pool.gather(src)
    assert torch.equal(packed.reshape(-1), want)
    others = {b: pool.get_kv_from_block(b) for b in range(64) if b not in dst}
    pool.scatter(dst, packed)
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(pool.get_kv_from_block(s), pool.get_kv_from_block(d), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for b, kv in others.items():  # nothing outside the targets changed
        for a, c in zip(kv, pool.get_kv_from_block(b), strict=True):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_flat_small_batches_and_odd_buffers() -> None:
    pool = BlockPool(_smollm2(16))
    assert pool._flat is not None
    packed = pool.gather([3, 3, 7])  # repeats allowed in a gather
    assert torch.equal(packed[0], packed[1])
    wide = torch.zeros((2, pool.bytes_per_block + 16), dtype=torch.uint8)
    odd = wide[:, 16:]  # rows not contiguous: the per-layer ops serve
    odd.copy_(packed[1:])
    pool.scatter([9, 10], odd)
    assert torch.equal(pool.gather([9, 10]), packed[1:])
    with pytest.raises(IndexError):
        pool.scatter([16], packed[:1])


def test_no_flat_for_small_units() -> None:
    layers = [_random((8, 1, 2, 8), torch.bfloat16, i) for i in range(2)]  # 64-byte rows
    pool = BlockPool(layers)
    assert pool._flat is None
    packed = pool.gather([1, 2])
    pool.scatter([5, 6], packed)
    assert torch.equal(pool.gather([5, 6]), packed)
