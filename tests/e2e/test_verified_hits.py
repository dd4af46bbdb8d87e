"""Issue 10, end to end: a corrupt disk tier must never fail a request.

Disk blocks are prefetched into the cpu tier and verified before the scheduler claims
a hit, so corruption only ever shortens a hit, under either ``kv_load_failure_policy``
(vLLM's default ``"fail"`` included). What these tests do on a real engine (CPU build,
dummy-weight tiny Llama; the session's engine server, ``support/e2e.py``, unless a
test kills its engines):

- damage a filled ``mmap`` / ``lmdb`` tier, plain or compressed (``mmap`` with
  ``zstd``: a packed slab), at random (5 seeds, bytes flipped across the files:
  payloads, headers, LMDB pages) and run the same batch under both
  policies: no failed request, outputs equal to an engine without the connector;
- an I/O error in the cpu tier at load time, the one late path left (the test
  plugin's ``flakycpu`` backend): recomputed under ``"recompute"``, a failed request
  under ``"fail"``;
- ``kill -9`` of a whole engine process group while it stores, five times (``fsync``
  on and off), and twice over a packed ``zstd`` slab: every store its disk tier
  acknowledged (the test plugin's ``ackmmap`` logs them) is held and intact after the
  kill, every restart is served the stored prefix from the disk, with outputs equal to
  the reference, and ``kvoffload verify`` finds nothing it cannot repair;
- 1000 requests aborted before their load: no pins, holds or prefetches are left.

Several engines run one after the other in one spec (its ``engines`` key): each is a
fresh ``LLM`` over its own tier directory.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvoffload.backends.mmap import ALIGN, MmapBackend
from kvoffload_testplugin import read_ack_log
from support.e2e import (
    BATCH,
    BATCH_BLOCKS,
    BLOCK,
    ENGINE_RUN,
    PREFIX,
    EngineServer,
    cached,
    connector_tiers,
    engine_env,
    failures,
    outputs,
    sabotaged,
    tokens,
    write_spec,
)

from kvoffload.config import KVOffloadConfig, MmapTierConfig
from kvoffload.keys import BlockKey
from kvoffload.record import FLAG_EXTENT, HEADER_BYTES, HEADER_DTYPE, MAGIC
from kvoffload.tier import build_tiers

pytestmark = pytest.mark.slow  # real vLLM engines
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

# Other prompts stored on the same tier (10 blocks each), so that its files hold more
# than the batch and random damage leaves some of the batch's blocks intact.
FILLER = [tokens(400 + i, 10 * BLOCK) for i in range(10)]
FILLER_BLOCKS = 100


# --------------------------------------------------------------------------- damage
def _mmap_spots(path: Path, rng: random.Random, spots: int) -> list[int]:
    """Offsets in a slab file: a third in the used slots' header-table entries, a third
    in their payloads, a third anywhere from the superblock to the end of the last
    payload. A fixed-slot slab's payload is its slot's; a packed (compressed) slab's is
    the extent its header names (``wtime``, the first page, under ``FLAG_EXTENT``), of
    its ``stored`` bytes: both read from the file, so only bytes a block's checksum
    covers are counted as payload damage."""
    meta = MmapBackend.read_superblock(path)
    assert meta is not None, path
    slots, stride, payload = meta["num_slots"], meta["stride"], meta["payload_bytes"]
    table = (slots * HEADER_BYTES + ALIGN - 1) // ALIGN * ALIGN
    data = ALIGN + table
    with open(path, "rb") as f:
        f.seek(ALIGN)
        headers = np.frombuffer(f.read(slots * HEADER_BYTES), dtype=HEADER_DTYPE)
    used = np.flatnonzero(headers["magic"] == MAGIC).tolist()
    if not used:
        return []
    packed = meta.get("packed")
    where: dict[int, tuple[int, int]] = {}  # slot -> (payload offset, stored bytes)
    for slot in used:
        if packed is None:
            where[slot] = (data + slot * stride, payload)
        else:
            h = headers[slot]
            assert h["flags"] & FLAG_EXTENT, f"{path}: slot {slot} names no extent"
            page = int(h["wtime"]) - packed["first_page"]
            assert 0 <= page < packed["pages"], f"{path}: slot {slot}: page {page}"
            where[slot] = (data + page * ALIGN, int(h["stored"]))
    end = max(at + n for at, n in where.values())
    out: set[int] = set()
    while len(out) < spots:
        kind = len(out) % 3
        slot = rng.choice(used)
        if kind == 0:
            out.add(ALIGN + slot * HEADER_BYTES + rng.randrange(HEADER_BYTES))
        elif kind == 1:
            at, n = where[slot]
            out.add(at + rng.randrange(n))
        else:
            out.add(rng.randrange(end))
    return sorted(out)


def _lmdb_used_bytes(directory: Path) -> int:
    """Bytes of data.mdb LMDB has used (its pages up to the last one in use); the rest
    of the file is the map's unwritten tail."""
    import lmdb

    env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=2, map_size=0)
    try:
        return (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
    finally:
        env.close()


def _damage(directory: Path, backend: str, seed: int, spots: int = 64) -> dict[str, int]:
    """Flip one byte (XOR a random non-zero value) at ``spots`` distinct random offsets
    of each file of the tier; the same seed damages the same way. Returns the number
    of bytes flipped per file."""
    rng = random.Random(seed)
    plan: dict[Path, list[int]] = {}
    if backend == "mmap":
        for slab in sorted(directory.glob("slab-*.kvo")):
            plan[slab] = _mmap_spots(slab, rng, spots)
    else:
        data = directory / "data.mdb"
        used = _lmdb_used_bytes(directory)
        plan[data] = sorted(rng.sample(range(used), min(spots, used)))
    for path, offsets in plan.items():
        with open(path, "r+b") as f:
            for off in offsets:
                f.seek(off)
                byte = f.read(1)[0]
                f.seek(off)
                f.write(bytes([byte ^ rng.randrange(1, 256)]))
    return {p.name: len(o) for p, o in plan.items()}


def _packed(directory: Path) -> bool:
    """Whether the ``mmap`` tier in ``directory`` is a packed slab (its superblock says
    so): a compressed tier must be, or its blocks' extents go untested."""
    meta = MmapBackend.read_superblock(directory / "slab-000.kvo")
    assert meta is not None, directory
    return "packed" in meta


def _held_blocks(directory: Path, backend: str) -> int:
    """Blocks a filled tier holds, read from its files."""
    if backend == "mmap":
        total = 0
        for slab in directory.glob("slab-*.kvo"):
            meta = MmapBackend.read_superblock(slab)
            assert meta is not None
            with open(slab, "rb") as f:
                f.seek(ALIGN)
                raw = f.read(meta["num_slots"] * HEADER_BYTES)
            total += int((np.frombuffer(raw, dtype=HEADER_DTYPE)["magic"] == MAGIC).sum())
        return total
    import lmdb

    env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=2, map_size=0)
    try:
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(db=blocks) as txn:
            return int(txn.stat(blocks)["entries"])
    finally:
        env.close()


# ----------------------------------------------------------------- corruption (issue)
@pytest.mark.parametrize(
    ("backend", "compression"),
    [("mmap", "none"), ("lmdb", "none"), ("mmap", "zstd"), ("lmdb", "lz4")],
    ids=["mmap", "lmdb", "mmap-zstd", "lmdb-lz4"],
)
def test_corrupt_disk_tier_never_fails_a_request(
    engines: EngineServer,
    tmp_path: Path,
    reference: list[list[int]],
    backend: str,
    compression: str,
) -> None:
    """Fill a cpu -> disk (write_through) tier with one batch (and other prompts); then,
    for 5 seeds, damage a fresh copy of it (64 bytes flipped at random per file) and
    run the same batch on a new engine over the copy, under both failure policies:
    ``"fail"`` (vLLM's default) and ``"recompute"`` (its first seed in vLLM's default
    multi-process mode, the others single-process, so that their counters show the
    damage was met and intact blocks were still served, with no load error: damage is
    found before a hit is claimed). Every run: no failed request, outputs equal to
    the reference. Compressed tiers too: a flip in a block's stored bytes must be
    caught by its checksum before it is decompressed. The compressed ``mmap`` tier is
    a packed slab (its superblock says so; the plain one's is not): its payload flips
    land in the extents its headers name."""
    pristine = tmp_path / "pristine"
    tiers = partial(connector_tiers, backend, compression=compression)
    (fill,) = engines.results(tmp_path, kvoffload=tiers(pristine), rounds=[BATCH, FILLER])
    assert outputs(fill) == reference
    assert _held_blocks(pristine, backend) == BATCH_BLOCKS + FILLER_BLOCKS
    written = fill["kvoffload"]
    if compression != "none":  # the blocks really are compressed on disk
        assert 0 < written["tier.disk.stored_bytes"] < written["tier.disk.logical_bytes"]
    if backend == "mmap":  # compressed: a packed slab, each block in an extent
        assert _packed(pristine) == (compression != "none")
    print(
        f"filled: stored {written['tier.disk.stored_bytes']} of "
        f"{written['tier.disk.logical_bytes']} logical bytes"
    )

    seeds = range(5)
    runs: dict[str, list[Path]] = {"fail": [], "recompute": []}
    flipped = {}
    for policy, dirs in runs.items():
        for seed in seeds:
            copy = tmp_path / f"{policy}-{seed}"
            shutil.copytree(pristine, copy)
            flipped[copy.name] = _damage(copy, backend, seed)
            dirs.append(copy)

    t0 = time.monotonic()
    failing = engines.results(
        tmp_path,
        rounds=[BATCH],
        engines=[{"kvoffload": tiers(d)} for d in runs["fail"]],
    )  # no policy: vLLM's default, "fail"
    t1 = time.monotonic()
    default_mode = {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    recomputing = engines.results(
        tmp_path,
        rounds=[BATCH],
        failure_policy="recompute",
        engines=[
            {"kvoffload": tiers(d), **(default_mode if i == 0 else {})}
            for i, d in enumerate(runs["recompute"])
        ],
    )
    t2 = time.monotonic()

    summary = []
    for policy, results in (("fail", failing), ("recompute", recomputing)):
        for seed, result in zip(seeds, results, strict=True):
            c = result["kvoffload"]
            summary.append(
                f"{policy} seed {seed}: flipped {flipped[f'{policy}-{seed}']}, cached "
                f"{[r['cached'] for r in result['rounds'][0]]}"
                + (
                    f", corrupt {c['tier.disk.corrupt_blocks']}, prefetched "
                    f"{c.get('prefetched_blocks')}, loaded {c['blocks_loaded']}, "
                    f"load errors {c['load_errors']}"
                    if c
                    else ""
                )
            )
    summary.append(f"fail runs {t1 - t0:.0f} s, recompute runs {t2 - t1:.0f} s")
    report = "\n".join(summary)
    print(report)
    for policy, results in (("fail", failing), ("recompute", recomputing)):
        for seed, result in zip(seeds, results, strict=True):
            assert result["failed"] == 0, f"{policy} seed {seed}: {failures(result)}\n{report}"
            assert outputs(result) == reference, f"{policy} seed {seed}\n{report}"
    # The damage must have been met, or this test proved nothing; and the damaged
    # tiers still served their intact blocks. No exact counts: a prefetch reads a
    # prompt's blocks up to its first bad one, and which prompt's lookup (of four
    # sharing a prefix) is answered first, in which step, decides which blocks are
    # read, and so how many bad ones are met and how many good ones loaded.
    corrupt = sum(r["kvoffload"]["tier.disk.corrupt_blocks"] for r in failing)
    assert corrupt > 0, report
    assert sum(r["kvoffload"]["prefetched_blocks"] for r in failing) > 0, report
    assert sum(r["kvoffload"]["blocks_loaded"] for r in failing) > 0, report
    counted = [r["kvoffload"] for r in failing + recomputing if r["kvoffload"]]
    assert len(counted) == 2 * len(seeds) - 1, report  # all but the multi-process one
    assert all(c["load_errors"] == 0 for c in counted), report
    # Not exact either, for the same reason.
    assert sum(c["blocks_loaded"] for c in counted[len(seeds) :]) > 0, report


# ----------------------------------------------------------------- the late path
FAILED_READ_BLOCKS = 13 + 2
"""The blocks of ``flakycpu``'s two failed reads in the batch's repeat: the first
request's (the shared 11-block prefix and its own 2), then the second's own 2."""


def test_cpu_tier_read_error_at_load(
    engines: EngineServer, tmp_path: Path, reference: list[list[int]]
) -> None:
    """The one way a load can still fail: an I/O error reading the cpu tier (the test
    plugin's ``flakycpu`` backend fails its first two non-empty reads). The batch runs
    twice (vLLM's prefix cache reset in between), so the second round loads from the
    tier: one read per request, in the batch's order. The first request reads its 13
    blocks (the shared 11-block prefix and its own 2), the next its own 2: both reads
    fail (15 blocks); the other three read theirs (2, 2 and 9: 13 blocks). Under
    ``"recompute"`` the failed blocks are recomputed: outputs equal the reference, no
    request fails, exactly those load errors are counted. Under ``"fail"`` (vLLM's
    default) the requests whose blocks failed fail, and only those: the first two,
    and the two others over the first one's prefix.

    A third engine, in vLLM's default multi-process mode under ``"fail"``, has every
    read fail: every request of the repeat fails. That is what the tests that run in
    that mode (where the connector's counters cannot be read) rely on to prove their
    hits: under ``"fail"`` a load that failed cannot pass as a hit."""
    tier = {"name": "cpu", "backend": "flakycpu", "capacity": "64MiB", "fail_reads": 2}
    conn = {"config": {"tiers": [tier]}}
    recompute, fail, default_mode = engines.results(
        tmp_path,
        kvoffload=conn,
        rounds=[BATCH, BATCH],
        engines=[
            {"failure_policy": "recompute"},
            {"failure_policy": "fail"},
            {
                "failure_policy": "fail",
                "kvoffload": sabotaged(connector_tiers(None)),
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            },
        ],
    )
    assert outputs(default_mode, 0) == reference  # nothing to load yet: nothing fails
    assert not failures({"rounds": default_mode["rounds"][:1]})
    every = default_mode["rounds"][1]
    assert all(r["failed"] and r["finish_reason"] == "error" for r in every), json.dumps(every)
    # vLLM's own prefix cache was emptied after round 1: round 2's hits are ours.
    assert recompute["resets"][0], recompute["resets"]
    assert fail["resets"][0], fail["resets"]
    c = recompute["kvoffload"]
    assert outputs(recompute, 0) == reference
    assert outputs(recompute, 1) == reference, json.dumps(c)
    assert recompute["failed"] == 0, failures(recompute)
    assert c["load_errors"] == FAILED_READ_BLOCKS, json.dumps(c)
    assert c["blocks_loaded"] == BATCH_BLOCKS - FAILED_READ_BLOCKS, json.dumps(c)

    keys = ("blocks_loaded", "load_errors", "tier.cpu.hits")
    print(
        "recompute:",
        {k: c[k] for k in keys},
        "cached",
        [r["cached"] for r in recompute["rounds"][1]],
    )
    c = fail["kvoffload"]
    print(
        "fail:",
        {k: c[k] for k in keys},
        "finish reasons",
        [r["finish_reason"] for r in fail["rounds"][1]],
    )
    assert outputs(fail, 0) == reference  # nothing to load yet: nothing fails
    assert c["load_errors"] == FAILED_READ_BLOCKS, json.dumps(c)
    assert c["blocks_loaded"] == BATCH_BLOCKS - FAILED_READ_BLOCKS, json.dumps(c)
    second = fail["rounds"][1]
    # The prompts over the shared prefix fail (its blocks were in the first failed
    # read); the fifth, of its own, does not.
    assert [r["failed"] for r in second] == [True] * 4 + [False], json.dumps(second)
    failed = [r for r in second if r["failed"]]
    assert all(r["finish_reason"] == "error" for r in failed), json.dumps(failed)
    for got, want in zip(second, reference, strict=True):
        if not got["failed"]:
            assert got["tokens"] == want


# ----------------------------------------------------------------- faults (issue 13)
def _faulty_tiers(path: Path, *, cpu: bool = True, **faults: Any) -> dict[str, Any]:
    """cpu -> ``faultymmap`` (the test plugin's mmap tier with ``faults`` injected), or
    the faulty disk tier alone; the breaker off unless ``faults`` sets it, so that
    every fault reaches the stack."""
    conf = connector_tiers("faultymmap", path, **{"breaker_errors": 0, **faults})["config"]
    if not cpu:
        conf["tiers"] = conf["tiers"][1:]
    return {"config": conf}


def test_disk_faults_and_hangs_never_fail_a_request(
    engines: EngineServer, tmp_path: Path, reference: list[list[int]]
) -> None:
    """Real engines over one disk tier with faults injected (``faultymmap``), one after
    the other, each starting with an empty cpu tier so its hits come from the disk:

    1. stores under write faults (EIO, ENOSPC, short writes, latency spikes);
    2. loads under read faults (EIO, latency spikes);
    3. every disk read hangs 3 s, ``load_timeout_ms`` 300: each claim stops waiting
       and takes the shorter hit;
    4. the same hang with the disk as the only tier, so the engine step's own load
       reads it: the load is abandoned and its blocks recomputed.

    Every run: no failed request, outputs equal to the reference, the faults counted
    where they hit. After run 2 the disk holds the whole batch (28 blocks: run 2
    stores what run 1's faults kept out), so in run 3 each of the 5 requests'
    claims stops waiting and loads nothing, and in run 4 every one of the 28 blocks'
    loads is abandoned and recomputed: neither run takes anything from the hung reads,
    which a step that waited for them would have."""
    disk = tmp_path / "disk"
    write_faults: dict[str, Any] = {
        "write_error": 0.2,
        "enospc": 0.1,
        "short_write": 0.2,
        "slow": 0.2,
    }
    hang: dict[str, Any] = {"read_hang": 1.0, "hang_s": 3.0}
    runs = [
        {"kvoffload": _faulty_tiers(disk, **write_faults, seed=1)},
        {"kvoffload": _faulty_tiers(disk, read_error=0.3, slow=0.3, seed=2)},
        {"kvoffload": _faulty_tiers(disk, **hang)},
        {"kvoffload": _faulty_tiers(disk, cpu=False, **hang)},
    ]
    for e in runs[2:]:
        e["kvoffload"]["config"]["load_timeout_ms"] = 300
    t0 = time.monotonic()
    results = engines.results(tmp_path, rounds=[BATCH], failure_policy="recompute", engines=runs)
    seconds = time.monotonic() - t0
    counts = [
        {
            k: r["kvoffload"].get(k)
            for k in (
                "blocks_loaded",
                "load_errors",
                "load_timeouts",
                "prefetched_blocks",
                "prefetch_failed",
                "prefetch_late",
                "tier.disk.store_errors",
                "tier.disk.blocks_stored",
            )
        }
        for r in results
    ]
    report = "\n".join(f"engine {i + 1}: {c}" for i, c in enumerate(counts))
    report += f"\n4 engines in {seconds:.0f} s"
    print(report)
    for i, result in enumerate(results):
        assert result["failed"] == 0, f"engine {i + 1}: {failures(result)}\n{report}"
        assert outputs(result) == reference, f"engine {i + 1}\n{report}"
    stored, read, hung, first = counts
    # Every block of the batch reached the disk's store, and was stored or failed with
    # its write (a failed write fails all its blocks). The split is not exact: faults
    # are drawn per write call, and how the stores are batched into calls follows the
    # engine's steps.
    written = stored["tier.disk.store_errors"] + stored["tier.disk.blocks_stored"]
    assert written == BATCH_BLOCKS, report
    assert stored["tier.disk.store_errors"] > 0, report  # the write faults hit
    assert stored["tier.disk.blocks_stored"] > 0, report  # and some stores got through
    # Not exact either: what run 2 can prefetch is what run 1 stored, and its read
    # faults are drawn per call too.
    assert read["prefetched_blocks"] + read["prefetch_failed"] > 0, report
    # What the read faults left intact was served: prefetched into the cpu tier and
    # loaded from there, without a load error.
    assert read["blocks_loaded"] > 0, report
    assert read["load_errors"] == 0, report
    assert hung["prefetch_late"] == len(BATCH), report  # every request's claim
    assert hung["blocks_loaded"] == 0, report  # nothing came up in time: all recomputed
    assert first["load_timeouts"] == BATCH_BLOCKS, report  # every block's load abandoned
    assert first["load_errors"] == first["load_timeouts"], report
    assert first["blocks_loaded"] == 0, report


def test_a_hanging_store_never_holds_the_engine(
    engines: EngineServer, tmp_path: Path, reference: list[list[int]]
) -> None:
    """An empty disk as the only tier, every call into it hanging 10 s, and
    ``store_timeout_ms`` 300: each store hands the engine its blocks back once it has
    read them (the write then hangs on its lane), and the stores queued behind a hung
    write are abandoned at their deadline, so finished requests' blocks are freed and
    no request waits for a disk. No request fails, outputs equal the reference.

    Checked by order and counts: the first request's store (13 blocks) is read, its
    write hangs; the other 48 of the 61 blocks the requests submit (each request its
    own full blocks) queue behind it and are abandoned. Every request finished, and
    vLLM's prefix cache was reset (every block of theirs freed), while that write
    still hung: at idle the disk had stored nothing; after shutdown (the Offloader
    closes after its queued jobs), the 13 blocks."""
    engine = {"kvoffload": _faulty_tiers(tmp_path / "disk", cpu=False, hang=1.0, hang_s=10.0)}
    engine["kvoffload"]["config"].update(load_timeout_ms=300, store_timeout_ms=300)
    t0 = time.monotonic()
    (result,) = engines.results(
        tmp_path, single_process=True, rounds=[BATCH], failure_policy="recompute", **engine
    )
    seconds = time.monotonic() - t0
    c = result["kvoffload"]
    report = (
        f"at idle: stored={result['kvoffload_at_idle'].get('tier.disk.blocks_stored')}; "
        f"store_timeouts={c.get('store_timeouts')} submitted="
        f"{c.get('blocks_submitted_for_store')} stored={c.get('tier.disk.blocks_stored')} "
        f"store_errors={c.get('tier.disk.store_errors')} in {seconds:.0f} s"
    )
    print(report)
    assert result["failed"] == 0, f"{failures(result)}\n{report}"
    assert outputs(result) == reference, report
    first = len(BATCH[0]) // BLOCK  # the first request's store: read, its write hung
    assert c["blocks_submitted_for_store"] == sum(len(p) // BLOCK for p in BATCH), report
    # Queued behind the hung write: abandoned.
    assert c["store_timeouts"] == c["blocks_submitted_for_store"] - first, report
    assert result["resets"] == [True], report  # every block of the requests freed
    idle = result["kvoffload_at_idle"]
    assert idle["store_timeouts"] == c["store_timeouts"], report
    assert idle["tier.disk.blocks_stored"] == 0, report  # the write still hung
    assert c["tier.disk.blocks_stored"] == first, report  # it ended at shutdown
    # The tier's view: the batch's distinct blocks, less the first request's, were in
    # the abandoned stores.
    assert c["tier.disk.store_errors"] == BATCH_BLOCKS - first, report


# ----------------------------------------------------------------- kill -9
def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies excepted)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _verify(tmp: Path, config: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    """``kvoffload verify`` (the CLI) over ``config``: exit status, JSON report, output."""
    out = tmp / f"verify-{len(list(tmp.glob('verify-*')))}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffload",
            "verify",
            "--config",
            str(config),
            "--json",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, report, proc.stdout + proc.stderr


def _tier_yaml(path: Path, tiers: dict[str, Any]) -> Path:
    path.write_text(json.dumps(tiers["config"]))  # JSON is YAML
    return path


KILL_ROUNDS = 12
"""Rounds of new prompts a killed engine runs (about 900 blocks): bounded, so that the
disk tier has room for all that five engines can store."""
KILL_DISK = "128MiB"
"""Room for the check round and five workloads (about 4,500 blocks of 16 KiB, plus each
slot's header), so that nothing is ever evicted."""
HANG_GUARD_S = 600.0
"""How long a wait for an engine may take before the test gives up on it: a guard
against a hang, not a measure (no assertion is made on any elapsed time)."""


def _start_engine(
    tmp: Path, spec: Path, env: dict[str, str], kill_at_round: int | None
) -> tuple[list[str], subprocess.Popen[str], list[dict[str, Any]] | None, threading.Thread]:
    """Start ``engine_run.py`` in a process group of its own and wait for its first
    round, or, with ``kill_at_round``, for that round to end; then the output lines so
    far (a thread keeps collecting them, so the engine never blocks on a full pipe),
    the process, its first round's results (``None`` if the engine ended first), and
    the collecting thread (done once the pipe closes)."""
    proc = subprocess.Popen(
        [sys.executable, str(ENGINE_RUN), str(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp,
        start_new_session=True,
    )
    lines: list[str] = []
    first: list[Any] = []
    wanted = f"E2E-ROUND 0 {kill_at_round or 0} "
    seen = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("E2E-ROUND 0 0 "):
                first.append(json.loads(line.split(" ", 3)[3]))
            if line.startswith(wanted):
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not seen.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
        pass
    return lines, proc, first[0] if first else None, reader


def _acks(log: Path) -> int:
    """Stores an ``ackmmap`` tier has acknowledged so far: whole lines of its log."""
    try:
        return log.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _wait_for_acks(log: Path, proc: subprocess.Popen[str], lines: list[str], want: int) -> int:
    """Wait until the engine's ``ackmmap`` tier has acknowledged ``want`` stores (lines
    of ``log``), or, with one acknowledged, the engine holds (its workload done: no
    more stores come); then how many it has. Raises if the engine ends first, or
    nothing comes within the hang guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        n = _acks(log)
        if n >= want or (n and any(line.startswith("E2E-HOLD") for line in lines)):
            return n
        if proc.poll() is not None:
            raise AssertionError(f"the engine ended ({proc.returncode}) with {n} stores acked")
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} of {want} stores acked after {HANG_GUARD_S:.0f} s")
        time.sleep(0.005)


def _disk_config(path: Path, compression: str) -> MmapTierConfig:
    """The kill test's disk tier at ``path``, as the built-in ``mmap`` backend."""
    return MmapTierConfig(name="disk", path=str(path), capacity=KILL_DISK, compression=compression)


def _lost_acknowledged(
    path: Path, acked: dict[BlockKey, int], compression: str
) -> tuple[list[BlockKey], list[BlockKey]]:
    """Reopen the disk tier at ``path`` here, as the next engine would (the built-in
    ``mmap`` backend, its blocks recovered from the header tables; opened as written,
    reading nothing into its LRU order, like ``kvoffload verify``), and read back every
    block of ``acked`` (key -> the engine whose tier acknowledged its store). Returns
    the acknowledged blocks it lost: those it does not hold, and those it holds but
    cannot serve intact (the read checks key, layout and payload checksum)."""
    conf = _disk_config(path, compression)
    layout = MmapBackend.stored_layout(conf)
    existing = MmapBackend.existing_config(conf, write=False)
    assert layout is not None, f"nothing written at {path}"
    assert existing is not None, f"nothing written at {path}"
    backend = MmapBackend(existing, layout)
    backend.record_access = False
    try:
        held = {b.key: b.slot for b in backend.recover()}
        missing = [k for k in acked if k not in held]
        present = [k for k in acked if k in held]
        invalid: list[BlockKey] = []
        for start in range(0, len(present), 256):
            chunk = present[start : start + 256]
            buf = torch.empty((len(chunk), layout.bytes_per_block), dtype=torch.uint8)
            valid = backend.read([held[k] for k in chunk], chunk, buf)
            invalid += [k for k, ok in zip(chunk, valid, strict=True) if not ok]
    finally:
        backend.close()
    return missing, invalid


def _check_acknowledged(path: Path, acked: dict[BlockKey, int], compression: str) -> None:
    """Guarantee 2 (docs/reliability.md): every store an engine's tier acknowledged
    survives the kill, read back intact. The disk tier has room for everything, so no
    block may be missing, not even as a clean miss. Raises naming each block lost."""
    missing, invalid = _lost_acknowledged(path, acked, compression)
    if missing or invalid:

        def named(keys: list[BlockKey]) -> str:
            return ", ".join(f"{k.hex()} (engine {acked[k]})" for k in keys)

        raise AssertionError(
            f"{len(missing) + len(invalid)} of {len(acked)} acknowledged blocks lost: "
            f"not held: [{named(missing)}]; held but not intact: [{named(invalid)}]"
        )


def _lose_two(src: Path, dst: Path, dropped: BlockKey, torn: BlockKey, compression: str) -> None:
    """A copy of the tier at ``src`` in ``dst`` that has lost two blocks: ``dropped``
    through the tier's own API (as if its store had never returned), and ``torn`` by
    the first byte of its payload flipped (as if its store had been cut short): where
    the tier says it is (``payload_at``: its slot, or in a packed slab its extent)."""
    shutil.copytree(src, dst)
    conf = _disk_config(dst, compression)
    layout = MmapBackend.stored_layout(conf)
    assert layout is not None
    (tier,) = build_tiers(KVOffloadConfig(tiers=[conf]), layout)
    try:
        assert tier.manager.holds(dropped)
        (slot,) = tier.manager.prepare_load([torn])  # where its payload is
        tier.manager.complete_load([torn])
        assert isinstance(tier.backend, MmapBackend)
        slab, at = tier.backend.payload_at(slot)
        tier.drop([dropped])
    finally:
        tier.close()
    with open(slab, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize(
    ("compression", "kills"), [("none", 5), ("zstd", 2)], ids=["mmap", "mmap-zstd"]
)
def test_kill_9_while_storing_then_restart_and_verify(
    engines: EngineServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    compression: str,
    kills: int,
) -> None:
    """A check round is stored on cpu -> mmap (write_through, fsync) by an engine that
    exits cleanly. Then, five times (``kills``), an engine over the same tiers runs
    the check round and round after round of new prompts (every step stores blocks),
    and its whole process group is killed with SIGKILL at a random moment of that
    workload (seeded): after one of its rounds, once its disk tier has acknowledged 1
    to 5 stores more (each round makes 6), so while the next round's stores are being
    written. A last engine exits cleanly.

    The killed engines' disk tier is the test plugin's ``ackmmap``: the built-in mmap
    tier, which logs the keys of every store that has returned. Engines 1, 3 and 5 run
    it with ``fsync`` on, 2 and 4 with it off (guarantee 2 promises both). After each
    kill, before the next engine starts, the tier is reopened here and every block
    acknowledged by any killed engine so far must be held and read back intact
    (:func:`_check_acknowledged`); after the last engine, once more. A copy of the
    final tier that lost one of engine 1's acknowledged blocks (dropped), and one of
    the last killed engine's (torn: a payload byte flipped), must fail that same
    check, naming exactly those two.

    Also over a packed compressed disk tier (``compression: zstd``: each block in an
    extent of its compressed bytes' pages), with two kills rather than five (engine 1
    with ``fsync`` on, engine 2 off) to bound the test's time: the same claims; the
    slab is packed (its superblock says so; the plain variant's is not), and the
    clean engine's counters show the check round stored compressed (stored bytes
    under logical bytes). A killed engine's ``ackmmap`` acknowledges only the blocks
    its write placed (charge above 0).

    The guarantee, whatever the machine's speed: the disk tier has room for every
    block the engines can store (their workloads are bounded, and an engine that ends
    its workload before the kill holds until it comes), so nothing is evicted (no
    acknowledged block may be missing, not even as a clean miss), and each restarted
    engine is served the check round's every full block from the disk, through the
    crashes before it, with outputs equal to the reference. Loads run under vLLM's
    default ``kv_load_failure_policy`` (``"fail"``), where a failed load fails its
    request. After each kill ``kvoffload verify`` reads every block: exit 0, or 1 with
    corrupt blocks that ``--repair`` (on a copy, so the next engine meets the crash's
    state) discards, after which a second ``verify`` finds none. The first killed
    engine runs in vLLM's default multi-process mode, the others in one process."""
    rng = random.Random(10)
    tier_dir = tmp_path / "ssd"
    tiers = connector_tiers("mmap", tier_dir, capacity=KILL_DISK, compression=compression)
    tiers["config"]["tiers"][0]["capacity"] = "16MiB"
    config = _tier_yaml(tmp_path / "tiers.yaml", tiers)
    check = [PREFIX + tokens(300 + i, 50) for i in range(3)]
    full = (len(check[0]) - 1) // BLOCK * BLOCK  # vLLM never counts a prompt's last token
    ref, stored = engines.results(
        tmp_path, rounds=[check], engines=[{"kvoffload": None}, {"kvoffload": tiers}]
    )
    want = outputs(ref)
    assert outputs(stored) == want
    # A fresh tier: nothing loaded from it (which prompt computes the shared prefix
    # first, and so which ones hit vLLM's own cache, depends on the step each lookup
    # is answered in).
    assert stored["kvoffload"]["blocks_loaded"] == 0, stored["kvoffload"]
    written = stored["kvoffload"]
    if compression != "none":  # the blocks really are compressed on disk
        assert 0 < written["tier.disk.stored_bytes"] < written["tier.disk.logical_bytes"]
    assert _packed(tier_dir) == (compression != "none")  # each block in an extent
    print(
        f"check round: stored {written['tier.disk.stored_bytes']} of "
        f"{written['tier.disk.logical_bytes']} logical bytes"
    )
    assert min(cached(stored)) == 0
    rc, report, out = _verify(tmp_path, config)
    assert rc == 0, out
    assert report["disk"]["ok"] == report["disk"]["blocks"] == full // BLOCK + 2, out

    def workload(engine: int) -> list[list[list[int]]]:
        return [
            [tokens(1000 * engine + 10 * r + i, 320 + 32 * i) for i in range(6)]
            for r in range(KILL_ROUNDS)
        ]

    def acking(engine: int, log: Path) -> dict[str, Any]:
        """The tiers, their disk ``ackmmap`` logging to ``log``, fsync on odd engines."""
        conf: dict[str, Any] = copy.deepcopy(tiers)
        disk = conf["config"]["tiers"][1]
        disk.update(backend="ackmmap", ack_log=str(log), fsync=engine % 2 == 1)
        return conf

    # The connector's Unix sockets go to $TMPDIR; a killed engine leaves its socket
    # file behind, so give the engines a short-lived one of their own (short: a
    # socket path has at most 107 bytes).
    sockets = Path(tempfile.mkdtemp(prefix="kvo-"))
    request.addfinalizer(lambda: shutil.rmtree(sockets, ignore_errors=True))
    served = []
    timeline = []
    acked: dict[BlockKey, int] = {}  # every acknowledged key -> the engine
    per_engine: list[str] = []
    t0 = time.monotonic()
    for engine in range(1, kills + 2):
        last = engine == kills + 1
        env = {**os.environ, **engine_env(single_process=engine != 1), "TMPDIR": str(sockets)}
        timeline.append(f"{time.monotonic() - t0:6.1f} s: engine {engine} starts")
        ack_log = tmp_path / f"acks-{engine}.log"
        spec = write_spec(
            tmp_path,
            kvoffload=tiers if last else acking(engine, ack_log),
            rounds=[check] + ([] if last else workload(engine)),
            hold=not last,
        )
        # A random moment of the workload: after one of its rounds but the last (drawn
        # at random), 1 to 5 stores (of 6) into the next round's: while that round's
        # stores are being written.
        at = None if last else rng.randrange(1, KILL_ROUNDS)
        lines, proc, checked, reader = _start_engine(tmp_path, spec, env, at)
        try:
            if not last and checked is not None:
                base = _acks(ack_log)
                more = rng.randint(1, 5)
                seen = _wait_for_acks(ack_log, proc, lines, base + more)
                assert proc.poll() is None, "the engine ended before it was killed"
                os.killpg(proc.pid, signal.SIGKILL)
                done = sum(line.startswith("E2E-ROUND") for line in lines) - 1
                timeline.append(
                    f"{time.monotonic() - t0:6.1f} s: killed after round {at} of "
                    f"{KILL_ROUNDS} of its workload ({done} seen done), {base} stores acked "
                    f"at its end, then {seen} (waited for {base + more})"
                )
            proc.wait(timeout=HANG_GUARD_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            reader.join(timeout=60)
            assert proc.stdout is not None
            proc.stdout.close()
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(proc.pid), "processes of the killed group live on"
        log = "".join(lines)[-4000:]
        assert checked is not None, log
        assert proc.returncode == (0 if last else -signal.SIGKILL), log
        assert [r["tokens"] for r in checked] == want, f"engine {engine}"
        assert not any(r["failed"] for r in checked), checked
        served.append([r["cached"] for r in checked])

        # What this engine's tier acknowledged (a line the kill cut short does not
        # count), then every acknowledged block so far: held, and read back intact.
        if not last:
            stores = read_ack_log(ack_log)
            mine = {k for keys in stores for k in keys}
            assert mine, f"engine {engine}: killed before any store returned"
            assert not mine & acked.keys(), f"engine {engine}: keys another engine stored"
            acked.update(dict.fromkeys(mine, engine))
            per_engine.append(
                f"engine {engine} (fsync {'on' if engine % 2 else 'off'}): "
                f"{len(stores)} stores, {len(mine)} blocks acknowledged"
            )
        _check_acknowledged(tier_dir, acked, compression)
        timeline.append(
            f"{time.monotonic() - t0:6.1f} s: all {len(acked)} acknowledged blocks intact"
        )

        # Whatever the crash (or the clean exit) left, verify classifies every block;
        # what it finds corrupt, --repair discards.
        rc, report, out = _verify(tmp_path, config)
        assert rc in (0, 1), out
        (counts,) = report.values()
        assert counts["blocks"] == counts["ok"] + counts["corrupt"], out
        assert rc == (1 if counts["corrupt"] else 0), out
        timeline.append(f"{time.monotonic() - t0:6.1f} s: verified {counts}")
        if not counts["corrupt"]:
            continue  # nothing to repair
        copy_dir = tmp_path / "repaired"
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(tier_dir, copy_dir)
        copy_config = _tier_yaml(
            tmp_path / "repaired.yaml",
            connector_tiers("mmap", copy_dir, capacity=KILL_DISK, compression=compression),
        )
        rc, fixed, out = _verify(tmp_path, copy_config, "--repair")
        assert rc == 0, out
        assert fixed["disk"]["repaired"] == fixed["disk"]["corrupt"], out
        rc, again, out = _verify(tmp_path, copy_config)
        assert rc == 0, out
        assert again["disk"]["corrupt"] == 0, out
        assert again["disk"]["ok"] == again["disk"]["blocks"] == fixed["disk"]["ok"], out
    print("\n".join(timeline), "\nserved per engine:", served, "\n" + "\n".join(per_engine))
    # Every restart: the check round's every full block, from the disk.
    assert served == [[full] * len(check)] * (kills + 1), served

    # The check fails when an acknowledged store is lost: a copy of the tier that lost
    # one of engine 1's blocks (dropped) and one of engine 5's (torn).
    order = list(acked)
    dropped = next(k for k in order if acked[k] == 1)
    torn = next(k for k in reversed(order) if acked[k] == kills)
    lossy = tmp_path / "lossy"
    _lose_two(tier_dir, lossy, dropped, torn, compression)
    assert _lost_acknowledged(lossy, acked, compression) == ([dropped], [torn])
    with pytest.raises(AssertionError, match=f"2 of {len(acked)} acknowledged blocks lost") as e:
        _check_acknowledged(lossy, acked, compression)
    assert f"[{dropped.hex()} (engine 1)]" in str(e.value), e.value
    assert f"[{torn.hex()} (engine {kills})]" in str(e.value), e.value
    _check_acknowledged(tier_dir, acked, compression)  # the original: untouched
    print(f"lossy copy: lost {dropped.hex()} (dropped) and {torn.hex()} (torn): both named")


# ----------------------------------------------------------------- aborts
def test_aborted_requests_leave_no_pins_holds_or_prefetches(
    engines: EngineServer, tmp_path: Path
) -> None:
    """One engine stores 20 distinct 11-block prefixes on the disk tier; a new engine
    over the same tiers (its cpu tier empty) gets 1000 requests over those prefixes,
    takes one step (which starts the prefetches: the lookups answer "not yet"), and
    aborts them all, nearly all before any load. Once the engine is idle, the connector holds
    nothing: no pinned block in any tier, no held claim, no prefetch in flight, and
    the Offloader's consistency check is clean. The same again with four steps half a
    second apart before the aborts, so that claims were decided, and requests loaded
    and running, when they were aborted; and once more with every hit loaded in the
    background (``async_load_min_bytes`` 1), so that requests were aborted while
    waiting for their loads (``WAITING_FOR_REMOTE_KVS``)."""
    prefixes = [tokens(500 + p, 11 * BLOCK) for p in range(20)]
    fill = [p + tokens(600 + i, 20) for i, p in enumerate(prefixes)]
    requests = [prefixes[i % 20] + tokens(10_000 + i, 10 + i % 30) for i in range(1000)]
    tiers = connector_tiers("mmap", tmp_path / "ssd", capacity="32MiB")
    background = copy.deepcopy(tiers)
    background["config"]["async_load_min_bytes"] = 1
    results = engines.results(
        tmp_path,
        kvoffload=tiers,
        engines=[
            {"rounds": [fill]},
            {"abort": {"prompts": requests, "steps": 1, "settle_s": 10}},
            {"abort": {"prompts": requests, "steps": 4, "pause_s": 0.5, "settle_s": 10}},
            {
                "abort": {"prompts": requests, "steps": 4, "pause_s": 0.5, "settle_s": 10},
                "kvoffload": background,
            },
        ],
    )
    assert results[0]["failed"] == 0
    for result in results[1:]:
        run = result["abort"]
        c = run["counters"]
        keys = (
            "lookups",
            "prefetched_blocks",
            "prefetch_wasted",
            "blocks_planned",
            "blocks_loaded",
        )
        print(
            f"abort, engine {result['index']}:",
            {k: run[k] for k in ("finished_before_abort", "steps_to_idle", "settle_seconds")},
            {k: c.get(k) for k in keys},
            "\n  health before abort:",
            run["health_before_abort"],
            "\n  at idle:",
            run["health_at_idle"],
            "\n  settled:",
            run["health"],
        )
        detail = json.dumps({k: v for k, v in run.items() if k != "counters"}, indent=1)
        detail += "\n" + json.dumps(run["counters"])
        assert run["submitted"] == 1000
        assert run["unfinished_after"] == 0, detail
        health = run["health"]
        assert health is not None, detail
        assert "error" not in health, detail
        assert health["pinned"] == [0, 0], detail
        assert health["holds"] == 0, detail
        assert health["prefetches"] == 0, detail
        assert health["problems"] == [], detail
        # Anything else the health report counts (claims waiting, plans) is 0 too.
        others = {k: v for k, v in health.items() if k not in ("pinned", "problems")}
        assert not any(others.values()), detail
        # The disk tier was asked: prefetches ran (or were in flight when aborted).
        # How many had run by the abort follows the lookups' own thread: no exact count.
        before = run["health_before_abort"]
        assert run["counters"]["prefetched_blocks"] > 0 or before["prefetches"] > 0, detail
    # One step: the lookups answered "not yet" (a prefetch can finish within that step,
    # so requests may have been claimed and loaded), so requests were still undecided or
    # held when aborted; after four, some requests had been loaded and were running.
    first = results[1]["abort"]
    # Claims waiting on prefetches, decided and held, or blocks the prefetches had
    # pinned in the cpu tier for the claims to come: something was the requests' when
    # they were aborted (lookups and prefetches run on their own threads, so which of
    # these it was varies: in one run all 20 prefetches had landed within the step,
    # leaving 40 blocks pinned and no claim yet; in another the claims had been decided
    # and their blocks loaded by the time the health was read, nothing held then, 220
    # blocks loaded).
    before = first["health_before_abort"]
    held = before["claims"] + before["holds"] + before["pinned"][0]
    assert held > 0 or first["counters"]["blocks_loaded"] > 0, json.dumps(first)
    assert first["finished_before_abort"] < first["submitted"], json.dumps(first)
    # How many had loaded by the fourth step follows the lookups' thread: not exact.
    assert results[2]["abort"]["counters"]["blocks_loaded"] > 0, json.dumps(results[2]["abort"])
    # In the background: requests were waiting for their loads when aborted (how
    # many, again, follows the lookups' thread).
    last = results[3]["abort"]
    assert last["counters"]["loads_in_background"] > 0, json.dumps(last)
