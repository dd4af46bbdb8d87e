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

This module is the parser and the dispatch; each group of subcommands is a module
of its own (``cli_stress``, ``cli_maintenance``, ``cli_bench``, ``cli_lookup``),
with what they share in ``cli_common`` and the stress tables in ``cli_tables``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvoffload.config import LAYOUT_PRESETS, config_schema, load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.layout import DTYPE_NAMES
from kvoffload.lookup import FP8_CACHES, HASH_ALGOS
from kvoffload.tools.cli_bench import BENCH_ALIGN, bench_command
from kvoffload.tools.cli_common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, one_line, usage
from kvoffload.tools.cli_lookup import LOOKUP_MODEL_FLAGS, lookup_command
from kvoffload.tools.cli_maintenance import maintenance_command
from kvoffload.tools.cli_stress import stress_command
from kvoffload.tools.cli_tables import print_report as _print_report

__all__ = [
    "BENCH_ALIGN",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "LOOKUP_MODEL_FLAGS",
    "_parser",
    "_print_report",
    "main",
]


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: no usage block, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE,
            f"{one_line(self.prog)}: error: {one_line(message)}; see '{self.prog} --help'\n",
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
            return stress_command(args)
        if args.command == "bench":
            return bench_command(args)
        if args.command in ("inspect", "verify", "snapshot"):
            return maintenance_command(args)
        if args.command == "lookup":
            return lookup_command(args)
    except KVOffloadError as exc:
        print(f"kvoffload: error: {one_line(str(exc))}", file=sys.stderr)
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
        raise usage(
            f"KVOFFLOAD_LOG_LEVEL = {name!r}: not a logging level; "
            "use DEBUG, INFO, WARNING or ERROR (or unset it)"
        )
    return level


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
