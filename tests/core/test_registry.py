"""The backend registry, with real entry points: an installed test distribution, and
throw-away ``.dist-info`` directories put on ``sys.path`` for the broken cases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvoffload.backends.cpu import CPUBackend

from kvoffload import load_config, registry
from kvoffload.backend import Backend
from kvoffload.config import TierConfig
from kvoffload.exceptions import ConfigError, RegistryError
from kvoffload.layout import KVLayout
from kvoffload.tier import build_tiers

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)


def _fake_dist(tmp_path: Path, name: str, entry_points: str) -> Path:
    """A real (if minimal) installed distribution: importlib.metadata reads it as such."""
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[kvoffload.backends]\n{entry_points}\n")
    return tmp_path


def test_builtin_registers_through_the_entry_point_group(fresh_registry: None) -> None:
    assert registry.known_backends()["cpu"] == "kvoffload.backends.cpu:CPUBackend"
    assert registry.get_backend_class("cpu") is CPUBackend


def test_third_party_backend_from_installed_distribution(fresh_registry: None) -> None:
    assert registry.known_backends()["memdict"] == "kvoffload_testplugin:DictBackend"
    cls = registry.get_backend_class("memdict")
    assert issubclass(cls, Backend)
    assert cls.__module__ == "kvoffload_testplugin"
    # Its own config model validates its own keys, through our config loader.
    cfg = load_config(
        {"tiers": [{"name": "d", "backend": "memdict", "capacity": 4096, "copies": 2}]}
    )
    (tier,) = build_tiers(cfg, LAYOUT)
    assert type(tier.backend) is cls
    assert getattr(tier.backend.config, "copies", None) == 2
    slots = tier.backend.allocate(1)
    assert slots is not None
    row = torch.arange(LAYOUT.bytes_per_block, dtype=torch.int64).to(torch.uint8).view(1, -1)
    tier.backend.write(slots, [b"k" * 16], row)  # type: ignore[list-item]
    out = torch.zeros_like(row)
    assert tier.backend.read(slots, [b"k" * 16], out) == [True]  # type: ignore[list-item]
    assert torch.equal(out, row)


def test_plugin_config_errors_name_the_field(fresh_registry: None) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\].*copies"):
        load_config({"tiers": [{"name": "d", "backend": "memdict", "copies": "many"}]})


def test_unknown_backend_lists_installed_names(fresh_registry: None) -> None:
    with pytest.raises(RegistryError, match=r"unknown backend 'nvme9'.*cpu.*memdict"):
        registry.get_backend_class("nvme9")


def test_entry_point_that_fails_to_import_is_loud(
    fresh_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(
        str(_fake_dist(tmp_path, "brokenplug", "broken = no_such_module_xyz:B"))
    )
    registry.reset()
    assert "broken" in registry.known_backends()
    with pytest.raises(RegistryError) as err:
        registry.get_backend_class("broken")
    msg = str(err.value)
    assert "'broken'" in msg
    assert "no_such_module_xyz:B" in msg
    assert "brokenplug" in msg
    assert "ModuleNotFoundError" in msg
    # The config loader surfaces the same failure as a ConfigError naming the tier.
    with pytest.raises(ConfigError, match=r"tiers\[0\].*no_such_module_xyz"):
        load_config({"tiers": [{"name": "b", "backend": "broken"}]})


def test_entry_point_that_is_not_a_backend_is_loud(
    fresh_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(_fake_dist(tmp_path, "wrongplug", "notabackend = json:dumps")))
    registry.reset()
    with pytest.raises(RegistryError, match=r"'notabackend'.*json:dumps.*not a subclass"):
        registry.get_backend_class("notabackend")


def test_conflicting_duplicate_names_are_an_error(
    fresh_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(_fake_dist(tmp_path, "impostor", "cpu = json:loads")))
    registry.reset()
    with pytest.raises(RegistryError, match=r"'cpu' is registered twice"):
        registry.known_backends()


def test_runtime_registration_and_duplicates(fresh_registry: None) -> None:
    class Mine(CPUBackend):
        pass

    registry.register_backend("mine", Mine)
    assert registry.get_backend_class("mine") is Mine
    with pytest.raises(RegistryError, match="already registered"):
        registry.register_backend("mine", Mine)
    with pytest.raises(RegistryError, match="not a Backend"):
        registry.register_backend("dict", dict)  # type: ignore[arg-type]


def test_tier_config_without_plugin_model_rejects_extra_keys(fresh_registry: None) -> None:
    class Plain(CPUBackend):
        config_model = TierConfig

    registry.register_backend("plain", Plain)
    with pytest.raises(ConfigError, match=r"tiers\[0\].*unknown keys \['speed'\]"):
        load_config({"tiers": [{"name": "p", "backend": "plain", "speed": 3}]})
