"""The redis tier outside the engine's path, against real ``redis-server`` processes:
``kvoffload inspect`` and ``verify`` (with ``--repair``) on a tier whose blocks live on
a shared server, and its secrets (``password``, ``username``), which reach the backend
intact and show nowhere else: no repr, dump, CLI output or validation error."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path
from typing import Any, Final

import pytest
import torch
import yaml
from kvoffload.backends.cpu import CPUBackend
from pydantic import SecretStr, ValidationError
from support.blocks import make_keys
from support.checkout import KVOFFLOAD
from support.redisserver import RedisServer, require_redis

from kvoffload.backend import Backend
from kvoffload.blockpool import BlockPool
from kvoffload.config import (
    KVOffloadConfig,
    TierConfig,
    layout_from_config,
    load_config,
    secret_fields,
)
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.record import HEADER_BYTES
from kvoffload.registry import register_backend
from kvoffload.tools.maintenance import export_snapshot, inspect_tiers, verify_tiers

SECRET: Final = "s3cr3t-XYZ"
USER: Final = "u-S3CRET-name"
STRESS: Final = {"preset": "tiny"}  # 16 KiB blocks: test_offloader's content helpers


def _raw(url: str, **settings: Any) -> dict[str, Any]:
    tier = {"name": "shared", "backend": "redis", "url": url, "capacity": "64MiB", **settings}
    return {"tiers": [{"name": "cpu", "capacity": "2MiB"}, tier], "stress": STRESS}


def _store(config: KVOffloadConfig, keys: list[BlockKey]) -> Offloader:
    """Store ``keys`` through an Offloader of ``config`` (the cpu tier copies them down
    to the server); returns it closed, for its stats."""
    layout = layout_from_config(config)
    with Offloader(config, layout, BlockPool.allocate(layout, len(keys))) as off:
        assert off.pool is not None
        ids = list(range(len(keys)))
        gen = torch.Generator().manual_seed(len(keys))
        shape = (len(keys), layout.bytes_per_block)
        off.pool.scatter(ids, torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
        job = off.submit_store(keys, ids)
        assert job is not None
        off.wait([job], timeout=30)
        assert off.drain(timeout=30)
    return off


def _name(config: KVOffloadConfig, key: BlockKey) -> bytes:
    """The server-side name of ``key`` in the config's redis tier."""
    prefix = config.resolved_tiers()[1].key_prefix  # type: ignore[attr-defined]
    return f"{prefix}:{layout_from_config(config).fingerprint.hex()}:{key.hex()}".encode()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KVOFFLOAD), *args], capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ inspect, verify
def test_inspect_counts_this_layouts_blocks_and_reports_the_server(
    server: RedisServer, tmp_path: Path
) -> None:
    config = load_config(_raw(server.url()), env={})
    assert _store(config, make_keys(12, 1)).stats[1].blocks_stored == 12
    other = load_config({**_raw(server.url()), "stress": {"preset": "small"}}, env={})
    assert _store(other, make_keys(3, 2)).stats[1].blocks_stored == 3  # another layout
    with server.client() as c:
        c.set(b"kvo:not-ours", b"x")

    report = inspect_tiers(config)
    assert report["cpu"] == {"backend": "cpu", "persistent": False, "blocks": 0}
    info = report["shared"]
    bpb = layout_from_config(config).bytes_per_block
    assert info["server_booked"]
    assert not info["missing"]
    assert (info["blocks"], info["bytes"]) == (12, 12 * (HEADER_BYTES + bpb))
    assert info["server"] == server.url()
    assert info["key_prefix"] == "kvo"
    assert info["fingerprint"] == layout_from_config(config).fingerprint.hex()
    assert info["maxmemory"] == 256 * 1024**2
    assert info["maxmemory_policy"] == "allkeys-lru"
    assert info["used_memory"] > 12 * bpb
    assert info["evicted_keys"] == 0
    assert info["nodes"] == 1
    assert inspect_tiers(other)["shared"]["blocks"] == 3

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(server.url())))
    out = tmp_path / "inspect.json"
    run = _cli("inspect", "--config", str(path), "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "shared (redis): 12 blocks" in run.stdout
    assert f"at {server.url()}" in run.stdout
    assert "allkeys-lru" in run.stdout
    assert json.loads(out.read_text())["shared"]["blocks"] == 12
    with pytest.raises(ConfigError, match="shared server, which export does not read"):
        export_snapshot(config, tmp_path / "snap.safetensors")


@pytest.mark.slow
def test_verify_finds_corrupt_values_and_repair_deletes_them(
    server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(server.url())))
    config = load_config(path)
    keys = make_keys(10, 3)
    _store(config, keys)
    assert verify_tiers(config)["shared"] == {
        "blocks": 10,
        "ok": 10,
        "corrupt": 0,
        "gone": 0,
        "repaired": 0,
    }
    garbage, flipped = _name(config, keys[2]), _name(config, keys[7])
    with server.client() as c:
        c.set(garbage, b"garbage, not a block")  # a foreign value under our key
        at = HEADER_BYTES + 100
        byte = c.getrange(flipped, at, at)
        c.setrange(flipped, at, bytes([byte[0] ^ 0xFF]))  # a damaged payload

    out = tmp_path / "verify.json"
    bad = _cli("verify", "--config", str(path), "--json", str(out))
    assert bad.returncode == 1, bad.stderr
    assert "shared: 10 blocks, 8 ok, 2 corrupt, 0 repaired" in bad.stdout
    assert json.loads(out.read_text()) == {
        "shared": {"blocks": 10, "ok": 8, "corrupt": 2, "gone": 0, "repaired": 0}
    }
    with server.client() as c:
        assert c.exists(garbage, flipped) == 2  # verify alone deletes nothing

    fixed = _cli("verify", "--config", str(path), "--repair")
    assert fixed.returncode == 0, fixed.stderr
    assert "2 corrupt, 2 repaired" in fixed.stdout
    with server.client() as c:
        assert c.exists(garbage, flipped) == 0
    assert verify_tiers(config)["shared"] == {
        "blocks": 8,
        "ok": 8,
        "corrupt": 0,
        "gone": 0,
        "repaired": 0,
    }


def test_verify_of_an_unreachable_server_is_one_line_exit_2(tmp_path: Path) -> None:
    require_redis()
    from support.redisserver import free_port

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(f"redis://127.0.0.1:{free_port()}/0", password=SECRET)))
    run = _cli("verify", "--config", str(path))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()[-1:]
    assert line.startswith("kvoffload: error: tier 'shared': redis scan")
    assert "unreachable" in line
    assert SECRET not in run.stdout + run.stderr


# ------------------------------------------------------------------------- secrets
def test_secrets_are_masked_in_reprs_and_dumps_and_reach_the_backend() -> None:
    for tier in (
        {"password": SECRET, "username": USER},
        {"url": f"redis://{USER}:{SECRET}@127.0.0.1:1/0"},  # moved out of the url
    ):
        raw = _raw("redis://127.0.0.1:1/0")
        raw["tiers"][1].update(tier)
        config = load_config(raw, env={})
        shown = [
            repr(config),
            str(config),
            repr(config.tiers[1]),
            str(config.tiers[1]),
            repr(config.model_dump()),
            config.model_dump_json(),
            json.dumps(config.model_dump(mode="json")),
            repr(config.resolved_tiers()),
        ]
        for text in shown:
            assert SECRET not in text, text
            assert USER not in text, text
        typed: Any = config.resolved_tiers()[1]
        assert typed.url == "redis://127.0.0.1:1/0"
        assert typed.password.get_secret_value() == SECRET
        assert typed.username.get_secret_value() == USER
        # A Python dump re-validates with the secret intact (kvoffload stress's
        # replicas, pickled to their processes; the connector's per-rank config).
        raw = {**config.model_dump(), "stress": config.stress.model_dump(exclude_unset=True)}
        again: Any = load_config(pickle.loads(pickle.dumps(raw)), env={})
        assert again.resolved_tiers()[1].password.get_secret_value() == SECRET
        assert again == config
    # A url query option named like a secret is masked where the url is shown.
    from kvoffload.backends.redis import RedisTierConfig

    url = f"rediss://h:6380/0?ssl_password={SECRET}&ssl_ca_certs=/etc/ca.pem"
    shown_url = RedisTierConfig(name="shared", url=url).where()
    assert SECRET not in shown_url
    assert "ssl_ca_certs=%2Fetc%2Fca.pem" in shown_url


@pytest.mark.parametrize(
    ("settings", "env", "expect"),
    [
        ({"ttl_s": -1}, {}, r"tiers\[1\]\.ttl_s = -1: Input should be greater than 0"),
        ({"capacity": "lots"}, {}, r"tiers\[1\]\.capacity = 'lots'"),
        ({"password": 12345}, {}, r"password = '\*{10}': Input should be a valid string"),
        ({"password": [SECRET]}, {}, r"password = '\*{10}'"),
        ({}, {"KVOFFLOAD_TIERS__1__PASSWORD": "12345"}, r"environment KVOFFLOAD_TIERS__1__PASS"),
        ({"url": f"redis://:{SECRET}@h:1"}, {}, "keep only the username and password"),
        ({"name": "cpu"}, {}, "duplicate tier name 'cpu'"),  # quotes the whole tier list
    ],
)
def test_validation_errors_never_show_a_secret(
    settings: dict[str, Any], env: dict[str, str], expect: str
) -> None:
    raw = _raw("redis://127.0.0.1:1/0", password=SECRET, username=USER)
    raw["tiers"][1] = {"password": SECRET, "username": USER, **raw["tiers"][1], **settings}
    with pytest.raises(ConfigError, match=expect) as err:
        load_config(raw, env=env)
    for text in (str(err.value), repr(err.value)):
        assert SECRET not in text, text
        assert USER not in text, text
        assert "12345" not in text, text
    if not env:
        with pytest.raises(ValidationError) as direct:  # pydantic's own message, too
            KVOffloadConfig.model_validate(raw)
        assert SECRET not in str(direct.value)
        assert USER not in str(direct.value)


class _SecretiveConfig(TierConfig):
    """A third-party tier with a secret and none of the redis tier's own care."""

    backend: str = "secretive"
    token: SecretStr
    retries: int = 1


class _Secretive(CPUBackend):
    config_model = _SecretiveConfig


@pytest.mark.usefixtures("fresh_registry")
def test_any_plugins_secret_fields_are_masked() -> None:
    register_backend("secretive", _Secretive, clobber=True)
    assert secret_fields(_SecretiveConfig) == {"token"}
    tier = {"name": "vault", "backend": "secretive", "capacity": "64KiB", "token": SECRET}
    config = load_config({"tiers": [tier]}, env={})
    assert SECRET not in repr(config) + config.model_dump_json()
    typed: Any = config.resolved_tiers()[0]
    assert typed.token.get_secret_value() == SECRET
    for bad, expect in (({"token": 12345}, "token"), ({"retries": "x"}, "retries")):
        with pytest.raises(ConfigError, match=expect) as err:
            load_config({"tiers": [{**tier, **bad}]}, env={})
        assert SECRET not in str(err.value)
        assert "12345" not in str(err.value)
    with pytest.raises(ConfigError) as dup:  # a whole tier quoted: its token masked
        load_config({"tiers": [{"token": SECRET, **tier}, {"token": SECRET, **tier}]}, env={})
    assert SECRET not in str(dup.value)


def test_config_validate_never_prints_the_secret(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(_raw("redis://127.0.0.1:1/0", password=SECRET)))
    bad.write_text(yaml.safe_dump(_raw("redis://127.0.0.1:1/0", password=SECRET, ttl_s=-1)))
    ok, failed = _cli("config", "validate", str(good)), _cli("config", "validate", str(bad))
    assert ok.returncode == 0
    assert "shared(redis)" in ok.stdout
    assert failed.returncode == 2
    assert "ttl_s = -1" in failed.stderr
    for run in (ok, failed):
        assert SECRET not in run.stdout + run.stderr


def test_the_backend_authenticates_with_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_redis()
    srv = RedisServer(tmp_path / "redis", password=SECRET).start()
    try:
        config = load_config(_raw(srv.url(), password=SECRET), env={})
        stats = _store(config, make_keys(8, 4)).stats[1]
        assert (stats.blocks_stored, stats.server_errors) == (8, 0)
        assert inspect_tiers(config)["shared"]["blocks"] == 8  # the tools log in too
        wrong = load_config(_raw(srv.url(), password="not-" + SECRET[::-1]), env={})
        stats = _store(wrong, make_keys(8, 5)).stats[1]
        assert stats.server_errors > 0
        assert stats.blocks_stored == 0
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "check the tier's username and password" in logged
        assert SECRET not in logged
        assert SECRET[::-1] not in logged
    finally:
        srv.kill()


def test_the_backend_receives_the_typed_config_with_its_secret() -> None:
    """The tier in the config is the generic plugin tier (secrets masked); the
    backend gets the plugin model's validated copy, the secret readable there only."""
    from kvoffload.backends.redis import RedisTierConfig

    from kvoffload.tier import build_tiers

    config = load_config(_raw("redis://127.0.0.1:1/0", password=SECRET), env={})
    tiers = build_tiers(config, layout_from_config(config))  # connects on first use
    try:
        backend: Backend = tiers[1].backend
        assert isinstance(backend.config, RedisTierConfig)
        assert isinstance(backend.config.password, SecretStr)
        assert backend.config.password.get_secret_value() == SECRET
        assert SECRET not in repr(backend.config) + repr(config.tiers[1])
    finally:
        for tier in tiers:
            tier.close()
