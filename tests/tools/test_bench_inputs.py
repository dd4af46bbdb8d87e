"""The benchmark scripts' inputs: a KV capture read into its layout, chains of keys."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvoffload.keys import ROOT_KEY, chain_key
from kvoffload.tools.bench.inputs import block_layout, key_chain, read_capture


def test_block_layout_is_one_layer_of_32_tokens() -> None:
    layout = block_layout(64 * 1024, 2, "bench-x")
    assert layout.bytes_per_block == 64 * 1024
    assert (layout.num_layers, layout.block_size, layout.dtype) == (1, 32, "bfloat16")
    assert block_layout(64 * 1024, 1, "bench-x").dtype == "float8_e4m3fn"
    with pytest.raises(SystemExit, match="not 32 tokens"):
        block_layout(1000, 2, "bench-x")


def test_read_capture_takes_the_element_size_from_meta(tmp_path: Path) -> None:
    blocks = np.arange(3 * 4096, dtype=np.uint8).reshape(3, 4096)
    path = tmp_path / "cap.npz"
    np.savez(path, blocks=blocks, meta=json.dumps({"element_size": 1}))
    layout, read, what = read_capture(path, "bench-x")
    assert np.array_equal(read, blocks)
    assert (layout.bytes_per_block, layout.dtype) == (4096, "float8_e4m3fn")
    assert what == "cap.npz (3 captured blocks, cycled)"
    np.savez(path, blocks=blocks)
    assert read_capture(path, "bench-x")[0].dtype == "bfloat16"


def test_key_chain_chains_salted_keys() -> None:
    keys = key_chain(2, "g0")
    first = chain_key(ROOT_KEY, b"g0:0")
    assert keys == [first, chain_key(first, b"g0:1")]
    assert key_chain(2, "g1")[0] != first
