"""Hostile inputs, generated: config files (YAML text and mappings), environment
overrides, trace files and snapshot files. Each one is either accepted or refused with
the project's one-line error (a :class:`~kvoffload.exceptions.KVOffloadError` whose
message is one line and names the file or variable); any other exception, or a
multi-line message, fails the test. 1,000 generated cases per input kind.

The CLI's side of the same promise (exit 2, one line, no traceback) is tested on
hand-picked files in ``test_config.py`` and ``test_maintenance.py``, and on 1,000
generated hostile command lines (bad flags, values, paths and files among them) in
``test_fuzz_cli.py``; the CLI maps exactly these exception types to exit 2.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.config import load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.tools.maintenance import check_snapshot
from kvoffload.tools.workloads import TraceWorkload

CASES = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

# Values of every shape YAML can produce, small enough to stay fast.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["1GiB", "0", "-1KiB", "512MiB", "lru", "arc", "mmap", "lmdb", "cpu", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)
TIER_KEYS = [
    "name",
    "backend",
    "capacity",
    "path",
    "write_policy",
    "admit_after_hits",
    "max_pending_stores",
    "max_store_delay_ms",
    "write_throttle",
    "fsync",
    "direct_io",
    "io_threads",
    "pin_memory",
    "readonly",
    "bogus",
]
TOP_KEYS = ["version", "tiers", "eviction", "prefetch_max_inflight", "stress", "bogus"]
tiers = st.dictionaries(st.sampled_from(TIER_KEYS), values, max_size=6)
configs = st.dictionaries(
    st.sampled_from(TOP_KEYS),
    st.one_of(values, st.lists(tiers, max_size=3)),
    max_size=5,
)


def _one_line_naming(exc: KVOffloadError, name: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    assert name in text, (name, text)


@pytest.mark.slow
@CASES
@given(raw=configs)
def test_config_mappings_are_accepted_or_refused_in_one_line(raw: dict[str, Any]) -> None:
    try:
        load_config(raw, env={})
    except KVOffloadError as exc:
        _one_line_naming(exc, "<dict>")


@pytest.mark.slow
@CASES
@given(text=st.one_of(st.text(max_size=200), configs.map(yaml.safe_dump)))
def test_config_files_are_accepted_or_refused_in_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path, env={})
    except KVOffloadError as exc:
        _one_line_naming(exc, str(path))


env_names = st.one_of(
    st.sampled_from(
        [
            "KVOFFLOAD_EVICTION",
            "KVOFFLOAD_VERSION",
            "KVOFFLOAD_TIERS",
            "KVOFFLOAD_TIERS__0__CAPACITY",
            "KVOFFLOAD_TIERS__1__PATH",
            "KVOFFLOAD_TIERS__0__NAME",
            "KVOFFLOAD_STRESS__LAYOUT__NUM_LAYERS",
            "KVOFFLOAD_PREFETCH_MAX_INFLIGHT",
            "KVOFFLOAD_",
            "KVOFFLOAD___",
            "KVOFFLOAD_TIERS__X",
        ]
    ),
    st.text(alphabet=string.ascii_uppercase + "_0123456789", max_size=20).map(
        lambda s: "KVOFFLOAD_" + s
    ),
)


@pytest.mark.slow
@CASES
@given(
    env=st.dictionaries(
        env_names, st.one_of(st.text(max_size=30), values.map(json.dumps)), max_size=3
    )
)
def test_environment_overrides_are_accepted_or_refused_in_one_line(env: dict[str, str]) -> None:
    env = {k: v for k, v in env.items() if "\x00" not in k + v}
    try:
        load_config(None, env=env)
    except KVOffloadError as exc:
        text = str(exc)
        assert "\n" not in text, text


trace_lines = st.one_of(
    st.text(max_size=60),
    st.dictionaries(
        st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"]),
        st.one_of(values, st.lists(st.integers(min_value=-5, max_value=2**65), max_size=6)),
        max_size=5,
    ).map(json.dumps),
)


@pytest.mark.slow
@CASES
@given(lines=st.lists(trace_lines, max_size=5))
def test_trace_files_are_accepted_or_refused_in_one_line(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    try:
        TraceWorkload(path)
    except KVOffloadError as exc:
        _one_line_naming(exc, str(path))


def _good_snapshot() -> bytes:
    """A small valid snapshot, made once: 3 blocks of a 2-layer layout."""
    import torch
    from safetensors.torch import save

    from kvoffload.layout import KVLayout
    from kvoffload.tools.maintenance import SNAPSHOT_FORMAT

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=32)
    meta = {
        "format": SNAPSHOT_FORMAT,
        "layout": json.dumps(layout.to_dict()),
        "fingerprint": layout.fingerprint.hex(),
    }
    tensors = {
        "blocks": torch.zeros((3, layout.bytes_per_block), dtype=torch.uint8),
        "keys": torch.ones((3, 64), dtype=torch.uint8),
        "key_lens": torch.full((3,), 32, dtype=torch.int16),
    }
    return save(tensors, meta)


GOOD = _good_snapshot()


@st.composite
def snapshots(draw: st.DrawFn) -> bytes:
    """Random bytes, or the good snapshot with bytes flipped, cut or inserted."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(GOOD)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            data[at] ^= draw(st.integers(min_value=1, max_value=255))
        elif op == "cut":
            del data[at:]
            if not data:
                break
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@pytest.mark.slow
@CASES
@given(data=snapshots())
def test_snapshot_files_are_accepted_or_refused_in_one_line(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        check_snapshot(path)
    except KVOffloadError as exc:
        _one_line_naming(exc, str(path))


def test_the_good_snapshot_passes() -> None:
    """The mutations above start from a file that is valid (else they test nothing)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "good.safetensors"
        path.write_bytes(GOOD)
        assert check_snapshot(path).num_layers == 2
