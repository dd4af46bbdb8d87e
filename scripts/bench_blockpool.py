#!/usr/bin/env python3
"""Gather/scatter and cpu-tier throughput against a plain torch copy of the same bytes.

A table over :func:`kvoffload.tools.bench.cpu.bench_cpu`, the measurement ``kvoffload bench``
reports as ``cpu_ratios`` (one implementation for both). Every ratio's baseline is
measured in the same run, on the same byte count: ``dst.copy_(src)`` of one contiguous
region as large as the whole batch (the memcpy limit of this machine). Usage::

    .venv/bin/python scripts/bench_blockpool.py [--total-mib 256] [--repeat 7] [--json PATH]
        [--markdown]

``--markdown`` also prints the rows as the table of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse

import torch

from kvoffload.tools.bench.cpu import PATHS, bench_cpu
from kvoffload.tools.bench.harness import fixed, markdown_table, with_ratio, write_json

DOCS_COLUMNS = [
    ("block", "block"),
    ("blocks", "blocks"),
    ("copy GB/s", fixed("copy_gbps")),
    *((k.replace("_", " "), with_ratio(f"{k}_gbps", f"{k}_ratio")) for k in PATHS),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per batch")
    ap.add_argument("--repeat", type=int, default=7, help="rounds per measurement; best kept")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="the docs' table too")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    report = bench_cpu(total_bytes=args.total_mib * 2**20, repeat=args.repeat)
    print(
        f"{'block':>9} {'n':>5} {'copy GB/s':>9} {'gather':>13} {'scatter':>13} "
        f"{'tier write':>13} {'tier read':>13}"
    )
    for row in report["cpu_ratios"]:
        print(
            f"{row['block']:>9} {row['blocks']:>5} {row['copy_gbps']:>9.2f} "
            + " ".join(f"{row[k + '_gbps']:>6.2f} ({row[k + '_ratio']:.2f}x)" for k in PATHS)
        )
    print(
        f"worst at >= {report['cpu_ratio_min_block_bytes'] // 1024} KiB blocks: "
        f"gather {report['cpu_gather_ratio']:.2f}x, scatter {report['cpu_scatter_ratio']:.2f}x"
    )
    if args.markdown:
        print(markdown_table(DOCS_COLUMNS, report["cpu_ratios"], left=0))
    if args.json:
        write_json(args.json, report["cpu_ratios"])


if __name__ == "__main__":
    main()
