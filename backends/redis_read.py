"""Deprecated: moved to :mod:`kvoffload.backends.redis.read` (each tier is a package now)."""

from __future__ import annotations

import warnings

from kvoffload.backends.redis.read import *  # noqa: F403

warnings.warn(
    "kvoffload.backends.redis_read is deprecated: import kvoffload.backends.redis.read",
    DeprecationWarning,
    stacklevel=2,
)
