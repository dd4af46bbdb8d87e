"""The ``redis`` tier: its settings (``SETTINGS``, from ``settings``: no torch) and its backend.

The backend's names are exported lazily (PEP 562), so the entry point
``kvoffload.backends.redis:CLASS`` loads the backend while importing this package, or
its settings, costs no torch."""

from __future__ import annotations

import importlib
from typing import Any

from kvoffload.backends.redis.settings import SETTINGS as SETTINGS


def __getattr__(name: str) -> Any:
    """Any name of the backend module, imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("kvoffload.backends.redis.backend"), name)
