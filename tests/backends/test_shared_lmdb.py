"""Several processes on one LMDB tier: one writer, readers with ``readonly: true``.

Real processes on a real tier directory (the programs are in ``tierproc.py``):

- a writer process stores batches continuously and reports each batch's keys once
  ``complete_store`` has returned (``ACK``), and the keys eviction dropped (``EVICT``);
- a reader process opens the same tier with ``readonly: true`` at the same time and,
  open after open, loads what its manager learnt at open and, by key, blocks the writer
  acknowledged after that open (the test forwards some ``ACK`` lines to it); every
  block it is served is checked bit-exact;
- after each of the ten runs the writer closes and a fresh reader (this process)
  checks the tier: every acknowledged block not evicted is there, bit-exact, and
  nothing else, each key once.

A second writer on the directory, and a reader before any writer, are refused with
one-line errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import lmdb
import pytest
import torch
from kvoffload.backends.lmdb import BLOCKS_DB
from support.checkout import SUPPORT
from support.waiting import wait_until

from kvoffload.config import layout_from_config, load_config
from kvoffload.tier import build_tiers
from kvoffload.tools.stress import BlockDataGenerator

RUNS = 10
RUN_S = 0.6
"""Seconds each run's reader reads while the writer stores, after its first open (and
then until it has been sent two of the writer's ACK lines: a slow machine's run is
longer, never emptier)."""
BATCH = 16
PAUSE_S = 0.0
"""Between the writer's batches; 0: none. The 254 slots turn over every few dozen ms, so
readers meet blocks evicted since they opened, and every race has its chances (a
writer that lost LMDB's lock-file locks corrupted the tier in every run like this)."""
TIMEOUT_S = 60.0


def _config(path: Path, *, readonly: bool = False) -> dict[str, Any]:
    # 16 KiB blocks (32 tokens), 254 slots.
    return {
        "tiers": [
            {
                "name": "ssd",
                "backend": "lmdb",
                "path": str(path),
                "capacity": "4MiB",
                "fsync": False,
                "readonly": readonly,
            }
        ],
        "stress": {
            "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 32}
        },
    }


class _Child:
    """A ``tierproc.py`` program: its stdout lines arrive on a queue (a thread reads
    them, and may hand each to ``on_line`` first); commands go to its stdin."""

    def __init__(self, args: list[str], stderr: Path) -> None:
        self._err = stderr.open("wb")
        self.stderr = stderr
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT / "tierproc.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.on_line: Callable[[str], None] | None = None
        self._send_lock = threading.Lock()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode().rstrip("\n")
            hook = self.on_line
            if hook is not None:
                hook(line)
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line: str) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        with self._send_lock:
            stdin.write(line.encode() + b"\n")
            stdin.flush()

    def expect(self, word: str) -> tuple[str, list[str]]:
        """Wait for the line starting with ``word``; return it and the lines before."""
        before = []
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(
                    f"no {word} from {self.proc.args[2]}; stderr:\n{self.stderr.read_text()}"
                )
            if line.split(" ", 1)[0] == word:
                return line, before
            before.append(line)

    def drain(self) -> None:
        """Forget the lines received so far."""
        with contextlib.suppress(queue.Empty):
            while self.lines.get_nowait() is not None:
                pass

    def finish(self) -> None:
        """Close its stdin (the programs end there) and require a clean exit."""
        with self._send_lock:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        assert self.proc.wait(timeout=TIMEOUT_S) == 0, self.stderr.read_text()

    def close(self) -> None:
        """Kill it if it still runs, and release its pipes."""
        self.proc.kill()
        self.proc.wait()
        self._pump.join(timeout=5)
        with self._send_lock:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._err.close()


def _lmdb_keys(path: Path) -> list[str]:
    """Every key of the ``blocks`` database, straight from LMDB."""
    with lmdb.open(str(path), max_dbs=2, readonly=True, map_size=0) as env:
        db = env.open_db(BLOCKS_DB, create=False)
        with env.begin(db=db) as txn:
            keys = [bytes(k).hex() for k in txn.cursor().iternext(values=False)]
            assert txn.stat(db)["entries"] == len(keys)
    return keys


def _check_at_rest(raw: dict[str, Any], path: Path, expected: set[str]) -> int:
    """With no writer running: a fresh reader holds exactly ``expected``, each key
    once, and every block loads bit-exact. Returns the blocks checked."""
    stored = _lmdb_keys(path)
    assert len(stored) == len(set(stored)), "a key is stored twice"
    config = load_config(raw)
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    (tier,) = build_tiers(config, layout)
    try:
        held = [k for k, _ in tier.manager.policy.items()]
        held_hex = [k.hex() for k in held]
        assert len(held_hex) == len(set(held_hex)), "recovered a key twice"
        assert sorted(held_hex) == sorted(stored), "recovery skipped records"
        lost = expected - set(held_hex)
        assert not lost, f"{len(lost)} acknowledged blocks lost"
        stale = set(held_hex) - expected
        assert not stale, f"{len(stale)} blocks held that were evicted or never acknowledged"
        buf = torch.empty((len(held), layout.bytes_per_block), dtype=torch.uint8)
        scratch = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
        slots = tier.manager.prepare_load(held)
        valid = tier.backend.read(slots, held, buf)
        tier.manager.complete_load(held)
        assert all(valid), f"{valid.count(False)} acknowledged blocks unreadable"
        bad = [k.hex() for i, k in enumerate(held) if not gen.matches(k, buf[i], scratch)]
        assert not bad, f"{len(bad)} blocks with wrong bytes, first {bad[0]}"
        assert tier.manager.check() == []
        assert tier.backend.check() == []
    finally:
        tier.close()
    return len(held)


@pytest.mark.slow
def test_a_writer_and_a_reader_process_share_a_tier_ten_runs(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    raw, raw_ro = _config(path), _config(path, readonly=True)
    args = ["serve_writer", json.dumps(raw), str(BATCH), str(PAUSE_S)]
    writer = _Child(args, tmp_path / "writer.err")
    reader = _Child(["serve_reader", json.dumps(raw_ro)], tmp_path / "reader.err")
    forward = threading.Event()
    last_forward = [0.0]
    forwarded = [0]

    def forward_acks(line: str) -> None:
        # Some of the writer's ACK lines go on to the reader, which reads those blocks
        # by key: stored after its open, its manager does not know them.
        now = time.monotonic()
        if forward.is_set() and line.startswith("ACK ") and now - last_forward[0] > 0.01:
            last_forward[0] = now
            with contextlib.suppress(OSError, ValueError):  # a dead reader fails below
                reader.send(line)
                forwarded[0] += 1

    writer.on_line = forward_acks
    expected: set[str] = set()
    acked_ever: set[str] = set()
    totals: Counter[str] = Counter()
    try:
        writer.expect("STARTED")
        reader.expect("STARTED")
        for run in range(RUNS):
            writer.send(f"open {run}")
            writer.expect("READY")
            forward.set()
            reader.send(f"go {run}")
            reader.expect("OPENED")
            forwarded[0] = 0
            time.sleep(RUN_S)
            # However slow the machine: the reader has this run's blocks to read (it
            # reads its input in order, so those come before the stop).
            wait_until(lambda: forwarded[0] >= 2, "ACK lines forwarded to the reader")
            forward.clear()
            reader.send("stop")
            done, _ = reader.expect("DONE")
            writer.send("close")
            closed, lines = writer.expect("CLOSED")
            assert json.loads(closed.split(" ", 1)[1]) == [], closed

            acked_now: set[str] = set()
            for line in lines:  # in order: a key acknowledged, then maybe evicted
                kind, _, keys_hex = line.partition(" ")
                if kind == "ACK":
                    acked_now.update(keys_hex.split())
                    expected.update(keys_hex.split())
                elif kind == "EVICT":
                    expected.difference_update(keys_hex.split())
            assert acked_now, f"run {run}: the writer acknowledged nothing"
            acked_ever |= acked_now
            totals["acked"] += len(acked_now)

            seen_stats = json.loads(done.split(" ", 1)[1])
            seen = set(seen_stats.pop("seen"))
            stats = Counter(seen_stats)
            totals.update(stats)
            assert stats["bit_errors"] == 0, f"run {run}: {stats}"
            # Every read that came back invalid was a block the writer had evicted
            # (counted in missing_blocks), none a damaged one.
            misses = stats["managed_misses"] + stats["by_key_misses"]
            assert misses == stats["missing_blocks"], f"run {run}: {stats}"
            assert not seen - acked_ever, f"run {run}: read blocks nobody acknowledged"
            # The reader saw this run's writer at work, not only earlier runs' blocks.
            assert seen & acked_now, f"run {run}: the reader read none of this run's blocks"
            assert stats["managed_reads"] + stats["by_key_reads"] > 0, f"run {run}: {stats}"

            totals["at_rest_checked"] += _check_at_rest(raw_ro, path, expected)
        writer.finish()
        reader.finish()
    finally:
        writer.close()
        reader.close()
    print(f"one writer + one reader process x{RUNS}: {dict(totals)}")
    # Blocks stored after the reader opened were read by key without reopening, and
    # blocks evicted after it opened were misses (never wrong bytes: bit_errors == 0).
    assert totals["managed_reads"] > 0, totals
    assert totals["by_key_reads"] > 0, totals
    assert totals["managed_misses"] > 0, totals


def _opener(raw: dict[str, Any]) -> subprocess.Popen[str]:
    """A process that opens the tier of ``raw`` once told to (a line on its stdin)
    and reads every block it holds (see ``tierproc.open_as``)."""
    return subprocess.Popen(
        [sys.executable, str(SUPPORT / "tierproc.py"), "open_as", json.dumps(raw)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_second_writer_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    raw = _config(path)
    args = ["serve_writer", json.dumps(raw), str(BATCH), str(PAUSE_S)]
    writer = _Child(args, tmp_path / "writer.err")
    # Started together, so their imports overlap the writer's; they open when told.
    with _opener(raw) as second, _opener(_config(path, readonly=True)) as reader:
        try:
            writer.expect("STARTED")
            writer.send("open 0")
            writer.expect("READY")
            writer.expect("ACK")
            out, err = second.communicate("open\n", timeout=TIMEOUT_S)
            assert second.returncode == 2, (out, err)
            error = err.strip()
            assert "\n" not in error, error
            assert error.startswith("ConfigError: tier 'ssd': "), error
            assert f"path = {str(path)!r} is in use by another writer process" in error
            assert error.endswith("or open it with readonly: true"), error
            # Its advice works: another process opens the tier read-only, writer running.
            # (A block may be evicted before it is read: a miss, never wrong bytes.)
            out, err = reader.communicate("open\n", timeout=TIMEOUT_S)
            assert reader.returncode == 0, err
            counts = json.loads(out)
            assert counts["held"] > 0, counts
            assert counts["managed_reads"] + counts["managed_misses"] == counts["held"], counts
            assert counts["managed_misses"] == counts["missing_blocks"], counts
            assert counts["bit_errors"] == 0, counts
            # The first writer never noticed: it stores on, and closes clean.
            writer.drain()
            writer.expect("ACK")
            writer.send("close")
            closed, _ = writer.expect("CLOSED")
            assert closed == "CLOSED []"
            writer.finish()
        finally:
            second.kill()
            reader.kill()
            writer.close()


def test_a_reader_before_any_writer_gets_the_documented_error(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    with _opener(_config(path, readonly=True)) as proc:
        out, err = proc.communicate("open\n", timeout=TIMEOUT_S)
    assert proc.returncode == 2, (out, err)
    error = err.strip()
    assert "\n" not in error, error
    assert error.startswith(
        f"BackendError: tier 'ssd': cannot open LMDB environment at {path} "
        "(read-only: start the writer first): "
    ), error
    assert not os.path.exists(path), "a reader must not create the tier"
