"""``kill -9`` in the middle of heavy stores, at random moments, ten times over.

A child process stores batches into an mmap tier (fsync on) and prints each batch's
keys once ``complete_store`` has returned. The parent SIGKILLs it at a random moment,
reopens the tier and checks: every acknowledged block (not evicted since) is there
and bit-exact, and no block is ever served with wrong bytes.

Three times: a fixed-slot slab of random blocks (``compression: none``), and packed
ones (``compression: zstd``, issue 33) of 8-page blocks: all KV-like (each stored in
6 pages), then two in three KV-like and one in three random (8 pages, raw), so that
extents differ in length and freed ones are reused by blocks of another length. The
child settles each write as the books do: a block the slab found no room for is not
acknowledged, the others are charged what they took.
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
from support.tierproc import block_data

from kvoffload.config import layout_from_config, load_config
from kvoffload.keys import BlockKey
from kvoffload.tier import build_tiers

ROUNDS = 10


def _run_until_killed(raw: dict[str, object], round_no: int, delay: float, data: str) -> list[str]:
    """The child's complete output lines, in order, up to the moment it was killed."""
    cmd = [
        sys.executable,
        str(SUPPORT / "tierproc.py"),
        "store_forever",
        json.dumps(raw),
        str(round_no),
        "16",
        data,
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
@pytest.mark.parametrize(
    ("compression", "data", "block_size", "extent_pages"),
    [
        ("none", "random", 16, []),
        ("zstd", "kv", 64, [6]),  # every block compressed, extents of one length
        ("zstd", "mixed", 64, [6, 8]),  # compressed and raw: extents of two lengths
    ],
)
def test_kill_9_during_stores_loses_nothing_acknowledged_and_serves_nothing_corrupt(
    tmp_path: Path, compression: str, data: str, block_size: int, extent_pages: list[int]
) -> None:
    raw: dict[str, object] = {
        "tiers": [
            {
                "name": "ssd",
                "backend": "mmap",
                "path": str(tmp_path / "t"),
                "capacity": "24MiB",
                "fsync": True,
                "compression": compression,
            }
        ],
        "stress": {
            "layout": {
                "num_layers": 2,
                "num_kv_heads": 2,
                "head_dim": 32,
                "block_size": block_size,
            }
        },
    }
    config = load_config(raw)
    layout = layout_from_config(config)
    gen = block_data(layout.bytes_per_block, data)
    rng = random.Random(1234)
    expected: set[str] = set()
    totals = {"acked": 0, "checked": 0, "served": 0}
    for round_no in range(ROUNDS):
        lines = _run_until_killed(raw, round_no, rng.uniform(0.05, 1.0), data)
        acked = empty = 0
        for line in lines:  # replay in order: a key acknowledged, then maybe evicted
            kind, _, keys_hex = line.partition(" ")
            if kind == "ACK":
                expected.update(keys_hex.split())
                acked += len(keys_hex.split())
                empty += not keys_hex
            elif kind == "EVICT":
                expected.difference_update(keys_hex.split())
        assert acked, (
            f"round {round_no}: the writer acknowledged nothing before the kill; {empty} "
            "stores placed no block (a packed slab with no free run long enough)"
        )
        totals["acked"] += acked

        (tier,) = build_tiers(config, layout)
        try:
            space = getattr(tier.backend, "space", None)
            assert (space is not None) == (compression != "none")
            if space is not None:
                # Budgeted by the pages blocks take (build_tiers wires it), and stored
                # compressed in extents of more than one length.
                assert (tier.manager.byte_budget, tier.manager.full_charge) == (
                    tier.backend.budget()
                )
                logical, stored = tier.backend.stats().held or (0, 0)
                assert 0 < stored < logical
                assert sorted(set(space.pages[space.pages > 0].tolist())) == extent_pages
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
