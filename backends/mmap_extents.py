"""Deprecated: moved to :mod:`kvoffload.backends.mmap.extents` (each tier is a package now)."""

from __future__ import annotations

import warnings

from kvoffload.backends.mmap.extents import *  # noqa: F403

warnings.warn(
    "kvoffload.backends.mmap_extents is deprecated: import kvoffload.backends.mmap.extents",
    DeprecationWarning,
    stacklevel=2,
)
