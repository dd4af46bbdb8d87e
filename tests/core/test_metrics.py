"""The tier metric schema (``kvoffload/metrics.py``) and every place that shows it.

Each tier counter is declared once, as a field of ``TierCounters``; the books' live
``TierStats``, the stress report (its table and ``--json``), the vLLM connector's stats
keys and Prometheus counters, and the docs' tables are derived from it. These tests
fail when one of them disagrees with the declaration: a counter missing from an
output, a help text that differs, a docs table gone stale, or prose naming a counter
that does not exist.

The docs tables sit between ``<!-- BEGIN tier-metrics TAG ... -->`` and
``<!-- END tier-metrics TAG -->``; run this file as a script to rewrite them from the
schema (``.venv/bin/python tests/core/test_metrics.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import threading
import typing
from collections.abc import Callable
from types import SimpleNamespace
from typing import Final

import pytest
from support.checkout import REPO

from kvoffload import books, offloader
from kvoffload.metrics import (
    TIER_DERIVED,
    TIER_HISTOGRAMS,
    TIER_IDENTITY,
    TIER_METRIC,
    TIER_METRICS,
    Metric,
    TierCounters,
    tier_values,
)

HAS_VLLM: Final = importlib.util.find_spec("vllm") is not None
TIER_SERIES_NAMES: Final = (
    *TIER_METRIC,
    *(h.name for h in TIER_HISTOGRAMS),
    *(d.name for d in TIER_DERIVED),
)
"""Every per-tier Prometheus metric after ``vllm:kvoffload_tier_``."""


def _sample_stats() -> books.TierStats:
    """A tier whose every counter holds a value of its own (1, 2, ...; floats for
    seconds), so an output that shows one counter under another's name is caught."""
    stats = books.TierStats("ssd", "mmap", 64, "write_through")
    for i, m in enumerate(TIER_METRICS, start=1):
        setattr(stats, m.name, m.type(i) + (0.5 if m.type is float else 0))
    stats.store_latency_s.extend([0.001, 0.002])
    stats.load_latency_s.append(0.003)
    return stats


# ------------------------------------------------------------------------ the schema
def test_every_counter_field_is_declared_with_its_type() -> None:
    hints = typing.get_type_hints(TierCounters)
    names = [f.name for f in dataclasses.fields(TierCounters)]
    assert names == [*TIER_IDENTITY, *TIER_METRIC]
    assert TIER_IDENTITY == ("name", "backend", "capacity_blocks", "write_policy")
    for m in TIER_METRICS:
        assert hints[m.name] is m.type, f"{m.name}: annotated {hints[m.name]}, unit {m.unit}"
        # Plain text, one sentence: it is Prometheus help and a docs table cell.
        assert re.fullmatch(r"[A-Z][^`*|\n]*\.", m.help), f"{m.name}: {m.help!r}"
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", m.name), m.name
    columns = [m.column for m in TIER_METRICS if m.column is not None]
    assert len(columns) == len(set(columns))


def test_tier_stats_are_the_declared_counters_plus_latency_samples() -> None:
    assert books.TierStats is offloader.TierStats
    assert issubclass(books.TierStats, TierCounters)
    own = [f.name for f in dataclasses.fields(books.TierStats)]
    assert own == [*TIER_IDENTITY, *TIER_METRIC, "store_latency_s", "load_latency_s"]
    stats = _sample_stats()
    assert tier_values(stats) == {m.name: getattr(stats, m.name) for m in TIER_METRICS}
    assert all(type(v) is TIER_METRIC[k].type for k, v in tier_values(stats).items())


def test_backend_counted_metrics_reach_the_stats_from_its_stats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The counters a backend keeps itself (``source="backend"``) are copied from its
    ``stats().counters`` whenever the stats are read; names it does not declare are not."""
    from kvoffload.backend import BackendStats
    from kvoffload.config import load_config
    from kvoffload.layout import KVLayout
    from kvoffload.metrics import BACKEND_METRICS

    assert {"round_trips", "server_errors"} <= BACKEND_METRICS
    assert all(TIER_METRIC[n].source == "backend" for n in BACKEND_METRICS)
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    config = load_config({"tiers": [{"name": "cpu", "capacity": 8 * layout.bytes_per_block}]})
    with offloader.Offloader(config, layout) as off:
        assert off.counters()[0]["cpu"]["round_trips"] == 0  # a local medium: none
        io = {"round_trips": 7, "server_errors": 2, "hits": 99, "bogus": 1}
        monkeypatch.setattr(off.tiers[0].backend, "stats", lambda **_: BackendStats(dict(io)))
        tiers, _ = off.counters()
        assert (tiers["cpu"]["round_trips"], tiers["cpu"]["server_errors"]) == (7, 2)
        assert tiers["cpu"]["hits"] == 0  # the books' counters are the books'
        io["round_trips"] = 9
        assert off.stats[0].round_trips == 9


# ------------------------------------------------------------------ stress report
def test_stress_report_and_its_json_carry_every_counter() -> None:
    from kvoffload.tools.stress import StressReport, TierReport

    stats = _sample_stats()
    tier = TierReport.from_stats(stats, 2.0)
    report = StressReport(seed=0, workload="zipf", concurrency=1, layout={}, bytes_per_block=1)
    report.tiers = [tier]
    (entry,) = report.to_json()["tiers"]
    for name in (*TIER_IDENTITY, *TIER_METRIC):
        assert entry[name] == getattr(stats, name), name
    derived = {"write_gbps", "read_gbps", "store_p50_ms", "store_p99_ms"}
    derived |= {"load_p50_ms", "load_p99_ms"}
    derived |= {"compression", "compression_ratio", "held_logical_bytes", "held_stored_bytes"}
    derived |= {"compress_gbps", "decompress_gbps", "blocks_per_gib"}
    assert set(entry) == {*TIER_IDENTITY, *TIER_METRIC, *derived}


def test_stress_table_has_the_declared_columns() -> None:
    from rich.console import Console

    from kvoffload.tools.cli import _print_report
    from kvoffload.tools.stress import StressReport, TierReport

    stats = _sample_stats()
    report = StressReport(seed=0, workload="zipf", concurrency=1, layout={}, bytes_per_block=1)
    report.tiers = [TierReport.from_stats(stats, 2.0)]
    console = Console(record=True, width=400)
    _print_report(console, report)
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "tier" in line and "backend" in line)
    row = next(line for line in lines if "ssd" in line and "mmap" in line)
    cells = [c.strip() for c in re.split(r"[│┃]", row)[1:-1]]
    heads = [c.strip() for c in re.split(r"[│┃]", header)[1:-1]]
    shown = {m.column: m for m in TIER_METRICS if m.column is not None}
    assert [h for h in heads if h in shown] == list(shown)
    for head, cell in zip(heads, cells, strict=True):
        if head in shown:
            assert cell == str(getattr(stats, shown[head].name)), head


# ------------------------------------------------------------------ vLLM connector
def test_connector_stats_and_prometheus_carry_every_counter() -> None:
    # A runtime skip, not a marker: under CI=true (vLLM installed) a skip fails.
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    from kvoffload.connectors.vllm import TIER_STATS, TieredOffloadPromMetrics
    from kvoffload.connectors.vllm.metrics import TIER_PROM_PREFIX
    from kvoffload.connectors.vllm.metrics import snapshot as take_snapshot
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload.plans import PrefetchStats

    assert {m.name: m.help for m in TIER_METRICS} == TIER_STATS
    stats = _sample_stats()
    shared = SimpleNamespace(
        lock=threading.Lock(),
        counters={},
        # Offloader.counters() as the real one builds it, from the sample tier's stats.
        offloader=SimpleNamespace(
            counters=lambda: ({stats.name: tier_values(stats)}, PrefetchStats()),
            stats=[stats],
            tiers=[],  # no tier to read what it holds: the stats' values stand
        ),
    )
    snapshot = take_snapshot(shared)  # type: ignore[arg-type]
    tier_keys = {k: v for k, v in snapshot.items() if k.startswith("tier.")}
    # The samples 0.001 and 0.002 (stores) and 0.003 (loads) fall in buckets 1, 2, 3.
    buckets = {
        "store_latency_seconds_n1": 1,
        "store_latency_seconds_s1": 0.001,
        "store_latency_seconds_n2": 1,
        "store_latency_seconds_s2": 0.002,
        "load_latency_seconds_n3": 1,
        "load_latency_seconds_s3": 0.003,
    }
    assert tier_keys == {
        **{f"tier.ssd.{m.name}": getattr(stats, m.name) for m in TIER_METRICS},
        **{f"tier.ssd.{k}": v for k, v in buckets.items()},
    }

    registry = CollectorRegistry()  # not the global one: vLLM calls the classes
    types = {c: functools.partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # no tiers known up front
    prom = TieredOffloadPromMetrics(vllm_config, types, ["engine"], {0: ["0"]})
    prom.observe(snapshot, engine_idx=0)
    helps = {m.name: m.documentation for m in registry.collect()}
    labels = {"engine": "0", "tier": "ssd"}
    for m in TIER_METRICS:
        series = f"{TIER_PROM_PREFIX}{m.name}"
        assert helps[series] == m.help
        sample = f"{series}_total" if m.kind == "counter" else series
        assert registry.get_sample_value(sample, labels) == getattr(stats, m.name), series
    for h in TIER_HISTOGRAMS:
        assert helps[f"{TIER_PROM_PREFIX}{h.name}"] == h.help
    # Each sample in its own bucket, and the sums exact (the bucket's mean observed).
    store = f"{TIER_PROM_PREFIX}store_latency_seconds"
    le = {"0.0005": 0, "0.001": 1, "0.0025": 2, "10.0": 2, "+Inf": 2}
    for bound, count in le.items():
        assert registry.get_sample_value(f"{store}_bucket", {**labels, "le": bound}) == count
    assert registry.get_sample_value(f"{store}_sum", labels) == pytest.approx(0.003)
    load = f"{TIER_PROM_PREFIX}load_latency_seconds"
    assert registry.get_sample_value(f"{load}_bucket", {**labels, "le": "0.0025"}) == 0
    assert registry.get_sample_value(f"{load}_bucket", {**labels, "le": "0.005"}) == 1
    assert registry.get_sample_value(f"{load}_sum", labels) == pytest.approx(0.003)
    tier_series = {n for n in helps if n.startswith(TIER_PROM_PREFIX)}
    assert tier_series == {f"{TIER_PROM_PREFIX}{n}" for n in TIER_SERIES_NAMES}


# ---------------------------------------------------------------------------- docs
BEGIN: Final = (
    "<!-- BEGIN tier-metrics {tag}: generated from kvoffload/metrics.py"
    " by tests/core/test_metrics.py -->"
)
END: Final = "<!-- END tier-metrics {tag} -->"


def _cell(m: Metric) -> str:
    return m.help.replace("|", "\\|")


def stress_table() -> str:
    """docs/config.md: the counters of each ``tiers[]`` object of the stress report."""
    rows = [f"| `{m.name}` | {m.unit} | {_cell(m)} |" for m in TIER_METRICS]
    return "\n".join(["| Counter | Unit | Meaning |", "|---|---|---|", *rows])


def vllm_table() -> str:
    """docs/vllm.md: the connector's per-tier keys and their Prometheus counters."""
    from kvoffload.connectors.vllm.metrics import TIER_PROM_PREFIX

    suffix = {"counter": "_total", "gauge": ""}
    rows = [
        f"| `{m.name}` | `{TIER_PROM_PREFIX}{m.name}{suffix[m.kind]}` | {m.unit} | {_cell(m)} |"
        for m in TIER_METRICS
    ]
    head = ["| counter | Prometheus | unit | what |", "| --- | --- | --- | --- |"]
    return "\n".join([*head, *rows])


DOCS: Final[dict[str, tuple[str, Callable[[], str]]]] = {
    "docs/config.md": ("stress", stress_table),
    "docs/vllm.md": ("vllm", vllm_table),
}
"""Docs file -> (marker tag, what belongs between its markers)."""


def _span(text: str, tag: str) -> tuple[int, int]:
    """Where the generated block of ``tag`` starts and ends (between the markers)."""
    begin, end = BEGIN.format(tag=tag), END.format(tag=tag)
    assert text.count(begin) == 1, f"marker {begin!r} missing or repeated"
    assert text.count(end) == 1, f"marker {end!r} missing or repeated"
    start = text.index(begin) + len(begin) + 1
    stop = text.index(end)
    assert start <= stop
    return start, stop


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_docs_tables_are_generated_from_the_schema(doc: str) -> None:
    tag, render = DOCS[doc]
    if tag == "vllm" and not HAS_VLLM:
        pytest.skip("vLLM is not installed: its Prometheus names come from the connector")
    text = (REPO / doc).read_text(encoding="utf-8")
    start, stop = _span(text, tag)
    assert text[start:stop] == render() + "\n", (
        f"{doc}: the tier metrics table is stale; run `.venv/bin/python tests/core/test_metrics.py`"
    )


TIER_KEY: Final = re.compile(r"\btier\.(?:<name>|[A-Za-z0-9_-]+)\.([a-z_]+)\b")
"""A connector stats key in prose: ``tier.<name>.corrupt_blocks``, ``tier.ssd.hits``."""
TIER_SERIES: Final = re.compile(r"kvoffload_tier_([a-z_]+?)(?:_total|_bucket|_sum|_count)?\b")
"""A Prometheus tier series in prose (a histogram's too)."""


def test_docs_name_only_declared_counters() -> None:
    """Prose outside the generated tables names counters too; each must exist."""
    unknown: list[str] = []
    for path in sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")]):
        text = path.read_text(encoding="utf-8")
        for pattern, known in ((TIER_KEY, TIER_METRIC), (TIER_SERIES, TIER_SERIES_NAMES)):
            for match in pattern.finditer(text):
                if match.group(1) not in known:
                    line = text.count("\n", 0, match.start()) + 1
                    unknown.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)}")
    assert not unknown, "counters the schema does not declare:\n" + "\n".join(unknown)


def write_docs() -> None:
    """Rewrite the generated tables of :data:`DOCS` from the schema."""
    for doc, (tag, render) in DOCS.items():
        path = REPO / doc
        text = path.read_text(encoding="utf-8")
        start, stop = _span(text, tag)
        new = text[:start] + render() + "\n" + text[stop:]
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote the tier metrics table of {doc}")


if __name__ == "__main__":
    write_docs()
