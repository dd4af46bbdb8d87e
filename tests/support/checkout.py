"""Where the tests find the ``kvoffload`` command and the checkout's data files.

The suite runs against an editable install in ``.venv`` (``make test``) and against a
tree installed elsewhere (``pip install --target "$T" .`` with ``$T`` on
``PYTHONPATH``, as on the GPU machine, run from outside the checkout). The command is
then not next to the interpreter, and the package's own directory is not the
checkout's, so nothing here is found relative to either of those alone.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Final

import kvoffload

SUPPORT: Final = Path(__file__).resolve().parent
"""This folder: the helpers, and the programs the tests run as child processes."""
TESTS: Final = SUPPORT.parent
REPO: Final = TESTS.parent
TRACE: Final = TESTS / "data" / "mooncake_conversation_head2000.jsonl"
"""The Mooncake trace slice the tests replay (attribution: ``tests/data/README.md``)."""


def _command() -> Path:
    """The ``kvoffload`` console script: next to the interpreter (a virtualenv), on
    ``PATH``, or in the ``bin/`` that ``pip install --target`` puts beside the
    package. Falls back to the first, so a failure names the expected place."""
    beside = Path(sys.executable).parent / "kvoffload"
    on_path = shutil.which("kvoffload")
    target = Path(kvoffload.__file__).resolve().parents[1] / "bin" / "kvoffload"
    for candidate in (beside, Path(on_path) if on_path else None, target):
        if candidate is not None and candidate.is_file():
            return candidate
    return beside


KVOFFLOAD: Final = _command()
