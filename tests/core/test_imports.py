"""The import graph of the package: no cycles, and layers that depend one way only.

The graph is built from the source with :mod:`ast`, never by importing it, over every
module setuptools installs as part of ``kvoffload``: the trees that
``[tool.setuptools.package-dir]`` in pyproject.toml maps (``kvoffload/``, ``backends/``
as ``kvoffload.backends``, ``connectors/`` as ``kvoffload.connectors``), with every
subpackage under them.

What counts as an edge ``a -> b`` (``a`` imports ``b``, both ours):

- every ``import`` / ``from ... import`` in ``a``, at any depth: module level, inside a
  function, a method or a ``try``. A function-level import is still a dependency; it
  only runs later. Deferring an import is a fine way to keep torch, matplotlib or vLLM
  off a path that does not need them (``kvoffload config validate``, ``kvoffload
  backends``), but not a way around the layering: a cycle through a lazy import is
  still two modules that cannot be understood, tested or reused apart, and it breaks
  the day someone hoists the import. So lazy imports count, and the layering stays
  honest without anyone having to remember which imports happen to be deferred.
- imports under ``if TYPE_CHECKING:`` too. They never execute, but a module that
  names another's type in its signatures depends on it all the same: it cannot be
  read, checked or changed apart from it, and a pair of modules that name each other's
  types is a cycle in every sense but the interpreter's (one used to hide a back-pointer
  from the claims to the books). Where a lower module needs to name what a higher one
  passes it, it declares the shape it needs (a :class:`typing.Protocol`) instead.
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module of ours,
  else to ``pkg``; ``import a.b.c`` is an edge to ``a.b.c`` alone, not to the parent
  packages it also initialises (every module would otherwise depend on ``kvoffload``).

Not seen, by design: ``importlib.import_module`` and entry points. The package root's
lazy exports (``kvoffload.__getattr__``) and the registry loading plugin classes by
entry point are the two uses, and both are the point of their modules: a facade over
the layers, and plugins that are not ours to place.

The layers, lowest first (:data:`LAYERS`); a module may import from its own layer and
the ones below, never from above, and within a layer only without cycles:

1. basic data: config, keys, layout, sizes, exceptions, record, codec, slots, extents,
   dirlock, plugins, metrics;
2. bookkeeping: manager, lru_manager, server_manager, server_events, policies, plans;
3. storage: backend, registry, tier, hostcopy, and the backends;
4. data movement: blockpool, transfer, books, claims, devicelane, datapath, jobs;
5. the offloader;
6. on top: the connectors, the tools (CLI, stress, maintenance, benchmarks, lookup),
   kvoffload.testing, and the package's own ``__init__`` / ``__main__``.

A module missing from :data:`LAYERS` fails the test: a new module takes a place in
the map when it is added, not when it first imports the wrong thing.
"""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from support.configs import write_tiers_yaml

REPO: Final = Path(__file__).resolve().parents[2]
ROOT: Final = "kvoffload"

LAYERS: Final[dict[int, tuple[str, tuple[str, ...]]]] = {
    1: (
        "basic data",
        (
            "config",
            # The settings every tier shares, and each built-in tier's own, beside the
            # config that puts them together: torch-free data, like it.
            "tierconfig",
            "backends.cpu.settings",
            "backends.lmdb.settings",
            "backends.mmap.settings",
            "backends.redis.settings",
            # The config's parts: the tiers list (union and rules), the masking of
            # secrets in its errors, and the stress section (before "tools", layer 6).
            "tierunion",
            "redact",
            "tools.stressconfig",
            "keys",
            "layout",
            "sizes",
            "exceptions",
            "record",
            # The codecs of the compressed tiers, beside the record that names them.
            "codec",
            "slots",
            # Pages as extents (issue 33's packed disk layout), beside the slots.
            "extents",
            "dirlock",
            # The entry-point name table the registry is built on: the config finds a
            # plugin tier's settings model through it, without the backend layer.
            "plugins",
            # The tier metric schema: the books count it, the tools and the connector
            # report it, so it sits below all of them.
            "metrics",
        ),
    ),
    2: (
        "bookkeeping",
        (
            "manager",
            "lru_manager",
            # The byte-budget part of the books, a mixin of lru_manager's.
            "budget",
            "server_manager",
            "server_events",
            "policies",
            "plans",
        ),
    ),
    3: (
        "storage",
        # hostcopy: the host-memory copy helpers the memory tiers and the block pool share.
        ("backend", "registry", "tier", "hostcopy", "backends"),
    ),
    # books and datapath come out of offloader.py; cudacopy is the block pool's
    # one-launch CUDA copy; devicelane is one direction of the data path on a GPU; jobs
    # carry out one order each over the data path, beside the books, never calling them;
    # breaker, cascade, withheld, settlement and mirror are parts of the books; staging
    # and inflight of the jobs; lanes is the loop joining books and jobs.
    4: (
        "data movement",
        (
            "blockpool",
            # The block pool's parts: its layout (row views, checks) and its copies.
            "blockrows",
            "blockcopy",
            "cudacopy",
            "transfer",
            "books",
            "claims",
            "devicelane",
            "datapath",
            "jobs",
            "breaker",
            "cascade",
            "withheld",
            "settlement",
            "mirror",
            "staging",
            "inflight",
            "lanes",
        ),
    ),
    5: ("offloader", ("offloader",)),
    # ``lookup``: a router's question to the shared tier, a tool beside the CLI.
    6: ("on top", ("connectors", "tools", "lookup", "testing", "__main__")),
}
"""Layer -> (its name, the modules or subpackages in it, relative to ``kvoffload``).
A subpackage's entry covers every module under it."""

TOP: Final = max(LAYERS)
"""The package root itself, a facade whose lazy exports reach into the layers, sits on top."""


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def package_dirs() -> dict[str, Path]:
    """Package name -> source directory, as setuptools maps them (pyproject.toml)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: REPO / d for name, d in setuptools["package-dir"].items()}
    assert ROOT in dirs, f"pyproject.toml maps no directory for {ROOT!r}"
    return dirs


def discover() -> dict[str, Path]:
    """Module name -> source file, for every module installed under ``kvoffload``."""
    dirs = package_dirs()
    mapped = {d.resolve() for d in dirs.values()}
    modules: dict[str, Path] = {}
    for package, top in dirs.items():
        for here, subdirs, files in os.walk(top):
            # A directory mapped as a package of its own is walked under that name.
            subdirs[:] = sorted(
                s
                for s in subdirs
                if s != "__pycache__"
                and not s.endswith(".egg-info")
                and (Path(here) / s).resolve() not in mapped
            )
            rel = Path(here).relative_to(top).parts
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                parts = [package, *rel]
                if name != "__init__.py":
                    parts.append(name.removesuffix(".py"))
                modules[".".join(parts)] = Path(here) / name
    return modules


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: at any depth, ``if TYPE_CHECKING:`` blocks included."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <...> import`` refers to, relative imports included."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, Path]) -> list[Edge]:
    """Edges between our modules (see the module docstring for what counts)."""
    edges: list[Edge] = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = os.path.relpath(path, REPO)
        for node in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_from(module, path.name == "__init__.py", node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in dict.fromkeys(targets):
                if target in modules and target != module:
                    edges.append(Edge(module, target, rel, node.lineno))
    return edges


def layer_of(module: str) -> int | None:
    if module == ROOT:
        return TOP
    rel = module.removeprefix(ROOT + ".")
    for layer, (_, names) in LAYERS.items():
        for name in names:
            if rel == name or rel.startswith(name + "."):
                return layer
    return None


def _describe_layer(layer: int) -> str:
    return f"layer {layer}, {LAYERS[layer][0]}"


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one
    cycle through it, so a failure shows a path to read rather than a set of names."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.src, []).append(e.dst)
        graph.setdefault(e.dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(comp), graph) for comp in components]


def _cycle_in(comp: list[str], graph: dict[str, list[str]]) -> list[str]:
    """One cycle through ``comp[0]`` inside the component (breadth-first, so shortest)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph[v]:
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {comp}")


# ------------------------------------------------------------------------------ tests


def test_every_module_is_found() -> None:
    """The walk sees the package as setuptools lays it out (a guard on the test itself)."""
    modules = discover()
    for name in (
        "kvoffload",
        "kvoffload.config",
        "kvoffload.offloader",
        "kvoffload.backends.cpu",
        "kvoffload.connectors",
        "kvoffload.tools.cli",
        "kvoffload.policies.lru",
    ):
        assert name in modules, f"{name} not found; found {sorted(modules)}"
    pairs = {(e.src, e.dst) for e in import_graph(modules)}
    assert ("kvoffload.tools.cli", "kvoffload.config") in pairs
    assert ("kvoffload.backends.mmap.backend", "kvoffload.backend") in pairs


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in discover() if layer_of(m) is None)
    assert not missing, (
        f"module(s) with no layer: {', '.join(missing)}; add each to LAYERS in "
        "tests/core/test_imports.py (the lowest layer whose modules are all it imports)"
    )


def test_no_import_cycles() -> None:
    modules = discover()
    edges = import_graph(modules)
    at = {(e.src, e.dst): e for e in edges}
    cycles = find_cycles(edges)
    lines = []
    for cycle in cycles:
        hops = [at[(a, b)] for a, b in itertools.pairwise(cycle)]
        lines.append(
            "import cycle: "
            + " -> ".join(cycle)
            + "\n"
            + "\n".join(f"    {h.src} imports {h.dst} at {h.where()}" for h in hops)
        )
    assert not cycles, (
        f"{len(cycles)} import cycle(s); break each by moving the shared piece down a "
        "layer or passing it in:\n" + "\n".join(lines)
    )


def test_layers_depend_downwards_only() -> None:
    modules = discover()
    bad = []
    for e in import_graph(modules):
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is None or dst is None:
            continue  # reported by test_every_module_has_a_layer
        if dst > src:
            bad.append(
                f"{e.src} [{_describe_layer(src)}] imports {e.dst} [{_describe_layer(dst)}] "
                f"at {e.where()}"
            )
    assert not bad, (
        "upward import(s): a module may import only from its own layer or below "
        "(layers in tests/core/test_imports.py):\n  " + "\n  ".join(bad)
    )


def test_lazy_and_type_checking_imports_are_classified(tmp_path: Path) -> None:
    """The rules above, on a made-up package: function-level imports are edges, and
    so are ``TYPE_CHECKING`` ones (both branches); relative imports resolve."""
    pkg = tmp_path / "kvoffload"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from kvoffload.sub import c
                from kvoffload import d
            else:
                import kvoffload.sub.b
            def f():
                from .sub.c import thing
            """
        )
    )
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "d.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import f\n")
    modules = {
        "kvoffload": pkg / "__init__.py",
        "kvoffload.a": pkg / "a.py",
        "kvoffload.sub": pkg / "sub" / "__init__.py",
        "kvoffload.sub.b": pkg / "sub" / "b.py",
        "kvoffload.sub.c": pkg / "sub" / "c.py",
        "kvoffload.d": pkg / "d.py",
    }
    got = {(e.src, e.dst) for e in import_graph(modules)}
    assert got == {
        ("kvoffload.a", "kvoffload.sub.b"),
        ("kvoffload.a", "kvoffload.sub.c"),
        ("kvoffload.a", "kvoffload.d"),  # under TYPE_CHECKING only: still an edge
        ("kvoffload.sub", "kvoffload.sub.b"),
        ("kvoffload.sub.c", "kvoffload.a"),
    }
    edges = [Edge(a, b, "x.py", 1) for a, b in sorted(got)]
    assert find_cycles(edges) == [["kvoffload.a", "kvoffload.sub.c", "kvoffload.a"]]


def test_config_validation_does_not_import_torch(tmp_path: Path) -> None:
    """``kvoffload config validate`` and any engine-side config check stay cheap: the
    built-in tiers validate, and resolve, without torch or the backend layer."""
    cfg = write_tiers_yaml(tmp_path, "tiers.yaml")
    code = textwrap.dedent(
        """
        import sys
        from kvoffload.config import load_config
        cfg = load_config(sys.argv[1], env={})
        assert [t.backend for t in cfg.resolved_tiers()] == ["cpu", "mmap"], cfg
        heavy = sorted(m for m in ("torch", "kvoffload.backend", "kvoffload.registry")
                       if m in sys.modules)
        print(",".join(heavy))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cfg)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"validating a config imported: {proc.stdout.strip()}"
