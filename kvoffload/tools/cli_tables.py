"""What ``kvoffload stress`` prints: the per-tier, compression and summary tables of
a run, the per-replica tables of ``--replicas``, and the progress bar (rich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.metrics import TIER_METRICS
from kvoffload.sizes import format_size

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from kvoffload.tools.stress import ReplicaSetReport, StressReport


def _ms(value: float | None, digits: int | None = None) -> str:
    """Milliseconds: fixed 3 decimals, or ``digits`` significant ones for narrow cells."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if digits else f"{value:.3f}"


def _count(value: object) -> str:
    """A counter's table cell: ints as they are, seconds to the millisecond."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def print_report(console: Console, report: StressReport) -> None:
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
    print_compression(console, report)
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


def print_compression(console: Console, report: StressReport) -> None:
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


def print_replicas(console: Console, report: ReplicaSetReport) -> None:
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


def request_bar(console: Console, show: bool) -> Progress:
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
