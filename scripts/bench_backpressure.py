"""Backpressure: the engine's submit latency while a disk tier is 10x too slow.

Two stress runs over cpu -> mmap (write-through), same workload:

1. unthrottled, to measure the rate at which the engine stores into the cpu tier;
2. the mmap tier throttled (``write_throttle``) to a tenth of that rate, its queue
   bounded at ``max_pending_stores: 4``.

Prints, for the throttled run, the caller's submit latency (p50 / p99 / max; target:
p99 < 1 ms), the stores dropped at the slow tier, and that the engine's own stores
were never dropped. Usage::

    .venv/bin/python scripts/bench_backpressure.py [--ops N] [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvoffload.config import load_config
from kvoffload.tools.bench.harness import print_figures, run_facts, write_json
from kvoffload.tools.stress import StressReport, StressRunner


def _config(path: Path, throttle: int | None, ops: int) -> dict[str, Any]:
    ssd: dict[str, Any] = {
        "name": "ssd",
        "backend": "mmap",
        "path": str(path),
        "capacity": "2GiB",
        "max_pending_stores": 4,
    }
    if throttle is not None:
        ssd["write_throttle"] = throttle
    return {
        "tiers": [{"name": "cpu", "backend": "cpu", "capacity": "256MiB"}, ssd],
        "stress": {"preset": "small", "pool_blocks": 128, "concurrency": 4, "ops": ops},
    }


def _run(raw: dict[str, Any], ops: int) -> StressReport:
    runner = StressRunner(load_config(raw, env={}))
    try:
        return runner.run(ops=ops, duration_s=600)
    finally:
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=600)
    ap.add_argument("--dir", type=Path, default=None, help="where the mmap tier goes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    base = args.dir or Path(
        tempfile.mkdtemp(prefix="kvo-bp-", dir="out" if Path("out").is_dir() else None)
    )
    try:
        free = _run(_config(base / "free", None, args.ops), args.ops)
        store_rate = free.tiers[0].bytes_written / free.duration_s
        throttle = max(1, int(store_rate / 10))
        slow = _run(_config(base / "slow", throttle, args.ops), args.ops)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cpu, ssd = slow.tiers
    result = {
        "store_rate_gbps": store_rate / 1e9,
        "throttle_gbps": throttle / 1e9,
        "submit_p50_ms": slow.submit_p50_ms,
        "submit_p99_ms": slow.submit_p99_ms,
        "submit_max_ms": slow.submit_max_ms,
        "unthrottled_submit_p99_ms": free.submit_p99_ms,
        "ssd_dropped_stores": ssd.dropped_stores,
        "ssd_blocks_stored": ssd.blocks_stored,
        "cpu_dropped_stores": cpu.dropped_stores,
        "engine_stores_dropped": slow.stores_dropped,
        "integrity_errors": slow.integrity_errors + free.integrity_errors,
        "ops": slow.ops,
    }
    print_figures(result, width=28)
    if args.json is not None:
        write_json(args.json, result, facts=run_facts())


if __name__ == "__main__":
    main()
