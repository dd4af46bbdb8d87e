"""A short soak: ``kvoffload stress`` for 3 minutes over cpu -> mmap -> lmdb on the
multi-turn workload, as a user runs it (the installed command, real files). Once
warm (the first minute), resident memory may not grow by more than 5%, and open file
descriptors and threads stay flat; every load stays bit-exact. The 30-minute run and
its figures are in docs/reliability.md ("Soak")."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from support.checkout import KVOFFLOAD

SOAK_S = float(os.environ.get("SOAK_SECONDS", "180"))  # shorter for a quick look
WARM_S = SOAK_S / 3
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
def test_three_minutes_of_stress_hold_memory_fds_and_threads_flat(tmp_path: Path) -> None:
    cfg = tmp_path / "soak.yaml"
    cfg.write_text(yaml.safe_dump(soak_config(tmp_path)))
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            str(KVOFFLOAD),
            "stress",
            "--config",
            str(cfg),
            "--ops",
            "1000000000",
            "--duration",
            str(SOAK_S),
            "--json",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=SOAK_S + 300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["integrity_errors"] == 0
    samples = report["resources"]
    assert samples[-1]["t"] >= SOAK_S * 0.95, "the run ended early"
    warm = next(s for s in samples if s["t"] >= WARM_S)
    later = [s for s in samples if s["t"] > warm["t"]]
    assert later, "no sample after the first minute"
    # The host buffer pools grow to a high-water mark whenever more jobs than ever
    # run at once, which may first happen after the first minute (a step of 8-16 MiB
    # at 77 s in one CI run): bounded by design, and resident from allocation, so
    # they are taken out of the comparison and checked against their bound instead.
    for kind in ("rss_bytes", "rss_anon_bytes"):
        peak = max(s[kind] - s["pooled_bytes"] for s in later)
        base = warm[kind] - warm["pooled_bytes"]
        assert peak <= base * 1.05, (
            f"{kind} less the pools grew from {base} to {peak} after warm-up"
        )
    assert max(s["pooled_bytes"] for s in samples) <= POOL_BOUND
    assert max(s["open_fds"] for s in later) <= warm["open_fds"] + 2
    assert max(s["threads"] for s in later) <= warm["threads"] + 2
    assert report["blocks_loaded"] > 0  # the tiers served hits throughout
