"""The rules of a CI run, checked in a pytest of their own (a child process over a
folder of throwaway test modules, with ``support/ci_rules.py`` as its only plugin):
under ``CI=true`` a skip of any kind fails the run; without it, it is a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.checkout import TESTS

PYTEST = [sys.executable, "-m", "pytest", "-p", "support.ci_rules", "-p", "no:cacheprovider"]
MODULES = {
    # vLLM's e2e modules once began like this: with a broken import, all of them vanished.
    "collection": 'import pytest\npytest.importorskip("kvoffload_no_such_package")\n\n'
    "def test_never_collected() -> None:\n    pass\n",
    "runtime": "import pytest\n\ndef test_skips() -> None:\n"
    '    pytest.importorskip("kvoffload_no_such_package")\n',
    "marker": 'import pytest\n\n@pytest.mark.skip(reason="later")\n'
    "def test_marked() -> None:\n    pass\n",
}


def _pytest(tmp: Path, module: str, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp / f"test_{module}.py").write_text(MODULES[module])
    (tmp / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [*PYTEST, "-q", "-rs", f"test_{module}.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env=env,
    )


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("collection", "skipped at collection under CI=true"),
        ("runtime", "skipped under CI=true"),
        ("marker", "is marked skip, which CI=true forbids"),
    ],
)
def test_under_ci_a_skip_fails_the_run(tmp_path: Path, module: str, says: str) -> None:
    proc = _pytest(tmp_path, module, ci=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert says in out, out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_outside_ci_a_skip_is_a_skip(tmp_path: Path, module: str) -> None:
    proc = _pytest(tmp_path, module, ci=False)
    out = proc.stdout + proc.stderr
    # A module skipped whole leaves no test: pytest's "no tests ran" (5), not a failure.
    assert proc.returncode == (5 if module == "collection" else 0), out
    assert "1 skipped" in out, out
