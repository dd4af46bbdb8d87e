"""``kvoffload stress``: short real runs, every loaded block verified bit for bit."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload.backends.cpu import CPUBackend
from support.checkout import KVOFFLOAD, TRACE
from support.stress import BLOCK, SMALL_STRESS, stress_cli
from support.waiting import HANG_S, HeldBackend, returns

from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.tools.stress import StressRunner

REPO = Path(__file__).resolve().parents[2]


def _config(tiers: list[dict[str, Any]], eviction: str = "lru") -> dict[str, Any]:
    return {"tiers": tiers, "eviction": eviction, "stress": SMALL_STRESS}


def _run(raw: dict[str, Any], ops: int = 300, seed: int = 0, rounds: int = 1) -> Any:
    """A stress run of ``ops`` requests, in ``rounds`` runs of one runner (the report
    adds them up). Each run ends by draining the lanes; so with several rounds, a lower
    tier is written even when one of its writes stalls (a loaded CI disk) longer than
    the ops take: a run of 300 ops takes well under a second here, and the first tier,
    its blocks pinned until the copy below has read them, refuses stores meanwhile."""
    runner = StressRunner(load_config(raw), seed=seed)
    try:
        done = 0
        for _ in range(rounds):
            rep = runner.run(ops=ops // rounds, duration_s=60)
            done += rep.ops
        rep.ops = done
        return rep
    finally:
        runner.close()


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_single_tier_run_is_clean_and_hits(eviction: str) -> None:
    # 40 blocks of room for a working set of ~100 prefix blocks: it must evict.
    rep = _run(_config([{"name": "cpu", "backend": "cpu", "capacity": 40 * BLOCK}], eviction))
    assert rep.ops == 300
    assert rep.integrity_errors == 0
    assert 0.1 < rep.hit_rate < 1.0
    (tier,) = rep.tiers
    assert tier.hits == rep.blocks_loaded > 0
    assert tier.evictions > 0
    assert tier.bytes_written == tier.blocks_stored * BLOCK
    assert tier.bytes_read == tier.hits * BLOCK


def test_second_tier_serves_what_the_first_evicted() -> None:
    rep = _run(
        _config(
            [
                {"name": "small", "backend": "cpu", "capacity": 12 * BLOCK},
                {"name": "big", "backend": "cpu", "capacity": 1000 * BLOCK},
            ]
        )
    )
    small, big = rep.tiers
    assert rep.integrity_errors == 0
    assert small.hits > 0
    assert big.hits > 0
    assert big.evictions == 0
    assert small.evictions > 0
    # the big tier holds every block of the run (96 prefix + 600 suffix blocks)
    assert big.hits > small.hits


def test_plugin_backend_runs_under_stress() -> None:
    rep = _run(_config([{"name": "d", "backend": "memdict", "capacity": 30 * BLOCK}]), ops=100)
    assert rep.integrity_errors == 0
    assert rep.blocks_loaded > 0


def test_same_seed_same_run_other_seed_other_run() -> None:
    # One request in flight: with more, which finishes first is up to the scheduler.
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": 40 * BLOCK}])
    raw["stress"] = {**SMALL_STRESS, "concurrency": 1}
    a, b = _run(raw, ops=120, seed=5), _run(raw, ops=120, seed=5)
    c = _run(raw, ops=120, seed=6)
    assert (a.blocks_loaded, a.blocks_requested) == (b.blocks_loaded, b.blocks_requested)
    assert (a.blocks_loaded, a.blocks_requested) != (c.blocks_loaded, c.blocks_requested)


def test_corrupted_tier_memory_is_caught() -> None:
    """The verification is real: flipping bytes in the tier's slab shows up as errors."""
    runner = StressRunner(
        load_config(_config([{"name": "cpu", "backend": "cpu", "capacity": 200 * BLOCK}]))
    )
    try:
        runner.run(ops=100, duration_s=60)
        assert runner.report.integrity_errors == 0
        backend = runner.tiers[0].backend
        assert isinstance(backend, CPUBackend)
        backend.slab[:, 100] ^= 0xFF  # one byte of every slot
        runner.run(ops=200, duration_s=60)
        assert runner.report.integrity_errors > 0
    finally:
        runner.close()


def test_pool_too_small_for_a_request_is_a_config_error() -> None:
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": 40 * BLOCK}])
    raw["stress"] = {**SMALL_STRESS, "pool_blocks": 5}
    with pytest.raises(
        ConfigError, match=r"<dict>: stress = .*pool_blocks = 5 .*pool_blocks >= 10"
    ):
        load_config(raw)


def test_cli_stress_json_report(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(
        yaml.safe_dump(_config([{"name": "cpu", "backend": "cpu", "capacity": "320KiB"}]))
    )
    out = tmp_path / "report.json"
    proc, report = stress_cli(out, "--config", str(cfg), "--ops", "80", "--seed", "3")
    assert "integrity errors: 0" in proc.stdout
    assert report["integrity_errors"] == 0
    assert report["ops"] == 80
    assert report["seed"] == 3
    for key in ("blocks_stored", "blocks_loaded", "hit_rate"):
        assert key in report
    assert report["blocks_loaded"] > 0
    assert 0 < report["hit_rate"] < 1
    (tier,) = report["tiers"]
    assert tier["name"] == "cpu"
    assert tier["backend"] == "cpu"
    assert tier["hits"] == report["blocks_loaded"]
    assert tier["bytes_written"] > 0
    assert tier["bytes_read"] > 0


def test_cli_stress_duration_bounds_the_run(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text(yaml.safe_dump(_config([{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}])))
    out = tmp_path / "r.json"
    _, report = stress_cli(out, "--config", str(cfg), "--ops", "100000000", "--duration", "1")
    # The zipf stream never ends, so only the duration can have stopped the run short
    # of its ops (a run that ignored it would go on past stress_cli's timeout).
    assert 0 < report["ops"] < 100000000


def test_cli_stress_with_bad_config_exits_2_without_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers:\n  - name: cpu\n    backend: cpu\n    capacity: -1GiB\n")
    proc = subprocess.run(
        [str(KVOFFLOAD), "stress", "--config", str(cfg)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "tiers[0].capacity" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_default_config_is_valid() -> None:
    cfg = load_config(REPO / "configs" / "default.yaml")
    assert [t.backend for t in cfg.tiers] == ["cpu", "mmap", "lmdb"]


def test_disk_tier_is_warm_for_the_next_run_whatever_its_seed(tmp_path: Path) -> None:
    """Block bytes depend on the key alone, so a second run (another seed, a reopened
    tier) hits what the first stored, and every hit verifies."""
    tiers = [{"name": "ssd", "backend": "mmap", "path": str(tmp_path / "t"), "capacity": "8MiB"}]
    first = _run(_config(tiers), ops=150, seed=1)
    runner = StressRunner(load_config(_config(tiers)), seed=2)
    try:
        held_at_start = len(runner.tiers[0].manager)
        second = runner.run(ops=150, duration_s=60)
    finally:
        runner.close()
    assert first.integrity_errors == 0
    assert held_at_start == first.blocks_stored
    assert second.integrity_errors == 0
    assert second.blocks_loaded > 0


@pytest.mark.parametrize(
    ("workload", "extra", "reuse"),
    [
        ("multiturn", {"sessions": 4, "turn_blocks": 1, "max_turns": 8}, True),
        ("scan", {"scan_blocks": 6}, False),
        ("trace", {"trace": str(TRACE)}, True),
    ],
)
def test_each_workload_is_clean_and_hits_only_where_reuse_exists(
    workload: str, extra: dict[str, Any], reuse: bool
) -> None:
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": 400 * BLOCK}])
    raw["stress"] = {**SMALL_STRESS, "pool_blocks": 256, "workload": workload, **extra}
    rep = _run(raw, ops=200)
    assert rep.workload == workload
    assert rep.integrity_errors == 0
    assert rep.ops == 200
    if reuse:
        assert rep.hit_rate > 0
    else:
        assert rep.hit_rate == 0.0


def test_cli_trace_flag_replays_the_trace(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": "4MiB"}])
    raw["stress"] = {**SMALL_STRESS, "pool_blocks": 256}
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "r.json"
    _, report = stress_cli(out, "--config", str(cfg), "--trace", str(TRACE), "--ops", "50")
    assert report["workload"] == "trace"
    assert report["ops"] == 50
    assert report["integrity_errors"] == 0


def test_trace_workload_without_a_file_is_a_config_error() -> None:
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}])
    raw["stress"] = {**SMALL_STRESS, "workload": "trace"}
    with pytest.raises(ConfigError, match=r"stress = .*workload = 'trace' needs trace"):
        load_config(raw)


# ------------------------------------------------------------ the tier chain, end to end
def _chain(tmp: Path, cpu: int, ssd: int, db: int, **ssd_extra: Any) -> list[dict[str, Any]]:
    """cpu -> mmap -> lmdb, capacities in blocks (disk slots carry a 4 KiB header)."""
    return [
        {"name": "cpu", "backend": "cpu", "capacity": cpu * BLOCK},
        {
            "name": "ssd",
            "backend": "mmap",
            "path": str(tmp / "ssd"),
            "capacity": ssd * (BLOCK + 4096),
            **ssd_extra,
        },
        {"name": "db", "backend": "lmdb", "path": str(tmp / "db"), "capacity": db * (BLOCK + 4096)},
    ]


@pytest.mark.parametrize(
    ("workload", "extra", "reuse"),
    [
        ("zipf", {}, True),
        ("multiturn", {"sessions": 6, "turn_blocks": 1, "max_turns": 8}, True),
        ("scan", {"scan_blocks": 6}, False),
        ("trace", {"trace": str(TRACE)}, True),
    ],
)
def test_every_workload_through_three_small_tiers_is_clean(
    tmp_path: Path, workload: str, extra: dict[str, Any], reuse: bool
) -> None:
    """Every tier is smaller than the working set, 8 requests are in flight, and blocks
    move down and back up all the time: pins must hold, so no loaded block differs."""
    raw = _config(_chain(tmp_path, cpu=24, ssd=40, db=80))
    raw["stress"] = {**SMALL_STRESS, "pool_blocks": 256, "concurrency": 8, "workload": workload}
    raw["stress"].update(extra)
    rep = _run(raw, ops=250, rounds=5)
    assert rep.integrity_errors == 0
    assert rep.ops == 250
    cpu, ssd, db = rep.tiers
    # Every block the cpu tier took beyond its capacity was evicted (how many it took
    # depends on the machine's speed: a store the lanes cannot take yet is refused, and
    # on a loaded 2-core CI machine a trace run once stored fewer than 24).
    assert cpu.blocks_stored > 0
    assert cpu.evictions >= cpu.blocks_stored - cpu.capacity_blocks
    assert ssd.blocks_stored > 0
    assert db.blocks_stored > 0
    if reuse:
        assert rep.hit_rate > 0
    else:
        assert rep.hit_rate == 0.0
    if workload in ("zipf", "multiturn"):  # reuse distances beyond the cpu tier
        assert ssd.hits + db.hits > 0  # served from below ...
        assert cpu.promotions > 0  # ... and promoted back up
    assert sum(t.hits for t in rep.tiers) == rep.blocks_loaded
    # A block requested is a hit in one tier or a miss in it, at every level.
    assert cpu.hits + cpu.misses == rep.blocks_requested


def test_slow_disk_tier_drops_stores_while_the_engine_never_waits(tmp_path: Path) -> None:
    """The ssd tier's writes hang until every request of the run has finished; its
    queue holds two jobs. Stores to it are dropped and counted, the engine's are not.
    The run finishing at all shows that no submit waited for the hung tier: that write
    is released only after the run's last request (a hang, caught by the guard)."""
    tiers = _chain(tmp_path, cpu=400, ssd=400, db=400)
    tiers[1]["max_pending_stores"] = 2
    raw = _config(tiers[:2])
    raw["stress"] = {**SMALL_STRESS, "pool_blocks": 64, "concurrency": 4}
    runner = StressRunner(load_config(raw), seed=0)
    ssd_tier = runner.tiers[1]
    held = HeldBackend(ssd_tier.backend, reads=False)
    ssd_tier.backend = held
    ops = 150

    def release_when_done(done: int, _t: float) -> None:
        if done == ops:
            held.release()

    try:
        with held.holding():
            rep = returns(
                lambda: runner.run(ops=ops, duration_s=HANG_S, progress=release_when_done),
                "a run whose disk tier hangs",
            )
    finally:
        runner.close()
    cpu, ssd = rep.tiers
    assert held.outlasted == 0, "a submit waited for the hung tier"
    assert rep.ops == ops
    assert held.held["write"] > 0  # the tier's copies did hang
    assert rep.integrity_errors == 0
    assert cpu.dropped_stores == 0
    assert rep.stores_dropped == 0
    assert ssd.dropped_stores > 0
    assert ssd.blocks_stored < cpu.blocks_stored


def test_cli_preset_concurrency_json_schema_and_plot(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": "2MiB"}])
    raw["stress"] = {k: v for k, v in SMALL_STRESS.items() if k != "layout"}
    cfg.write_text(yaml.safe_dump(raw))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--config", str(cfg), "--ops", "60", "--preset", "tiny", "--concurrency", "3"]
    proc, report = stress_cli(out, *args, "--plot", str(png))
    assert report["schema"] == "kvoffload.stress/2"
    assert report["concurrency"] == 3
    assert report["bytes_per_block"] == 16 * 1024  # the tiny preset
    assert report["integrity_errors"] == 0
    for key in ("submit_p50_ms", "submit_p99_ms", "request_p99_ms", "timeline", "hit_rate"):
        assert key in report
    (tier,) = report["tiers"]
    for key in ("hits", "misses", "dropped_stores", "store_p99_ms", "load_p99_ms", "write_gbps"):
        assert key in tier
    assert report["timeline"][-1]["requested"] == report["blocks_requested"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "store ms p50/p99" in proc.stdout


def test_preset_and_layout_together_is_a_config_error() -> None:
    raw = _config([{"name": "cpu", "backend": "cpu", "capacity": "1MiB"}])
    raw["stress"] = {**SMALL_STRESS, "preset": "tiny"}
    with pytest.raises(ConfigError, match=r"stress.preset = 'tiny' and stress.layout"):
        load_config(raw)


@pytest.mark.parametrize("data", ["kv", "random"])
def test_compressed_tiers_under_stress_report_what_they_store(tmp_path: Path, data: str) -> None:
    """cpu -> mmap (zstd) -> lmdb (lz4), every load verified: KV-like blocks are
    stored compressed (the report's ratio, the tier's footprint and counters agree);
    random ones are stored raw (ratio 1)."""
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": 12 * BLOCK},
        {"name": "ssd", "backend": "mmap", "path": str(tmp_path / "ssd"), "capacity": 40 * BLOCK},
        {
            "name": "db",
            "backend": "lmdb",
            "path": str(tmp_path / "db"),
            "capacity": 200 * BLOCK,
            "write_policy": "on_evict",
        },
    ]
    tiers[1]["compression"] = "zstd"
    tiers[2]["compression"] = "lz4"
    raw = _config(tiers)
    raw["stress"] = {**raw["stress"], "data": data}
    rep = _run(raw, rounds=10)
    assert rep.integrity_errors == 0
    cpu, ssd, db = rep.tiers
    assert cpu.compression == "none"
    assert cpu.compression_ratio == 1.0  # a raw tier: both counters are bytes_written
    assert (ssd.compression, db.compression) == ("zstd", "lz4")
    for tier in (ssd, db):
        assert tier.hits > 0
        assert tier.logical_bytes == tier.bytes_written > 0
        assert tier.held_logical_bytes is not None
        assert tier.held_stored_bytes is not None
        if data == "kv":
            assert tier.compression_ratio < 0.9
            assert tier.held_stored_bytes < tier.held_logical_bytes
            assert tier.compress_gbps is not None
            assert tier.decompress_gbps is not None
        else:
            assert tier.compression_ratio == 1.0
            assert tier.held_stored_bytes == tier.held_logical_bytes
