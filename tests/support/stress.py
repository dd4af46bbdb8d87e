"""The small ``stress`` setting the stress and replica tests share: a 2-layer layout
of 8 KiB blocks and a 16-block pool, so a run of a few hundred ops is quick and still
evicts."""

from __future__ import annotations

from typing import Any

SMALL_STRESS: dict[str, Any] = {
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16},
    "pool_blocks": 16,
    "prefixes": 12,
    "prefix_blocks": 8,
    "suffix_blocks": 2,
}
BLOCK = 2 * 2 * 16 * 2 * 32 * 2  # 8 KiB: layers x (K, V) x tokens x heads x dim x bf16
