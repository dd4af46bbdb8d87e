"""The benchmarks' one home: ``kvoffload bench`` and the parts it is made of.

:mod:`~kvoffload.tools.bench.tiers` is the command (every tier against the raw disk,
vLLM's fs tier and raw redis-py, in one run); :mod:`~kvoffload.tools.bench.manager`,
:mod:`~kvoffload.tools.bench.cpu`, :mod:`~kvoffload.tools.bench.chain` and
:mod:`~kvoffload.tools.bench.redis` its parts; :mod:`~kvoffload.tools.bench.raw` the
raw-disk baseline they share; :mod:`~kvoffload.tools.bench.harness` the timing,
same-run ratios, JSON and docs table that every benchmark (here and in ``scripts/``)
reports through; :mod:`~kvoffload.tools.bench.inputs` the captured KV blocks and key
chains that the scripts feed their tiers. This package re-exports what
``kvoffload.tools.bench`` held when it was one module, so ``from kvoffload.tools.bench
import run_bench`` keeps working; lazily, so that a script that only needs the harness
does not import every tier.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.tools.bench.tiers import (
        BATCH_BYTES,
        BLOCK_SIZES,
        VLLM_THREADS,
        bench_tier,
        disk_rows,
        redis_rows,
        run_bench,
        vllm_fs,
    )

__all__ = [
    "BATCH_BYTES",
    "BLOCK_SIZES",
    "VLLM_THREADS",
    "bench_tier",
    "disk_rows",
    "redis_rows",
    "run_bench",
    "vllm_fs",
]
_FROM_TIERS = frozenset(__all__)


def __getattr__(name: str) -> Any:
    """``kvoffload.tools.bench.<name>`` of the old single module, imported on first use."""
    if name in _FROM_TIERS:
        return getattr(import_module("kvoffload.tools.bench.tiers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
