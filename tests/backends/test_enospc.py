"""A real full disk while serving (issue 13): the disk tier lives on a small tmpfs that
another process's file fills up while the Offloader runs. Then stores into the disk
tier fail cleanly (counted in its ``store_errors``, nothing raises into the caller),
every block stored before still loads bit-exact, the tier takes and serves new blocks
once the space returns, and ``Offloader.check()`` finds nothing wrong throughout.

``tests/core/test_faults.py`` injects ENOSPC through a wrapper; here the kernel returns it.
The mmap tier runs with ``preallocate: false`` (its sparse slab fills as it is written);
with the default ``preallocate: true`` a filesystem too small for the capacity is
refused at open instead, and space once reserved stays usable whoever fills the disk.
LMDB writes through a shared mapping (``writemap``), where a full disk is a SIGBUS
rather than an error unless the backend reserves the pages first: its scenario runs in
a child process, so that a regression is reported as a failure of this test and does
not kill the test session."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import block_content, make_keys
from support.ci_rules import IN_CI

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

logger = logging.getLogger(__name__)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, namespace="t-nospc")
BPB = LAYOUT.bytes_per_block  # 32 KiB
BATCH = 8
POOL = 2 * BATCH
FS_BYTES = 8 * 1024**2

# The disk tiers: larger than the filesystem (the slab is sparse, the LMDB map is only
# address space), and every failure reaches the tier (no circuit breaker), so each one
# is counted.
SPARSE_MMAP = {"backend": "mmap", "preallocate": False, "io_threads": 2}
LMDB: dict[str, Any] = {"backend": "lmdb"}


# -- the filesystem ------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``mount(nbytes)``: a fresh tmpfs of that size under ``tmp_path``, unmounted
    (lazily, if still busy) at teardown. Without the right to mount, the tests are
    skipped, except under CI, where they must run."""
    mounted: list[Path] = []

    def mount(nbytes: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            why = done.stderr.strip() if done.returncode else ""
        except OSError as exc:
            why = str(exc)
        if why:
            if IN_CI:
                pytest.fail(f"CI must be able to mount a tmpfs: {' '.join(cmd)}: {why}")
            pytest.skip(f"cannot mount a tmpfs here ({why})")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=True)


def _free(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def _fill_up(path: Path) -> int:
    """Another process's data: write ``path`` until the filesystem is full."""
    chunk = b"\xa5" * (256 * 1024)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            try:
                n = os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
            written += n
            if n < len(chunk):
                chunk = chunk[:4096]  # the last pages, one at a time
    finally:
        os.close(fd)
    assert _free(path.parent) == 0, "the filler did not fill the filesystem"
    return written


# -- blocks ----------------------------------------------------------------------------
def _keys(salt: int) -> list[BlockKey]:
    return make_keys(BATCH, salt)


def _content(key: BlockKey) -> torch.Tensor:
    return block_content(key, BPB)


def _offloader(disk: dict[str, Any], fs: Path) -> Offloader:
    """cpu (one batch) -> disk (write-through, on ``fs``): every batch but the last
    stored is served from the disk."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": BATCH * BPB},
        {"name": "disk", "capacity": 512 * (BPB + 4096), "path": str(fs / "t"), **disk},
    ]
    tiers[1].setdefault("breaker_errors", 0)
    config = load_config({"tiers": tiers}, env={})
    return Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL))


def _store(off: Offloader, keys: list[BlockKey]) -> int:
    """Store a batch through the first tier and let the cascade into the disk settle;
    returns how many of its blocks the disk tier counted as failed."""
    assert off.pool is not None
    errors = off.stats[1].store_errors
    ids = list(range(BATCH))
    off.pool.scatter(ids, torch.stack([_content(k) for k in keys]))
    job = off.submit_store(keys, ids)  # never raises, full disk or not
    assert job is not None
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error  # the first tier is memory: its part always works
    assert off.drain(timeout=30)
    return off.stats[1].store_errors - errors


def _load(off: Offloader, keys: list[BlockKey]) -> int:
    """Load a batch into the pool; returns the blocks loaded, each checked bit for bit."""
    assert off.pool is not None
    ids = list(range(BATCH, 2 * BATCH))
    off.pool.scatter(ids, torch.zeros((BATCH, BPB), dtype=torch.uint8))
    plan = off.prepare_load(keys)
    job = off.submit_load(plan, ids[: plan.hits])
    assert job is not None
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error
    n = res.nbytes // BPB
    got = off.pool.gather(ids[:n])
    for i in range(n):
        assert torch.equal(got[i], _content(keys[i])), f"block {i} loaded wrong bytes"
    assert off.drain(timeout=30)  # the promotion into the first tier
    return n


# -- the scenario -----------------------------------------------------------------------
def serve_through_full_disk(disk: dict[str, Any], fs: Path) -> dict[str, int]:
    """Store, fill the filesystem, keep storing, load, free the space, store and load
    again. Asserts (a) to (d) of the module docstring; returns the figures."""
    with _offloader(disk, fs) as off:
        stats = off.stats[1]
        # 1. Room on the disk: four batches reach it.
        before = [_keys(salt) for salt in range(4)]
        for batch in before:
            assert _store(off, batch) == 0
        assert stats.blocks_stored == 4 * BATCH
        assert off.check() == []

        # 2. Another process fills the filesystem while the tier is open.
        filled = _fill_up(fs / "filler")

        # 3. Stores go on. The disk tier may use space it had already reserved, but
        # then every cascade write fails, counted, and nothing raises into the caller.
        stored_then = stats.blocks_stored
        outcome: list[int] = []  # failed blocks per batch
        salt = 100
        while len(outcome) < 12 and outcome[-3:] != [BATCH] * 3:
            outcome.append(_store(off, _keys(salt + len(outcome))))
        assert outcome[-3:] == [BATCH] * 3, f"stores on a full disk did not fail: {outcome}"
        assert all(n in (0, BATCH) for n in outcome), outcome  # whole batches, no halves
        during = [_keys(salt + i) for i in range(len(outcome))]
        failed = sum(outcome)
        assert stats.blocks_stored - stored_then + failed == BATCH * len(during)
        assert stats.store_errors == failed
        assert off.check() == []
        # What failed is gone from the disk, not half there: once the first tier
        # evicted it (all but the last batch), it is a miss, never wrong bytes.
        for batch, n in zip(during[:-1], outcome[:-1], strict=True):
            assert off.lookup(batch) == (BATCH if n == 0 else 0)
        assert _load(off, during[-1]) == BATCH  # still in the first tier

        # 4. Everything the disk took still loads, bit-exact, from the disk.
        on_disk = before + [b for b, n in zip(during, outcome, strict=True) if n == 0]
        hits = stats.hits
        for batch in on_disk:
            assert _load(off, batch) == BATCH
        assert stats.hits - hits == BATCH * len(on_disk)
        assert stats.corrupt_blocks == 0
        assert off.check() == []

        # 5. The space returns: new blocks reach the disk and load back from it.
        (fs / "filler").unlink()
        stored_then = stats.blocks_stored
        after = [_keys(salt) for salt in range(200, 204)]
        for batch in after:
            assert _store(off, batch) == 0
        assert stats.blocks_stored - stored_then == BATCH * len(after)
        assert stats.store_errors == failed
        hits = stats.hits
        for batch in after[:-1] + before:  # the last one is in the first tier too
            assert _load(off, batch) == BATCH
        assert stats.hits - hits == BATCH * (len(after) - 1 + len(before))
        assert off.check() == []
        assert off.pinned() == [0, 0]
        figures = {
            "fs_bytes": os.statvfs(fs).f_blocks * os.statvfs(fs).f_frsize,
            "filler_bytes": filled,
            "stored_before_full": BATCH * len(before),
            "stored_while_full": BATCH * len(during) - failed,
            "failed_while_full": failed,
            "loaded_from_disk": BATCH * len(on_disk),
            "stored_after": BATCH * len(after),
            "store_errors": stats.store_errors,
        }
    logger.info("full disk, %s: %s", disk["backend"], figures)
    return figures


def test_sparse_mmap_tier_survives_a_full_disk(small_fs: Callable[[int], Path]) -> None:
    """preallocate: false: the slab's holes are filled as blocks are written, so a full
    disk fails the very first store into it (no space was reserved)."""
    fs = small_fs(FS_BYTES)
    figures = serve_through_full_disk(SPARSE_MMAP, fs)
    assert figures["stored_while_full"] == 0
    assert figures["failed_while_full"] >= 3 * BATCH


def test_lmdb_tier_survives_a_full_disk(small_fs: Callable[[int], Path]) -> None:
    """LMDB maps its file shared and writes pages in place; the backend reserves the
    pages a transaction may take beforehand, so a full disk fails the reservation (a
    store error) instead of killing the process with SIGBUS on a page fault."""
    fs = small_fs(FS_BYTES)
    here = Path(__file__).resolve()
    tests = here.parents[1]  # where ``support`` lives: on the child's path too
    path = os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(here), "lmdb", str(fs)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tests.parent,
        env={**os.environ, "PYTHONPATH": path},
    )
    if done.returncode == -signal.SIGBUS:
        pytest.fail(f"the LMDB tier died of SIGBUS on the full disk:\n{done.stderr[-3000:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["failed_while_full"] >= 3 * BATCH
    assert figures["stored_before_full"] == 4 * BATCH
    assert figures["stored_after"] == 4 * BATCH


def test_preallocated_mmap_tier_too_big_for_the_disk_is_refused_at_open(
    small_fs: Callable[[int], Path],
) -> None:
    """preallocate: true (the default) reserves the slab at open: a capacity the disk
    cannot hold is a one-line ConfigError naming the tier and its path, and leaves no
    space taken; a capacity that fits is reserved whole, so filling the disk
    afterwards costs the tier no store."""
    size = 4 * 1024**2
    fs = small_fs(size)
    tier = {"backend": "mmap", "io_threads": 2}
    with pytest.raises(ConfigError) as refused:
        _offloader(tier, fs)  # 573 slots of 32 KiB: 18 MiB on a 4 MiB disk
    msg = str(refused.value)
    assert "\n" not in msg
    assert "tier 'disk'" in msg
    assert str(fs / "t") in msg
    assert "free disk space or lower tiers[].capacity" in msg
    assert _free(fs) >= size - 64 * 1024, "a refused tier kept disk space"

    # As the message says: a capacity that fits opens, and takes its space now.
    fits = {**tier, "capacity": 64 * (BPB + 4096)}  # 71 slots: 2.2 MiB
    with _offloader(fits, fs) as off:
        assert size - _free(fs) >= off.tiers[1].backend.num_slots * BPB
        _fill_up(fs / "filler")
        batches = [_keys(salt) for salt in range(4)]
        for batch in batches:
            assert _store(off, batch) == 0  # into space reserved at open
        assert off.stats[1].blocks_stored == 4 * BATCH
        for batch in batches[:-1]:
            assert _load(off, batch) == BATCH
        assert off.check() == []


if __name__ == "__main__":  # the child of test_lmdb_tier_survives_a_full_disk
    print(json.dumps(serve_through_full_disk(LMDB, Path(sys.argv[2]))), flush=True)
