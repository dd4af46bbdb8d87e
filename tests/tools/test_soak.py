"""A short soak: ``kvoffload stress`` for a minute over cpu -> mmap -> lmdb on the
multi-turn workload, as a user runs it (the installed command, real files). After a
10-second warm-up (the small tiers are full and the hit rate steady from the first
sample, 5 s in), anonymous memory (less the bounded buffer pools) may grow by at most
``LEAK_BYTES_PER_BLOCK`` per block requested, file-backed resident memory by no more
than the disk tiers can map, and open file descriptors and threads stay flat; every
load stays bit-exact. The 30-minute run and its figures are in docs/reliability.md
("Soak").

Why a minute is enough: a leak costs bytes per operation, so what catches it is a
bound on growth per block requested, not the window's length. The 3-minute version of
this test allowed 5% of the warm level over its last 2 minutes: in one run on the
2-core VM, about 68 bytes of anonymous memory per block requested (213 MiB, some
165,000 blocks requested in those 2 minutes). 64 bytes a block catches what that one
caught there, in a third of the time. Anonymous memory is where a leak shows: RSS also
counts the disk tiers' file pages, resident as they are touched and bounded by the
tiers' size (a bound per block on RSS failed one run for that alone: 74 bytes a
block, with anonymous memory at 32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from support.stress import stress_cli

SOAK_S = float(os.environ.get("SOAK_SECONDS", "60"))  # longer for a closer look
WARM_S = 10.0
LEAK_BYTES_PER_BLOCK = 64
"""The growth allowed per block requested after the warm-up (see the docstring)."""
MIN_SAMPLES = 8
"""Samples (one each ``stress.RESOURCE_EVERY_S``, 5 s) after the warm-up: a trend, not a
single reading."""
DISK_TIERS_BYTES = (24 + 48 + 8) * 1024**2
"""What the disk tiers' mapped files can keep resident: their capacities (24 and 48
MiB, see :func:`soak_config`) and 8 MiB for LMDB's own pages."""
POOL_BOUND = 512 * 1024**2 + 3 * 16 * 1024**2
"""What the host buffer pools may hold: the data path's kept staging (its
``Buffers.KEEP_BYTES``) and the LMDB tier's three pack chunks."""


def soak_config(tmp: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"name": "cpu", "backend": "cpu", "capacity": "8MiB", "max_pending_stores": 32},
            {
                "name": "ssd",
                "backend": "mmap",
                "path": str(tmp / "ssd"),
                "capacity": "24MiB",  # small tiers: full, and steady, well within a minute
                "write_policy": "on_evict",
            },
            {
                "name": "db",
                "backend": "lmdb",
                "path": str(tmp / "db"),
                "capacity": "48MiB",
                "write_policy": "on_evict",
                "admit_after_hits": 1,
            },
        ],
        "stress": {
            "layout": {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "block_size": 32},
            "workload": "multiturn",
            "pool_blocks": 128,
            "concurrency": 4,
        },
    }


@pytest.mark.slow
def test_a_minute_of_stress_holds_memory_fds_and_threads_flat(tmp_path: Path) -> None:
    cfg = tmp_path / "soak.yaml"
    cfg.write_text(yaml.safe_dump(soak_config(tmp_path)))
    out = tmp_path / "soak.json"
    _, report = stress_cli(
        out,
        "--config",
        str(cfg),
        "--ops",
        "1000000000",  # never reached: the run ends at --duration
        "--duration",
        str(SOAK_S),
        "--no-progress",
        timeout=SOAK_S + 300,
    )
    assert report["integrity_errors"] == 0
    samples = report["resources"]
    warm = next(s for s in samples if s["t"] >= WARM_S)
    later = [s for s in samples if s["t"] > warm["t"]]
    assert len(later) >= MIN_SAMPLES, f"{len(later)} samples after the warm-up"
    # The host buffer pools grow to a high-water mark whenever more jobs than ever
    # run at once, which may first happen late (a step of 8-16 MiB at 77 s in one CI
    # run): bounded by design, and resident from allocation, so they are taken out of
    # the comparison and checked against their bound instead.
    blocks = later[-1]["requested"] - warm["requested"]
    allowed = LEAK_BYTES_PER_BLOCK * blocks
    base = warm["rss_anon_bytes"] - warm["pooled_bytes"]
    grown = max(s["rss_anon_bytes"] - s["pooled_bytes"] for s in later) - base
    assert grown <= allowed, (
        f"anonymous memory less the pools grew {grown} B in the {blocks} blocks requested"
        f" after warm-up: {grown / blocks:.0f} B a block, over {LEAK_BYTES_PER_BLOCK}"
    )
    # File-backed resident pages: the disk tiers' mapped files as they are touched,
    # bounded by their capacity (a leaked mapping would show in the fds).
    file_base = samples[0]["rss_bytes"] - samples[0]["rss_anon_bytes"]
    file_peak = max(s["rss_bytes"] - s["rss_anon_bytes"] for s in samples)
    assert file_peak - file_base <= DISK_TIERS_BYTES, (file_base, file_peak)
    assert max(s["pooled_bytes"] for s in samples) <= POOL_BOUND
    assert max(s["open_fds"] for s in later) <= warm["open_fds"] + 2
    assert max(s["threads"] for s in later) <= warm["threads"] + 2
    # The tiers served hits throughout (how many depends on the machine's speed: the
    # run is bounded by time, not by a count of requests).
    assert later[-1]["loaded"] > warm["loaded"]
