"""What the benchmark scripts feed a tier: captured KV blocks and chains of keys.

Several scripts in ``scripts/`` measure a tier on real KV (an ``.npz`` written by
``scripts/capture_kv.py``: ``blocks``, one row of bytes per 32-token block, and an
optional JSON ``meta``) or on chains of prefix keys; they read a capture and build its
layout here, so that every script sees the same blocks the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.layout import KVLayout

_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16"}


def block_layout(nbytes: int, itemsize: int, namespace: str) -> KVLayout:
    """A layout whose blocks are ``nbytes`` of ``itemsize``-byte values, one layer of
    one head (the tier sees only the block's size, its dtype, which a codec's shuffle
    uses, and the layout's fingerprint)."""
    values = nbytes // itemsize
    if values % 64:
        raise SystemExit(f"a block of {nbytes} bytes is not 32 tokens of K and V; use 64 KiB")
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=values // 64,
        block_size=32,
        dtype=_DTYPES[itemsize],
        namespace=namespace,
    )


def read_capture(path: Path, namespace: str) -> tuple[KVLayout, npt.NDArray[Any], str]:
    """The capture's blocks (one row of bytes each), their layout, and the line a
    benchmark prints to say what it ran on (the blocks are cycled to fill a run)."""
    with np.load(path) as z:
        blocks = z["blocks"]
        meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    layout = block_layout(blocks.shape[1], int(meta.get("element_size", 2)), namespace)
    return layout, blocks, f"{path.name} ({len(blocks)} captured blocks, cycled)"


def key_chain(n: int, salt: str) -> list[BlockKey]:
    """``n`` keys of one prefix chain (each the hash of its parent and ``salt:i``), so a
    different ``salt`` gives blocks no other chain shares."""
    keys, parent = [], ROOT_KEY
    for i in range(n):
        parent = chain_key(parent, f"{salt}:{i}".encode())
        keys.append(parent)
    return keys
