"""Host-memory paths against a plain torch copy of the same bytes, in one run.

Every transfer to or from a tier goes through :meth:`BlockPool.gather` (engine blocks
-> staging rows) or :meth:`BlockPool.scatter` (back), and the ``cpu`` tier adds one
more indexed copy; none of them can beat ``memcpy``. So each is reported as a ratio
to the memcpy limit of this machine, measured in the same run on the same byte count:
``dst.copy_(src)`` of one contiguous ``uint8`` region as large as the whole batch. A
ratio near 1.0 means the path adds nothing to the copy it must do.

The blocks are a realistic allocation: ids drawn as a random subset of a pool twice
the batch (the engine frees and reuses blocks in no order), the same ids for gather
and scatter; the ``cpu`` tier's slots are shuffled the same way. Used by
``kvoffload bench`` and ``scripts/bench_blockpool.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from kvoffload.backends.cpu import CPUBackend
from kvoffload.blockpool import BlockPool
from kvoffload.config import CPUTierConfig
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.sizes import format_size
from kvoffload.tools.bench.harness import best_seconds, gbps, ratio

logger = logging.getLogger(__name__)

LAYOUTS: Final[tuple[KVLayout, ...]] = (
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16),  # 16 KiB
    KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16),  # 64 KiB
    KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=8),  # 256 KiB
    KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16),  # 2 MiB
)
"""bf16 blocks from 16 KiB to 2 MiB, several layers each, since gather and scatter do
one indexed copy per layer (so the layer count matters, not only the block size)."""

RATIO_MIN_BLOCK_BYTES: Final = 64 * 1024
"""Blocks from this size up count towards the headline ratios. Below it, per-layer
rows are a few KiB and the indexed copy's per-row overhead shows; real models'
blocks (16 tokens x layers x heads x head_dim) are larger."""

PATHS: Final = ("gather", "scatter", "tier_write", "tier_read")


def _random_pool(layout: KVLayout, num_blocks: int, gen: torch.Generator) -> BlockPool:
    """A canonical-shape pool whose bytes are random (not calloc'd zero pages, which
    would read faster than memory really does)."""
    caches = []
    for _ in range(layout.num_layers):
        t = torch.empty((num_blocks, *layout.layer_block_shape), dtype=layout.torch_dtype)
        t.view(torch.int16).random_(generator=gen)
        caches.append(t)
    return BlockPool(caches)


def bench_layout(
    layout: KVLayout,
    total_bytes: int,
    repeat: int,
    *,
    tier: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """One row: the copy baseline and our paths on the same ``total_bytes`` (at least
    8 blocks), in GB/s and as ratios to the copy."""
    gen = torch.Generator().manual_seed(seed)
    n = max(8, total_bytes // layout.bytes_per_block)
    nbytes = n * layout.bytes_per_block
    pool = _random_pool(layout, 2 * n, gen)
    ids: list[int] = torch.randperm(2 * n, generator=gen)[:n].tolist()
    staging = pool.new_staging(n)
    src = torch.empty(nbytes, dtype=torch.uint8).random_(generator=gen)
    dst = torch.empty_like(src)
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(src),
        "gather": lambda: pool.gather(ids, staging),
        "scatter": lambda: pool.scatter(ids, staging),
    }
    backend: CPUBackend | None = None
    if tier:
        cpu = backend = CPUBackend(CPUTierConfig(name="cpu", capacity=nbytes), layout)
        got = cpu.allocate(n)
        assert got is not None  # capacity is exactly n blocks
        order: list[int] = torch.randperm(n, generator=gen).tolist()
        slots = [got[i] for i in order]  # scattered slots, as after churn
        keys = [BlockKey(i.to_bytes(16, "little")) for i in range(n)]
        fns["tier_write"] = lambda: cpu.write(slots, keys, staging)
        fns["tier_read"] = lambda: cpu.read(slots, keys, staging)
    try:
        seconds = best_seconds(fns, repeat)
    finally:
        if backend is not None:
            backend.close()
    # The figures are only worth something if the paths moved the right bytes.
    pool.gather(ids, staging)
    packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in pool.get_kv_from_block(ids[-1])])
    if not torch.equal(staging[-1], packed):
        raise AssertionError(f"{layout}: gather packed the wrong bytes")
    row: dict[str, Any] = {
        "block": format_size(layout.bytes_per_block),
        "block_bytes": layout.bytes_per_block,
        "blocks": n,
        "pool_blocks": 2 * n,
    }
    for key, sec in seconds.items():
        row[f"{key}_gbps"] = gbps(nbytes, sec)
    for key in PATHS:
        if key in seconds:
            row[f"{key}_ratio"] = ratio(row[f"{key}_gbps"], row["copy_gbps"])
    return row


def bench_cpu(
    *,
    layouts: Sequence[KVLayout] = LAYOUTS,
    total_bytes: int = 256 * 1024 * 1024,
    repeat: int = 7,
    tier: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Every layout's row, and the headline ratios for ``kvoffload bench``.

    ``cpu_gather_ratio`` / ``cpu_scatter_ratio`` are the *worst* (minimum) ratio over
    the blocks of at least :data:`RATIO_MIN_BLOCK_BYTES`: a promise that holds at every
    realistic size, not at the friendliest one. ``None`` when no layout is that large.
    """
    rows = []
    for layout in layouts:
        row = bench_layout(layout, total_bytes, repeat, tier=tier, seed=seed)
        logger.info(
            "cpu %s blocks: copy %.2f GB/s, gather %.2fx, scatter %.2fx",
            row["block"],
            row["copy_gbps"],
            row["gather_ratio"],
            row["scatter_ratio"],
        )
        rows.append(row)
    counted = [r for r in rows if r["block_bytes"] >= RATIO_MIN_BLOCK_BYTES]
    return {
        "cpu_gather_ratio": min((r["gather_ratio"] for r in counted), default=None),
        "cpu_scatter_ratio": min((r["scatter_ratio"] for r in counted), default=None),
        "cpu_ratio_min_block_bytes": RATIO_MIN_BLOCK_BYTES,
        "cpu_ratios": rows,
    }
