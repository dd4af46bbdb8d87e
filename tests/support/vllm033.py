"""vLLM 0.33 beside the suite's vLLM 0.32: where it is installed, and how to run in it.

``make dev`` installs vLLM 0.33.0's Python code, without its dependencies, into
``<venv>/vllm033`` (``pip install --no-deps --target``): 0.33 is the CUDA build that a
GPU user gets from ``pip install vllm``, and its kernels never load on this machine,
but its scheduler and its connector API are plain Python. A child interpreter of the
main venv with that folder first on ``PYTHONPATH`` imports 0.33 in place of the venv's
0.32 CPU build and finds everything else (torch 2.13, transformers, kvoffload) in the
venv; the main suite's process never imports it. The child runs
``support/vllm033_walk.py`` and prints one ``VLLM033-RESULT <json>`` line.

Importable under either vLLM: nothing here imports vllm at module level.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

VERSION: Final = "0.33.0"
TARGET: Final = Path(sys.prefix) / "vllm033"
"""The ``--target`` folder the Makefile fills (``$(VENV)/vllm033``)."""
WALK: Final = Path(__file__).resolve().parent / "vllm033_walk.py"
RESULT: Final = "VLLM033-RESULT "
WAIT_S: Final = 600.0
"""The child's whole run (vLLM's import, about 10 s here, and a few hundred steps):
longer is a hang."""


def installed() -> bool:
    """Whether ``make dev`` installed vLLM 0.33 beside this venv."""
    return (TARGET / "vllm" / "__init__.py").is_file() and any(
        TARGET.glob(f"vllm-{VERSION}.dist-info")
    )


def child_env() -> dict[str, str]:
    """This process's environment with the 0.33 folder, then ``tests/``, first on the
    path (the child imports ``support.*`` as the tests do)."""
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parents[1])
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(TARGET), tests, *([rest] if rest else [])])
    return env


def run_walk(workdir: Path) -> dict[str, Any]:
    """Run ``vllm033_walk.py`` in vLLM 0.33 (in ``workdir``); its result."""
    proc = subprocess.run(
        [sys.executable, str(WALK), str(workdir)],
        env=child_env(),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or len(lines) != 1:
        raise AssertionError(
            f"vllm033_walk.py exited {proc.returncode}\n--- stdout (tail)\n"
            f"{proc.stdout[-4000:]}\n--- stderr (tail)\n{proc.stderr[-8000:]}"
        )
    result: dict[str, Any] = json.loads(lines[0][len(RESULT) :])
    return result


def base_api(cls: type) -> dict[str, str]:
    """The public methods and properties of vLLM's ``KVConnectorBase_V1`` (``cls``),
    each with its signature (a property: ``property``), annotations as written: what
    a connector sees of the base class, to compare across vLLM versions."""
    api: dict[str, str] = {}
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            api[name] = "property"
            continue
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if not callable(func):
            continue
        kind = "classmethod " if isinstance(member, classmethod) else ""
        api[name] = kind + str(inspect.signature(func))
    return api
