"""``inspect``, ``verify [--repair]`` and snapshots on a packed (zstd) ``mmap`` tier.

The maintenance tools open a tier through ``existing_config``, which must reopen a
packed slab as it is (its superblock names its capacity and file size) whatever the
config now says of compression; corrupt payloads are found where the blocks' extents
are, and a snapshot imported into a packed tier is charged by what each block took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from kvoffload.backends.mmap import ALIGN, MmapBackend

from kvoffload.config import KVOffloadConfig, layout_from_config, load_config
from kvoffload.keys import BlockKey, chain_key
from kvoffload.tier import build_tiers
from kvoffload.tools.maintenance import (
    export_snapshot,
    import_snapshot,
    inspect_tiers,
    verify_tiers,
)
from kvoffload.tools.stress import BlockDataGenerator

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 32}  # 32 KiB


def _config(path: Path, compression: str = "zstd", capacity: str = "2MiB") -> KVOffloadConfig:
    raw: dict[str, Any] = {
        "tiers": [
            {
                "name": "disk",
                "backend": "mmap",
                "path": str(path),
                "capacity": capacity,
                "compression": compression,
            }
        ],
        "stress": {"layout": LAYOUT},
    }
    return load_config(raw)


def _gen(cfg: KVOffloadConfig) -> BlockDataGenerator:
    layout = layout_from_config(cfg)
    return BlockDataGenerator(layout.bytes_per_block, seed=5, kind="kv", dtype=layout.dtype)


def _fill(cfg: KVOffloadConfig, n: int) -> list[BlockKey]:
    """``n`` KV-like blocks stored as the books store them (charged by the write)."""
    layout = layout_from_config(cfg)
    gen = _gen(cfg)
    keys = [chain_key(b"p", i.to_bytes(4, "little")) for i in range(n)]
    (tier,) = build_tiers(cfg, layout)
    try:
        out = tier.manager.prepare_store(keys)
        assert out is not None
        buf = torch.empty((len(keys), layout.bytes_per_block), dtype=torch.uint8)
        for i, key in enumerate(out.keys_to_store):
            gen.fill(key, buf[i])
        sizes = tier.backend.write(out.slots, out.keys_to_store, buf)
        assert sizes is not None
        assert all(sizes)
        tier.manager.charge(out.keys_to_store, sizes)
        tier.manager.complete_store(out.keys_to_store)
    finally:
        tier.close()
    return keys


def _read_all(cfg: KVOffloadConfig) -> dict[BlockKey, bool]:
    """Every block a reopen finds, and whether it reads back exactly its bytes."""
    layout = layout_from_config(cfg)
    gen = _gen(cfg)
    (tier,) = build_tiers(cfg, layout)
    try:
        manager: Any = tier.manager
        keys = manager.held_keys()
        slots = manager.prepare_load(keys)
        buf = torch.empty((len(keys), layout.bytes_per_block), dtype=torch.uint8)
        valid = tier.backend.read(slots, keys, buf)
        manager.complete_load(keys)
        row = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
        result = {}
        for i, key in enumerate(keys):
            result[key] = valid[i] and gen.matches(key, buf[i], row)
        assert manager.check() == []
        assert tier.backend.check() == []
        return result
    finally:
        tier.close()


def _corrupt(cfg: KVOffloadConfig, keys: list[BlockKey]) -> None:
    """Flip a byte inside each block's extent, behind the tier's back."""
    layout = layout_from_config(cfg)
    (tier,) = build_tiers(cfg, layout)
    try:
        backend = tier.backend
        assert isinstance(backend, MmapBackend)
        manager: Any = tier.manager
        places = [backend.payload_at(manager.state(k).slot) for k in keys]
    finally:
        tier.close()
    for path, at in places:
        with open(path, "r+b") as f:
            f.seek(at + 100)
            byte = f.read(1)
            f.seek(at + 100)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_inspect_verify_repair_and_snapshots_on_a_packed_tier(tmp_path: Path) -> None:
    """Inspect counts the blocks and their compression; verify reads every one back,
    finds exactly the two corrupted, and ``--repair`` drops them for good; export
    writes the rest, and an import into a new packed tier serves them bit-exact."""
    cfg = _config(tmp_path / "a")
    keys = _fill(cfg, 40)
    (info,) = inspect_tiers(cfg).values()
    assert info["blocks"] == 40
    assert info["stored_bytes"] < info["logical_bytes"]
    # Opened under a config that no longer compresses: still read as it is.
    plain = _config(tmp_path / "a", compression="none")
    assert verify_tiers(plain) == {"disk": {"blocks": 40, "ok": 40, "corrupt": 0, "repaired": 0}}
    _corrupt(cfg, keys[3:5])
    assert verify_tiers(cfg)["disk"] == {"blocks": 40, "ok": 38, "corrupt": 2, "repaired": 0}
    assert verify_tiers(cfg, repair=True)["disk"]["repaired"] == 2
    assert verify_tiers(cfg)["disk"] == {"blocks": 38, "ok": 38, "corrupt": 0, "repaired": 0}
    held = _read_all(cfg)
    assert sorted(held) == sorted(keys[:3] + keys[5:])
    assert all(held.values())

    snap = tmp_path / "snap.safetensors"
    assert export_snapshot(cfg, snap) == 38
    target = _config(tmp_path / "b")
    counts = import_snapshot(target, snap)
    assert counts["imported"] == 38
    assert counts["rejected"] == 0
    again = _read_all(target)
    assert sorted(again) == sorted(held)
    assert all(again.values())


def test_a_snapshot_bigger_than_a_packed_tier_fills_it_by_bytes(tmp_path: Path) -> None:
    """Imported into a packed tier of half the capacity, a snapshot keeps what that
    tier's pages hold at the blocks' own charges (more than the full-size count),
    each block bit-exact."""
    cfg = _config(tmp_path / "a", capacity="4MiB")
    _fill(cfg, 120)
    snap = tmp_path / "snap.safetensors"
    assert export_snapshot(cfg, snap) == 120
    small = _config(tmp_path / "b", capacity="2MiB")
    counts = import_snapshot(small, snap)
    held = _read_all(small)
    assert counts["imported"] == len(held)
    assert all(held.values())
    layout = layout_from_config(small)
    full_blocks = (2 << 20) // MmapBackend.slot_bytes(layout)  # 63 uncompressed
    assert len(held) > full_blocks
    (info,) = inspect_tiers(small).values()
    assert info["stored_bytes"] <= (2 << 20)
    assert ALIGN == 4096
