"""What every benchmark repeats: timing, the same-run baseline's ratio, JSON and tables.

The project's rule is that a speed is never printed alone: it is a ratio against the
strongest baseline measured *in the same run*, since this machine drifts by 2x from
minute to minute and an absolute GB/s from another day says nothing. So a benchmark
here times its baseline and its candidates with :func:`timings` (interleaved rounds, so
a slow spell hits every side alike), turns seconds into :func:`gbps`, divides by the
baseline with :func:`ratio` / :func:`ratios`, writes the figures with
:func:`write_json` (the command, the date and the machine's facts beside them, so a
figure in ``docs/benchmarks.md`` can be traced back; :func:`save_report` is a script's
``--json`` end of run) and the docs' row with
:func:`markdown_table`. Every clock is injectable, so the tests check exact values.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final, TypeVar

Clock = Callable[[], float]
"""Seconds from an arbitrary origin: :func:`time.perf_counter`, or a fake in tests."""

RATIO_SUFFIX: Final = "_ratio"
TIMES: Final = "\N{MULTIPLICATION SIGN}"
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Timing:
    """Every timed round of one function, in seconds.

    ``best`` is what the benchmarks report: on a shared machine noise only ever adds
    time. ``median`` is there for the ones that measure a latency users see."""

    seconds: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def timed_result(fn: Callable[[], T], *, clock: Clock = time.perf_counter) -> tuple[float, T]:
    """Seconds one call of ``fn`` takes, and what it returned (to check it moved the
    right bytes: a figure of wrong results is worth nothing)."""
    start = clock()
    result = fn()
    return clock() - start, result


def timed(fn: Callable[[], object], *, clock: Clock = time.perf_counter) -> float:
    """Seconds one call of ``fn`` takes."""
    return timed_result(fn, clock=clock)[0]


def timings(
    fns: Mapping[str, Callable[[], object]],
    repeat: int,
    *,
    warmup: bool = True,
    clock: Clock = time.perf_counter,
) -> dict[str, Timing]:
    """Each function timed ``repeat`` times, after one untimed warm-up round (first
    touch of pages, the allocator); the rounds interleave the functions, in order."""
    if repeat < 1:
        raise ValueError(f"repeat = {repeat}: at least one round")
    if warmup:
        for fn in fns.values():
            fn()
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            rounds[name].append(timed(fn, clock=clock))
    return {name: Timing(tuple(s)) for name, s in rounds.items()}


def best_seconds(
    fns: Mapping[str, Callable[[], object]], repeat: int, *, clock: Clock = time.perf_counter
) -> dict[str, float]:
    """Best wall time of each function over ``repeat`` interleaved rounds, after one
    warm-up round (:func:`timings`)."""
    return {name: t.best for name, t in timings(fns, repeat, clock=clock).items()}


def gbps(nbytes: int, seconds: float) -> float:
    """Gigabytes (10**9 bytes) per second; 0 for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, or ``None`` where either side was not measured (or the
    baseline is 0): a missing baseline must print as missing, not as infinity."""
    if value is None or not baseline:
        return None
    return value / baseline


def ratios(
    figures: Mapping[str, float], baseline: str, *, suffix: str = RATIO_SUFFIX
) -> dict[str, float | None]:
    """Every figure but the baseline over the baseline, keyed ``<name><suffix>``."""
    base = figures[baseline]
    return {f"{k}{suffix}": ratio(v, base) for k, v in figures.items() if k != baseline}


def strongest(figures: Mapping[K, float | None]) -> tuple[K, float]:
    """The name and value of the highest measured figure (a throughput): the baseline
    to divide by when several were measured (raw at several thread counts, say)."""
    measured = {k: v for k, v in figures.items() if v is not None}
    if not measured:
        raise ValueError("no baseline was measured")
    name = max(measured, key=lambda k: measured[k])
    return name, measured[name]


# ---------------------------------------------------------------------------- report
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The facts a figure depends on: cores, Python, torch (without importing it)."""
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "platform": platform.platform(),
    }


def run_facts(
    argv: Sequence[str] | None = None, *, now: dt.datetime | None = None
) -> dict[str, Any]:
    """The command that produced a result, when, and on what machine."""
    when = now if now is not None else dt.datetime.now(dt.UTC)
    return {
        "command": shlex.join(sys.argv if argv is None else argv),
        "date": when.isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_json(
    path: str | os.PathLike[str],
    payload: Any,
    *,
    facts: Mapping[str, Any] | None = None,
    indent: int = 2,
) -> None:
    """``payload`` as JSON with a final newline; a dict gets ``facts`` (see
    :func:`run_facts`) under ``"run"`` when given. The parent directory is made."""
    if facts is not None:
        if not isinstance(payload, Mapping):
            raise TypeError("facts go into a dict payload")
        payload = {**payload, "run": dict(facts)}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent) + "\n")


def save_report(
    path: str | os.PathLike[str] | None, report: Mapping[str, Any], *, echo: bool = False
) -> None:
    """The end of a benchmark's run: with ``echo``, ``report`` as indented JSON on
    stdout (what the long-running ones leave in their log); then, when ``--json`` named
    a ``path``, the report there with the run's facts (:func:`run_facts`)."""
    if echo:
        print(json.dumps(report, indent=2))
    if path:
        write_json(path, report, facts=run_facts())


def print_figures(result: Mapping[str, Any], *, width: int = 28, file: Any = None) -> None:
    """One ``name value`` line per figure, floats to 4 significant digits."""
    for key, value in result.items():
        text = f"{value:.4g}" if isinstance(value, float) else f"{value}"
        print(f"{key:{width}s} {text}", file=file)


# ----------------------------------------------------------------------------- table
Cell = str | Callable[[Mapping[str, Any]], str]
"""A column's cell: a key of the row (its value printed with ``str``), or a function
of the row (for a figure with its ratio, see :func:`with_ratio`)."""


def with_ratio(value_key: str, ratio_key: str, *, digits: int = 2) -> Cell:
    """A cell of a figure then, in brackets, its ratio to the same-run baseline and a
    multiplication sign (``12.84 (0.89x)``), as the tables of
    ``docs/benchmarks.md`` show them."""

    def cell(row: Mapping[str, Any]) -> str:
        r = row.get(ratio_key)
        tail = f" ({r:.{digits}f}{TIMES})" if r is not None else ""
        return f"{row[value_key]:.{digits}f}{tail}"

    return cell


def fixed(key: str, digits: int = 2) -> Cell:
    """A cell of a float with ``digits`` decimals (``-`` where not measured)."""

    def cell(row: Mapping[str, Any]) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return cell


def markdown_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(
    columns: Sequence[tuple[str, Cell]],
    rows: Iterable[Mapping[str, Any]],
    *,
    left: int = 1,
) -> str:
    """A Markdown table as ``docs/benchmarks.md`` has them: the first ``left`` columns
    left-aligned (names), the rest right-aligned (figures)."""
    align = ["---" if i < left else "---:" for i in range(len(columns))]
    lines = [markdown_row(h for h, _ in columns), "|" + "|".join(align) + "|"]
    for row in rows:
        cells = [c(row) if callable(c) else str(row[c]) for _, c in columns]
        lines.append(markdown_row(cells))
    return "\n".join(lines)
