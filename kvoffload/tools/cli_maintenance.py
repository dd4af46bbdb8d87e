"""``kvoffload inspect``, ``verify`` and ``snapshot export|import``: the maintenance
tools (:mod:`~kvoffload.tools.maintenance`) run and their results printed."""

from __future__ import annotations

import argparse
from typing import Any

from kvoffload.config import load_config
from kvoffload.tools.cli_common import EXIT_FAILED, EXIT_OK, check_output, dump


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


def maintenance_command(args: argparse.Namespace) -> int:
    """``inspect``, ``verify`` (exit 1 on a corrupt block, unless ``--repair``) and
    ``snapshot export|import``."""
    from kvoffload.tools import maintenance

    check_output("--json", getattr(args, "json", None))
    if args.command == "snapshot" and args.snapshot_command == "export":
        check_output("snapshot export OUT", args.out)
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
        dump(args.json, report)
        return EXIT_OK
    if args.command == "verify":
        counts = maintenance.verify_tiers(config, repair=args.repair)
        for name, c in counts.items():
            gone = f", {c['gone']} gone (evicted meanwhile)" if "gone" in c else ""
            print(
                f"{name}: {c['blocks']} blocks, {c['ok']} ok, {c['corrupt']} corrupt, "
                f"{c['repaired']} repaired{gone}"
            )
        dump(args.json, counts)
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


def _when(ts: object) -> str:
    import datetime

    if not isinstance(ts, float):
        return "-"
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
