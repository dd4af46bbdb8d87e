"""``inspect``, ``verify`` (with corruption injected into real files) and snapshots."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from kvoffload.backends.mmap import ALIGN, MmapBackend
from support.checkout import KVOFFLOAD

from kvoffload.config import KVOffloadConfig, layout_from_config, load_config
from kvoffload.exceptions import LayoutMismatchError
from kvoffload.keys import BlockKey, chain_key
from kvoffload.record import HEADER_BYTES
from kvoffload.tier import Tier, build_tiers
from kvoffload.tools.maintenance import (
    export_snapshot,
    import_snapshot,
    inspect_tiers,
    verify_tiers,
)
from kvoffload.tools.stress import BlockDataGenerator

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}  # 8 KiB


def raw_config(
    path: Path, backend: str = "mmap", layout: dict[str, Any] = LAYOUT
) -> dict[str, Any]:
    return {
        "tiers": [{"name": "disk", "backend": backend, "path": str(path), "capacity": "4MiB"}],
        "stress": {"layout": layout},
    }


def fill(cfg: KVOffloadConfig, n: int, tag: bytes = b"m") -> list[BlockKey]:
    layout = layout_from_config(cfg)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=3)
    keys = [chain_key(tag, i.to_bytes(4, "little")) for i in range(n)]
    tiers: list[Tier] = build_tiers(cfg, layout)
    tier = tiers[0]
    plan = tier.manager.prepare_store(keys)
    assert plan is not None
    buf = torch.empty((len(keys), layout.bytes_per_block), dtype=torch.uint8)
    for i, k in enumerate(plan.keys_to_store):
        gen.fill(k, buf[i])
    tier.backend.write(plan.slots, plan.keys_to_store, buf)
    tier.manager.complete_store(plan.keys_to_store)
    tier.close()
    return keys


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_inspect_reports_blocks_bytes_ages_and_fill(tmp_path: Path, backend: str) -> None:
    cfg = load_config(raw_config(tmp_path / "t", backend))
    fill(cfg, 12)
    (info,) = inspect_tiers(cfg).values()
    assert info["blocks"] == 12
    assert info["bytes"] == 12 * 8192
    assert 0 < info["used"] < 1
    assert info["oldest"] <= info["newest"]
    assert info["fingerprint"] == layout_from_config(cfg).fingerprint.hex()


def _corrupt_mmap_payloads(path: Path, slots: list[int]) -> None:
    slab = path / "slab-000.kvo"
    meta = MmapBackend.read_superblock(slab)
    assert meta is not None
    table = (meta["num_slots"] * HEADER_BYTES + ALIGN - 1) // ALIGN * ALIGN
    with open(slab, "r+b") as f:
        for slot in slots:
            off = ALIGN + table + slot * meta["stride"] + 123
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x5A]))


def test_verify_finds_every_corrupted_block_and_repair_frees_them(tmp_path: Path) -> None:
    cfg = load_config(raw_config(tmp_path / "t"))
    keys = fill(cfg, 40)
    bad_slots = sorted(random.Random(5).sample(range(40), 7))  # slots 0..39 in key order
    _corrupt_mmap_payloads(tmp_path / "t", bad_slots)
    assert verify_tiers(cfg) == {"disk": {"blocks": 40, "ok": 33, "corrupt": 7, "repaired": 0}}
    # verify without --repair changes nothing
    assert verify_tiers(cfg)["disk"]["corrupt"] == 7
    assert verify_tiers(cfg, repair=True)["disk"] == {
        "blocks": 40,
        "ok": 33,
        "corrupt": 7,
        "repaired": 7,
    }
    assert verify_tiers(cfg)["disk"] == {"blocks": 33, "ok": 33, "corrupt": 0, "repaired": 0}
    # the corrupt keys are misses after the repair
    (tier,) = build_tiers(cfg, layout_from_config(cfg))
    held = [tier.manager.lookup([k]) for k in keys]
    tier.close()
    assert [i for i, h in enumerate(held) if not h] == bad_slots


@pytest.mark.slow
def test_verify_cli_exit_codes_and_json(tmp_path: Path) -> None:
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(raw_config(tmp_path / "t")))
    cfg = load_config(cfg_path)
    fill(cfg, 10)
    ok = subprocess.run(
        [str(KVOFFLOAD), "verify", "--config", str(cfg_path)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert "10 blocks, 10 ok, 0 corrupt" in ok.stdout
    _corrupt_mmap_payloads(tmp_path / "t", [3])
    out = tmp_path / "v.json"
    bad = subprocess.run(
        [str(KVOFFLOAD), "verify", "--config", str(cfg_path), "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert json.loads(out.read_text()) == {
        "disk": {"blocks": 10, "ok": 9, "corrupt": 1, "repaired": 0}
    }
    fixed = subprocess.run(
        [str(KVOFFLOAD), "verify", "--config", str(cfg_path), "--repair"],
        capture_output=True,
        text=True,
    )
    assert fixed.returncode == 0
    assert "1 repaired" in fixed.stdout
    inspect = subprocess.run(
        [str(KVOFFLOAD), "inspect", "--config", str(cfg_path)], capture_output=True, text=True
    )
    assert inspect.returncode == 0
    assert "disk (mmap): 9 blocks" in inspect.stdout


@pytest.mark.parametrize(("src", "dst"), [("mmap", "mmap"), ("mmap", "lmdb"), ("lmdb", "mmap")])
def test_snapshot_round_trip_is_bit_exact(tmp_path: Path, src: str, dst: str) -> None:
    cfg_a = load_config(raw_config(tmp_path / "a", src))
    keys = fill(cfg_a, 25)
    snap = tmp_path / "out" / "snap.safetensors"
    assert export_snapshot(cfg_a, snap) == 25
    cfg_b = load_config(raw_config(tmp_path / "b", dst))  # a new node: empty tier
    assert import_snapshot(cfg_b, snap) == {
        "blocks": 25,
        "imported": 25,
        "evicted": 0,
        "present": 0,
        "rejected": 0,
    }
    # importing again finds them all present
    assert import_snapshot(cfg_b, snap)["present"] == 25
    layout = layout_from_config(cfg_b)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=3)
    (tier,) = build_tiers(cfg_b, layout)
    slots = tier.manager.prepare_load(keys)
    buf = torch.empty((25, layout.bytes_per_block), dtype=torch.uint8)
    assert tier.backend.read(slots, keys, buf) == [True] * 25
    scratch = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
    assert all(gen.matches(k, buf[i], scratch) for i, k in enumerate(keys))
    tier.manager.complete_load(keys)
    tier.close()
    # the file is a plain safetensors file other tools can read
    from safetensors.torch import load_file

    tensors = load_file(str(snap))
    assert tensors["blocks"].shape == (25, layout.bytes_per_block)


def test_snapshot_of_another_layout_is_refused(tmp_path: Path) -> None:
    cfg_a = load_config(raw_config(tmp_path / "a"))
    fill(cfg_a, 5)
    snap = tmp_path / "s.safetensors"
    export_snapshot(cfg_a, snap)
    other = {**LAYOUT, "num_layers": 4}
    cfg_b = load_config(raw_config(tmp_path / "b", layout=other))
    fill(cfg_b, 3)  # tier b now holds data of the other layout
    with pytest.raises(LayoutMismatchError, match=r"does not match tier 'disk'"):
        import_snapshot(cfg_b, snap)
    cfg_path = tmp_path / "b.yaml"
    cfg_path.write_text(yaml.safe_dump(raw_config(tmp_path / "b", layout=other)))
    proc = subprocess.run(
        [str(KVOFFLOAD), "snapshot", "import", "--config", str(cfg_path), str(snap)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "does not match tier 'disk'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_tools_never_reformat_or_shrink_a_tier(tmp_path: Path, backend: str) -> None:
    """A config whose capacity changed must not cost data when only inspecting."""
    cfg = load_config(raw_config(tmp_path / "t", backend))
    fill(cfg, 30)
    small = raw_config(tmp_path / "t", backend)
    small["tiers"][0]["capacity"] = "64KiB"  # room for ~7 blocks: opening it would shrink
    small_cfg = load_config(small)
    assert inspect_tiers(small_cfg)["disk"]["blocks"] == 30
    assert verify_tiers(small_cfg)["disk"]["ok"] == 30
    assert inspect_tiers(cfg)["disk"]["blocks"] == 30  # still all there


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_tools_do_not_create_missing_tiers(tmp_path: Path, backend: str) -> None:
    cfg = load_config(raw_config(tmp_path / "nowhere", backend))
    assert inspect_tiers(cfg)["disk"] == {
        "backend": backend,
        "persistent": True,
        "blocks": 0,
        "missing": True,
    }
    assert verify_tiers(cfg)["disk"]["blocks"] == 0
    assert not (tmp_path / "nowhere").exists()


def test_verify_leaves_access_order_alone(tmp_path: Path) -> None:
    cfg = load_config(raw_config(tmp_path / "t"))
    fill(cfg, 10)
    before = inspect_tiers(cfg)["disk"]
    verify_tiers(cfg)
    after = inspect_tiers(cfg)["disk"]
    assert (after["oldest"], after["newest"]) == (before["oldest"], before["newest"])


def test_snapshot_bigger_than_the_tier_counts_what_it_evicted(tmp_path: Path) -> None:
    cfg_a = load_config(raw_config(tmp_path / "a"))
    fill(cfg_a, 60)
    snap = tmp_path / "s.safetensors"
    export_snapshot(cfg_a, snap)
    small = raw_config(tmp_path / "b")
    small["tiers"][0]["capacity"] = 20 * (8192 + HEADER_BYTES)  # 20 slots
    counts = import_snapshot(load_config(small), snap)
    assert counts["blocks"] == 60
    assert counts["imported"] == 20
    assert counts["imported"] + counts["evicted"] + counts["rejected"] == 60
    assert inspect_tiers(load_config(small))["disk"]["blocks"] == 20


def _damaged(snap: Path, how: str) -> None:
    """Rewrite the good snapshot ``snap`` the way ``how`` says."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    data = snap.read_bytes()
    with safe_open(str(snap), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if how == "garbage":
        snap.write_bytes(random.Random(5).randbytes(4096))
    elif how == "empty":
        snap.write_bytes(b"")
    elif how == "truncated":
        snap.write_bytes(data[: len(data) // 2])
    elif how == "huge-header":
        snap.write_bytes((2**60).to_bytes(8, "little") + data[8:])
    elif how == "wrong-dtype":
        save_file({**tensors, "key_lens": tensors["key_lens"].to(torch.int32)}, str(snap), meta)
    elif how == "wrong-shape":
        save_file({**tensors, "blocks": tensors["blocks"][:, :-64].clone()}, str(snap), meta)
    elif how == "missing-tensor":
        save_file({"blocks": tensors["blocks"], "keys": tensors["keys"]}, str(snap), meta)
    elif how == "bad-key-length":
        lens = tensors["key_lens"].clone()
        lens[0] = 1000
        save_file({**tensors, "key_lens": lens}, str(snap), meta)
    elif how == "other-format":
        save_file(tensors, str(snap), {**meta, "format": "someone-else/1"})
    elif how == "layout-fingerprint-mismatch":
        other = {**json.loads(meta["layout"]), "num_layers": 4}
        save_file(tensors, str(snap), {**meta, "layout": json.dumps(other)})
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "garbage",
        "empty",
        "truncated",
        "huge-header",
        "wrong-dtype",
        "wrong-shape",
        "missing-tensor",
        "bad-key-length",
        "other-format",
        "layout-fingerprint-mismatch",
    ],
)
def test_a_damaged_snapshot_is_refused_before_any_tier_is_touched(tmp_path: Path, how: str) -> None:
    cfg_a = load_config(raw_config(tmp_path / "a"))
    fill(cfg_a, 5)
    snap = tmp_path / "s.safetensors"
    export_snapshot(cfg_a, snap)
    _damaged(snap, how)
    target = tmp_path / "b"
    with pytest.raises(LayoutMismatchError, match=r"s\.safetensors: not a usable kvoffload"):
        import_snapshot(load_config(raw_config(target)), snap)
    assert not target.exists()  # validated first: no tier directory was even created
    cfg_path = tmp_path / "b.yaml"
    cfg_path.write_text(yaml.safe_dump(raw_config(target)))
    proc = subprocess.run(
        [str(KVOFFLOAD), "snapshot", "import", "--config", str(cfg_path), str(snap)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "s.safetensors" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not target.exists()
