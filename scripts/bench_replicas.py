#!/usr/bin/env python3
"""Two replicas over one Redis vs. one replica that saw both replicas' traffic.

The target of issue 14: on a shared-prefix workload, replica B's hit rate is within
0.02 of a single replica that served the merged stream. For each seed, on a fresh
``redis-server`` (``FLUSHALL`` between runs):

1. **one replica** (one process) runs the whole stream: ``2 x --ops`` requests;
2. **two replicas** (two processes, ``kvoffload stress --replicas 2``'s code) each run
   their share of the same stream, ``--ops`` requests each, sharing the Redis tier;
3. **B alone**: replica B's share with an empty server and no A beside it, what B
   would get if the replicas shared nothing (each with a store of its own).

Each process has a small cpu tier in front of the Redis tier, so most hits come from
the server. Usage::

    .venv/bin/python scripts/bench_replicas.py [--ops 2000] [--seeds 0,1,2] [--json PATH]

With ``--admit-after-hits N`` it measures admission instead: the two replicas with the
shared tier writing every block, then admitting only blocks loaded N times (bytes the
server took, its hits, the hit rate); ``--replicas`` and ``--trace`` (a Mooncake JSONL
trace instead of the Zipf workload) and ``--cpu-blocks`` (each replica's own tier) apply
to it.

Needs ``redis-server`` on the PATH (the Debian package ``redis-server``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # support.redisserver: a real server on a free port

from support.redisserver import RedisServer  # noqa: E402

from kvoffload.config import KVOffloadConfig, load_config  # noqa: E402
from kvoffload.tools.bench.harness import run_facts, write_json  # noqa: E402
from kvoffload.tools.stress import (  # noqa: E402
    StressReport,
    StressRunner,
    run_replicas,
    workload_from_config,
)
from kvoffload.tools.workloads import ReplicaShare, prefix_hit_ratio  # noqa: E402

CPU_BLOCKS = 128
"""Blocks of each replica's cpu tier (16 KiB each): a tenth of the prefix set."""


def config(
    server: RedisServer,
    seed: int,
    admit_after_hits: int = 0,
    trace: Path | None = None,
    cpu_blocks: int = CPU_BLOCKS,
) -> KVOffloadConfig:
    shared: dict[str, Any] = {"admit_after_hits": admit_after_hits} if admit_after_hits else {}
    stress: dict[str, Any] = {"preset": "tiny", "workload": "zipf", "concurrency": 4}
    if trace is not None:
        stress.update(workload="trace", trace=str(trace))
    return load_config(
        {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": cpu_blocks * 16384},
                {
                    "name": "redis",
                    "backend": "redis",
                    "url": server.url(),
                    "capacity": "1GiB",
                    # Room for every store in flight: a dropped store would be a miss
                    # caused by backpressure, not by what the replicas share.
                    "max_pending_stores": 256,
                    **shared,
                },
            ],
            "stress": {**stress, "seed": seed},
        },
        env={},
    )


def summary(report: StressReport) -> dict[str, Any]:
    return {
        "ops": report.ops,
        "hit_rate": report.hit_rate,
        "blocks_requested": report.blocks_requested,
        "blocks_loaded": report.blocks_loaded,
        "hits": {t.name: t.hits for t in report.tiers},
        "dropped_stores": {t.name: t.dropped_stores for t in report.tiers},
        "bytes_written": {t.name: t.bytes_written for t in report.tiers},
        "not_admitted": {t.name: t.not_admitted for t in report.tiers},
        "integrity_errors": report.integrity_errors,
        "duration_s": report.duration_s,
    }


def ideal_shares(cfg: KVOffloadConfig, seed: int, ops: int) -> list[float]:
    """Each replica's hit rate with an infinite cache that saw both replicas' requests
    in stream order: what the split alone makes of A's and B's rates (which requests
    each got), before any timing between the two processes."""
    owner: dict[int, int] = {}  # stream index -> the replica that ran it
    for r in range(2):
        share = ReplicaShare(
            workload_from_config(cfg.stress, seed), replica=r, replicas=2, seed=seed
        )
        for _ in range(ops):
            share.next()
            owner[share.position - 1] = r
    stream = workload_from_config(cfg.stress, seed)
    seen: set[bytes] = set()
    hits, asked = [0, 0], [0, 0]
    for i in range(max(owner) + 1):
        keys = stream.next()
        r = owner.get(i)
        if r is None:
            continue  # past the other replica's last request: never run
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        seen.update(keys)
        asked[r] += len(keys)
        hits[r] += n
    return [h / a for h, a in zip(hits, asked, strict=True)]


def bench_seed(server: RedisServer, seed: int, ops: int) -> dict[str, Any]:
    cfg = config(server, seed)
    flush = server.client().flushall
    flush()
    (single,) = run_replicas(cfg, replicas=1, ops=2 * ops, duration_s=3600, seed=seed).reports
    flush()
    pair = run_replicas(cfg, replicas=2, ops=ops, duration_s=3600, seed=seed).reports
    flush()
    alone = StressRunner(cfg, seed=seed, replica=1, replicas=2)
    try:
        b_alone = alone.run(ops=ops, duration_s=3600)
    finally:
        alone.close()
    flush()
    ideal = prefix_hit_ratio(workload_from_config(cfg.stress, seed), None, requests=2 * ops)
    ideal_a, ideal_b = ideal_shares(cfg, seed, ops)
    return {
        "seed": seed,
        "ideal_hit_rate": ideal,
        "ideal_a": ideal_a,
        "ideal_b": ideal_b,
        "single": summary(single),
        "replica_a": summary(pair[0]),
        "replica_b": summary(pair[1]),
        "b_alone": summary(b_alone),
        "b_minus_single": pair[1].hit_rate - single.hit_rate,
    }


def bench_admission(server: RedisServer, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """``--replicas`` replicas with the shared tier writing every block, then admitting
    only blocks loaded ``--admit-after-hits`` times: bytes the server took and the hits
    each way, on the same stream."""
    rows = {}
    for label, n in (("every", 0), ("admit", args.admit_after_hits)):
        server.client().flushall()
        cfg = config(server, seed, n, args.trace, args.cpu_blocks)
        pair = run_replicas(
            cfg, replicas=args.replicas, ops=args.ops, duration_s=3600, seed=seed
        ).reports
        rows[label] = {
            "written": sum(r.tiers[1].bytes_written for r in pair),
            "redis_hits": sum(r.tiers[1].hits for r in pair),
            "hit_rate": sum(r.blocks_loaded for r in pair) / sum(r.blocks_requested for r in pair),
            "replicas": [summary(r) for r in pair],
        }
    server.client().flushall()
    return {"seed": seed, "admit_after_hits": args.admit_after_hits, **rows}


def admission_main(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        server = RedisServer(Path(tmp), maxmemory="1gb").start()
        try:
            for seed in (int(s) for s in args.seeds.split(",")):
                rows.append(bench_admission(server, seed, args))
        finally:
            server.kill()
    print(
        f"{'seed':>4} {'MB written every/admit':>23} {'cut':>6} "
        f"{'redis hits every/admit':>23} {'hit rate every/admit':>21}"
    )
    for r in rows:
        e, a = r["every"], r["admit"]
        written = f"{e['written'] / 1e6:.1f}/{a['written'] / 1e6:.1f}"
        hits = f"{e['redis_hits']}/{a['redis_hits']}"
        rates = f"{e['hit_rate']:.4f}/{a['hit_rate']:.4f}"
        cut = e["written"] / max(1, a["written"])
        print(f"{r['seed']:>4} {written:>23} {cut:>5.2f}x {hits:>23} {rates:>21}")
    if args.json is not None:
        doc = {"ops_per_replica": args.ops, "replicas": args.replicas, "seeds": rows}
        write_json(args.json, doc, facts=run_facts())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=2000, help="requests per replica")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--admit-after-hits",
        type=int,
        default=0,
        help="instead: two replicas with the shared tier writing every block, then with "
        "this admit_after_hits (bytes written and hits, each way)",
    )
    ap.add_argument("--replicas", type=int, default=2, help="with --admit-after-hits")
    ap.add_argument("--cpu-blocks", type=int, default=CPU_BLOCKS, help="with --admit-after-hits")
    ap.add_argument(
        "--trace", type=Path, default=None, help="with --admit-after-hits: a Mooncake trace"
    )
    args = ap.parse_args()
    if args.admit_after_hits:
        admission_main(args)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        server = RedisServer(Path(tmp), maxmemory="1gb").start()
        try:
            for seed in (int(s) for s in args.seeds.split(",")):
                rows.append(bench_seed(server, seed, args.ops))
                r = rows[-1]
                print(
                    f"seed {seed}: single {r['single']['hit_rate']:.4f}  "
                    f"A {r['replica_a']['hit_rate']:.4f}  B {r['replica_b']['hit_rate']:.4f}  "
                    f"B - single {r['b_minus_single']:+.4f}  "
                    f"B alone {r['b_alone']['hit_rate']:.4f}  ideal {r['ideal_hit_rate']:.4f} "
                    f"(A {r['ideal_a']:.4f}, B {r['ideal_b']:.4f})",
                    flush=True,
                )
        finally:
            server.kill()
    print(
        f"{'seed':>4} {'single':>7} {'A':>7} {'B':>7} {'B-single':>9} {'split A/B':>13} "
        f"{'B alone':>8} {'redis hits single/A/B':>22} {'integrity':>9}"
    )
    for r in rows:
        hits = "/".join(str(r[k]["hits"]["redis"]) for k in ("single", "replica_a", "replica_b"))
        errors = sum(r[k]["integrity_errors"] for k in ("single", "replica_a", "replica_b"))
        split = f"{r['ideal_a']:.4f}/{r['ideal_b']:.4f}"
        print(
            f"{r['seed']:>4} {r['single']['hit_rate']:>7.4f} {r['replica_a']['hit_rate']:>7.4f} "
            f"{r['replica_b']['hit_rate']:>7.4f} {r['b_minus_single']:>+9.4f} {split:>13} "
            f"{r['b_alone']['hit_rate']:>8.4f} {hits:>22} {errors:>9}"
        )
    worst = max(abs(r["b_minus_single"]) for r in rows)
    verdict = "met" if worst <= 0.02 else "NOT met"
    print(f"largest |B - single|: {worst:.4f} (target <= 0.02: {verdict})")
    if args.json is not None:
        doc = {"ops_per_replica": args.ops, "seeds": rows}
        write_json(args.json, doc, facts=run_facts())


if __name__ == "__main__":
    main()
