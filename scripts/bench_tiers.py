#!/usr/bin/env python3
"""Disk-tier throughput against raw O_DIRECT and vLLM's fs tier; same as ``kvoffload bench``.

.venv/bin/python scripts/bench_tiers.py --config configs/bench.yaml --json out/bench.json
"""

from kvoffload.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *__import__("sys").argv[1:]]))
