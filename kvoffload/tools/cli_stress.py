"""``kvoffload stress``: its flags checked, the config's ``stress`` section overridden
by them, then one run (or ``--replicas N`` processes) printed, written and plotted."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvoffload.config import load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.tools.cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    check_output,
    check_positive,
    usage,
)
from kvoffload.tools.cli_tables import print_replicas, print_report, request_bar

if TYPE_CHECKING:
    from rich.console import Console

    from kvoffload.config import KVOffloadConfig


def stress_command(args: argparse.Namespace) -> int:
    """``kvoffload stress``: every flag checked before a tier is opened; exit 1 on an
    integrity error."""
    from rich.console import Console

    from kvoffload.tools.stress import MAX_REPLICAS, StressRunner, shared_tiers

    check_positive("--ops", args.ops)
    check_positive("--duration", args.duration)
    if args.concurrency is not None and args.concurrency < 1:
        raise usage(f"--concurrency = {args.concurrency}: it must be at least 1")
    replicas = 1 if args.replicas is None else args.replicas
    if not 1 <= replicas <= MAX_REPLICAS:
        raise usage(f"--replicas = {replicas}: it must be between 1 and {MAX_REPLICAS}")
    if replicas > 1 and args.plot is not None:
        raise usage(
            f"--plot with --replicas {replicas}: the plot draws one process's run; "
            "drop --plot, or run --replicas 1"
        )
    if args.trace is not None and args.workload not in (None, "trace"):
        raise usage(
            f"--trace {args.trace} with --workload {args.workload}: the trace would be "
            "ignored; drop one, or pass --workload trace"
        )
    check_output("--json", args.json)
    check_output("--plot", args.plot)
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
            raise usage(f"{' '.join(flags)}: {str(exc).removeprefix('<dict>: ')}") from None
    if replicas > 1 and not shared_tiers(config):
        raise usage(
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
        with request_bar(console, show) as bar:
            task = bar.add_task("stress", total=ops)
            report = runner.run(
                ops=ops,
                duration_s=duration,
                progress=lambda done, _t: bar.update(task, completed=done),
            )
    finally:
        runner.close()
    print_report(console, report)
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
    with request_bar(console, show) as bar:
        task = bar.add_task("stress", total=ops * replicas)
        report = run_replicas(
            config,
            replicas=replicas,
            ops=ops,
            duration_s=duration,
            seed=seed,
            progress=lambda done, _t: bar.update(task, completed=done),
        )
    print_replicas(console, report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        console.print(f"report written to {args.json}")
    return EXIT_FAILED if report.integrity_errors else EXIT_OK
