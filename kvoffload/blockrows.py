"""The layout of a :class:`~kvoffload.blockpool.BlockPool`: the engine's per-layer KV
tensors seen as numbered blocks of rows, and a staging buffer's rows as their columns.

Block ``b`` of layer ``l`` is ``kv_caches[l].select(block_dim, b)``, whatever the rest of
the shape is. A block's *packed* form (the unit every tier stores, a row of a ``uint8
[n, bytes_per_block]`` staging buffer) is the concatenation of its per-layer bytes,
layer 0 first: layer ``l``'s bytes are the buffer's column at ``layer_offsets[l]``.
Where a layer's block is contiguous, both sides are viewed as rows of the widest element
type that divides the sizes and offsets (:data:`HOST_WIDTHS`, :data:`DEVICE_WIDTHS`),
so each block's bytes of a layer are one row and torch copies a few wide elements
instead of many narrow ones; where the layers' addresses allow, a host pool is also one
row tensor over every layer (:class:`FlatRows`). :class:`PoolLayout` builds these views
and checks the ids and buffers a copy is given; the copies themselves are
:mod:`kvoffload.blockcopy`'s.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import numpy.typing as npt
import torch

from kvoffload.exceptions import LayoutMismatchError
from kvoffload.hostcopy import as_numpy as _numpy
from kvoffload.layout import KVLayout

DEVICE_WIDTHS: Final = ((8, torch.int64), (4, torch.int32), (2, torch.int16))
# Host rows are only ever copied (memcpy, element copies, numpy as int64), so a 16-byte
# element is just a wider unit; on a GPU the int64 kernels stay as they were validated.
HOST_WIDTHS: Final = ((16, torch.complex128), *DEVICE_WIDTHS)


FLAT_MIN_UNIT: Final = 1024
"""Smallest unit (bytes) of the flat view (:class:`FlatRows`); below it a copy of one
index entry costs more than it moves, and the per-layer ops serve instead."""


@dataclass(frozen=True)
class FlatRows:
    """Every layer of a host pool as rows of one tensor over their address range.

    vLLM allocates each layer on its own, so the per-layer ops are one call per layer:
    one Python-level call, one GIL hand-off and one OpenMP region each. In the engine
    a load runs beside the engine's thread, which holds the GIL between its own calls,
    and every hand-off waits for it (up to the switch interval, 5 ms): 30 layers of
    SmolLM2 took a 136 MB load from 10 ms alone to 300-450 ms beside a stepping engine.
    When the layers' addresses, block strides and sizes share a unit of at least
    :data:`FLAT_MIN_UNIT` bytes, the pool is one ``[units, unit]`` row tensor spanning
    all of them (gaps between the layers included, never touched), block ``b`` of layer
    ``l`` is the ``layer_bytes[l] / unit`` rows from ``offset[l] + b * stride[l]``, and a
    whole batch is one indexed copy: one call for every layer and block."""

    rows: torch.Tensor
    """``[units, unit / width]`` of the widest element that fits, over the layers."""
    np_rows: npt.NDArray[Any]
    unit: int
    per_block: int
    """Rows of one packed block (``bytes_per_block / unit``)."""
    offsets: torch.Tensor
    """Per packed row of a block, its row in :attr:`rows` for block 0 (int64)."""
    strides: torch.Tensor
    """Per packed row of a block, the rows one block further on (int64)."""

    def index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The rows of ``block_ids``, packed order (block, then layer, then unit)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        return (ids[:, None] * self.strides + self.offsets).reshape(-1)

    def packed(self, buf: torch.Tensor) -> torch.Tensor | None:
        """``buf`` (``uint8 [n, bytes_per_block]``) as ``[n * per_block, unit / width]``
        rows of :attr:`rows`' dtype; ``None`` if its rows are not contiguous."""
        width = self.rows.element_size()
        if not buf.is_contiguous() or buf.data_ptr() % width or buf.storage_offset() % width:
            return None
        return buf.view(self.rows.dtype).view(-1, self.rows.shape[1])


def flat_rows(views: Sequence[torch.Tensor], layer_bytes: Sequence[int]) -> FlatRows | None:
    """The :class:`FlatRows` view of host layers (each ``[num_blocks, ...]`` with contiguous
    blocks), or ``None`` when they share no unit of :data:`FLAT_MIN_UNIT` bytes."""
    num_blocks = views[0].shape[0]
    ptrs = [v.data_ptr() for v in views]
    strides = [v.stride(0) * v.element_size() for v in views]
    base = min(ptrs)
    unit = math.gcd(*layer_bytes, *strides, *(p - base for p in ptrs))
    if unit < FLAT_MIN_UNIT or any(s <= 0 for s in strides):
        return None
    width, dtype = next(
        (w, d) for w, d in (*HOST_WIDTHS, (1, torch.uint8)) if unit % w == 0 and base % w == 0
    )
    end = max(
        p + (num_blocks - 1) * s + n for p, s, n in zip(ptrs, strides, layer_bytes, strict=True)
    )
    memory = (ctypes.c_uint8 * (end - base)).from_address(base)
    rows = torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(-1, unit // width)
    offsets: list[int] = []
    steps: list[int] = []
    for p, s, n in zip(ptrs, strides, layer_bytes, strict=True):
        first = (p - base) // unit
        offsets.extend(range(first, first + n // unit))
        steps.extend([s // unit] * (n // unit))
    return FlatRows(
        rows=rows,
        np_rows=_numpy(rows),
        unit=unit,
        per_block=len(offsets),
        offsets=torch.tensor(offsets, dtype=torch.int64),
        strides=torch.tensor(steps, dtype=torch.int64),
    )


class PoolLayout:
    """Numbered blocks over a list of per-layer tensors sharing the block dimension: the
    views, the checks, and the columns of a staging buffer (no copies)."""

    _host_paths: ClassVar[bool] = True
    """Use the host row views and strategies for a CPU pool. Tests turn it off to run,
    on CPU tensors, the code a CUDA pool runs."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_dim: int = 0) -> None:
        if not kv_caches:
            raise LayoutMismatchError("BlockPool needs at least one layer tensor")
        views = [t.movedim(block_dim, 0) for t in kv_caches]  # each [num_blocks, ...]
        num_blocks = views[0].shape[0]
        device = views[0].device
        for i, v in enumerate(views):
            if v.shape[0] != num_blocks or v.device != device:
                raise LayoutMismatchError(
                    f"layer {i}: {v.shape[0]} blocks on {v.device}, layer 0 has "
                    f"{num_blocks} on {device}; all layers must match"
                )
        self._views = views
        self.num_blocks = num_blocks
        self.device = device
        self.layer_shapes = [tuple(v.shape[1:]) for v in views]
        self.layer_dtypes = [v.dtype for v in views]
        self.layer_bytes = [
            math.prod(s) * v.element_size() for s, v in zip(self.layer_shapes, views, strict=True)
        ]
        self.layer_offsets = [sum(self.layer_bytes[:i]) for i in range(len(views))]
        self.bytes_per_block = sum(self.layer_bytes)
        for off, v in zip(self.layer_offsets, views, strict=True):
            if off % v.element_size():
                raise LayoutMismatchError("layer byte offsets must be multiples of the dtype size")
        self._host = device.type == "cpu" and self._host_paths
        widths = HOST_WIDTHS if self._host else DEVICE_WIDTHS
        # Per layer: (row view [num_blocks, elems] of a wide dtype, that dtype), or
        # None when the layer's block is not contiguous and the shaped view must serve.
        self._rows: list[tuple[torch.Tensor, torch.dtype] | None] = [
            self._row_view(v, off, nbytes, widths)
            for v, off, nbytes in zip(views, self.layer_offsets, self.layer_bytes, strict=True)
        ]
        # Alignment a staging buffer needs for the typed column views above.
        self._align = max(
            (r[0].element_size() if r is not None else v.element_size())
            for r, v in zip(self._rows, views, strict=True)
        )
        # Host only, per row layer: the rows as a numpy array, for the queue strategy.
        self._np_rows: list[npt.NDArray[Any] | None] = [
            _numpy(r[0]) if r is not None and self._host else None for r in self._rows
        ]
        # Host only: every layer as rows of one tensor, when their addresses allow.
        self._flat = (
            flat_rows([r[0] for r in self._rows if r is not None], self.layer_bytes)
            if self._host and all(r is not None for r in self._rows)
            else None
        )

    @property
    def num_layers(self) -> int:
        return len(self._views)

    def check_layout(self, layout: KVLayout) -> None:
        """Raise unless packed blocks of this pool have ``layout``'s size."""
        if self.bytes_per_block != layout.bytes_per_block:
            raise LayoutMismatchError(
                f"pool blocks are {self.bytes_per_block} bytes but the layout says "
                f"{layout.bytes_per_block} ({layout})"
            )

    def device_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 index on the pool's device, checked on the host and
        uploaded from pinned memory on the current stream: no device synchronisation
        (a pageable upload, or a range check on the device, would wait for the
        model's queued kernels)."""
        self._check_ids(block_ids)
        host = torch.tensor(block_ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def check_ids(self, block_ids: Sequence[int]) -> None:
        """Raise ``IndexError`` unless every id names a block (checked on the host)."""
        self._check_ids(block_ids)

    # -- views and checks ---------------------------------------------------------
    def _row_view(
        self,
        view: torch.Tensor,
        offset: int,
        nbytes: int,
        widths: Sequence[tuple[int, torch.dtype]],
    ) -> tuple[torch.Tensor, torch.dtype] | None:
        try:
            rows = view.view(view.shape[0], -1).view(torch.uint8)
        except RuntimeError:
            return None  # block not contiguous within the layer (e.g. K and V apart)
        for width, dtype in widths:
            aligned = rows.data_ptr() % width == 0 and rows.stride(0) % width == 0
            sizes = (nbytes, offset, self.bytes_per_block)
            if aligned and all(size % width == 0 for size in sizes):
                return rows.view(dtype), dtype
        return rows, torch.uint8

    def _wide_column(self, buf: torch.Tensor, layer: int, dtype: torch.dtype) -> torch.Tensor:
        off, nbytes = self.layer_offsets[layer], self.layer_bytes[layer]
        return buf[:, off : off + nbytes].view(dtype)

    def _aligned(self, buf: torch.Tensor) -> bool:
        """Whether ``buf``'s columns can be viewed with the pool's column dtypes."""
        rows_ok = buf.shape[0] <= 1 or buf.stride(0) % self._align == 0
        # ``Tensor.view(dtype)`` checks the offset into the storage, not the address.
        offset_ok = buf.storage_offset() % self._align == 0
        return buf.data_ptr() % self._align == 0 and rows_ok and offset_ok

    def _column(self, buf: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s bytes of every row of ``buf``, as ``[n, *layer_shape]``."""
        off, nbytes = self.layer_offsets[layer], self.layer_bytes[layer]
        col = buf[:, off : off + nbytes].view(self.layer_dtypes[layer])
        return col.view(buf.shape[0], *self.layer_shapes[layer])

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if self.device.type == "cuda":
            return self.device_index(block_ids)
        self._check_ids(block_ids)
        return torch.as_tensor(block_ids, dtype=torch.int64)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        """Range check on the host (a check on the device would synchronise it)."""
        if len(block_ids) and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise IndexError(f"block ids must be in 0..{self.num_blocks - 1}")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} not in 0..{self.num_blocks - 1}")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} not in 0..{self.num_layers - 1}")

    def _check_buffer(self, buf: torch.Tensor, n: int) -> None:
        want = (n, self.bytes_per_block)
        if tuple(buf.shape) != want or buf.dtype != torch.uint8 or buf.stride(-1) != 1:
            raise LayoutMismatchError(
                f"staging buffer must be uint8 {want} with contiguous rows, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
