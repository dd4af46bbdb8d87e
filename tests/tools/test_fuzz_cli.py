"""Hostile ``kvoffload`` command lines, generated: unknown flags, known flags with bad
values (zero, negative, huge, non-numeric, NaN, bad choices, unreadable or unwritable
paths, empty, unicode and very long strings), missing values, missing or unknown
subcommands, missing or extra positional arguments.

Every generated command line holds exactly one bad element among valid ones, so it can
never start a run; each must exit 2 with exactly one line on stderr that names the bad
flag, value or file, print nothing on stdout, and leave the file system as it was (the
config's tiers are never created). 1,000 cases, run in-process through
:func:`kvoffload.tools.cli.main`; a few real processes check that the console script
gives the very same result.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from support.checkout import KVOFFLOAD

from kvoffload.layout import DTYPE_NAMES
from kvoffload.lookup import FP8_CACHES, HASH_ALGOS
from kvoffload.sizes import parse_size
from kvoffload.tools.cli import _parser, main

CASES = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ------------------------------------------------------------------------- the files
@dataclass(frozen=True)
class Files:
    """What the CLI may see: all under ``root``; it runs in the empty ``cwd``."""

    root: Path
    cwd: Path
    config: Path
    """Valid; its two disk tiers (``tiers``) must never come to exist."""
    tiers: tuple[Path, ...]
    garbage: Path
    bad_yaml: Path
    bad_schema: Path
    empty: Path
    trace: Path
    """A valid one-request trace."""
    snapshot: Path
    """A valid (empty) snapshot of the config's stress layout."""
    dirs: tuple[Path, ...]
    tree: frozenset[str]
    """Every path under ``root`` at the start: what a refused command leaves."""


def _make_files(root: Path) -> Files:
    cwd = root / "cwd"
    cwd.mkdir()
    (root / "dir").mkdir()
    tiers = (root / "tier-mmap", root / "tier-lmdb")
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}
    config = root / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"name": "cpu", "backend": "cpu", "capacity": "1MiB"},
                    {"name": "disk", "backend": "mmap", "path": str(tiers[0]), "capacity": "4MiB"},
                    {"name": "db", "backend": "lmdb", "path": str(tiers[1]), "capacity": "4MiB"},
                ],
                "stress": {
                    "layout": layout,
                    "pool_blocks": 64,
                    "prefixes": 12,
                    "prefix_blocks": 8,
                    "suffix_blocks": 2,
                },
            }
        )
    )
    garbage = root / "garbage.bin"
    garbage.write_bytes(b"\x00\xff\xfe garbage {[\n\x80")
    bad_yaml = root / "bad.yaml"
    bad_yaml.write_text("tiers: [\n  - {name: a\n")
    bad_schema = root / "schema.yaml"
    bad_schema.write_text("tiers:\n  - name: cpu\n    backend: cpu\n    capacity: -5\n")
    empty = root / "empty"
    empty.write_bytes(b"")
    trace = root / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "hash_ids": [1, 2, 3]}) + "\n")
    snapshot = root / "snap.safetensors"
    snapshot.write_bytes(_empty_snapshot(layout))
    return Files(
        root=root,
        cwd=cwd,
        config=config,
        tiers=tiers,
        garbage=garbage,
        bad_yaml=bad_yaml,
        bad_schema=bad_schema,
        empty=empty,
        trace=trace,
        snapshot=snapshot,
        dirs=(root, cwd, root / "dir"),
        tree=_tree(root),
    )


def _empty_snapshot(layout: dict[str, int]) -> bytes:
    import torch
    from safetensors.torch import save

    from kvoffload.layout import KVLayout
    from kvoffload.tools.maintenance import SNAPSHOT_FORMAT

    kv = KVLayout(**layout, namespace="kvoffload-stress")
    meta = {
        "format": SNAPSHOT_FORMAT,
        "layout": json.dumps(kv.to_dict()),
        "fingerprint": kv.fingerprint.hex(),
    }
    tensors = {
        "blocks": torch.zeros((0, kv.bytes_per_block), dtype=torch.uint8),
        "keys": torch.zeros((0, 64), dtype=torch.uint8),
        "key_lens": torch.zeros((0,), dtype=torch.int16),
    }
    return save(tensors, meta)


def _tree(root: Path) -> frozenset[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return frozenset(found)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Files:
    """The files, the CLI run from the empty ``cwd`` with no ``KVOFFLOAD_*`` variable
    but ``KVOFFLOAD_CONFIG`` (so a command without ``--config`` also names the tiers)."""
    f = _make_files(tmp_path)
    for var in list(os.environ):
        if var.startswith("KVOFFLOAD_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("KVOFFLOAD_CONFIG", str(f.config))
    monkeypatch.chdir(f.cwd)
    return f


# ----------------------------------------------------------------- running the CLI
@dataclass
class Result:
    code: object
    out: str
    err: str


def run_cli(argv: list[str]) -> Result:
    """``kvoffload ARGV`` in this process: exit code (argparse exits, the commands
    return), stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: object = main(argv)
        except SystemExit as exc:
            code = exc.code
    return Result(code, out.getvalue(), err.getvalue())


def shown(text: str) -> str:
    """``text`` as the CLI prints it: unprintable characters escaped (one line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def assert_refused(result: Result, names: tuple[str, ...]) -> str:
    """Exit 2, nothing on stdout, one line on stderr naming one of ``names``."""
    err = result.err
    assert result.code == 2, (result.code, err, result.out)
    assert result.out == "", result.out
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert err.endswith("\n"), err
    line = lines[0]
    assert line.startswith("kvoffload"), line
    assert ": error: " in line, line
    assert line.split(": error: ", 1)[1].strip(), line
    assert any(name in line for name in names), (names, line)
    return line


# ------------------------------------------------------------------- the strategies
_ARG_CHARS = st.characters(blacklist_characters="\x00")  # argv cannot hold a NUL
WEIRD = [
    *["", " ", "-", "+", ".", "..", "/", "~", "*", "'", '"', "\\", "%s", "{}", "$HOME"],
    *["nan", "NaN", "-nan", "inf", "-inf", "1e999", "1e-400", "0x1f", "1_000", "0.0", "-0"],
    *["\u0661\u0662", "\u00bd", "\u00fcn\u00efc\u00f8d\u00e9", "\U0001f642", "\udcff"],
    *["a\nb", "\r", "\t", "\x1b[31m", "\u2028", "\x85", "line\n"],
]
"""Values a fuzzer should always try: empty, signs, NaN/infinity, unicode digits, a
lone surrogate (an undecodable byte of a real argv), line breaks, escape codes."""
junk = st.one_of(
    st.sampled_from(WEIRD),
    st.text(_ARG_CHARS, max_size=30),
    st.integers(300, 6000).map(lambda n: "\u00e9" * n),  # past NAME_MAX as a file name
    st.integers(4301, 6000).map(lambda n: "9" * n),  # past int()'s digit limit
)


def _int_ok(text: str, lo: int | None = None, hi: int | None = None) -> bool:
    try:
        value = int(text)  # what argparse's type=int does
    except ValueError:
        return False
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def _float_ok_positive(text: str) -> bool:
    try:
        return float(text) > 0  # NaN is not
    except ValueError:
        return False


def bad_int(lo: int | None = None, hi: int | None = None) -> st.SearchStrategy[str]:
    ranges = [junk]
    if lo is not None:
        ranges.append(st.integers(max_value=lo - 1).map(str))
    if hi is not None:
        ranges.append(st.integers(min_value=hi + 1).map(str))
    return st.one_of(ranges).filter(lambda s: not _int_ok(s, lo, hi))


def _sizes_ok(text: str) -> bool:
    try:
        return all(parse_size(s) % 4096 == 0 for s in text.split(","))
    except ValueError:
        return False


def _total_ok(text: str) -> bool:
    # valid beside any --sizes filler (the largest of each is at least 64 KiB)
    try:
        total = parse_size(text)
    except ValueError:
        return False
    return total >= 64 * 1024 and 2 * total <= MEMORY


@dataclass(frozen=True)
class Flag:
    name: str
    good: st.SearchStrategy[str] | None
    """Valid values (``None``: never a filler); a switch has ``switch=True``."""
    bad: st.SearchStrategy[str] | None = None
    """Values that must be refused, whatever the valid fillers beside them."""
    switch: bool = False
    clashes: tuple[str, ...] = ()
    """Flags that, as fillers beside a bad value of this one, would be an error too."""


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    flags: tuple[Flag, ...] = ()
    positional: tuple[str, st.SearchStrategy[str], st.SearchStrategy[str]] | None = None
    """(dest, valid values, values that must be refused)."""


def _existing(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return False


@cache
def commands(f: Files) -> tuple[Command, ...]:
    """Every leaf command with its flags, valid values and bad values, for ``f``."""
    dirs = [str(d) for d in f.dirs] + [".", "..", "/", ""]
    relative_junk = junk.filter(lambda s: s != "" and not _existing(f.cwd / s))

    def unreadable(*files: Path) -> st.SearchStrategy[str]:
        """Paths that cannot be read as the input in question: missing, a directory,
        a file of the wrong kind, below a file, or junk naming nothing."""
        named = [str(p) for p in files] + [
            str(f.root / "missing.yaml"),
            str(f.root / "missing" / "x"),
            str(f.garbage / "x"),
            str(f.root / "no\nsuch"),
        ]
        return st.one_of(st.sampled_from(named + dirs), relative_junk)

    unwritable = st.one_of(
        st.sampled_from([*dirs[:-1], str(f.garbage / "x"), str(f.config / "sub" / "r.json")]),
        st.integers(300, 2000).map(lambda n: "\u00e9" * n),  # one component past NAME_MAX
    )
    out = st.sampled_from([str(f.cwd / "out.json"), "report.json", str(f.root / "new" / "r")])
    config = Flag(
        "--config", st.just(str(f.config)), unreadable(f.garbage, f.bad_yaml, f.bad_schema, f.trace)
    )
    inputs_config = unreadable(f.garbage, f.bad_yaml, f.bad_schema, f.trace)
    bad_choice = lambda choices: junk.filter(lambda s: s not in choices)  # noqa: E731
    bench_sizes = st.one_of(
        st.sampled_from(["0", "100", "4097", "1.5KiB", "16KiB,", ",", "16KiB,,64KiB", "1TiB"]),
        junk,
    ).filter(lambda s: s == "1TiB" or not _sizes_ok(s))
    tier = Flag("--tier", st.sampled_from(["disk", "db"]), bad_choice({"disk", "db"}))
    return (
        Command(("config", "validate"), positional=("file", st.just(str(f.config)), inputs_config)),
        Command(("config", "schema")),
        Command(("backends",)),
        Command(
            ("stress",),
            (
                config,
                Flag("--ops", st.integers(1, 10**6).map(str), bad_int(1)),
                Flag(
                    "--duration",
                    st.sampled_from(["0.5", "inf", "1e9"]),
                    st.one_of(
                        st.sampled_from(["0", "-1", "-0.0", "nan", "NaN", "1e-400"]),
                        st.floats(max_value=0).map(repr),
                        junk,
                    ).filter(lambda s: not _float_ok_positive(s)),
                ),
                Flag("--seed", st.integers().map(str), bad_int()),
                Flag("--json", out, unwritable),
                Flag("--no-progress", None, switch=True),
                Flag(
                    "--workload",
                    st.sampled_from(["zipf", "scan", "multiturn"]),
                    bad_choice({"zipf", "multiturn", "scan", "trace"}),
                ),
                Flag(
                    "--trace",
                    None,
                    unreadable(f.garbage, f.bad_yaml, f.config, f.empty),
                    clashes=("--workload",),
                ),
                Flag("--concurrency", st.integers(1, 1024).map(str), bad_int(1, 1024)),
                Flag(
                    "--preset",
                    st.sampled_from(["tiny", "small", "qwen2.5-0.5b", "llama3-8b"]),
                    bad_choice({"tiny", "small", "qwen2.5-0.5b", "llama3-8b"}),
                ),
                Flag("--plot", None, unwritable),
            ),
        ),
        Command(("inspect",), (config, Flag("--json", out, unwritable))),
        Command(
            ("verify",),
            (config, Flag("--repair", None, switch=True), Flag("--json", out, unwritable)),
        ),
        Command(
            ("bench",),
            (
                config,
                Flag("--json", out, unwritable),
                Flag(
                    "--total",
                    st.sampled_from(["2MiB", "64MiB"]),
                    st.one_of(st.sampled_from(["0", "1", "1KiB", "16KiB", "1000TiB"]), junk).filter(
                        lambda s: not _total_ok(s)
                    ),
                ),
                Flag("--reps", st.integers(1, 5).map(str), bad_int(1)),
                Flag("--sizes", st.sampled_from(["16KiB,64KiB", "2MiB"]), bench_sizes),
                Flag("--skip-disk", None, switch=True),
                Flag(
                    "--trace",
                    st.just(str(f.trace)),
                    unreadable(f.garbage, f.bad_yaml, f.config, f.empty),
                ),
            ),
        ),
        Command(
            ("lookup",),
            (
                config,
                Flag("--prompts", None, unreadable(f.garbage, f.bad_yaml, f.config, f.empty)),
                Flag("--block-size", st.sampled_from(["16", "32"]), bad_int(1)),
                Flag("--hash-algo", st.just("sha256"), bad_choice(set(HASH_ALGOS))),
                Flag("--hash-seed", st.sampled_from(["0", "42", "random"])),
                Flag(
                    "--fingerprint",
                    None,
                    st.one_of(st.sampled_from(["ab", "zz" * 16, "0" * 31, "0" * 32 + ","]), junk),
                ),
                Flag("--model-id", st.just("m@main"), st.sampled_from(["", "a\nb", "\x85"])),
                *(
                    Flag(name, st.integers(1, 64).map(str), bad_int(1))
                    for name in ("--num-layers", "--num-kv-heads", "--head-dim")
                ),
                Flag("--tensor-parallel-size", st.sampled_from(["1", "2"]), bad_int(1)),
                Flag("--dtype", st.just("float16"), bad_choice(set(DTYPE_NAMES))),
                Flag("--cache-dtype", st.just("fp8"), bad_choice({"auto", "fp8", *FP8_CACHES})),
                Flag("--mla", None, switch=True),
                Flag("--json", out, unwritable),
            ),
        ),
        Command(
            ("snapshot", "export"),
            (config, tier),
            positional=("out", st.just(str(f.cwd / "snap.safetensors")), unwritable),
        ),
        Command(
            ("snapshot", "import"),
            (config, tier),
            positional=(
                "src",
                st.just(str(f.snapshot)),
                unreadable(f.garbage, f.empty, f.config, f.trace),
            ),
        ),
    )


def _known_options() -> frozenset[str]:
    """Every option string of every parser: an unknown flag must not abbreviate one."""
    import argparse

    found: set[str] = set()
    todo = [_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            found.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return frozenset(found)


KNOWN = _known_options()


def _unknown(flag: str) -> bool:
    option = flag.split("=", 1)[0]
    if option == "--" or option.startswith("-h") or " " in flag:
        return False  # "--" ends the options; -h is help; a space makes it a positional
    return not any(known.startswith(option) for known in KNOWN if known.startswith("--"))


_NAME = st.text(st.characters(blacklist_characters="\x00 =-"), min_size=1, max_size=20)
unknown_flags = st.one_of(
    st.sampled_from(["--bogus", "--ops2", "--config-file", "--JSON", "--\u00fcber", "--x\ny"]),
    _NAME.map(lambda s: "--" + s),
    st.tuples(_NAME, st.text(_ARG_CHARS, max_size=10)).map(lambda t: f"--{t[0]}={t[1]}"),
    st.tuples(st.sampled_from("abcdefgijklmnopqrstuwxyzABZ"), st.text(_ARG_CHARS, max_size=5)).map(
        lambda t: "-" + t[0] + t[1]
    ),
    st.integers(300, 3000).map(lambda n: "--" + "x" * n),
).filter(_unknown)
extra_args = st.one_of(st.sampled_from(WEIRD), st.text(_ARG_CHARS, max_size=30)).filter(
    lambda s: not s.startswith("-")
)
VERBOSE = st.lists(st.sampled_from([["-v"], ["-vv"], ["--verbose"]]), max_size=1)


@dataclass
class Case:
    kind: str
    argv: list[str]
    names: tuple[str, ...]
    """The line must hold one of these: the bad flag, value or file as printed."""


def _path_names(flag: str, value: str) -> tuple[str, ...]:
    """A bad path is named as ``PATH:`` (the file's own error), or the flag is."""
    names = (f" {shown(str(Path(value)))}:", f"argument {flag}:")
    return (*names, f"{flag} ") if flag.startswith("-") else names


@st.composite
def leaf_cases(draw: st.DrawFn, cmd: Command) -> Case:
    valued = [fl for fl in cmd.flags if fl.bad is not None]
    kinds = ["unknown flag", "unknown flag first", "extra argument"]
    if valued:  # bad values weigh most: there are many flags and many ways to be bad
        kinds += ["bad value"] * max(3, len(valued) // 2) + ["missing value"]
    if any(fl.switch for fl in cmd.flags):
        kinds.append("switch with a value")
    if cmd.positional is not None:
        kinds += ["bad positional"] * 3 + ["missing positional"]
    kind = draw(st.sampled_from(kinds))
    head: list[str] = []  # before the command words
    bad: list[str] = []  # a unit among the fillers
    tail: list[str] = []  # after everything
    taken: set[str] = set()
    positional = cmd.positional is not None
    if kind.startswith("unknown flag"):
        flag = draw(unknown_flags)
        (head if kind == "unknown flag first" else bad).append(flag)
        names: tuple[str, ...] = (f"unrecognized arguments: {flag!r}",)
    elif kind == "extra argument":
        extra = draw(extra_args)
        bad.append(extra)
        names = (f"unrecognized arguments: {extra!r}",)
    elif kind == "switch with a value":
        sw = draw(st.sampled_from([fl for fl in cmd.flags if fl.switch]))
        value = draw(st.text(_ARG_CHARS, max_size=10))
        bad.append(f"{sw.name}={value}")
        taken.add(sw.name)
        names = (f"argument {sw.name}:",)
    elif kind == "missing value":
        fl = draw(st.sampled_from(valued))
        tail.append(fl.name)
        taken.add(fl.name)
        names = (f"argument {fl.name}: expected one argument",)
    elif kind == "bad value":
        fl = draw(st.sampled_from(valued))
        assert fl.bad is not None
        value = draw(fl.bad)
        if draw(st.booleans()):
            bad += [fl.name, value]
        else:
            bad.append(f"{fl.name}={value}")
        taken.update((fl.name, *fl.clashes))
        names = (fl.name, *_path_names(fl.name, value))
    else:
        assert cmd.positional is not None
        dest, _, bad_values = cmd.positional
        positional = False
        if kind == "bad positional":
            value = draw(bad_values)
            bad.append(value)
            names = _path_names(dest, value)
            if value.startswith("-"):  # taken for an option: the positional is missing
                names = (*names, f"the following arguments are required: {dest}")
        else:
            names = (f"the following arguments are required: {dest}",)
    units: list[list[str]] = [bad] if bad else []
    fillers = st.lists(st.sampled_from(cmd.flags), unique=True) if cmd.flags else st.just([])
    for fl in draw(fillers):
        if fl.name in taken or (fl.good is None and not fl.switch):
            continue
        if fl.switch:
            units.append([fl.name])
            continue
        assert fl.good is not None
        value = draw(fl.good)
        units.append([fl.name, value] if draw(st.booleans()) else [f"{fl.name}={value}"])
    if positional:
        assert cmd.positional is not None
        dest, good_values, _ = cmd.positional
        good = draw(good_values)
        units.append([good])
        if kind == "extra argument":  # the extra one may take the positional's place
            names = (*names, f"unrecognized arguments: {good!r}", *_path_names(dest, extra))
    units = draw(st.permutations(units))
    argv = [*head, *cmd.words]
    for unit in units:
        argv += unit
    return Case(f"{' '.join(cmd.words)}: {kind}", argv + tail, names)


@st.composite
def group_cases(draw: st.DrawFn) -> Case:
    """A missing or unknown (sub)command."""
    group = draw(st.sampled_from([(), ("config",), ("snapshot",)]))
    dest = {(): "command", ("config",): "config_command", ("snapshot",): "snapshot_command"}
    choices = {
        (): {"config", "backends", "stress", "inspect", "verify", "bench", "snapshot", "lookup"},
        ("config",): {"validate", "schema"},
        ("snapshot",): {"export", "import"},
    }[group]
    argv = [*group]
    if draw(st.booleans()):
        word = draw(extra_args.filter(lambda s: s not in choices))
        names: tuple[str, ...] = (f"invalid choice: {word!r}",)
        argv.append(word)
        kind = "unknown command"
    else:
        names = (f"the following arguments are required: {dest[group]}",)
        if draw(st.booleans()):
            argv.append(draw(unknown_flags))
        kind = "missing command"
    return Case(f"{' '.join(group) or 'kvoffload'}: {kind}", argv, names)


@cache
def all_cases(f: Files) -> st.SearchStrategy[Case]:
    return st.one_of(group_cases(), *(leaf_cases(cmd) for cmd in commands(f)))


@pytest.mark.slow
# ------------------------------------------------------------------------- the tests
@CASES
@given(data=st.data())
def test_hostile_command_lines_exit_2_with_one_line(files: Files, data: st.DataObject) -> None:
    case = data.draw(all_cases(files), label="case")
    verbose = data.draw(VERBOSE, label="verbose")
    argv = [*(verbose[0] if verbose else []), *case.argv]
    event(case.kind)
    note(f"argv = {argv!r}")
    result = run_cli(argv)
    assert_refused(result, case.names)
    for tier in files.tiers:
        assert not tier.exists(), f"{argv!r} created the tier {tier}"
    assert _tree(files.root) == files.tree, f"{argv!r} changed the files"


REAL_PROCESS_CASES: list[tuple[str, Callable[[Files], list[str]], tuple[str, ...]]] = [
    # argparse's own error, which printed a usage block before its error line
    ("bad int", lambda f: ["stress", "--config", str(f.config), "--ops", "many"], ("--ops",)),
    ("bad subcommand", lambda f: ["snapshot", "imprt"], ("invalid choice: 'imprt'",)),
    # a traceback after scanning every tier: the --json directory is now refused first
    (
        "json dir",
        lambda f: ["inspect", "--config", str(f.config), "--json", str(f.root)],
        ("--json",),
    ),
    # a traceback (min() of an empty list) after the manager part had run
    ("reps 0", lambda f: ["bench", "--config", str(f.config), "--reps", "0"], ("--reps",)),
    # a file name with a newline split the error over two lines
    ("newline", lambda f: ["config", "validate", str(f.root / "no\nsuch.yaml")], ("no\\nsuch",)),
]


def test_the_real_command_gives_the_same_result(files: Files) -> None:
    """The console script in its own process: exit 2, the same one line as in-process,
    no traceback (5 processes, in parallel)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    procs = []
    for _, make, _ in REAL_PROCESS_CASES:
        argv = make(files)
        popen = subprocess.Popen(
            [str(KVOFFLOAD), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=files.cwd,
        )
        procs.append((argv, popen))
    for (name, _, names), (argv, proc) in zip(REAL_PROCESS_CASES, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        real = Result(proc.returncode, out, err)
        line = assert_refused(real, names)
        assert run_cli(argv).err == err, (name, line)
    for tier in files.tiers:
        assert not tier.exists()


def test_a_bad_log_level_is_one_line(files: Files, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_LOG_LEVEL", "loud\nlouder")
    assert_refused(run_cli(["backends"]), ("KVOFFLOAD_LOG_LEVEL = 'loud\\nlouder'",))
    monkeypatch.setenv("KVOFFLOAD_LOG_LEVEL", "debug")  # any case
    result = run_cli(["config", "validate", str(files.config)])
    assert result.code == 0, result.err


def test_valid_parts_alone_run(files: Files) -> None:
    """The quick commands built of the strategies' valid parts alone succeed: the
    refusals above come from the one bad element."""
    assert run_cli(["config", "validate", str(files.config)]).code == 0
    assert run_cli(["-v", "inspect", "--json", "report.json"]).code == 0
    assert (files.cwd / "report.json").is_file()
    verify = ["verify", "--config", str(files.config), "--repair", f"--json={files.cwd}/v.json"]
    assert run_cli(verify).code == 0
    for tier in files.tiers:
        assert not tier.exists()  # looking never creates a tier
    result = run_cli(["snapshot", "import", "--tier=db", str(files.snapshot)])
    assert result.code == 0, result.err
    assert files.tiers[1].exists()  # an import creates its tier: a new node


def test_snapshot_export_of_an_empty_tier(files: Files) -> None:
    """An existing tier with no blocks exports an empty snapshot (it raised a
    TypeError from a memoryview of nothing), which imports as nothing."""
    from kvoffload.config import layout_from_config, load_config
    from kvoffload.tier import build_tiers

    cfg = load_config(files.config)
    for tier in build_tiers(cfg, layout_from_config(cfg)):
        tier.close()
    out = files.root / "empty.safetensors"
    result = run_cli(["snapshot", "export", "--config", str(files.config), str(out)])
    assert result.code == 0, result.err
    assert result.out == f"exported 0 blocks to {out}\n"
    result = run_cli(
        ["snapshot", "import", "--config", str(files.config), "--tier", "db", str(out)]
    )
    assert result.code == 0, result.err
    assert result.out.startswith("imported 0 of 0 blocks"), result.out
