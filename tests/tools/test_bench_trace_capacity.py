"""scripts/bench_trace_capacity.py: the trace hit-ratio bench at equal disk bytes (issue 33).

A real run of the script, as a child process, on the first 150 requests of the
in-repo Mooncake slice through configs/trace_packed.yaml's mmap tier cut to 2 MiB
(~127 blocks of 16 KiB stored raw): real slab files, real compression, every loaded
block verified. The figures mean little at this size; the document's structure, its
exact counts, and the invariant compressible data gives (the compressed tier holds
more blocks than the raw one in the same bytes) must hold at any size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.checkout import REPO, TRACE

from kvoffload.tools.workloads import TraceWorkload, prefix_hit_ratio

SCRIPT = REPO / "scripts" / "bench_trace_capacity.py"
CONFIG = REPO / "configs" / "trace_packed.yaml"
OPS = 150
POOL_BLOCKS = 256  # configs/trace_packed.yaml's stress.pool_blocks: the trace's truncation


def _bench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """One run of the script (none, lz4, zstd): its JSON document, stdout, tier root."""
    tmp = tmp_path_factory.mktemp("bench-trace")
    root = tmp / "tiers"
    out = tmp / "bench.json"
    proc = _bench(
        "--config", str(CONFIG), "--ops", str(OPS), "--capacity", "2MiB",
        "--trace", str(TRACE), "--dir", str(root), "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout, root


def test_every_run_replays_the_same_requests_and_verifies_them(
    bench: tuple[dict[str, Any], str, Path],
) -> None:
    """Three runs in order, each the first 150 requests of the slice (their blocks
    counted from the file), no integrity error, and the tier directories removed."""
    doc, _, root = bench
    assert doc["schema"] == "kvoffload.bench_trace_capacity/1"
    assert [r["codec"] for r in doc["runs"]] == ["none", "lz4", "zstd"]
    assert doc["tier"] == "ssd"
    assert doc["capacity_bytes"] == 2 * 1024 * 1024
    assert doc["block_bytes"] == 16 * 1024
    assert doc["requests_compared"] == OPS
    lines = TRACE.read_text().splitlines()[:OPS]
    blocks = sum(min(len(json.loads(line)["hash_ids"]), POOL_BLOCKS) for line in lines)
    for run in doc["runs"]:
        assert run["ops"] == OPS
        assert run["blocks_requested"] == blocks
        assert run["integrity_errors"] == 0
        assert run["hit_rate"] == run["blocks_loaded"] / blocks
        # One tier: every loaded block came from it.
        assert run["tier_hits"] == run["blocks_loaded"]
    assert not root.exists()


def test_compression_holds_more_blocks_in_the_same_bytes(
    bench: tuple[dict[str, Any], str, Path],
) -> None:
    """The raw tier is full at its capacity in blocks and stores at ratio 1; each codec shrinks
    KV-like data and its tier holds more blocks than the raw one, at the end and on
    average over the second half; the ratios are those figures over the raw run's."""
    doc, _, _ = bench
    none, lz4, zstd = doc["runs"]
    assert none["compression_ratio"] == 1.0
    assert none["blocks_held"] == none["blocks_held_mean"] == none["capacity_blocks"]
    for run in (lz4, zstd):
        assert run["compression_ratio"] < 1.0
        assert run["blocks_held"] > none["blocks_held"]
        assert run["blocks_held_mean"] > none["blocks_held_mean"]
        assert run["blocks_held_vs_none"] == run["blocks_held"] / none["blocks_held"]
        assert run["hit_rate_vs_none"] == run["hit_rate"] / none["hit_rate"]


def test_the_yardstick_is_an_ideal_lru_of_the_blocks_held(
    bench: tuple[dict[str, Any], str, Path],
) -> None:
    """Each run's ideal-LRU figure is prefix_hit_ratio of its mean blocks held on the
    same 150 requests, and the unbounded one bounds them all."""
    doc, stdout, _ = bench
    for run in doc["runs"]:
        assert run["ideal_lru_blocks"] == round(run["blocks_held_mean"])
        expected = prefix_hit_ratio(
            TraceWorkload(TRACE, max_blocks=POOL_BLOCKS), run["ideal_lru_blocks"], requests=OPS
        )
        assert run["ideal_lru_hit_rate"] == expected
        assert run["ideal_lru_hit_rate"] <= doc["ideal_lru_unbounded_hit_rate"]
        assert f"\n{run['codec']} " in stdout  # its line of the table


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--codecs", "none,brotli"], "--codecs none,brotli: give distinct names among"),
        (["--tier", "nvme"], "--tier nvme: no such tier; the config has ssd"),
        (["--ops", "0"], "--ops 0: it must be at least 1"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    """Refused before any tier is opened: exit 2, one line naming the argument."""
    proc = _bench("--config", str(CONFIG), "--dir", str(tmp_path / "tiers"), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert says in proc.stderr
    assert not (tmp_path / "tiers").exists()
