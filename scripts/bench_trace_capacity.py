"""Trace hit ratio at equal disk bytes: one tier stored raw, then compressed (issue 33).

Issue 33's target: a trace replay (``kvoffload stress``, ``workload: trace``, KV-like
data) at equal disk bytes, where the compressed tier's hit ratio is above the
uncompressed tier's by what its extra blocks allow. A packed mmap tier
(``compression`` other than ``none``) budgets the bytes its blocks take on disk, so
the same ``capacity`` holds more of them.

For each codec of ``--codecs`` (``none`` first), in this process, one after another:
the config's tier ``--tier`` (default: its last mmap tier) gets that ``compression``
and a fresh directory ``<--dir>/<codec>`` (removed after the run unless ``--keep``),
and the stress runner (:class:`kvoffload.tools.stress.StressRunner`, every loaded
block verified) replays the workload. Per run, from its report: the tier's blocks
held at the end (its ``footprint``: logical bytes over the block size) and on average
after each request of the run's second half, its hits, evictions, rejected and dropped
stores, the compression ratio of what it wrote, and the overall hit ratio. Then the
yardstick: the hit ratio of an ideal LRU of the run's average blocks held on the same
request stream (:func:`kvoffload.tools.workloads.prefix_hit_ratio`, a single cache:
the like of a one-tier config such as configs/trace_packed.yaml; with tiers above, it
leaves their blocks out), and every figure over the first codec's run's
(``*_vs_none``)::

    .venv/bin/python scripts/bench_trace_capacity.py --config configs/trace_packed.yaml \\
        --json out/bench_trace_capacity.json

Exit status 1 if a run found an integrity error, 2 for a bad argument or config.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from kvoffload.config import KVOffloadConfig, layout_from_config, load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.sizes import parse_size
from kvoffload.tools.bench.harness import run_facts, write_json
from kvoffload.tools.stress import StressReport, StressRunner, workload_from_config
from kvoffload.tools.workloads import prefix_hit_ratio

SCHEMA: Final = "kvoffload.bench_trace_capacity/1"
"""Version tag of the ``--json`` document."""

CODECS: Final = ("none", "lz4", "zstd")


def pick_tier(config: KVOffloadConfig, name: str | None) -> int:
    """Index of the tier named ``name``, or of the config's last mmap tier."""
    names = [t.name for t in config.tiers]
    if name is not None:
        if name not in names:
            raise KVOffloadError(f"--tier {name}: no such tier; the config has {', '.join(names)}")
        index = names.index(name)
    else:
        mmaps = [i for i, t in enumerate(config.tiers) if t.backend == "mmap"]
        if not mmaps:
            raise KVOffloadError(
                f"the config's tiers ({', '.join(names)}) include no mmap tier; add one or "
                "name the tier to vary with --tier"
            )
        index = mmaps[-1]
    if config.tiers[index].backend not in ("mmap", "lmdb"):
        raise KVOffloadError(
            f"--tier {names[index]}: backend {config.tiers[index].backend!r} has no "
            "compression; name an mmap (or lmdb) tier"
        )
    return index


def run_config(
    config: KVOffloadConfig, tier: int, codec: str, path: Path, overrides: dict[str, Any]
) -> KVOffloadConfig:
    """``config`` with tier ``tier`` compressed by ``codec`` in directory ``path``, and
    ``overrides`` of that tier (``capacity``) and of the ``stress`` section."""
    raw = config.model_dump()
    # Only what was set: a preset and the default layout both dumped would conflict.
    raw["stress"] = {**config.stress.model_dump(exclude_unset=True), **overrides["stress"]}
    raw["tiers"][tier] = {
        **raw["tiers"][tier],
        **overrides["tier"],
        "compression": codec,
        "path": str(path),
    }
    return load_config(raw, env={})


def run_one(
    config: KVOffloadConfig, tier: int, ops: int, duration_s: float
) -> tuple[StressReport, float | None]:
    """One stress run of ``config`` (its tiers closed after): its report, and the mean
    of the blocks tier ``tier`` held after each request of the run's second half.

    The mean, not only the count at the end: a budgeted tier admits a store at full
    size and learns its stored size when it is settled, so its count swings by about
    a request's blocks, and the last request can land anywhere in the swing. By the
    second half the tier is long full (it holds a small share of the working set)."""
    runner = StressRunner(config)
    manager = runner.offloader.tiers[tier].manager
    held: dict[int, int] = {}  # requests done -> blocks held then (the last sample)

    def sample(done: int, _t: float) -> None:
        if isinstance(manager, LRUOffloadingManager):  # every local tier's
            held[done] = len(manager)

    try:
        report = runner.run(ops=ops, duration_s=duration_s, progress=sample)
    finally:
        runner.close()
    late = [n for done, n in held.items() if done > report.ops // 2]
    return report, sum(late) / len(late) if late else None


def row_of(report: StressReport, tier: int, held_mean: float | None) -> dict[str, Any]:
    """The figures of one run that the comparison needs."""
    t = report.tiers[tier]
    held = None
    if t.held_logical_bytes is not None:
        held = t.held_logical_bytes // report.bytes_per_block
    return {
        "codec": t.compression,
        "capacity_blocks": t.capacity_blocks,
        "blocks_held": held,
        "blocks_held_mean": held_mean,
        "held_stored_bytes": t.held_stored_bytes,
        "compression_ratio": t.compression_ratio,
        "tier_hits": t.hits,
        "tier_blocks_stored": t.blocks_stored,
        "tier_evictions": t.evictions,
        "rejected_stores": t.rejected_stores,
        "dropped_stores": t.dropped_stores,
        "ops": report.ops,
        "blocks_requested": report.blocks_requested,
        "blocks_loaded": report.blocks_loaded,
        "hit_rate": report.hit_rate,
        "integrity_errors": report.integrity_errors,
        "duration_s": report.duration_s,
    }


def ideal_lru(config: KVOffloadConfig, blocks: int | None, requests: int) -> float:
    """Hit ratio of an ideal LRU of ``blocks`` blocks (``None``: unbounded) on the first
    ``requests`` requests of the stream ``config``'s stress run replays."""
    workload = workload_from_config(config.stress, config.stress.seed)
    return prefix_hit_ratio(workload, blocks, requests=requests)


def _over(x: float | int | None, base: float | int | None) -> float | None:
    return None if x is None or not base else x / base


def bench(
    config: KVOffloadConfig,
    *,
    tier_name: str | None,
    codecs: list[str],
    root: Path,
    capacity: str | None = None,
    ops: int | None = None,
    duration_s: float | None = None,
    trace: Path | None = None,
    keep: bool = False,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every codec of ``codecs`` (the first is the baseline) and compare; the
    ``--json`` document."""
    if config.stress.workload != "trace" and trace is None:
        raise KVOffloadError(
            f"stress.workload = {config.stress.workload!r}: this bench replays a trace; "
            "set workload: trace and trace: PATH in the config, or pass --trace"
        )
    tier = pick_tier(config, tier_name)
    overrides: dict[str, Any] = {"tier": {}, "stress": {}}
    if capacity is not None:
        overrides["tier"]["capacity"] = capacity
    if trace is not None:
        overrides["stress"].update(workload="trace", trace=str(trace))
    ops = config.stress.ops if ops is None else ops
    duration_s = config.stress.duration_s if duration_s is None else duration_s
    rows = []
    last: KVOffloadConfig | None = None
    for codec in codecs:
        path = root / codec
        if path.exists():
            raise KVOffloadError(f"{path}: already exists; each run needs a fresh tier directory")
        cfg = run_config(config, tier, codec, path, overrides)
        try:
            report, held_mean = run_one(cfg, tier, ops, duration_s)
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
                if root.exists() and not any(root.iterdir()):
                    root.rmdir()
        row = row_of(report, tier, held_mean)
        row["codec"] = codec
        say(
            f"{codec}: {row['blocks_held']} blocks held, hit rate {row['hit_rate']:.4f}, "
            f"{row['duration_s']:.1f} s"
        )
        rows.append(row)
        last = cfg
    assert last is not None  # codecs is never empty
    requests = min(r["ops"] for r in rows)
    for row in rows:
        # The yardstick's size: the blocks the tier held through the run, else at its end.
        size = row["blocks_held_mean"]
        size = row["blocks_held"] if size is None else max(1, round(size))
        row["ideal_lru_blocks"] = size
        row["ideal_lru_hit_rate"] = None if size is None else ideal_lru(last, size, requests)
    base = rows[0]
    for row in rows:
        for name in (
            "blocks_held",
            "blocks_held_mean",
            "hit_rate",
            "tier_hits",
            "ideal_lru_hit_rate",
        ):
            row[f"{name}_vs_{base['codec']}"] = _over(row[name], base[name])
    tier_cfg = last.tiers[tier]
    return {
        "schema": SCHEMA,
        "tier": tier_cfg.name,
        "backend": tier_cfg.backend,
        "capacity_bytes": int(tier_cfg.capacity),
        "trace": last.stress.trace,
        "ops": ops,
        "requests_compared": requests,
        "layout": last.stress.resolved_layout().model_dump(),
        "block_bytes": layout_from_config(last).bytes_per_block,
        "concurrency": last.stress.concurrency,
        "ideal_lru_unbounded_hit_rate": ideal_lru(last, None, requests),
        "runs": rows,
    }


def table(doc: dict[str, Any]) -> str:
    """The runs side by side, one line each, ratios against the first."""
    base = doc["runs"][0]["codec"]
    head = (
        f"{'codec':<6} {'cap':>6} {'held':>6} {'mean':>7} {'x' + base:>7} {'stored/log':>10} "
        f"{'tier hits':>9} {'evicted':>8} {'rejected':>8} {'hit rate':>8} {'x' + base:>7} "
        f"{'ideal LRU':>9} {'x' + base:>7}"
    )
    lines = [
        f"tier {doc['tier']} ({doc['backend']}), capacity {doc['capacity_bytes']} bytes, "
        f"blocks of {doc['block_bytes']} bytes, {doc['requests_compared']} requests of "
        f"{doc['trace']}; ideal LRU unbounded: {doc['ideal_lru_unbounded_hit_rate']:.4f}",
        head,
    ]

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in doc["runs"]:
        lines.append(
            f"{r['codec']:<6} {r['capacity_blocks']:>6} {num(r['blocks_held'], 'd'):>6} "
            f"{num(r['blocks_held_mean'], '.1f'):>7} "
            f"{num(r[f'blocks_held_mean_vs_{base}'], '.3f'):>7} "
            f"{num(r['compression_ratio'], '.3f'):>10} {r['tier_hits']:>9} "
            f"{r['tier_evictions']:>8} {r['rejected_stores']:>8} {r['hit_rate']:>8.4f} "
            f"{num(r[f'hit_rate_vs_{base}'], '.3f'):>7} "
            f"{num(r['ideal_lru_hit_rate'], '.4f'):>9} "
            f"{num(r[f'ideal_lru_hit_rate_vs_{base}'], '.3f'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--config", type=Path, default=Path("configs/trace_packed.yaml"))
    ap.add_argument("--tier", default=None, help="tier to vary (default: the last mmap tier)")
    ap.add_argument("--codecs", default=",".join(CODECS), help="first one is the baseline")
    ap.add_argument("--capacity", default=None, help="the tier's capacity, e.g. 64MiB")
    ap.add_argument("--ops", type=int, default=None, help="requests per run (stress.ops)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per run, at most")
    ap.add_argument("--trace", type=Path, default=None, help="JSONL trace (stress.trace)")
    ap.add_argument("--dir", type=Path, default=None, help="tier directories (default: config's)")
    ap.add_argument("--keep", action="store_true", help="keep the tier directories")
    ap.add_argument("--json", type=Path, default=None, help="write the document here")
    args = ap.parse_args(argv)
    try:
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        unknown = sorted(set(codecs) - set(CODECS))
        if not codecs or unknown or len(set(codecs)) != len(codecs):
            raise KVOffloadError(
                f"--codecs {args.codecs}: give distinct names among {', '.join(CODECS)}"
            )
        if args.capacity is not None:
            parse_size(args.capacity)
        if args.ops is not None and args.ops < 1:
            raise KVOffloadError(f"--ops {args.ops}: it must be at least 1")
        config = load_config(args.config)
        tier = pick_tier(config, args.tier)
        root = args.dir
        if root is None:
            raw_path = getattr(config.tiers[tier], "path", None)
            root = Path(str(raw_path)).parent / "bench-trace-capacity"
        doc = bench(
            config,
            tier_name=config.tiers[tier].name,
            codecs=codecs,
            root=root,
            capacity=args.capacity,
            ops=args.ops,
            duration_s=args.duration,
            trace=args.trace,
            keep=args.keep,
        )
    except (KVOffloadError, ValueError) as exc:
        print(f"bench_trace_capacity: {exc}", file=sys.stderr)
        return 2
    print(table(doc))
    if args.json is not None:
        write_json(args.json, doc, facts=run_facts())
        print(f"written to {args.json}")
    return 1 if any(r["integrity_errors"] for r in doc["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
