"""Deprecated: moved to :mod:`kvoffload.tools.bench.cpu` (one package for the benchmarks)."""

from __future__ import annotations

import warnings

from kvoffload.tools.bench.cpu import *  # noqa: F403

warnings.warn(
    "kvoffload.tools.bench_cpu is deprecated: import kvoffload.tools.bench.cpu",
    DeprecationWarning,
    stacklevel=2,
)
