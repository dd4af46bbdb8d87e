"""Deprecated: moved to :mod:`kvoffload.tools.bench.manager` (one package for the benchmarks)."""

from __future__ import annotations

import warnings

from kvoffload.tools.bench.manager import *  # noqa: F403

warnings.warn(
    "kvoffload.tools.bench_manager is deprecated: import kvoffload.tools.bench.manager",
    DeprecationWarning,
    stacklevel=2,
)
