"""Deprecated: moved to :mod:`kvoffload.tools.bench.redis` (one package for the benchmarks)."""

from __future__ import annotations

import warnings

from kvoffload.tools.bench.redis import *  # noqa: F403

warnings.warn(
    "kvoffload.tools.bench_redis is deprecated: import kvoffload.tools.bench.redis",
    DeprecationWarning,
    stacklevel=2,
)
