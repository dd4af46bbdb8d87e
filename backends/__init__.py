"""Built-in storage backends, installed as ``kvoffload.backends``.

Each is registered through the ``kvoffload.backends`` entry-point group in
``pyproject.toml``, exactly as a third-party backend would be; nothing here is
imported until a tier names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(module: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that hands out the names of ``module``,
    importing it on first use: a tier's entry point ``kvoffload.backends.<tier>:CLASS``
    loads its backend (and torch) then, while importing the package for its torch-free
    ``SETTINGS`` does not."""

    def exported(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(module), name)

    return exported
