"""A small cpu tier over one compressed disk tier, and KV-like blocks to fill it with.

The packing tests (mmap and LMDB tiers holding blocks by what they compress to, and the
blocks-per-GiB figures derived from them) all compare a ``compression: none`` tier with
a ``zstd`` one of the same capacity, filled through a real Offloader: one builder and
one store loop here, so that each test says only what differs (the disk tier's backend,
capacity and batch size).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.tools.stress import kv_like
from support.blocks import LAYOUT, POOL


def kv_content(key: BlockKey) -> torch.Tensor:
    """KV-like values seeded by ``key``: a codec shrinks them, each by its own ratio."""
    return kv_like(LAYOUT, 1, int.from_bytes(key[:4], "little"))[0]


def two_tiers(
    tmp: Path, compression: str, *, name: str, backend: str, capacity: int, cpu_capacity: int
) -> list[dict[str, Any]]:
    """A cpu tier of ``cpu_capacity`` bytes over a ``backend`` tier called ``name``,
    ``compression`` its codec, kept under ``tmp / compression`` so that both codecs'
    tiers can live in one test directory."""
    return [
        {"name": "cpu", "backend": "cpu", "capacity": cpu_capacity},
        {
            "name": name,
            "backend": backend,
            "path": str(tmp / compression),
            "capacity": capacity,
            "compression": compression,
        },
    ]


def two_tier_offloader(tiers: list[dict[str, Any]]) -> Offloader:
    """An Offloader over ``tiers`` with its own host pool of :data:`support.blocks.POOL`
    blocks."""
    pool = BlockPool.allocate(LAYOUT, POOL)
    return Offloader(load_config({"tiers": tiers}, env={}), LAYOUT, pool)


def store_batches(
    off: Offloader,
    keys: list[BlockKey],
    *,
    batch: int = 8,
    timeout: float = 30,
    content: Callable[[BlockKey], torch.Tensor] = kv_content,
) -> None:
    """Store ``keys`` through ``off``, ``batch`` at a time, each job settled (drained)
    before the next, so that every write-through has finished when this returns."""
    assert off.pool is not None
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        ids = list(range(len(part)))
        off.pool.scatter(ids, torch.stack([content(k) for k in part]))
        job = off.submit_store(part, ids)
        assert job is not None
        (res,) = off.wait([job], timeout=timeout)
        assert res.success, res.error
        assert off.drain()
