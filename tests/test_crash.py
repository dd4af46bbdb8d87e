"""``kill -9`` in the middle of heavy stores, at random moments, ten times over.

A child process stores batches into an mmap tier (fsync on) and prints each batch's
keys once ``complete_store`` has returned. The parent SIGKILLs it at a random moment,
reopens the tier and checks: every acknowledged block (not evicted since) is there
and bit-exact, and no block is ever served with wrong bytes.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.checkout import SUPPORT

from kvoffload.config import layout_from_config, load_config
from kvoffload.keys import BlockKey
from kvoffload.tier import build_tiers
from kvoffload.tools.stress import BlockDataGenerator

ROUNDS = 10


def _run_until_killed(raw: dict[str, object], round_no: int, delay: float) -> list[str]:
    """The child's complete output lines, in order, up to the moment it was killed."""
    cmd = [
        sys.executable,
        str(SUPPORT / "tierproc.py"),
        "store_forever",
        json.dumps(raw),
        str(round_no),
        "16",
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        fd = proc.stdout.fileno()
        data = b""
        started: float | None = None
        while True:
            timeout = 60.0 if started is None else started + delay - time.monotonic()
            if timeout <= 0:
                break
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
            if started is None and b"ACK " in data:
                # The random moment counts from the first acknowledged store, so a slow
                # synced first batch (over 50 ms on a busy disk) cannot leave a round
                # with nothing to check.
                started = time.monotonic()
        assert started is not None, proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)
        data += proc.stdout.read()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
    # A line cut mid-way by the kill was never fully acknowledged: drop it.
    return data.decode().split("\n")[:-1]


@pytest.mark.slow
def test_kill_9_during_stores_loses_nothing_acknowledged_and_serves_nothing_corrupt(
    tmp_path: Path,
) -> None:
    raw: dict[str, object] = {
        "tiers": [
            {
                "name": "ssd",
                "backend": "mmap",
                "path": str(tmp_path / "t"),
                "capacity": "24MiB",
                "fsync": True,
            }
        ],
        "stress": {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}
        },
    }
    config = load_config(raw)
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    rng = random.Random(1234)
    expected: set[str] = set()
    totals = {"acked": 0, "checked": 0, "served": 0}
    for round_no in range(ROUNDS):
        lines = _run_until_killed(raw, round_no, delay=rng.uniform(0.05, 1.0))
        acked = 0
        for line in lines:  # replay in order: a key acknowledged, then maybe evicted
            kind, _, keys_hex = line.partition(" ")
            if kind == "ACK":
                expected.update(keys_hex.split())
                acked += len(keys_hex.split())
            elif kind == "EVICT":
                expected.difference_update(keys_hex.split())
        assert acked, "the writer acknowledged nothing before the kill"
        totals["acked"] += acked

        (tier,) = build_tiers(config, layout)
        try:
            held = {k.hex() for k, _ in tier.manager.policy.items()}
            missing = expected - held
            assert not missing, f"round {round_no}: {len(missing)} acknowledged blocks lost"
            # Read back everything the tier offers: a block is either served with
            # exactly the right bytes, or refused (False). Never wrong bytes.
            keys = [BlockKey(bytes.fromhex(h)) for h in sorted(held)]
            scratch = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
            for start in range(0, len(keys), 256):
                chunk = keys[start : start + 256]
                slots = tier.manager.prepare_load(chunk)
                buf = torch.empty((len(chunk), layout.bytes_per_block), dtype=torch.uint8)
                valid = tier.backend.read(slots, chunk, buf)
                tier.manager.complete_load(chunk)
                for i, (key, ok) in enumerate(zip(chunk, valid, strict=True)):
                    if ok:
                        assert gen.matches(key, buf[i], scratch), f"served corrupt {key.hex()}"
                        totals["served"] += 1
                    else:
                        assert key.hex() not in expected, f"acknowledged block {key.hex()} corrupt"
                tier.drop([k for k, ok in zip(chunk, valid, strict=True) if not ok])
                totals["checked"] += len(chunk)
            assert tier.manager.check() == []
            assert tier.backend.check() == []
        finally:
            tier.close()
    print(f"kill -9 x{ROUNDS}: {totals}")
    assert totals["served"] >= len(expected)
