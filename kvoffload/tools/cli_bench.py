"""``kvoffload bench``: its sizes and totals checked against the machine, then
:func:`~kvoffload.tools.bench.run_bench` run and its rows printed."""

from __future__ import annotations

import argparse
import os

from kvoffload.config import load_config
from kvoffload.tools.cli_common import EXIT_OK, check_output, dump, usage

BENCH_ALIGN = 4096
"""``bench --sizes`` must be multiples of this: O_DIRECT I/O of whole 4 KiB sectors."""


def bench_command(args: argparse.Namespace) -> int:
    """``kvoffload bench``: every size checked (and the trace read) before the first
    measurement, which takes minutes."""
    from kvoffload.sizes import parse_size
    from kvoffload.tools.bench import run_bench
    from kvoffload.tools.bench.manager import load_trace

    if args.reps < 1:
        raise usage(f"--reps = {args.reps}: it must be at least 1")
    sizes = []
    for size in args.sizes.split(","):
        try:
            sizes.append(parse_size(size))
        except ValueError as exc:
            raise usage(f"--sizes {args.sizes!r}: {size!r}: {exc}") from None
        if sizes[-1] % BENCH_ALIGN:
            raise usage(
                f"--sizes {args.sizes!r}: {size!r} is not a multiple of 4KiB "
                "(O_DIRECT I/O moves whole 4 KiB sectors)"
            )
    try:
        total = parse_size(args.total)
    except ValueError as exc:
        raise usage(f"--total {args.total!r}: {exc}") from None
    if total < max(sizes):
        raise usage(
            f"--total {args.total!r} is less than the largest of --sizes {args.sizes!r}; "
            "give at least one block of each size"
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * total > memory:
        raise usage(
            f"--total {args.total!r}: a measurement holds it twice in memory (written and "
            f"read back), more than this machine's {memory} bytes; give a smaller --total"
        )
    check_output("--json", args.json)
    config = load_config(args.config)
    if args.trace is not None:
        load_trace(args.trace)  # a bad line fails now, not after the parts before it
    report = run_bench(
        config,
        sizes=sizes,
        total_bytes=total,
        reps=args.reps,
        progress=lambda m: print(f"bench: {m}", flush=True),
        disk=not args.skip_disk,
        trace=args.trace,
        data_kind=args.data,
    )
    print(
        f"manager: {_f(report['manager_ns_per_block'])} ns/block, vLLM LRU "
        f"{_f(report['vllm_lru_ns_per_block'])}, x vllm {_f(report['manager_vs_vllm_lru'])}"
    )
    for c in report["cpu_ratios"]:
        print(
            f"cpu {c['block']:>9}: copy {c['copy_gbps']:.2f} GB/s, gather "
            f"{c['gather_ratio']:.2f}x, scatter {c['scatter_ratio']:.2f}x"
        )
    if report["tiers"]:
        print(
            f"{'tier':<10} {'block':>7} {'store':>6} {'raw w':>6} {'x raw':>6} {'vllm':>6} "
            f"{'x vllm':>6} {'load':>6} {'raw r':>6} {'x raw':>6} {'vllm':>6} {'x vllm':>6}"
            "   (GB/s)"
        )
    for r in report["tiers"]:
        print(
            f"{r['tier']:<10} {r['block_bytes'] // 1024:>5}Ki {r['store_gbps']:>6.2f} "
            f"{r['raw_write_gbps']:>6.2f} {r['store_vs_raw']:>6.2f} {_f(r['vllm_fs_store_gbps'])} "
            f"{_f(r['store_vs_vllm_fs'])} {r['load_gbps']:>6.2f} {r['raw_read_gbps']:>6.2f} "
            f"{r['load_vs_raw']:>6.2f} {_f(r['vllm_fs_load_gbps'])} {_f(r['load_vs_vllm_fs'])}"
        )
        if r["compression"] != "none":
            print(
                f"{'':<10} {'':>7} {r['compression']}: stored {_f(r['compression_ratio'])} of "
                f"logical ({r['data']} data), decompress {_f(r['decompress_gbps'])} GB/s "
                "per thread"
            )
    if report["redis"]:
        print(
            f"{'tier':<10} {'block':>7} {'op':>5} {'tier':>6} {'raw':>6} {'x raw':>6} "
            f"{'tuned':>6} {'x tuned':>7} {'r-bench':>7} {'x r-b':>6}   (GB/s; raw: "
            "redis-py defaults, tuned: the tier's client settings, r-bench: "
            f"redis-benchmark; {report['redis'][0]['batch_blocks']} values per pipeline)"
        )
    for r in report["redis"]:
        for side, op in (("store", "set"), ("load", "get")):
            print(
                f"{r['tier']:<10} {r['block_bytes'] // 1024:>5}Ki {side:>5} "
                f"{r[f'{side}_gbps']:>6.2f} {r[f'redis_raw_{op}_gbps']:>6.2f} "
                f"{r[f'{side}_vs_raw']:>6.2f} {r[f'redis_tuned_{op}_gbps']:>6.2f} "
                f"{r[f'{side}_vs_tuned']:>7.2f} {_f(r[f'redis_benchmark_{op}_gbps']):>7} "
                f"{_f(r[f'{side}_vs_redis_benchmark'])}"
            )
        if r["redis_benchmark_set_gbps"] is None:
            print(f"{r['tier']:<10} redis-benchmark {r['redis_benchmark']}")
    if not all(r["page_cache_dropped"] for r in report["tiers"]):
        print("note: could not drop the page cache (not root); buffered loads are cache reads")
    dump(args.json, report)
    return EXIT_OK


def _f(x: object) -> str:
    return f"{x:>6.2f}" if isinstance(x, float) else f"{'-':>6}"
