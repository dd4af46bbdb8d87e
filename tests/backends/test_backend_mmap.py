"""The ``mmap`` SSD slab: contract, persistence, verification, failures. Real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kvoffload.backends.mmap import ALIGN, MmapBackend
from support.checkout import SUPPORT

from kvoffload.config import KVOffloadConfig, MmapTierConfig, layout_from_config, load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey, chain_key
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES
from kvoffload.testing import BackendContract, BackendFactory, make_backend
from kvoffload.tier import Tier, build_tiers
from kvoffload.tools.stress import BlockDataGenerator

STRESS_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}  # 8 KiB


class TestMmapContractDirect(BackendContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, n: make_backend("mmap", layout, n, tmp_path, direct_io="on")


class TestMmapContractBuffered(BackendContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, n: make_backend("mmap", layout, n, tmp_path, direct_io="off")


class TestMmapContractCompressedDirect(BackendContract):
    """Compressed blocks (the contract's KV-like rows) use the front of their slots."""

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, n: make_backend(
            "mmap", layout, n, tmp_path, direct_io="on", compression="zstd"
        )


class TestMmapContractCompressedBuffered(BackendContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, n: make_backend(
            "mmap", layout, n, tmp_path, direct_io="off", compression="lz4"
        )


def config(path: Path, capacity: str = "4MiB", **extra: Any) -> KVOffloadConfig:
    tier = {"name": "ssd", "backend": "mmap", "path": str(path), "capacity": capacity, **extra}
    return load_config({"tiers": [tier], "stress": {"layout": STRESS_LAYOUT}})


def open_tier(cfg: KVOffloadConfig) -> Tier:
    (tier,) = build_tiers(cfg, layout_from_config(cfg))
    return tier


def keys(n: int, tag: bytes = b"k") -> list[BlockKey]:
    return [chain_key(tag, i.to_bytes(4, "little")) for i in range(n)]


def store(tier: Tier, ks: list[BlockKey], gen: BlockDataGenerator) -> None:
    plan = tier.manager.prepare_store(ks)
    assert plan is not None
    buf = torch.empty((len(plan.keys_to_store), gen.nbytes), dtype=torch.uint8)
    for i, k in enumerate(plan.keys_to_store):
        gen.fill(k, buf[i])
    tier.backend.write(plan.slots, plan.keys_to_store, buf)
    tier.manager.complete_store(plan.keys_to_store)


def load(tier: Tier, ks: list[BlockKey], gen: BlockDataGenerator) -> list[bool]:
    """Per key: loaded and bit-exact. Corrupt ones are dropped, as the engine would."""
    n = tier.manager.lookup(ks)
    assert n == len(ks), f"only {n} of {len(ks)} keys held"
    slots = tier.manager.prepare_load(ks)
    buf = torch.empty((len(ks), gen.nbytes), dtype=torch.uint8)
    valid = tier.backend.read(slots, ks, buf)
    tier.manager.complete_load(ks)
    scratch = torch.empty(gen.nbytes, dtype=torch.uint8)
    exact = [
        v and gen.matches(k, buf[i], scratch)
        for i, (k, v) in enumerate(zip(ks, valid, strict=False))
    ]
    tier.drop([k for k, v in zip(ks, valid, strict=True) if not v])
    return exact


@pytest.fixture
def gen() -> BlockDataGenerator:
    return BlockDataGenerator(8192, seed=1)


def test_restart_restores_blocks_and_lru_order(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t")
    tier = open_tier(cfg)
    ks = keys(20)
    store(tier, ks, gen)
    assert load(tier, ks[:5], gen) == [True] * 5  # 0..4 are now the most recently used
    tier.close()

    tier = open_tier(cfg)
    assert tier.manager.lookup(ks) == 20
    assert load(tier, ks, gen) == [True] * 20
    assert tier.manager.check() == []
    assert tier.backend.check() == []
    tier.close()


def test_recovered_order_follows_access_times(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t", capacity=str(10 * (8192 + HEADER_BYTES)))
    tier = open_tier(cfg)
    ks = keys(10)
    store(tier, ks, gen)
    load(tier, ks[:3], gen)  # touch 0..2 after the others were written
    tier.close()
    tier = open_tier(cfg)
    # full tier: storing 3 new blocks evicts the 3 least recently used: 3, 4, 5 or so,
    # never the touched 0..2
    plan = tier.manager.prepare_store(keys(3, b"new"))
    assert plan is not None
    assert not set(plan.evicted) & set(ks[:3])
    tier.manager.complete_store(plan.keys_to_store, success=False)
    tier.close()


def test_layout_mismatch_is_all_misses(tmp_path: Path, gen: BlockDataGenerator) -> None:
    tier = open_tier(config(tmp_path / "t"))
    store(tier, keys(8), gen)
    tier.close()
    other = {**STRESS_LAYOUT, "dtype": "float16"}  # same size, other fingerprint
    cfg = load_config(
        {
            "tiers": [
                {"name": "ssd", "backend": "mmap", "path": str(tmp_path / "t"), "capacity": "4MiB"}
            ],
            "stress": {"layout": other},
        }
    )
    tier = open_tier(cfg)
    assert tier.manager.lookup(keys(8)) == 0
    assert len(tier.manager) == 0
    tier.close()


def _slab(path: Path) -> tuple[Path, dict[str, Any]]:
    slab = path / "slab-000.kvo"
    meta = MmapBackend.read_superblock(slab)
    assert meta is not None
    return slab, meta


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_payload_is_a_miss_and_freed(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t")
    tier = open_tier(cfg)
    ks = keys(6)
    store(tier, ks, gen)
    slot = tier.manager.state(ks[2]).slot  # type: ignore[union-attr]
    tier.close()
    slab, meta = _slab(tmp_path / "t")
    table = (meta["num_slots"] * HEADER_BYTES + ALIGN - 1) // ALIGN * ALIGN
    _flip(slab, ALIGN + table + slot * meta["stride"] + 1000)
    tier = open_tier(cfg)
    assert tier.manager.lookup(ks) == 6  # headers are fine; the payload is checked on load
    assert load(tier, ks, gen) == [True, True, False, True, True, True]
    assert tier.manager.lookup(ks[2:3]) == 0  # dropped: a miss from now on
    tier.close()
    tier = open_tier(cfg)
    assert tier.manager.lookup(ks[2:3]) == 0  # and after a restart
    tier.close()


def test_flipped_header_is_reclaimed_at_open(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t")
    tier = open_tier(cfg)
    ks = keys(6)
    store(tier, ks, gen)
    slot = tier.manager.state(ks[4]).slot  # type: ignore[union-attr]
    tier.close()
    slab, _ = _slab(tmp_path / "t")
    _flip(slab, ALIGN + slot * HEADER_BYTES + 40)  # inside the layout fingerprint
    tier = open_tier(cfg)
    assert [tier.manager.lookup([k]) for k in ks] == [1, 1, 1, 1, 0, 1]
    tier.close()


def test_truncated_file_starts_clean(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t")
    tier = open_tier(cfg)
    store(tier, keys(4), gen)
    tier.close()
    slab, _ = _slab(tmp_path / "t")
    with open(slab, "r+b") as f:
        f.truncate(ALIGN + 100)
    tier = open_tier(cfg)  # header table unreadable: the file is rebuilt, nothing served
    assert tier.manager.lookup(keys(4)) == 0
    store(tier, keys(4), gen)
    assert load(tier, keys(4), gen) == [True] * 4
    tier.close()


def test_newest_copy_of_a_key_wins(tmp_path: Path, gen: BlockDataGenerator) -> None:
    cfg = config(tmp_path / "t")
    tier = open_tier(cfg)
    ks = keys(3)
    store(tier, ks, gen)
    tier.manager.remove(ks[:1])  # evicted from the books; the record stays on disk
    store(tier, ks[:1], gen)  # stored again, in another slot
    tier.close()
    tier = open_tier(cfg)
    assert len(tier.manager) == 3
    assert load(tier, ks, gen) == [True] * 3
    tier.close()


def test_second_process_on_same_dir_is_refused(tmp_path: Path) -> None:
    tier = open_tier(config(tmp_path / "t"))
    code = (
        "import json,sys; from kvoffload.config import layout_from_config, load_config;"
        "from kvoffload.tier import build_tiers;"
        "c=load_config(json.loads(sys.argv[1])); build_tiers(c, layout_from_config(c))"
    )
    raw = {
        "tiers": [
            {"name": "ssd", "backend": "mmap", "path": str(tmp_path / "t"), "capacity": "4MiB"}
        ]
    }
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(raw)], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "is in use by another writer process" in proc.stderr
    tier.close()


def test_full_disk_fails_stores_cleanly_and_loads_keep_working(tmp_path: Path) -> None:
    raw = {
        "tiers": [
            {
                "name": "ssd",
                "backend": "mmap",
                "path": str(tmp_path / "t"),
                "capacity": "1MiB",
                "preallocate": False,
            }
        ],
        "stress": {"layout": STRESS_LAYOUT},
    }
    meta_slots = 1024 * 1024 // (8192 + HEADER_BYTES)
    table = (meta_slots * HEADER_BYTES + ALIGN - 1) // ALIGN * ALIGN
    limit = ALIGN + table + 40 * 8192  # room for the first 40 slots only
    proc = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "tierproc.py"),
            "fill_past_limit",
            json.dumps(raw),
            str(limit),
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"stored": 40, "failed": 60, "raised": 0, "loaded": 40}


def test_unusable_directory_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2)
    cfg = MmapTierConfig(name="ssd", path=str(blocker / "sub"), capacity=1 << 20)
    with pytest.raises(ConfigError, match=r"tier 'ssd': path = .*cannot use directory"):
        MmapBackend(cfg, layout)
