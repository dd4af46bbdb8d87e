"""Block keys (prefix chaining) and the layout fingerprint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvoffload.keys import MAX_KEY_BYTES, chain_block_keys, key_from_hash, namespaced
from kvoffload.layout import KVLayout


def test_keys_chain_over_the_prefix() -> None:
    a = chain_block_keys(list(range(40)), 16)
    b = chain_block_keys([*range(32), 99, 98], 16)
    assert len(a) == 2
    assert len(b) == 2
    assert a[0] == b[0]
    assert a[1] == b[1]
    c = chain_block_keys([1, *range(1, 32)], 16)
    # one changed token in block 0 changes block 1's key too: keys name prefixes
    assert c[0] != a[0]
    assert c[1] != a[1]


def test_same_block_tokens_after_different_prefix_differ() -> None:
    x = chain_block_keys([1] * 16 + [7] * 16, 16)
    y = chain_block_keys([2] * 16 + [7] * 16, 16)
    assert x[1] != y[1]


def test_extra_keys_separate_sequences() -> None:
    tokens = list(range(32))
    plain = chain_block_keys(tokens, 16)
    salted = chain_block_keys(tokens, 16, extra_keys=("lora-7",))
    assert plain[0] != salted[0]
    assert plain[1] != salted[1]
    assert salted == chain_block_keys(tokens, 16, extra_keys=("lora-7",))


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from kvoffload.keys import chain_block_keys; "
        "print(chain_block_keys(list(range(32)), 16)[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == chain_block_keys(list(range(32)), 16)[1].hex()


def test_engine_hashes_are_accepted() -> None:
    assert key_from_hash(b"\x01" * 32) == b"\x01" * 32
    assert len(key_from_hash(12345)) == 16
    assert key_from_hash(-1) != key_from_hash(1)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        key_from_hash(b"x" * (MAX_KEY_BYTES + 1))
    assert namespaced(b"k", b"rank0") != namespaced(b"k", b"rank1")


def test_layout_sizes_and_fingerprint() -> None:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert layout.bytes_per_block == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB, Llama-3-8B-like
    same = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert layout.fingerprint == same.fingerprint
    assert len(layout.fingerprint) == 16
    variants = [
        KVLayout(num_layers=31, num_kv_heads=8, head_dim=128, block_size=16),
        KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"),
        KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=32),
        KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, namespace="tp1"),
    ]
    assert len({v.fingerprint for v in variants} | {layout.fingerprint}) == 5


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "from kvoffload.layout import KVLayout; "
        "print(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4).fingerprint.hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    want = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4).fingerprint.hex()
    assert out.stdout.strip() == want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"head_dim": -1},
        {"block_size": True},
        {"dtype": "float64"},
    ],
)
def test_bad_layouts_are_rejected(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    with pytest.raises(ValueError, match=next(iter(kwargs)) if "dtype" not in kwargs else "dtype"):
        KVLayout(**{**base, **kwargs})  # type: ignore[arg-type]
