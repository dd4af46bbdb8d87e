"""The GPU tests' blocks: a CUDA block pool in either block layout, contents made on
the device, real tiers behind an Offloader, and a busy compute stream (``tests/gpu``;
CUDA only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16, namespace="gpu")
BPB = LAYOUT.bytes_per_block  # 256 KiB
POOL = 256


def cuda_pool(flash: bool) -> tuple[BlockPool, list[torch.Tensor]]:
    """A CUDA pool in the canonical ``[B, 2, N, H, D]`` layout or flash-attention's
    ``[2, B, N, H, D]`` (``block_dim=1``)."""
    shape = list(LAYOUT.layer_block_shape)  # [2, N, H, D]
    shape = [2, POOL, *shape[1:]] if flash else [POOL, *shape]
    caches = [
        torch.zeros(shape, dtype=LAYOUT.torch_dtype, device="cuda")
        for _ in range(LAYOUT.num_layers)
    ]
    return BlockPool(caches, block_dim=1 if flash else 0), caches


def cuda_offloader(tmp: Path, pool: BlockPool, *, cpu_blocks: int, mmap: bool) -> Offloader:
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


def cuda_content(ids: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (len(ids), BPB), dtype=torch.uint8, device="cuda", generator=gen)


def busy(n: int = 30) -> None:
    """Queue ~tens of milliseconds of matmuls on the current (compute) stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)


def wait_blocks(off: Offloader, job: int | None) -> int:
    assert job is not None
    (res,) = off.wait([job], timeout=60)
    assert res.success, res.error
    return res.nbytes // BPB
