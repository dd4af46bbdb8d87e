"""The ``kvoffload`` command line.

- ``kvoffload config validate FILE``: exit 0 with one OK line, or 2 with the error;
- ``kvoffload config schema``: the config's JSON Schema;
- ``kvoffload backends``: installed backends and where they come from;
- ``kvoffload stress``: the seeded offload stress run (see :mod:`kvoffload.tools.stress`),
  ``--replicas N``: N processes sharing a server-booked (redis) tier;
- ``kvoffload inspect`` / ``verify``: what persistent tiers hold, and whether it is intact;
- ``kvoffload bench``: disk-tier throughput against raw O_DIRECT and vLLM's fs tier,
  the redis tier against raw redis-py ``SET``/``GET``, manager cost against vLLM's,
  gather/scatter against a plain copy;
- ``kvoffload snapshot export|import``: move a tier's blocks through a safetensors file;
- ``kvoffload lookup``: how much of each prompt's prefix the shared (redis) tier holds,
  for a batch of token-id prompts, in one round trip per node (:mod:`kvoffload.lookup`).

Expected failures (bad arguments, bad config, broken plugin) print one line on stderr
and exit 2, never a traceback. Every flag is checked before any tier is opened or any
run starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvoffload.config import LAYOUT_PRESETS, config_schema, load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.layout import DTYPE_NAMES
from kvoffload.lookup import FP8_CACHES, HASH_ALGOS, Prompt
from kvoffload.metrics import TIER_METRICS
from kvoffload.sizes import format_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from kvoffload.config import KVOffloadConfig
    from kvoffload.tools.stress import ReplicaSetReport, StressReport

logger = logging.getLogger("kvoffload")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
BENCH_ALIGN = 4096
"""``bench --sizes`` must be multiples of this: O_DIRECT I/O of whole 4 KiB sectors."""


def _one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\x1b``, ...): a
    file name or argument holding a newline cannot split the error line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: no usage block, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE,
            f"{_one_line(self.prog)}: error: {_one_line(message)}; see '{self.prog} --help'\n",
        )


def _path(value: str) -> Path:
    """A path argument: an empty one (``--config ""``) is refused by name, not read as
    the current directory."""
    if not value:
        raise argparse.ArgumentTypeError("an empty string is not a path")
    return Path(value)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvoffload", description="Tiered KV-cache offloading.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)

    cfg = sub.add_parser("config", help="validate a config file or print its schema")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    val = cfg_sub.add_parser("validate", help="check a YAML config; exit 2 if invalid")
    val.add_argument("file", type=_path)
    cfg_sub.add_parser("schema", help="print the config's JSON Schema")

    sub.add_parser("backends", help="list installed backends")

    st = sub.add_parser("stress", help="seeded offload stress run, every load verified")
    st.add_argument(
        "--config", type=_path, default=None, help="YAML config (default: $KVOFFLOAD_CONFIG)"
    )
    st.add_argument("--ops", type=int, default=None, help="requests to run (config: stress.ops)")
    st.add_argument("--duration", type=float, default=None, help="wall-time bound in seconds")
    st.add_argument("--seed", type=int, default=None, help="workload and data seed")
    st.add_argument("--json", type=_path, default=None, help="write the report as JSON here")
    st.add_argument("--no-progress", action="store_true", help="no progress bar")
    st.add_argument(
        "--workload",
        choices=["zipf", "multiturn", "scan", "trace"],
        default=None,
        help="request stream (config: stress.workload)",
    )
    st.add_argument("--trace", type=_path, default=None, help="replay a JSONL trace (Mooncake)")
    st.add_argument(
        "--data",
        choices=["random", "kv"],
        default=None,
        help="block contents: random bytes, or KV-like values a codec shrinks (stress.data)",
    )
    st.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (stress.concurrency)"
    )
    st.add_argument(
        "--preset",
        choices=sorted(LAYOUT_PRESETS),
        default=None,
        help="simulated model layout (stress.preset)",
    )
    st.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run N replica processes (1-64) over one split request stream, sharing the "
        "config's server-booked tier (redis); default 1",
    )
    st.add_argument(
        "--plot",
        type=_path,
        default=None,
        help="PNG of throughput and hit rate over time (needs the 'plot' extra: matplotlib)",
    )

    ins = sub.add_parser("inspect", help="blocks, bytes, ages and fill of each tier")
    ins.add_argument("--config", type=_path, default=None)
    ins.add_argument("--json", type=_path, default=None)

    ver = sub.add_parser("verify", help="re-read every persisted block; exit 1 on corruption")
    ver.add_argument("--config", type=_path, default=None)
    ver.add_argument(
        "--repair", action="store_true", help="discard the corrupt blocks' records for good"
    )
    ver.add_argument("--json", type=_path, default=None)

    bench = sub.add_parser("bench", help="tier throughput vs raw O_DIRECT and vLLM's fs tier")
    bench.add_argument("--config", type=_path, default=None)
    bench.add_argument("--json", type=_path, default=None)
    bench.add_argument("--total", default="512MiB", help="bytes moved per measurement")
    bench.add_argument("--reps", type=int, default=3, help="tries per measurement; best kept")
    bench.add_argument(
        "--sizes", default="16KiB,64KiB,256KiB,2MiB", help="comma-separated block sizes"
    )
    bench.add_argument(
        "--skip-disk",
        action="store_true",
        help="only the manager and cpu parts, no disk or redis tier",
    )
    bench.add_argument(
        "--trace", type=_path, default=None, help="JSONL trace (Mooncake) for the manager part"
    )
    bench.add_argument(
        "--data",
        choices=["random", "kv"],
        default="random",
        help="block contents: random bytes, or KV-like values a compressing tier shrinks",
    )

    snap = sub.add_parser("snapshot", help="export or import a tier as safetensors")
    snap_sub = snap.add_subparsers(dest="snapshot_command", required=True)
    exp = snap_sub.add_parser("export", help="write a tier's blocks to a safetensors file")
    exp.add_argument("--config", type=_path, default=None)
    exp.add_argument("out", type=_path)
    exp.add_argument("--tier", default=None, help="tier name (default: first persistent tier)")
    imp = snap_sub.add_parser("import", help="pre-warm a tier from a safetensors file")
    imp.add_argument("--config", type=_path, default=None)
    imp.add_argument("src", type=_path)
    imp.add_argument("--tier", default=None, help="tier name (default: first persistent tier)")

    lk = sub.add_parser(
        "lookup", help="how much of each prompt's prefix the shared (redis) tier holds"
    )
    lk.add_argument("--config", type=_path, default=None, help="the connector's YAML config")
    lk.add_argument(
        "--prompts",
        type=_path,
        default=None,
        help="(required) JSON lines, one prompt each: a list of token ids, or an object with "
        "token_ids (and cache_salt, lora_name, lora_path); '-' reads stdin",
    )
    lk.add_argument(
        "--block-size", type=int, default=None, help="(required) the engines' block_size"
    )
    lk.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="the engines' prefix_caching_hash_algo (default sha256)",
    )
    lk.add_argument(
        "--hash-seed",
        default=None,
        help="the engines' PYTHONHASHSEED (default: $PYTHONHASHSEED here; unset: vLLM's "
        "fixed seed of the sha256 algorithms)",
    )
    lk.add_argument(
        "--fingerprint",
        default=None,
        help="the layout fingerprints (hex, comma-separated, one per TP rank) instead of "
        "the model's fields below",
    )
    lk.add_argument("--model-id", default=None, help="the connector's model_id (or the model)")
    lk.add_argument("--num-layers", type=int, default=None, help="the model's layers")
    lk.add_argument("--num-kv-heads", type=int, default=None, help="KV heads, all ranks")
    lk.add_argument("--head-dim", type=int, default=None, help="vLLM's head size")
    lk.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="the model's dtype")
    lk.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="the engines' TP size (default 1)"
    )
    lk.add_argument(
        "--cache-dtype",
        choices=["auto", *FP8_CACHES],
        default="auto",
        help="the engines' cache_dtype (default auto)",
    )
    lk.add_argument("--mla", action="store_true", help="the model's cache is MLA's")
    lk.add_argument("--json", type=_path, default=None, help="write the report as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # quoted, so an empty or blank argument is seen
        parser.error(f"unrecognized arguments: {' '.join(map(repr, extras))}")
    try:
        logging.basicConfig(
            level=_log_level(args.verbose),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if args.command == "config":
            return _config(args)
        if args.command == "backends":
            return _backends()
        if args.command == "stress":
            return _stress(args)
        if args.command == "bench":
            return _bench(args)
        if args.command in ("inspect", "verify", "snapshot"):
            return _maintenance(args)
        if args.command == "lookup":
            return _lookup(args)
    except KVOffloadError as exc:
        print(f"kvoffload: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    raise AssertionError(f"unhandled command {args.command}")


def _log_level(verbose: int) -> int:
    """``$KVOFFLOAD_LOG_LEVEL`` (a level name, any case), else from ``-v``."""
    name = os.environ.get("KVOFFLOAD_LOG_LEVEL")
    if name is None:
        return {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    levels = logging.getLevelNamesMapping()
    level = levels.get(name.strip().upper())
    if level is None:
        raise _usage(
            f"KVOFFLOAD_LOG_LEVEL = {name!r}: not a logging level; "
            "use DEBUG, INFO, WARNING or ERROR (or unset it)"
        )
    return level


def _check_output(flag: str, path: Path | None) -> None:
    """Refuse an output path that cannot be a file before any work starts, not after a
    run of minutes: an existing directory, or one whose nearest existing ancestor is
    not a directory."""
    if path is None:
        return
    try:
        if path.is_dir():
            raise _usage(f"{flag} {path}: is a directory; give the path of a file")
        parent = next((d for d in path.parents if d.exists()), None)
    except OSError as exc:
        raise _usage(f"{flag} {path}: cannot be written: {exc.strerror or exc}") from None
    if parent is not None and not parent.is_dir():
        raise _usage(f"{flag} {path}: {parent} is not a directory; give the path of a file")


def _check_positive(flag: str, value: float | None) -> None:
    if value is not None and not value > 0:  # NaN too: it is not > 0
        raise _usage(f"{flag} = {value}: it must be greater than zero")


def _config(args: argparse.Namespace) -> int:
    if args.config_command == "schema":
        print(json.dumps(config_schema(), indent=2))
        return EXIT_OK
    cfg = load_config(args.file)
    tiers = " -> ".join(f"{t.name}({t.backend})" for t in cfg.tiers)
    print(f"OK {args.file}: {len(cfg.tiers)} tier(s) {tiers}, eviction={cfg.eviction}")
    return EXIT_OK


def _backends() -> int:
    from kvoffload.registry import known_backends

    for name, target in known_backends().items():
        print(f"{name}\t{target}")
    return EXIT_OK


def _stress(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvoffload.tools.stress import MAX_REPLICAS, StressRunner, shared_tiers

    _check_positive("--ops", args.ops)
    _check_positive("--duration", args.duration)
    if args.concurrency is not None and args.concurrency < 1:
        raise _usage(f"--concurrency = {args.concurrency}: it must be at least 1")
    replicas = 1 if args.replicas is None else args.replicas
    if not 1 <= replicas <= MAX_REPLICAS:
        raise _usage(f"--replicas = {replicas}: it must be between 1 and {MAX_REPLICAS}")
    if replicas > 1 and args.plot is not None:
        raise _usage(
            f"--plot with --replicas {replicas}: the plot draws one process's run; "
            "drop --plot, or run --replicas 1"
        )
    if args.trace is not None and args.workload not in (None, "trace"):
        raise _usage(
            f"--trace {args.trace} with --workload {args.workload}: the trace would be "
            "ignored; drop one, or pass --workload trace"
        )
    _check_output("--json", args.json)
    _check_output("--plot", args.plot)
    config = load_config(args.config)
    overrides: dict[str, Any] = {}
    flags: list[str] = []
    if args.workload is not None or args.trace is not None:
        overrides["workload"] = args.workload or "trace"
        if args.workload is not None:
            flags.append(f"--workload {args.workload}")
        if args.trace is not None:
            overrides["trace"] = str(args.trace)
            flags.append(f"--trace {args.trace}")
    if args.data is not None:
        overrides["data"] = args.data
        flags.append(f"--data {args.data}")
    if args.concurrency is not None:
        overrides["concurrency"] = args.concurrency
        flags.append(f"--concurrency {args.concurrency}")
    if args.preset is not None:
        overrides["preset"] = args.preset
        flags.append(f"--preset {args.preset}")
    if overrides:
        stress = config.stress.model_dump(exclude_unset=True)
        if "preset" in overrides:
            stress.pop("layout", None)  # the flag names the whole layout
        raw = {**config.model_dump(), "stress": {**stress, **overrides}}
        try:
            config = load_config(raw, env={})
        except KVOffloadError as exc:  # name the flags, not the "<dict>" they went into
            raise _usage(f"{' '.join(flags)}: {str(exc).removeprefix('<dict>: ')}") from None
    if replicas > 1 and not shared_tiers(config):
        raise _usage(
            f"--replicas {replicas}: no tier of the config is shared between processes; "
            "add a tier whose books live on its server (backend: redis) below the cpu "
            "tier, or run --replicas 1"
        )
    if args.plot is not None:
        from kvoffload.tools.plot import require_matplotlib

        require_matplotlib()
    ops = args.ops if args.ops is not None else config.stress.ops
    duration = args.duration if args.duration is not None else config.stress.duration_s
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # logs and CI: do not squeeze the table to 80 columns
    if replicas > 1:
        return _stress_replicas(args, config, console, replicas, ops, duration)
    runner = StressRunner(config, seed=args.seed)
    try:
        console.print(
            f"kvoffload stress: {len(runner.tiers)} tier(s) "
            f"({' -> '.join(t.name for t in runner.tiers)}), {config.stress.workload} workload, "
            f"block {runner.layout.bytes_per_block} bytes, {config.stress.concurrency} in flight, "
            f"up to {ops} requests / {duration:g} s, seed {runner.seed}"
        )
        show = not args.no_progress and console.is_terminal
        with _request_bar(console, show) as bar:
            task = bar.add_task("stress", total=ops)
            report = runner.run(
                ops=ops,
                duration_s=duration,
                progress=lambda done, _t: bar.update(task, completed=done),
            )
    finally:
        runner.close()
    _print_report(console, report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"report written to {args.json}")
    if args.plot is not None:
        from kvoffload.tools.plot import plot_report

        plot_report(report.to_json(), args.plot)
        console.print(f"plot written to {args.plot}")
    return EXIT_FAILED if report.integrity_errors else EXIT_OK


def _stress_replicas(
    args: argparse.Namespace,
    config: KVOffloadConfig,
    console: Console,
    replicas: int,
    ops: int,
    duration: float,
) -> int:
    """``stress --replicas N`` (N > 1): N processes, one report each and their totals."""

    from kvoffload.tools.stress import run_replicas, shared_tiers

    seed = config.stress.seed if args.seed is None else args.seed
    local = [t.name for t in config.tiers if getattr(t, "path", None) is not None]
    local = [name for name in local if name not in shared_tiers(config)]
    console.print(
        f"kvoffload stress: {replicas} replicas, each {len(config.tiers)} tier(s) "
        f"({' -> '.join(t.name for t in config.tiers)}) sharing "
        f"{', '.join(shared_tiers(config))}, {config.stress.workload} workload split "
        f"between them, {config.stress.concurrency} in flight each, up to {ops} requests "
        f"/ {duration:g} s each, seed {seed}"
        + (f"; {', '.join(local)}: a directory per replica (PATH.replicaN)" if local else "")
    )
    show = not args.no_progress and console.is_terminal
    with _request_bar(console, show) as bar:
        task = bar.add_task("stress", total=ops * replicas)
        report = run_replicas(
            config,
            replicas=replicas,
            ops=ops,
            duration_s=duration,
            seed=seed,
            progress=lambda done, _t: bar.update(task, completed=done),
        )
    _print_replicas(console, report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"report written to {args.json}")
    return EXIT_FAILED if report.integrity_errors else EXIT_OK


def _fill(info: dict[str, Any]) -> str:
    """How full an inspected tier is: of its byte budget where it has one (a packed
    slab: blocks take what they compressed to), else of its slots."""
    if "budget_bytes" in info:
        return (
            f"{info['used']:.1%} of its {info['budget_bytes']} byte budget "
            f"({info['bytes_held']} bytes held)"
        )
    return f"{info['used']:.1%} of {info['slots']} slots"


def _per_gib(info: dict[str, Any]) -> str:
    """An inspected tier's blocks per GiB of capacity, with what its capacity holds
    of full-size blocks (the number compression is measured against)."""
    per_gib = info["blocks_per_gib"]
    held = "-" if per_gib is None else f"{per_gib:.1f}"
    return (
        f"{held} blocks per GiB of {info['capacity_bytes']} bytes "
        f"({info['capacity_blocks']} full-size blocks, codec {info['compression']})"
    )


def _maintenance(args: argparse.Namespace) -> int:
    from kvoffload.tools import maintenance

    _check_output("--json", getattr(args, "json", None))
    if args.command == "snapshot" and args.snapshot_command == "export":
        _check_output("snapshot export OUT", args.out)
    config = load_config(args.config)
    if args.command == "inspect":
        report: dict[str, object] = dict(maintenance.inspect_tiers(config))
        for name, info in report.items():
            assert isinstance(info, dict)
            extra = ""
            if info.get("missing"):
                extra = " (nothing written at its path yet)"
            elif info.get("server_booked"):
                limit = info["maxmemory"] or "no limit"
                extra = (
                    f" {info['bytes']} bytes under {info['key_prefix']}:"
                    f"{info['fingerprint'][:12]}... at {info['server']}; server: "
                    f"{info['used_memory']} bytes used of {limit} "
                    f"({info['maxmemory_policy']}), {info['evicted_keys']} keys evicted"
                )
            elif info.get("persistent"):
                extra = f" {info['bytes']} bytes, {_fill(info)}, {_per_gib(info)}"
                extra += f", oldest {_when(info['oldest'])}, newest {_when(info['newest'])}"
                ratio = info.get("compression_ratio")
                if info.get("compression", "none") != "none" or (ratio is not None and ratio < 1):
                    extra += (
                        f", stored {info['stored_bytes']} bytes ({ratio:.3f} of logical; "
                        f"compression {info['compression']})"
                    )
            print(f"{name} ({info['backend']}): {info['blocks']} blocks{extra}")
        _dump(args.json, report)
        return EXIT_OK
    if args.command == "verify":
        counts = maintenance.verify_tiers(config, repair=args.repair)
        for name, c in counts.items():
            gone = f", {c['gone']} gone (evicted meanwhile)" if "gone" in c else ""
            print(
                f"{name}: {c['blocks']} blocks, {c['ok']} ok, {c['corrupt']} corrupt, "
                f"{c['repaired']} repaired{gone}"
            )
        _dump(args.json, counts)
        corrupt = sum(c["corrupt"] for c in counts.values())
        return EXIT_FAILED if corrupt and not args.repair else EXIT_OK
    if args.snapshot_command == "export":
        n = maintenance.export_snapshot(config, args.out, args.tier)
        print(f"exported {n} blocks to {args.out}")
        return EXIT_OK
    result = maintenance.import_snapshot(config, args.src, args.tier)
    print(
        f"imported {result['imported']} of {result['blocks']} blocks "
        f"({result['present']} already present, {result['rejected']} without room, "
        f"{result['evicted']} evicted again by later ones)"
    )
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from kvoffload.sizes import parse_size
    from kvoffload.tools.bench import run_bench
    from kvoffload.tools.bench.manager import load_trace

    if args.reps < 1:
        raise _usage(f"--reps = {args.reps}: it must be at least 1")
    sizes = []
    for size in args.sizes.split(","):
        try:
            sizes.append(parse_size(size))
        except ValueError as exc:
            raise _usage(f"--sizes {args.sizes!r}: {size!r}: {exc}") from None
        if sizes[-1] % BENCH_ALIGN:
            raise _usage(
                f"--sizes {args.sizes!r}: {size!r} is not a multiple of 4KiB "
                "(O_DIRECT I/O moves whole 4 KiB sectors)"
            )
    try:
        total = parse_size(args.total)
    except ValueError as exc:
        raise _usage(f"--total {args.total!r}: {exc}") from None
    if total < max(sizes):
        raise _usage(
            f"--total {args.total!r} is less than the largest of --sizes {args.sizes!r}; "
            "give at least one block of each size"
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * total > memory:
        raise _usage(
            f"--total {args.total!r}: a measurement holds it twice in memory (written and "
            f"read back), more than this machine's {memory} bytes; give a smaller --total"
        )
    _check_output("--json", args.json)
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
    _dump(args.json, report)
    return EXIT_OK


def _f(x: object) -> str:
    return f"{x:>6.2f}" if isinstance(x, float) else f"{'-':>6}"


def _when(ts: object) -> str:
    import datetime

    if not isinstance(ts, float):
        return "-"
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


LOOKUP_MODEL_FLAGS = ("--model-id", "--num-layers", "--num-kv-heads", "--head-dim")
"""The model's fields ``lookup`` needs unless ``--fingerprint`` is given."""


def _lookup(args: argparse.Namespace) -> int:
    """``kvoffload lookup``: one JSON line per prompt (its full blocks, and the blocks
    and tokens each shared tier holds of its prefix); ``--json``: that and the round
    trips."""
    from kvoffload.lookup import PrefixLookup, VllmEngineLayout, VllmHashing

    # Each value given is checked first, then what is missing or clashes, then the
    # prompts and the config are read: a bad value is named whatever else is wrong.
    _check_output("--json", args.json)
    for flag in ("--block-size", *LOOKUP_MODEL_FLAGS[1:], "--tensor-parallel-size"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value <= 0:
            raise _usage(f"{flag} {value}: it must be greater than zero")
    if args.model_id is not None and (not args.model_id or not args.model_id.isprintable()):
        raise _usage(f"--model-id {args.model_id!r}: give the connector's model_id")
    fps = None if args.fingerprint is None else _fingerprints(args.fingerprint)
    prompts = None if args.prompts is None else _read_prompts(args.prompts)
    config = load_config(args.config)
    if prompts is None or args.block_size is None:
        raise _usage(
            f"{'--prompts' if args.prompts is None else '--block-size'}: missing; "
            "give the prompts (a JSON-lines file) and the engines' block_size"
        )
    fields = {f: getattr(args, f[2:].replace("-", "_")) for f in LOOKUP_MODEL_FLAGS}
    given = [f for f, v in fields.items() if v is not None]
    fingerprints: list[bytes] | VllmEngineLayout
    if fps is not None:
        if given:
            raise _usage(
                f"--fingerprint and {given[0]}: give the fingerprints or the model's "
                "fields, not both"
            )
        fingerprints = fps
    else:
        missing = [f for f, v in fields.items() if v is None]
        if missing:
            raise _usage(
                f"{missing[0]}: missing; give the model's {', '.join(LOOKUP_MODEL_FLAGS)} "
                "(or --fingerprint)"
            )
        fingerprints = VllmEngineLayout(
            model_id=str(args.model_id),
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            cache_dtype=args.cache_dtype,
            mla=args.mla,
        )
    seed = args.hash_seed if args.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    hashing = VllmHashing(args.block_size, args.hash_algo, seed)
    with PrefixLookup(config, hashing, fingerprints) as lookup:
        full = [len(lookup.hashing.block_hashes(p)) for p in prompts]
        answers = lookup.lookup(prompts)
    for i, n in enumerate(full):
        held = {a.tier: a.blocks[i] for a in answers}
        line = {
            "prompt": i,
            "full_blocks": n,
            "blocks": held,
            "tokens": {t: b * args.block_size for t, b in held.items()},
        }
        print(json.dumps(line))
    for a in answers:
        logger.info(
            "lookup: tier %s: %d prompts, %d names asked, %d round trips (new "
            "connections' handshakes included)",
            a.tier,
            len(prompts),
            a.names,
            a.round_trips,
        )
    _dump(
        args.json,
        {
            "block_size": args.block_size,
            "full_blocks": full,
            "tiers": {
                a.tier: {"blocks": a.blocks, "round_trips": a.round_trips, "names": a.names}
                for a in answers
            },
        },
    )
    return EXIT_OK


def _fingerprints(text: str) -> list[bytes]:
    out = []
    for part in text.split(","):
        try:
            fp = bytes.fromhex(part.strip())
        except ValueError:
            fp = b""
        if len(fp) != 16:
            raise _usage(
                f"--fingerprint {text!r}: expected 32 hex digits per rank, comma-separated "
                "(a layout's fingerprint: the hex after the key prefix in the tier's names on the "
                "server, {key_prefix}:{fingerprint}:{key})"
            )
        out.append(fp)
    return out


def _read_prompts(path: Path) -> list[Prompt]:
    """``--prompts``: JSON lines, each a list of token ids or an object of
    :class:`~kvoffload.lookup.Prompt`'s fields (``lora_name`` and ``lora_path``)."""
    where = "<stdin>" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _usage(f"--prompts {where}: cannot be read: {why}") from None
    fix = (
        "each line is a JSON list of token ids, or an object with token_ids and "
        "optional cache_salt, lora_name and lora_path"
    )
    prompts: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise _usage(f"--prompts {where}:{n}: not JSON ({exc}); {fix}") from None
        if isinstance(raw, list):
            raw = {"token_ids": raw}
        if not isinstance(raw, dict) or not set(raw) <= {
            "token_ids",
            "cache_salt",
            "lora_name",
            "lora_path",
        }:
            raise _usage(f"--prompts {where}:{n}: unexpected {_short(raw)}; {fix}")
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise _usage(
                f"--prompts {where}:{n}: token_ids = {_short(tokens)}: expected a list of "
                "non-negative integers"
            )
        extra = {k: raw.get(k) for k in ("cache_salt", "lora_name", "lora_path")}
        for key, value in extra.items():
            if value is not None and not isinstance(value, str):
                raise _usage(f"--prompts {where}:{n}: {key} = {_short(value)}: expected a string")
        if (extra["lora_name"] is None) != (extra["lora_path"] is None):
            raise _usage(f"--prompts {where}:{n}: give both lora_name and lora_path, or neither")
        lora = None
        if extra["lora_name"] is not None and extra["lora_path"] is not None:
            lora = (extra["lora_name"], extra["lora_path"])
        prompts.append(Prompt(tokens, extra["cache_salt"], lora))
    if not prompts:
        raise _usage(f"--prompts {where}: no prompt in it; {fix}")
    return prompts


def _short(value: object, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dump(path: Path | None, data: object) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


def _ms(value: float | None, digits: int | None = None) -> str:
    """Milliseconds: fixed 3 decimals, or ``digits`` significant ones for narrow cells."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if digits else f"{value:.3f}"


def _count(value: object) -> str:
    """A counter's table cell: ints as they are, seconds to the millisecond."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _usage(message: str) -> KVOffloadError:
    return KVOffloadError(message)


def _print_report(console: Console, report: StressReport) -> None:
    from rich.table import Table

    # The counter columns come from the metric schema: the counters declared with a
    # stress-table column, in declaration order (counter name -> column header).
    columns = {m.name: m.column for m in TIER_METRICS if m.column is not None}
    table = Table(title="kvoffload stress: per tier")
    for col in (
        "tier",
        "backend",
        "policy",
        "capacity",
        "held",
        "blk/GiB",
        *columns.values(),
        "write GB/s",
        "read GB/s",
        "store ms p50/p99",
        "load ms p50/p99",
    ):
        left = col in ("tier", "backend", "policy")
        table.add_column(col, justify="left" if left else "right", no_wrap=col.endswith("p99"))
    for t in report.tiers:
        table.add_row(
            t.name,
            t.backend,
            t.write_policy,
            f"{t.capacity_blocks} blk",
            f"{t.blocks_held} blk",
            "-" if t.blocks_per_gib is None else f"{t.blocks_per_gib:.1f}",
            *(_count(getattr(t, name)) for name in columns),
            f"{t.write_gbps:.2f}",
            f"{t.read_gbps:.2f}",
            f"{_ms(t.store_p50_ms, 3)}/{_ms(t.store_p99_ms, 3)}",
            f"{_ms(t.load_p50_ms, 3)}/{_ms(t.load_p99_ms, 3)}",
        )
    console.print(table)
    _print_compression(console, report)
    summary = Table(title="kvoffload stress: summary", show_header=False)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    summary.add_row("requests", str(report.ops))
    summary.add_row("duration", f"{report.duration_s:.1f} s")
    summary.add_row("blocks requested", str(report.blocks_requested))
    summary.add_row("blocks loaded", str(report.blocks_loaded))
    summary.add_row("blocks stored", str(report.blocks_stored))
    summary.add_row("requests whose store was dropped", str(report.stores_dropped))
    summary.add_row(
        "submit latency p50 / p99 / max",
        " / ".join(_ms(v) for v in (report.submit_p50_ms, report.submit_p99_ms))
        + f" / {_ms(report.submit_max_ms)} ms",
    )
    summary.add_row(
        "request latency p50 / p99",
        f"{_ms(report.request_p50_ms)} / {_ms(report.request_p99_ms)} ms",
    )
    summary.add_row("hit rate", f"{report.hit_rate:.3f}")
    summary.add_row("integrity errors", str(report.integrity_errors))
    res = [r for r in report.resources if "rss_bytes" in r]
    if res:  # start, middle and end of the run: what a soak looks at
        picks = (res[0], res[len(res) // 2], res[-1])
        for label, key, scale in (
            ("RSS MiB start / middle / end", "rss_bytes", 2**20),
            ("locked MiB start / middle / end", "locked_bytes", 2**20),
            ("open fds start / middle / end", "open_fds", 1),
            ("threads start / middle / end", "threads", 1),
        ):
            summary.add_row(label, " / ".join(f"{r[key] / scale:.0f}" for r in picks))
    console.print(summary)
    console.print(f"integrity errors: {report.integrity_errors}")


def _print_compression(console: Console, report: StressReport) -> None:
    """The compressed tiers: what the run's writes took as stored, what each holds
    at the end, and the codec's speed (per thread, logical bytes)."""
    from rich.table import Table

    packed = [t for t in report.tiers if t.compression != "none"]
    if not packed:
        return
    table = Table(title="kvoffload stress: compression")
    for col in ("tier", "codec", "stored / logical", "held", "compress GB/s", "decompress GB/s"):
        table.add_column(col, justify="left" if col in ("tier", "codec") else "right")
    for t in packed:
        held = (
            f"{format_size(t.held_stored_bytes)} of {format_size(t.held_logical_bytes)}"
            if t.held_stored_bytes is not None and t.held_logical_bytes is not None
            else "-"
        )
        table.add_row(
            t.name,
            t.compression,
            "-" if t.compression_ratio is None else f"{t.compression_ratio:.3f}",
            held,
            "-" if t.compress_gbps is None else f"{t.compress_gbps:.2f}",
            "-" if t.decompress_gbps is None else f"{t.decompress_gbps:.2f}",
        )
    console.print(table)


def _print_replicas(console: Console, report: ReplicaSetReport) -> None:
    """``stress --replicas``: hit rates and per-tier hits of each replica, their
    totals, then every tier's counters summed over the replicas."""
    from rich.table import Table

    names = [t.name for t in report.reports[0].tiers]
    table = Table(title="kvoffload stress: per replica")
    for col in (
        "replica",
        "requests",
        "duration",
        "requested",
        "loaded",
        "hit rate",
        *(f"{n} hits" for n in names),
        "integrity errors",
    ):
        table.add_column(col, justify="right")
    for i, r in enumerate(report.reports):
        table.add_row(
            str(i),
            str(r.ops),
            f"{r.duration_s:.1f} s",
            str(r.blocks_requested),
            str(r.blocks_loaded),
            f"{r.hit_rate:.3f}",
            *(str(t.hits) for t in r.tiers),
            str(r.integrity_errors),
        )
    totals = report.tier_totals()
    table.add_row(
        "all",
        str(report.ops),
        f"{report.duration_s:.1f} s",
        str(report.blocks_requested),
        str(report.blocks_loaded),
        f"{report.hit_rate:.3f}",
        *(str(t["hits"]) for t in totals),
        str(report.integrity_errors),
        style="bold",
    )
    console.print(table)
    columns = {m.name: m.column for m in TIER_METRICS if m.column is not None}
    tiers = Table(title="kvoffload stress: per tier, summed over the replicas")
    for col in ("tier", "backend", "shared", *columns.values()):
        tiers.add_column(col, justify="left" if col in ("tier", "backend") else "right")
    for t in totals:
        tiers.add_row(
            t["name"],
            t["backend"],
            "yes" if t["shared"] else "no",
            *(_count(t[name]) for name in columns),
        )
    console.print(tiers)
    console.print(f"integrity errors: {report.integrity_errors}")


def _request_bar(console: Console, show: bool) -> Progress:
    """The stress runs' progress bar: requests done of requests planned."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests"),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
    )
