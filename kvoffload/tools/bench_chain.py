"""Deprecated: moved to :mod:`kvoffload.tools.bench.chain` (one package for the benchmarks)."""

from __future__ import annotations

import warnings

from kvoffload.tools.bench.chain import *  # noqa: F403

warnings.warn(
    "kvoffload.tools.bench_chain is deprecated: import kvoffload.tools.bench.chain",
    DeprecationWarning,
    stacklevel=2,
)
