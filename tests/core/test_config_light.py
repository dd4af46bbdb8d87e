"""The config stays light and says each name once.

Validating a config, every built-in tier included, imports neither torch nor the
backend layer (``kvoffload config validate`` runs on a router or a CI box without
them); the names the config offers (eviction policies, codecs) are the ones the code
implements; sizes are parsed by pydantic's ``ByteSize`` in exactly the spellings the
config documents.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
from support.configs import write_tiers_yaml

from kvoffload.codec import CODECS
from kvoffload.config import KVOffloadConfig, config_schema
from kvoffload.policies import POLICIES
from kvoffload.sizes import SIZE_HINT, parse_size
from kvoffload.tierconfig import Compression, DiskTierConfig, PolicyName

HEAVY = ("torch", "kvoffload.backend", "kvoffload.registry")


def _every_builtin_tier(tmp_path: Path) -> Path:
    return write_tiers_yaml(
        tmp_path,
        "every-tier.yaml",
        f"""
        - {{name: db, backend: lmdb, capacity: 1GiB, path: {tmp_path / "db"}}}
        - name: shared
          backend: redis
          capacity: 2GiB
          url: redis://127.0.0.1:1/0
          password: hunter2
        """,
    )


def _run(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_every_builtin_tier_validates_without_torch(tmp_path: Path) -> None:
    """No redis server is needed either: validation never connects."""
    proc = _run(
        f"""
        import sys
        from kvoffload.config import load_config
        cfg = load_config(sys.argv[1], env={{}})
        tiers = cfg.resolved_tiers()
        assert [t.backend for t in tiers] == ["cpu", "mmap", "lmdb", "redis"], tiers
        assert type(tiers[3]).__name__ == "RedisTierConfig", type(tiers[3])
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
        """,
        str(_every_builtin_tier(tmp_path)),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"validating a config imported: {proc.stdout.strip()}"


def test_cli_config_validate_runs_without_torch(tmp_path: Path) -> None:
    """``kvoffload config validate FILE`` (the CLI's own entry, run in process so that
    what it imported can be seen afterwards)."""
    proc = _run(
        f"""
        import sys
        from kvoffload.tools.cli import main
        rc = main(["config", "validate", sys.argv[1]])
        print(rc, ",".join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
        """,
        str(_every_builtin_tier(tmp_path)),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].strip() == "0", proc.stderr
    assert "hunter2" not in proc.stdout + proc.stderr


# ------------------------------------------------------------------ one name, one place


def test_eviction_names_are_the_policies() -> None:
    assert set(get_args(PolicyName)) == set(POLICIES)
    assert KVOffloadConfig.model_fields["eviction"].annotation == PolicyName
    assert set(config_schema()["properties"]["eviction"]["enum"]) == set(POLICIES)


def test_compression_names_are_the_codecs() -> None:
    assert set(get_args(Compression)) == set(CODECS)
    assert all(name == codec.name for name, codec in CODECS.items())
    assert DiskTierConfig.model_fields["compression"].annotation == Compression


# ------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("1k", 1000), ("2M", 2 * 10**6), ("3g", 3 * 10**9), ("1T", 10**12), ("1.5kib", 1536)],
)
def test_bare_si_units_and_fractions_of_larger_units(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    "text",
    # pydantic reads the first six (PB, EB, bits, ".5", text after the unit); the
    # config takes none of them.
    ["1pb", "1eb", "8bit", "1kbit", ".5kb", "4GiB junk", "4 Ki", "-4kb", "1e3"],
)
def test_spellings_pydantic_takes_and_the_config_does_not(text: str) -> None:
    with pytest.raises(ValueError, match=r"^expected a positive size") as info:
        parse_size(text)
    assert str(info.value) == f"expected {SIZE_HINT}"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (True, ", got a boolean"),
        (0, "; sizes must be greater than zero"),
        (-4096, "; sizes must be greater than zero"),
        ("0kb", "; sizes must be greater than zero"),
        (1.5, ", got a fractional byte count"),
        ("1.5b", ", got a fractional byte count"),
        ("0.0001kb", ", got a fractional byte count"),
        (None, ", got NoneType"),
    ],
)
def test_size_refusals_name_what_is_allowed(value: object, why: str) -> None:
    with pytest.raises(ValueError, match=r"^expected a positive size") as info:
        parse_size(value)
    assert str(info.value) == f"expected {SIZE_HINT}{why}"


def test_the_old_bytesize_name_warns() -> None:
    import kvoffload.config as config

    with pytest.warns(DeprecationWarning, match="kvoffload.config.Bytes"):
        old = config.ByteSize
    assert old is config.Bytes
