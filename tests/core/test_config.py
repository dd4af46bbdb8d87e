"""Configuration: loading, environment overrides, one-line errors, schema and CLI.

Every bad config must raise one :class:`ConfigError` whose single-line message names
the file, the field path, the value found and what is allowed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support.checkout import KVOFFLOAD

from kvoffload import registry
from kvoffload.config import KVOffloadConfig, config_schema, load_config
from kvoffload.exceptions import ConfigError
from kvoffload.sizes import parse_size

REPO = Path(__file__).parents[2]
DEFAULT_YAML = REPO / "configs" / "default.yaml"
CLI = KVOFFLOAD

GiB = 1024**3
MiB = 1024**2


def _tier(body: str, name: str = "fast") -> str:
    """A config with one tier whose extra lines are ``body`` (already indented)."""
    return f"version: 1\ntiers:\n  - name: {name}\n{body}"


# (file content, substrings the message must contain). The first substring is the field
# path (or, for errors about the file itself, what is wrong with it); when there is a
# value, its repr is among them. ``None`` content: the file is not created.
BAD_CONFIGS = [
    pytest.param(
        "version: 1\ncolour: red\n",
        (
            "colour",
            "unknown key",
            "allowed keys: version, tiers, eviction, prefetch_max_inflight, "
            "load_timeout_ms, store_timeout_ms, books_timeout_ms, producer_wait_ms, "
            "async_load_min_bytes, admin_port, admin_host, admin_ready_timeout_ms, "
            "stress",
        ),
        id="unknown-top-level-key",
    ),
    pytest.param(
        _tier("    backend: cpu\n    speed: fast\n"),
        ("tiers[0].speed", "unknown key", "allowed keys:", "capacity", "pin_memory"),
        id="unknown-tier-key",
    ),
    pytest.param(
        # No ``backend:``: the tier is still validated as the default (cpu) backend.
        "tiers:\n  - name: a\n  - name: b\n    colour: red\n",
        ("tiers[1].colour", "unknown key", "allowed keys:", "name, backend, capacity"),
        id="unknown-tier-key-default-backend",
    ),
    pytest.param(
        _tier("    capcity: 1GiB\n"),
        ("tiers[0].capcity", "unknown key", "capacity"),
        id="misspelled-tier-key",
    ),
    pytest.param(
        "evicton: arc\n",
        ("evicton", "unknown key", "eviction"),
        id="misspelled-top-level-key",
    ),
    pytest.param(
        _tier("    capacity: -5\n"),
        ("tiers[0].capacity", "= -5", "greater than zero"),
        id="negative-capacity",
    ),
    pytest.param(
        _tier("    capacity: -1GiB\n"),
        ("tiers[0].capacity", "'-1GiB'", "positive size"),
        id="negative-capacity-with-unit",
    ),
    pytest.param(
        _tier("    capacity: 0\n"),
        ("tiers[0].capacity", "= 0", "greater than zero"),
        id="zero-capacity",
    ),
    pytest.param(
        _tier("    capacity: 0GiB\n"),
        ("tiers[0].capacity", "'0GiB'", "greater than zero"),
        id="zero-capacity-with-unit",
    ),
    pytest.param(
        _tier("    capacity: lots\n"),
        ("tiers[0].capacity", "'lots'", "'512MiB'", "'4GiB'"),
        id="non-numeric-capacity",
    ),
    pytest.param(
        _tier("    capacity: 1.5\n"),
        ("tiers[0].capacity", "= 1.5", "fractional byte count"),
        id="fractional-bytes",
    ),
    pytest.param(
        _tier("    capacity: 2.5B\n"),
        ("tiers[0].capacity", "'2.5B'", "fractional byte count"),
        id="fractional-bytes-string",
    ),
    pytest.param(
        _tier("    capacity: 5XB\n"),
        ("tiers[0].capacity", "'5XB'", "positive size such as"),
        id="bad-unit",
    ),
    pytest.param(
        _tier("    capacity: true\n"),
        ("tiers[0].capacity", "= True", "boolean"),
        id="boolean-capacity",
    ),
    pytest.param(
        _tier("    capacity: {gib: 4}\n"),
        ("tiers[0].capacity", "{'gib': 4}", "got dict"),
        id="mapping-capacity",
    ),
    pytest.param(
        # Unnamed tiers all get the default name, so two of them clash.
        "tiers:\n  - capacity: 1GiB\n  - capacity: 2GiB\n",
        ("tiers", "duplicate tier name 'tier'", "tiers[0] and tiers[1]", "unique name"),
        id="missing-tier-names",
    ),
    pytest.param(
        "tiers:\n  - name: fast\n  - name: slow\n  - name: fast\n",
        ("tiers", "duplicate tier name 'fast'", "tiers[0] and tiers[2]"),
        id="duplicate-tier-names",
    ),
    pytest.param(
        _tier("    backend: nvme\n"),
        ("tiers[0].backend", "'nvme'", "unknown backend", "installed backends:", "cpu"),
        id="unknown-backend",
    ),
    pytest.param(
        _tier("    backend: [cpu]\n"),
        ("tiers[0].backend", "['cpu']", "valid string"),
        id="backend-not-a-string",
    ),
    pytest.param(
        "tiers: []\n",
        ("tiers", "= []", "at least 1 item"),
        id="empty-tiers",
    ),
    pytest.param(
        "tiers:\n  name: fast\n  capacity: 1GiB\n",
        ("tiers", "{'name': 'fast', 'capacity': '1GiB'}", "valid list"),
        id="tiers-not-a-list",
    ),
    pytest.param(
        "tiers:\n  - cpu\n",
        ("tiers[0]", "'cpu'", "must be a mapping"),
        id="tier-not-a-mapping",
    ),
    pytest.param(
        "eviction: fifo\n",
        ("eviction", "'fifo'", "'lru' or 'arc'"),
        id="eviction-fifo",
    ),
    pytest.param(
        "version: 2\n",
        ("version", "= 2", "reads config version 1", "newer kvoffload", "upgrade"),
        id="version-from-the-future",
    ),
    pytest.param(
        "version: one\n",
        ("version", "'one'", "should be 1"),
        id="version-not-a-number",
    ),
    pytest.param(
        "tiers:\n  - name: cpu\n  - name: ssd\n    backend: mmap\n",
        ("tiers[1].path", "required field is missing", "'ssd'", "directory of its own"),
        id="disk-tier-without-a-path",
    ),
    pytest.param(
        "tiers:\n  - name: cpu\n  - name: ssd\n    backend: mmap\n    path: /srv/kv\n"
        "  - name: db\n    backend: lmdb\n    path: /srv/kv/\n",
        ("tiers[2].path", "'/srv/kv/'", "same directory", "tiers[1].path", "'ssd'"),
        id="two-disk-tiers-in-one-directory",
    ),
    pytest.param(
        "tiers:\n  - name: cpu\n  - name: ssd\n    backend: mmap\n    path: /srv/kv\n"
        "  - name: db\n    backend: lmdb\n    path: /srv/kv/db\n",
        ("tiers[2].path", "'/srv/kv/db'", "is inside", "tiers[1].path = '/srv/kv'"),
        id="a-disk-tier-inside-another",
    ),
    pytest.param(
        _tier("    capacity: 1GiB\n", name="'my tier!'"),
        ("tiers[0].name", "'my tier!'", "pattern"),
        id="bad-tier-name-characters",
    ),
    pytest.param(
        "stress:\n  layout:\n    dtype: float64\n",
        ("stress.layout.dtype", "'float64'", "'bfloat16'", "'float16'"),
        id="dtype-float64",
    ),
    pytest.param(
        "stress:\n  layout:\n    num_layers: four\n",
        ("stress.layout.num_layers", "'four'", "integer"),
        id="num-layers-not-an-int",
    ),
    pytest.param(
        "stress:\n  layout:\n    num_layers: 2\n    heads: 4\n",
        ("stress.layout.heads", "unknown key", "num_layers, num_kv_heads, head_dim"),
        id="extra-key-in-layout",
    ),
    pytest.param(
        "stress:\n  pool_blocks: 0\n",
        ("stress.pool_blocks", "= 0", "greater than 0"),
        id="pool-blocks-zero",
    ),
    pytest.param(
        "stress:\n  ops: -3\n",
        ("stress.ops", "= -3", "greater than 0"),
        id="negative-ops",
    ),
    pytest.param(
        "stress: 5\n",
        ("stress", "= 5", "valid dictionary"),
        id="section-not-a-mapping",
    ),
    pytest.param(
        _tier("    backend: cpu\n    pin_memory: maybe\n"),
        ("tiers[0].pin_memory", "'maybe'", "valid boolean"),
        id="pin-memory-maybe",
    ),
    pytest.param(
        "- name: fast\n- name: slow\n",
        ("top level must be a mapping", "got list"),
        id="top-level-list",
    ),
    pytest.param(
        "eviction: lru\ntiers:\n  - name: a\n   capacity: [1GiB\n",
        ("line 4", "invalid YAML"),
        id="invalid-yaml",
    ),
    pytest.param(
        "eviction: lru\ntiers: [\n",
        ("line 3", "invalid YAML"),
        id="unterminated-yaml",
    ),
    pytest.param(
        b"eviction: \xff\xfe\n",
        ("not UTF-8", "0xff"),
        id="not-utf8",
    ),
    pytest.param(
        None,
        ("cannot read config file", "No such file"),
        id="missing-file",
    ),
    pytest.param(
        "tiers:\n  - name: a\n  - name: b\n    write_policy: write_back\n",
        ("tiers[1].write_policy", "'write_back'", "'write_through'", "'on_evict'"),
        id="unknown-write-policy",
    ),
    pytest.param(
        "tiers:\n  - name: a\n    admit_after_hits: 2\n  - name: b\n",
        ("tiers[0].admit_after_hits = 2", "first tier", "tiers[1]"),
        id="admission-filter-on-the-first-tier",
    ),
    pytest.param(
        "tiers:\n  - name: a\n    write_policy: on_evict\n  - name: b\n",
        ("tiers[0].write_policy = 'on_evict'", "first tier"),
        id="write-policy-on-the-first-tier",
    ),
    pytest.param(
        _tier("    max_pending_stores: 0\n"),
        ("tiers[0].max_pending_stores", "= 0", "greater than or equal to 1"),
        id="zero-store-queue",
    ),
    pytest.param(
        _tier("    admit_after_hits: -1\n"),
        ("tiers[0].admit_after_hits", "= -1", "greater than or equal to 0"),
        id="negative-admission",
    ),
    pytest.param(
        _tier("    write_throttle: fast\n"),
        ("tiers[0].write_throttle", "'fast'", "'512MiB'"),
        id="non-numeric-throttle",
    ),
    pytest.param(
        "stress:\n  preset: llama-9000\n",
        ("stress.preset", "'llama-9000'", "'llama3-8b'"),
        id="unknown-preset",
    ),
    pytest.param(
        "stress:\n  concurrency: 0\n",
        ("stress.concurrency", "= 0", "greater than or equal to 1"),
        id="zero-concurrency",
    ),
]


@pytest.mark.parametrize(("content", "needles"), BAD_CONFIGS)
def test_bad_config_is_one_line_naming_file_field_and_value(
    tmp_path: Path, content: str | bytes | None, needles: tuple[str, ...]
) -> None:
    path = tmp_path / "kvoffload.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_bad_config_cases_are_plenty() -> None:
    assert len(BAD_CONFIGS) >= 20


def test_several_errors_are_still_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: 3\neviction: fifo\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "\n" not in msg
    assert "version = 3" in msg
    assert "(and 1 more:" in msg
    assert "eviction = 'fifo'" in msg


def test_dict_source_errors_are_labelled() -> None:
    with pytest.raises(ConfigError, match=r"^<dict>: tiers\[0\]\.capacity = 'lots': "):
        load_config({"tiers": [{"name": "a", "capacity": "lots"}]}, env={})


# --------------------------------------------------------------------------- good input


def test_default_yaml_loads() -> None:
    cfg = load_config(DEFAULT_YAML, env={})
    assert cfg.version == 1
    assert cfg.eviction == "lru"
    assert [(t.name, t.backend, t.capacity) for t in cfg.tiers] == [
        ("cpu", "cpu", 128 * MiB),
        ("ssd", "mmap", 512 * MiB),
        ("db", "lmdb", 1024 * MiB),
    ]
    assert [t.write_policy for t in cfg.tiers[1:]] == ["on_evict", "on_evict"]
    assert cfg.tiers[2].admit_after_hits == 1
    assert cfg.stress.pool_blocks == 128
    assert cfg.stress.concurrency == 4
    assert cfg.stress.layout.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("1.5GB", 1_500_000_000),
        ("64KiB", 64 * 1024),
        ("2TiB", 2 * 1024**4),
        ("10kb", 10_000),
        (" 2 gib ", 2 * GiB),
        ("4096", 4096),
        ("4096B", 4096),
        (4096, 4096),
        (8.0, 8),
    ],
)
def test_sizes_parse(text: str | int | float, nbytes: int) -> None:
    assert parse_size(text) == nbytes
    cfg = load_config({"tiers": [{"name": "t", "capacity": text}]}, env={})
    assert cfg.tiers[0].capacity == nbytes


def test_dict_source() -> None:
    source = {"eviction": "arc", "tiers": [{"name": "a", "capacity": "1GiB"}, {"name": "b"}]}
    cfg = load_config(source, env={"KVOFFLOAD_TIERS__1__CAPACITY": "2GiB"})
    assert cfg.eviction == "arc"
    assert [(t.name, t.capacity) for t in cfg.tiers] == [("a", GiB), ("b", 2 * GiB)]
    # The caller's mapping is not modified by the overrides.
    assert source["tiers"][1] == {"name": "b"}


def test_a_tier_without_backend_is_cpu() -> None:
    cfg = load_config({"tiers": [{"name": "a"}]}, env={})
    assert cfg.tiers[0].backend == "cpu"
    assert type(cfg.tiers[0]).__name__ == "CPUTierConfig"


def test_no_source_gives_defaults() -> None:
    cfg = load_config(None, env={})
    assert cfg == KVOffloadConfig()
    assert cfg.eviction == "lru"
    assert [(t.name, t.backend, t.capacity) for t in cfg.tiers] == [("cpu", "cpu", GiB)]


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path, env={}) == KVOffloadConfig()


# --------------------------------------------------------------------------- environment


def test_env_overrides_apply() -> None:
    env = {
        "KVOFFLOAD_EVICTION": "arc",
        "KVOFFLOAD_TIERS__0__CAPACITY": "2GiB",
        "KVOFFLOAD_STRESS__LAYOUT__NUM_LAYERS": "4",
        "KVOFFLOAD_LOG_LEVEL": "DEBUG",  # reserved: not a config field
        "KVOFFLOAD_CUDA_GRAPHS": "0",  # reserved: the data path's switches
        "KVOFFLOAD_CUDA_COPY": "kernel",
        "PATH": "/usr/bin",
    }
    cfg = load_config(DEFAULT_YAML, env=env)
    assert cfg.eviction == "arc"
    assert cfg.tiers[0].capacity == 2 * GiB
    assert cfg.tiers[0].name == "cpu"  # the rest of the tier comes from the file
    assert cfg.stress.layout.num_layers == 4
    assert isinstance(cfg.stress.layout.num_layers, int)
    assert cfg.stress.pool_blocks == 128


def test_env_overrides_apply_to_defaults() -> None:
    cfg = load_config(None, env={"KVOFFLOAD_TIERS__0__CAPACITY": "512MiB"})
    assert cfg.tiers[0].capacity == 512 * MiB


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("KVOFFLOAD_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("KVOFFLOAD_EVICTION", "arc")
    assert load_config().eviction == "arc"


def test_kvoffload_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "picked.yaml"
    path.write_text("eviction: arc\ntiers:\n  - name: picked\n    capacity: 8MiB\n")
    cfg = load_config(None, env={"KVOFFLOAD_CONFIG": str(path)})
    assert cfg.eviction == "arc"
    assert [(t.name, t.capacity) for t in cfg.tiers] == [("picked", 8 * MiB)]
    # An explicit source wins over the variable.
    assert load_config(DEFAULT_YAML, env={"KVOFFLOAD_CONFIG": str(path)}).tiers[0].name == "cpu"


def test_kvoffload_config_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("eviction: fifo\n")
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"KVOFFLOAD_CONFIG": str(path)})
    assert str(info.value).startswith(f"{path}: eviction = 'fifo'")


@pytest.mark.parametrize(
    ("var", "value", "needles"),
    [
        ("KVOFFLOAD_TIERS__0__CAPACITY", "lots", ("tiers[0].capacity", "'lots'", "'4GiB'")),
        ("KVOFFLOAD_TIERS__0__CAPACITY", "0", ("tiers[0].capacity", "= 0", "greater than zero")),
        ("KVOFFLOAD_EVICTION", "fifo", ("eviction", "'fifo'", "'lru' or 'arc'")),
        ("KVOFFLOAD_STRESS__LAYOUT__DTYPE", "float64", ("stress.layout.dtype", "'float64'")),
        ("KVOFFLOAD_STRESS__LAYOUT__NUM_LAYERS", "four", ("stress.layout.num_layers", "'four'")),
        ("KVOFFLOAD_TIERS__0__BACKEND", "nvme", ("tiers[0].backend", "'nvme'", "cpu")),
        ("KVOFFLOAD_TIERS__0__PIN_MEMORY", "maybe", ("tiers[0].pin_memory", "'maybe'")),
        ("KVOFFLOAD_TIERS__0__COLOUR", "red", ("tiers[0].colour", "unknown key", "capacity")),
        ("KVOFFLOAD_COLOUR", "red", ("colour", "unknown key", "eviction")),
        # A whole section from one variable: errors inside it still name the variable.
        ("KVOFFLOAD_TIERS", "[{name: a}, {name: b, capacity: 0}]", ("tiers[1].capacity",)),
    ],
)
def test_bad_env_value_names_the_variable(var: str, value: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_YAML, env={var: value})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"environment {var}: "), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


@pytest.mark.parametrize(
    "var", ["KVOFFLOAD_TIERS__3__CAPACITY", "KVOFFLOAD_TIERS__5", "KVOFFLOAD_TIERS__X__CAPACITY"]
)
def test_env_override_of_missing_tier_index(var: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEFAULT_YAML, env={var: "1GiB"})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"environment {var}: "), msg
    assert str(DEFAULT_YAML) in msg  # names the file whose tiers list is too short


def test_malformed_env_name() -> None:
    with pytest.raises(ConfigError, match=r"^environment KVOFFLOAD_TIERS____CAPACITY: malformed"):
        load_config(None, env={"KVOFFLOAD_TIERS____CAPACITY": "1GiB"})


# --------------------------------------------------------------------------- plugins


def test_plugin_tier_errors_name_the_field() -> None:
    # ``memdict`` is the test distribution's backend (tests/plugin_dist), with a ``copies`` key.
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"name": "d", "backend": "memdict", "copies": "many"}]}, env={})
    assert str(info.value).startswith("<dict>: tiers[0].copies = 'many': ")
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"name": "d", "backend": "memdict", "colour": 1}]}, env={})
    assert str(info.value) == (
        "<dict>: tiers[0].colour: unknown key; allowed keys: name, backend, capacity, "
        "write_policy, admit_after_hits, max_pending_stores, max_store_delay_ms, "
        "write_throttle, breaker_errors, breaker_backoff_ms, copies"
    )


def test_plugin_import_error_stays_one_line(
    fresh_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "multiline-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: multiline\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvoffload.backends]\nml = kvo_multiline_mod:B\n")
    (tmp_path / "kvo_multiline_mod.py").write_text('raise RuntimeError("first\\nsecond")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reset()
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [{"name": "p", "backend": "ml"}]}, env={})
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("<dict>: tiers[0].backend = 'ml': ")
    assert "first second" in msg


# --------------------------------------------------------------------------- schema


def test_config_schema_has_fields_and_descriptions() -> None:
    schema = config_schema()
    json.dumps(schema)  # JSON-serialisable
    props = schema["properties"]
    assert {"version", "tiers", "eviction", "stress"} <= set(props)
    assert props["eviction"]["enum"] == ["lru", "arc"]
    assert schema.get("additionalProperties") is False
    cpu = schema["$defs"]["CPUTierConfig"]["properties"]
    assert "Bytes of block data" in cpu["capacity"]["description"]
    assert cpu["pin_memory"]["description"]
    layout = schema["$defs"]["LayoutConfig"]["properties"]
    assert "bfloat16" in layout["dtype"]["enum"]
    assert "float64" not in layout["dtype"]["enum"]


@pytest.mark.parametrize(
    "text",
    ["512MiB", "4GiB", "1.5GB", "4096", "4096B", "8b", "10kb", " 2 gib ", "4Ki", "5XB", "lots"],
)
def test_schema_size_pattern_matches_the_parser(text: str) -> None:
    cpu = config_schema()["$defs"]["CPUTierConfig"]["properties"]
    (pattern,) = [s["pattern"] for s in cpu["capacity"]["anyOf"] if s.get("type") == "string"]
    try:
        parse_size(text)
        parsed = True
    except ValueError:
        parsed = False
    assert (re.search(pattern, text) is not None) == parsed


# --------------------------------------------------------------------------- CLI


BAD_CLI_CONFIG = "tiers:\n  - name: a\n    capacity: -5\n"


@pytest.fixture(scope="module")
def cli_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every CLI invocation below, run concurrently: each pays the start-up (torch) once."""
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "bad.yaml"
    bad.write_text(BAD_CLI_CONFIG)
    commands = {
        "ok": ["config", "validate", str(DEFAULT_YAML)],
        "bad": ["config", "validate", str(bad)],
        "missing": ["config", "validate", str(tmp / "nope.yaml")],
        "schema": ["config", "schema"],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    procs = {
        name: subprocess.Popen(
            [str(CLI), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name, args in commands.items()
    }
    runs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return runs


def test_cli_validate_ok(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = cli_runs["ok"]
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("OK"), proc.stdout
    assert "cpu(cpu)" in lines[0]


def test_cli_validate_bad_file(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = cli_runs["bad"]
    path = proc.args[-1]
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvoffload: error: {path}: tiers[0].capacity = -5: "), lines[0]


def test_cli_validate_missing_file(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = cli_runs["missing"]
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert "nope.yaml" in proc.stderr


def test_cli_schema_prints_json(cli_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    proc = cli_runs["schema"]
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert "tiers" in schema["properties"]
    assert "eviction" in schema["properties"]


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("eviction: lru\ntiers:\n  - name: a\n    capacity: 1GiB\n    capacity: 2GiB\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert str(path) in msg
    assert "line 5" in msg
    assert "'capacity' appears twice" in msg
    assert "\n" not in msg


def test_every_shipped_config_validates_against_the_exported_schema() -> None:
    """The schema is exact: each tier matches one ``oneOf`` branch, and bad input fails.
    (``jsonschema`` is a dev dependency: under CI it is there, and a skip would fail.)"""
    jsonschema = pytest.importorskip("jsonschema")

    schema = config_schema()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    plugin = {"tiers": [{"name": "d", "backend": "memdict", "capacity": "1MiB", "copies": 2}]}
    jsonschema.validate(plugin, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tiers": [{"name": "c", "backend": "cpu", "capcity": 5}]}, schema)
