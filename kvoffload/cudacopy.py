"""One-launch pack and unpack of a CUDA block pool's layers (a Triton kernel), opt-in.

Why it exists: torch needs one ``index_select`` (or ``index_copy_``) per layer, so packing a job's
blocks of a 32-layer model is 32 launches from Python. On an H100 those kernels run at
about 1.2 TB/s, but launched from the lane threads, sharing the GIL with the engine's
thread and the other lane, each launch cost 20-40 us, and the bus sat idle between
jobs (``docs/benchmarks.md``). One kernel takes every layer's base address and moves
every (block, layer) piece in one launch.

Opt-in (``KVOFFLOAD_CUDA_COPY=kernel``), because it did not measurably help: in the
same runs on an H100, Offloader loads were within noise of the per-layer torch ops and
stores of 256 KiB blocks were 2-3x slower with it (``docs/benchmarks.md``); the cost
that remains is the Python around each job, not the launches. Used, when asked for,
where Triton imports, the pool is on CUDA, and each layer's block is one contiguous,
8-byte aligned run (the canonical ``[B, 2, N, H, D]`` layout and vLLM's per-layer
caches); otherwise the per-layer torch ops run. Both write the same bytes
(``tests/gpu``).
"""

# No ``from __future__ import annotations`` here: Triton reads the kernels' parameter
# annotations (``tl.constexpr``) as objects.
import importlib
import logging
import os
from collections.abc import Sequence
from typing import Any, Final

import torch

logger = logging.getLogger(__name__)

BLOCK: Final = 1024
"""8-byte elements each program copies per step (8 KiB)."""

_kernels: "tuple[Any, Any] | None" = None
_failed = False


def _compile() -> tuple[Any, Any] | None:
    """The two kernels, or ``None`` without Triton (imported lazily: CPU machines have
    none, and importing it costs time)."""
    global _kernels, _failed
    if _kernels is not None or _failed:
        return _kernels
    try:
        # Typed as Any on purpose: CPU machines (and CI's type check) have no Triton.
        triton: Any = importlib.import_module("triton")
        tl: Any = importlib.import_module("triton.language")
    except ImportError:
        _failed = True
        return None

    @triton.jit  # type: ignore[untyped-decorator]
    def pack(bases, strides, offsets, sizes, index, packed, row, block: tl.constexpr):  # type: ignore[no-untyped-def]
        b = tl.program_id(0)
        layer = tl.program_id(1)
        src = tl.cast(tl.load(bases + layer), tl.pointer_type(tl.int64))
        src += tl.load(index + b) * tl.load(strides + layer)
        dst = packed + b.to(tl.int64) * row + tl.load(offsets + layer)
        size = tl.load(sizes + layer)
        for start in range(0, size, block):
            o = start + tl.arange(0, block)
            m = o < size
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    @triton.jit  # type: ignore[untyped-decorator]
    def unpack(bases, strides, offsets, sizes, index, packed, row, block: tl.constexpr):  # type: ignore[no-untyped-def]
        b = tl.program_id(0)
        layer = tl.program_id(1)
        dst = tl.cast(tl.load(bases + layer), tl.pointer_type(tl.int64))
        dst += tl.load(index + b) * tl.load(strides + layer)
        src = packed + b.to(tl.int64) * row + tl.load(offsets + layer)
        size = tl.load(sizes + layer)
        for start in range(0, size, block):
            o = start + tl.arange(0, block)
            m = o < size
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    _kernels = (pack, unpack)
    return _kernels


class LayerCopy:
    """Pack and unpack for one pool's layers; build it with :func:`for_layers`."""

    def __init__(self, tables: torch.Tensor, bytes_per_block: int, layers: int) -> None:
        self._bases, self._strides, self._offsets, self._sizes = tables
        self._row = bytes_per_block // 8
        self._layers = layers

    def pack(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i]`` = block ``index[i]``, packed; queued on the current stream."""
        self._launch(0, index, out)

    def unpack(self, index: torch.Tensor, src: torch.Tensor) -> None:
        """Block ``index[i]`` = ``src[i]``, unpacked; queued on the current stream."""
        self._launch(1, index, src)

    def _launch(self, which: int, index: torch.Tensor, packed: torch.Tensor) -> None:
        kernels = _compile()
        assert kernels is not None
        n = index.numel()
        if n:
            kernels[which][(n, self._layers)](
                self._bases,
                self._strides,
                self._offsets,
                self._sizes,
                index,
                packed.view(torch.int64),
                self._row,
                block=BLOCK,
            )


def for_layers(
    views: Sequence[torch.Tensor], offsets: Sequence[int], bytes_per_block: int
) -> LayerCopy | None:
    """A :class:`LayerCopy` for layer views ``[num_blocks, ...]`` (block dimension
    first) whose packed columns start at ``offsets``; ``None`` where it cannot serve
    them (see the module docstring)."""
    if os.environ.get("KVOFFLOAD_CUDA_COPY", "torch") != "kernel":
        return None
    if not views or views[0].device.type != "cuda" or bytes_per_block % 8:
        return None
    bases, strides, sizes = [], [], []
    for v in views:
        try:
            rows = v.view(v.shape[0], -1)
        except RuntimeError:
            return None  # a layer's block is not one run (e.g. K and V apart)
        nbytes = rows.shape[1] * rows.element_size()
        stride = rows.stride(0) * rows.element_size()
        if rows.stride(1) != 1 or rows.data_ptr() % 8 or stride % 8 or nbytes % 8:
            return None
        bases.append(rows.data_ptr())
        strides.append(stride // 8)
        sizes.append(nbytes // 8)
    if any(off % 8 for off in offsets) or _compile() is None:
        return None
    tables = torch.tensor(
        [bases, strides, [off // 8 for off in offsets], sizes],
        dtype=torch.int64,
        device=views[0].device,
    )
    return LayerCopy(tables, bytes_per_block, len(views))
