"""The store chain alone: pool -> cpu -> mmap (write-through) vs raw O_DIRECT write.

The same measurement ``kvoffload bench`` makes at its end (``chain_*`` keys), without
the per-tier disk sweep before it. Usage::

    .venv/bin/python scripts/bench_chain.py [--config configs/bench.yaml] [--json PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvoffload.config import load_config
from kvoffload.tools.bench.chain import bench_chain
from kvoffload.tools.bench.harness import print_figures, run_facts, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/bench.yaml"))
    ap.add_argument("--total", type=int, default=1024, help="MiB stored through the chain")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tiers = [t for t in load_config(args.config).resolved_tiers() if t.backend == "mmap"]
    if not tiers:
        raise SystemExit(f"{args.config}: no mmap tier to run the chain into")
    result = bench_chain(tiers[0], total_bytes=args.total * 1024 * 1024)
    print_figures(result, width=36)
    if args.json is not None:
        write_json(args.json, result, facts=run_facts())


if __name__ == "__main__":
    main()
