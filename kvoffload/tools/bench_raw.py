"""Deprecated: moved to :mod:`kvoffload.tools.bench.raw` (one package for the benchmarks)."""

from __future__ import annotations

import warnings

from kvoffload.tools.bench.raw import *  # noqa: F403

warnings.warn(
    "kvoffload.tools.bench_raw is deprecated: import kvoffload.tools.bench.raw",
    DeprecationWarning,
    stacklevel=2,
)
