"""``kvoffload stress --replicas N``: N processes over one split request stream, sharing
a real ``redis-server`` tier; and the refusals of the flag."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.checkout import KVOFFLOAD, TRACE
from support.redisserver import RedisServer
from support.stress import BLOCK, SMALL_STRESS
from support.waiting import HANG_S, returns

from kvoffload.config import load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.keys import BlockKey
from kvoffload.tools.cli import main
from kvoffload.tools.stress import REPLICA_START_TIMEOUT_S, replica_config, run_replicas
from kvoffload.tools.workloads import ReplicaShare, Workload, make_workload


def _write(path: Path, tiers: list[dict[str, Any]], **stress: Any) -> Path:
    path.write_text(yaml.safe_dump({"tiers": tiers, "stress": {**SMALL_STRESS, **stress}}))
    return path


# ------------------------------------------------------------------------ the split
def _stream(name: str) -> Workload:
    if name == "zipf":
        return make_workload("zipf", prefixes=12, prefix_blocks=8, suffix_blocks=2, seed=7)
    return make_workload("multiturn", sessions=4, turn_blocks=2, max_turns=6, seed=7)


@pytest.mark.parametrize("name", ["zipf", "multiturn"])
def test_replica_shares_split_one_stream(name: str) -> None:
    """The shares of 3 replicas are disjoint and, in stream order, are the stream: every
    request goes to exactly one replica, unchanged, so all of them draw on the same
    prefixes (multiturn: a session's turns land on several replicas)."""
    n, total = 3, 600
    whole = _stream(name)
    stream = [whole.next() for _ in range(total)]
    owner: dict[int, int] = {}
    for r in range(n):
        share = ReplicaShare(_stream(name), replica=r, replicas=n, seed=7)
        while True:
            keys = share.next()
            at = share.position - 1  # the stream index of the request just returned
            if at >= total:
                break
            assert keys == stream[at]
            assert at not in owner, f"request {at} went to replicas {owner[at]} and {r}"
            owner[at] = r
    assert sorted(owner) == list(range(total))
    counts = [list(owner.values()).count(r) for r in range(n)]
    assert min(counts) > total / n * 0.7, counts  # a uniform router, roughly even
    # Shared prefixes: each replica asks for blocks another one also asks for.
    blocks: list[set[BlockKey]] = [set() for _ in range(n)]
    for at, r in owner.items():
        blocks[r].update(stream[at])
    assert all(blocks[0] & blocks[r] for r in range(1, n))


def test_replica_share_of_a_finite_stream_ends() -> None:
    trace = TRACE
    sizes = []
    for r in range(2):
        share = ReplicaShare(
            make_workload("trace", path=trace, limit=50), replica=r, replicas=2, seed=1
        )
        assert share.finite
        sizes.append(sum(1 for _ in share))
        assert share.exhausted
        with pytest.raises(IndexError, match="exhausted"):
            share.next()
    assert sum(sizes) == 50


def test_each_replica_gets_its_own_disk_tier_directory(tmp_path: Path) -> None:
    config = load_config(
        {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": "1MiB"},
                {
                    "name": "ssd",
                    "backend": "mmap",
                    "path": str(tmp_path / "ssd/"),
                    "capacity": "4MiB",
                },
                {"name": "shared", "backend": "redis", "url": "redis://127.0.0.1:1/0"},
            ],
            "stress": {"preset": "tiny"},
        },
        env={},
    )
    paths = [replica_config(config, r)["tiers"][1]["path"] for r in range(2)]
    assert paths == [f"{tmp_path / 'ssd'}.replica0", f"{tmp_path / 'ssd'}.replica1"]
    again = load_config(replica_config(config, 1), env={})  # valid as it is
    assert again.stress.preset == "tiny"
    assert [t.backend for t in again.tiers] == ["cpu", "mmap", "redis"]


# ------------------------------------------------------------------------ the CLI
def test_stress_two_replicas_share_the_redis_tier(tmp_path: Path, server: RedisServer) -> None:
    """Two replica processes over one server, each with a cpu tier that never evicts:
    whatever a replica stored itself is still in its own cpu tier (asked first), so
    every hit from the redis tier is a block the *other* replica stored. Both must
    have such hits, every loaded block verified intact, exit 0."""
    cpu = {"name": "cpu", "backend": "cpu", "capacity": 1024 * BLOCK, "max_pending_stores": 64}
    redis_tier = {
        "name": "shared",
        "backend": "redis",
        "url": server.url(),
        "capacity": "64MiB",
        "max_pending_stores": 64,
    }
    cfg = _write(tmp_path / "c.yaml", [cpu, redis_tier])
    out = tmp_path / "r.json"
    cmd = [str(KVOFFLOAD), "stress", "--config", str(cfg), "--replicas", "2", "--ops", "150"]
    t0 = time.monotonic()
    # --duration only as a hang guard: every replica must finish its 150 requests.
    proc = subprocess.run(
        [*cmd, "--duration", str(HANG_S), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=2 * HANG_S,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "kvoffload stress: per replica" in proc.stdout
    assert "integrity errors: 0" in proc.stdout
    doc = json.loads(out.read_text())
    summary = [
        (
            r["replica"],
            r["ops"],
            round(r["hit_rate"], 3),
            {t["name"]: t["hits"] for t in r["tiers"]},
        )
        for r in doc["replicas"]
    ]
    print(f"{took:.1f} s: {summary}")
    assert doc["schema"] == "kvoffload.stress.replicas/1"
    assert doc["replica_count"] == 2
    assert doc["shared_tiers"] == ["shared"]
    assert [r["replica"] for r in doc["replicas"]] == [0, 1]
    assert doc["integrity_errors"] == 0
    for rep in doc["replicas"]:
        assert rep["schema"] == "kvoffload.stress/2"
        assert rep["ops"] == 150
        assert rep["integrity_errors"] == 0
        own, shared = rep["tiers"]
        assert own["evictions"] == own["rejected_stores"] == 0, own
        assert shared["hits"] > 0, summary  # blocks the other replica stored
        assert shared["corrupt_blocks"] == 0
    totals = {t["name"]: t for t in doc["tiers"]}
    assert totals["shared"]["shared"]
    assert not totals["cpu"]["shared"]
    assert totals["shared"]["hits"] == sum(r["tiers"][1]["hits"] for r in doc["replicas"])
    assert doc["blocks_loaded"] == sum(r["blocks_loaded"] for r in doc["replicas"])
    assert doc["hit_rate"] == pytest.approx(doc["blocks_loaded"] / doc["blocks_requested"])
    # The server holds what the replicas stored, each block once.
    assert 0 < server.client().dbsize() <= totals["shared"]["blocks_stored"]


def test_a_replica_that_cannot_start_fails_the_run_by_name(tmp_path: Path) -> None:
    """Replica 1's disk tier directory cannot be made (a file holds its name): it fails
    while opening its tiers and breaks the start barrier, so replica 0 stops waiting;
    the run raises one line naming replica 1 and its directory. A replica 0 that waited
    out the barrier's timeout instead would still be waiting when the hang guard,
    at half that timeout, gives up."""
    (tmp_path / "ssd.replica1").write_text("not a directory")
    config = load_config(
        {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": "1MiB"},
                {
                    "name": "ssd",
                    "backend": "mmap",
                    "path": str(tmp_path / "ssd"),
                    "capacity": "4MiB",
                },
                {"name": "shared", "backend": "redis", "url": "redis://127.0.0.1:1/0"},
            ],
            "stress": {"preset": "tiny"},
        },
        env={},
    )
    with pytest.raises(KVOffloadError) as caught:
        returns(
            lambda: run_replicas(config, replicas=2, ops=10, duration_s=HANG_S),
            "a run whose replica 1 cannot start",
            timeout=REPLICA_START_TIMEOUT_S / 2,
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("replica 1: tier 'ssd'"), message
    assert "ssd.replica1" in message
    assert "replica 0" not in message  # it only gave up waiting: not the cause


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--replicas", "2"], ("--replicas 2", "backend: redis", "--replicas 1")),
        (["--replicas", "0"], ("--replicas = 0", "between 1 and 64")),
        (["--replicas", "65"], ("--replicas = 65", "between 1 and 64")),
        (["--replicas", "2", "--plot", "p.png"], ("--plot", "--replicas 2")),
    ],
)
def test_stress_replicas_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    names: tuple[str, ...],
) -> None:
    """Without a shared (server-booked) tier, with a count out of 1..64, or with --plot:
    exit 2 and one line naming the flag and the fix, before any tier is opened."""
    disk = tmp_path / "disk"
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "1MiB"},
        {"name": "disk", "backend": "mmap", "path": str(disk), "capacity": "4MiB"},
    ]
    cfg = _write(tmp_path / "c.yaml", tiers)
    monkeypatch.chdir(tmp_path)
    assert main(["stress", "--config", str(cfg), *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], lines[0]
    assert not disk.exists()
    assert not list(tmp_path.glob("disk.replica*"))
