"""Blocks for the Offloader's tests: a small layout, keys, and contents derived from
each key, so that any load is checked bit for bit wherever the block came from; and
three real tiers (cpu, mmap, lmdb) to put them in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, namespace="t-off")
BPB = LAYOUT.bytes_per_block  # 16 KiB
POOL = 64


def make_keys(n: int, salt: int = 0) -> list[BlockKey]:
    keys, parent = [], ROOT_KEY
    for i in range(n):
        parent = chain_key(parent, f"{salt}:{i}".encode())
        keys.append(parent)
    return keys


def block_content(key: BlockKey, nbytes: int = BPB) -> torch.Tensor:
    """``nbytes`` random bytes seeded by ``key``: the same key, the same block."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def fill_pool(pool: BlockPool, keys: list[BlockKey], ids: list[int]) -> None:
    pool.scatter(ids, torch.stack([block_content(k) for k in keys]))


def assert_pool_holds(pool: BlockPool, keys: list[BlockKey], ids: list[int]) -> None:
    got = pool.gather(ids)
    for i, key in enumerate(keys):
        assert torch.equal(got[i], block_content(key)), f"block {i} differs"


def three_tiers(tmp: Path, cpu_blocks: int, **lower: Any) -> list[dict[str, Any]]:
    mmap = {
        "name": "ssd",
        "backend": "mmap",
        "capacity": 256 * (BPB + 4096),
        "path": str(tmp / "m"),
    }
    lmdb = {"name": "db", "backend": "lmdb", "capacity": 512 * (BPB + 4096), "path": str(tmp / "l")}
    mmap.update(lower.get("ssd", {}))
    lmdb.update(lower.get("db", {}))
    return [{"name": "cpu", "backend": "cpu", "capacity": cpu_blocks * BPB}, mmap, lmdb]


def make_offloader(tiers: list[dict[str, Any]], pool: BlockPool) -> Offloader:
    return Offloader(load_config({"tiers": tiers}, env={}), LAYOUT, pool)


def store_and_settle(off: Offloader, keys: list[BlockKey], ids: list[int]) -> None:
    assert off.pool is not None
    fill_pool(off.pool, keys, ids)
    job = off.submit_store(keys, ids)
    assert job is not None
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error
    # Write-through copies pin their source until done: settle before the next store.
    assert off.drain()


def corrupt_mmap_payload(off: Offloader, key: BlockKey) -> None:
    """Overwrite 64 payload bytes of ``key``'s block in the mmap tier's slab file."""
    slot = off.tiers[1].manager.state(key).slot  # type: ignore[union-attr]
    backend: Any = off.tiers[1].backend
    path, at = backend.payload_at(slot)  # the slot's payload in its slab file
    fd = os.open(path, os.O_WRONLY)  # buffered: the tier's own fd is O_DIRECT
    try:
        os.pwrite(fd, b"\xff" * 64, at + 100)
        os.fsync(fd)
    finally:
        os.close(fd)
