"""kvoffload.tools.bench.harness: timing, same-run ratios, JSON and the docs' table.

Every clock is a fake that steps by known amounts, so the figures are exact: nothing
here depends on how fast this machine is.
"""

from __future__ import annotations

import datetime as dt
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.tools.bench import harness
from kvoffload.tools.bench.harness import (
    Timing,
    best_seconds,
    fixed,
    gbps,
    markdown_table,
    print_figures,
    ratio,
    ratios,
    run_facts,
    save_report,
    strongest,
    timed,
    timed_result,
    timings,
    with_ratio,
    write_json,
)


class FakeClock:
    """A clock that advances only when a timed function says how long it took."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def work(self, seconds: float) -> Callable[[], None]:
        def fn() -> None:
            self.now += seconds

        return fn

    def steps(self, seconds: list[float]) -> Callable[[], None]:
        """A function whose successive calls take ``seconds`` in turn."""
        it: Iterator[float] = iter(seconds)

        def fn() -> None:
            self.now += next(it)

        return fn


def test_timed_counts_the_call_and_returns_its_result() -> None:
    clock = FakeClock()
    assert timed(clock.work(0.25), clock=clock) == 0.25
    assert clock.reads == 2

    def answer() -> int:
        clock.now += 1.5
        return 42

    assert timed_result(answer, clock=clock) == (1.5, 42)


def test_timings_interleave_warm_up_and_keep_every_round() -> None:
    clock = FakeClock()
    order: list[str] = []
    steps = {"copy": [9.0, 2.0, 1.0, 3.0], "gather": [9.0, 4.0, 5.0, 3.0]}

    def make(name: str) -> Callable[[], None]:
        step = clock.steps(steps[name])

        def fn() -> None:
            order.append(name)
            step()

        return fn

    got = timings({"copy": make("copy"), "gather": make("gather")}, 3, clock=clock)
    # One warm-up round (the 9 s calls, untimed), then three interleaved rounds.
    assert order == ["copy", "gather"] * 4
    assert got["copy"] == Timing((2.0, 1.0, 3.0))
    assert got["gather"] == Timing((4.0, 5.0, 3.0))
    assert got["copy"].best == 1.0
    assert got["copy"].median == 2.0
    assert got["gather"].median == 4.0


def test_best_seconds_without_warm_up_rounds_and_refusals() -> None:
    clock = FakeClock()
    assert best_seconds({"a": clock.steps([0.5, 0.75, 0.25, 0.5])}, 3, clock=clock) == {"a": 0.25}
    cold = timings({"a": clock.steps([0.5, 0.25])}, 2, warmup=False, clock=clock)
    assert cold["a"].seconds == (0.5, 0.25)
    with pytest.raises(ValueError, match="repeat = 0"):
        timings({"a": clock.work(1.0)}, 0, clock=clock)


def test_ratio_against_the_same_run_baseline() -> None:
    clock = FakeClock()
    nbytes = 4 * 10**9
    seconds = best_seconds(
        {"copy": clock.work(2.0), "gather": clock.work(2.5), "scatter": clock.work(4.0)},
        2,
        clock=clock,
    )
    figures = {name: gbps(nbytes, s) for name, s in seconds.items()}
    assert figures == {"copy": 2.0, "gather": 1.6, "scatter": 1.0}
    assert ratios(figures, "copy") == {"gather_ratio": 0.8, "scatter_ratio": 0.5}
    assert ratios(figures, "copy", suffix="_vs_copy") == {
        "gather_vs_copy": 0.8,
        "scatter_vs_copy": 0.5,
    }
    assert ratio(3.0, 4.0) == 0.75
    # A baseline not measured (or of zero) gives no ratio rather than infinity.
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None
    assert ratio(None, 4.0) is None
    assert gbps(10**9, 0.0) == 0.0


def test_strongest_baseline_is_the_highest_measured() -> None:
    raw = {"raw_1": 1.5, "raw_4": 2.5, "raw_8": None, "raw_16": 2.0}
    assert strongest(raw) == ("raw_4", 2.5)
    # Keyed by thread count, as raw_best keeps them; a tie goes to the first.
    assert strongest({1: 0.5, 4: 0.75, 8: 0.75, 16: None}) == (4, 0.75)
    with pytest.raises(ValueError, match="no baseline"):
        strongest({"raw_1": None})


def test_json_carries_the_command_date_and_machine(tmp_path: Path) -> None:
    when = dt.datetime(2026, 11, 27, 9, 30, 5, tzinfo=dt.UTC)
    facts = run_facts(["scripts/bench_x.py", "--json", "out dir/x.json"], now=when)
    assert facts["command"] == "scripts/bench_x.py --json 'out dir/x.json'"
    assert facts["date"] == "2026-11-27T09:30:05+00:00"
    machine = facts["machine"]
    assert set(machine) == {"cpu_count", "python", "torch", "platform"}
    assert machine == harness.machine()
    out = tmp_path / "sub" / "bench.json"
    write_json(out, {"copy_gbps": 2.0, "gather_ratio": 0.8}, facts=facts)
    text = out.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"copy_gbps": 2.0, "gather_ratio": 0.8, "run": facts}
    # Without facts the payload is written as it is: a list stays a list.
    write_json(out, [{"a": 1}], indent=1)
    assert out.read_text() == '[\n {\n  "a": 1\n }\n]\n'
    with pytest.raises(TypeError):
        write_json(out, [1], facts=facts)


def test_save_report_echoes_and_writes_only_what_was_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["scripts/bench_x.py", "--json", "x.json"])
    report = {"hit_ttft_ms": 12.5, "modes": {"on": 1}}
    save_report(None, report)
    assert capsys.readouterr().out == ""
    out = tmp_path / "x.json"
    save_report(out, report, echo=True)
    assert capsys.readouterr().out == json.dumps(report, indent=2) + "\n"
    written = json.loads(out.read_text())
    assert written["run"]["command"] == "scripts/bench_x.py --json x.json"
    assert {k: v for k, v in written.items() if k != "run"} == report


def test_print_figures() -> None:
    buf = io.StringIO()
    print_figures({"store_gbps": 1.234567, "blocks": 12, "why": None}, width=12, file=buf)
    assert buf.getvalue() == "store_gbps   1.235\nblocks       12\nwhy          None\n"


def test_markdown_table_as_the_docs_show_it() -> None:
    rows = [
        {"block": "64 KiB", "copy_gbps": 15.07, "gather_gbps": 11.97, "gather_ratio": 0.794},
        {"block": "2 MiB", "copy_gbps": 12.64, "gather_gbps": 10.32, "gather_ratio": None},
    ]
    table = markdown_table(
        [
            ("block", "block"),
            ("copy GB/s", fixed("copy_gbps")),
            ("gather", with_ratio("gather_gbps", "gather_ratio")),
            ("missing", fixed("nothing")),
        ],
        rows,
        left=0,
    )
    assert table.splitlines() == [
        "| block | copy GB/s | gather | missing |",
        "|---:|---:|---:|---:|",
        "| 64 KiB | 15.07 | 11.97 (0.79\N{MULTIPLICATION SIGN}) | - |",
        "| 2 MiB | 12.64 | 10.32 | - |",
    ]
    columns = [("codec", "codec"), ("ratio", fixed("ratio", 3))]
    named = markdown_table(columns, [{"codec": "lz4", "ratio": 0.5}])
    assert named.splitlines()[1] == "|---|---:|"
    assert named.splitlines()[2] == "| lz4 | 0.500 |"
