"""A view over the engine's per-layer KV tensors as numbered blocks.

Runs on the worker side. The engine owns the tensors; :class:`BlockPool` only indexes
them. Block ``b`` of layer ``l`` is ``kv_caches[l].select(block_dim, b)``, whatever the
rest of the shape is (vLLM's CPU build: ``[B, H, N, C]`` int8 views, LBHNC; CUDA flash
attention: ``[2, B, N, H, D]`` with ``block_dim=1``; the canonical pool of
:meth:`BlockPool.allocate`: ``[B, 2, N, H, D]``).

A block's *packed* form, the unit every tier stores, is the concatenation of its
per-layer bytes, layer 0 first. :meth:`gather` and :meth:`scatter` move many blocks
between the pool and a ``uint8 [n, bytes_per_block]`` staging buffer, writing straight
into the staging buffer's per-layer columns so no intermediate copy is made. Where a
layer's block is contiguous, both sides are viewed as rows of the widest element type
that divides the sizes and offsets, so each block's bytes of a layer are one row and
torch copies a few wide elements instead of many narrow ones. On a GPU that is one
``index_select`` / ``index_copy_`` per layer over int64 rows.

On the host, copies are bound by memory bandwidth, and two things decide whether they
reach it. Figures: ratios to a plain ``dst.copy_(src)`` of the same bytes (torch, two
threads), ``kvoffload/tools/bench_cpu.py`` on a 2-core VM, blocks of 64 KiB-2 MiB drawn at
random from a pool twice the batch, best of 7; *idle*: nothing else running, *loaded*:
another process spinning on one core.

* **Element width.** ``index_copy_`` copies element by element: over int64 rows the
  scatter ran at 0.35-0.6x. Viewing rows as 16-byte elements (``complex128``, only ever
  copied, never computed on) halves the element count: 0.8-1.0x idle. ``index_select``
  ``memcpy``-s whole rows either way; 16-byte elements only double what one call may
  move without OpenMP (:data:`SERIAL_ELEMS`). So host rows use 16-byte elements.
* **Who runs the copy.** Torch runs each per-layer op as an OpenMP region split in fixed
  halves: the *team* strategy. Idle it is as fast as it gets (gather 0.8-0.95x; a C
  ``memcpy`` loop on two threads did no better). Loaded, every region waits for its half
  on the busy core: gather 0.55-0.85x, and 0.1-0.25x for 32 layers under heavier load.
  The *queue* strategy cuts the work into calls that copy in the calling thread
  (``index_select`` of at most ``SERIAL_ELEMS // row_elements`` rows, which ATen runs
  inline; for the scatter, numpy fancy assignment ``rows[ids] = column``, one C loop over
  whole rows with the GIL released) and has the caller and one helper thread pop them
  from one queue, so a paused thread delays only the call it is in: loaded, gather
  0.75-0.9x, scatter 1.0-1.3x. Idle it trails the team by 0.1-0.2 (the helper wakes 1-5
  ms late, and after any OpenMP op shares its core with OpenMP's spinning worker for a
  few ms more). Which one wins changes with the machine's load within seconds, so
  :class:`Chooser` times both and keeps the faster, for batches of
  :data:`QUEUE_MIN_BYTES` and more. Both write the same bytes.

**One call per batch** (:class:`_Flat`). Where the layers' addresses, block strides and
sizes share a unit of 1 KiB or more (vLLM's large per-layer allocations: a page), the
host pool is one row tensor over all layers, and a batch is one ``index_select`` /
``index_copy_`` (team) or a few numpy calls (queue) for every layer at once. Per-layer
calls each hand the GIL back and wait to get it again: beside an engine thread that
steps Python code (a background load) that wait, up to 5 ms, took a 30-layer load of
136 MB from ~10 ms to 280-460 ms in vLLM. The per-layer paths below remain for pools
without such a unit.

At 64 KiB blocks (16 KiB per layer) a gather from random blocks reaches 0.75-0.85x in
either regime, as does a plain C loop: 16 KiB random reads, not the copy calls, set it.

Measured and not used: coalescing runs of consecutive ids into slice copies (ids drawn
at random hardly ever follow each other; for fully consecutive ids, torch slice copies
ran like the team and numpy ones like a one-thread queue, no faster than the paths
here, since they face the same OpenMP-or-one-thread trade-off); ``index_put_``
(as fast as ``index_copy_``, no faster); ``torch._foreach_copy_``, a Python loop of
per-chunk ``copy_`` or of ``ctypes.memmove`` (0.4-0.7x: per-call overhead on 16-64 KiB
chunks); ``np.take(out=)`` (it buffers a non-contiguous output: 0.15x); a gather into a
cache-sized scratch, then a copy to the column (two passes: 0.5-0.65x); Python threads
around whole-layer ``index_select`` / ``index_copy_`` (their OpenMP teams compete).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Final

import numpy.typing as npt
import torch

from kvoffload.cudacopy import LayerCopy, for_layers
from kvoffload.exceptions import LayoutMismatchError
from kvoffload.hostcopy import QUEUE_MIN_BYTES as QUEUE_MIN_BYTES
from kvoffload.hostcopy import Chooser as Chooser
from kvoffload.hostcopy import as_numpy as _numpy
from kvoffload.hostcopy import assign as _assign
from kvoffload.hostcopy import byte_view as byte_view
from kvoffload.hostcopy import page_aligned_empty as page_aligned_empty
from kvoffload.hostcopy import run_queue as run_queue
from kvoffload.hostcopy import take as _take
from kvoffload.hostcopy import worth_choosing
from kvoffload.layout import KVLayout

SERIAL_ELEMS: Final = 32768
"""ATen's ``at::internal::GRAIN_SIZE``. On the host, ``index_select`` of rows of ``e``
elements (``e`` below this) ``memcpy``-s them in the calling thread when the call has at
most ``SERIAL_ELEMS // e`` rows, and in an OpenMP region otherwise; rows of more elements
get one ``copy_`` (an OpenMP region) each, so the queue gathers those (512 KiB and more
per layer at 16-byte elements) with one numpy row copy per block instead. Were a torch
release to change the constant, the queue's calls would only go parallel again: slower
under load, never wrong."""

_TASK_BYTES: Final = 4 * 2**20
"""About the bytes one numpy call of the queue moves."""

_DEVICE_WIDTHS: Final = ((8, torch.int64), (4, torch.int32), (2, torch.int16))
# Host rows are only ever copied (memcpy, element copies, numpy as int64), so a 16-byte
# element is just a wider unit; on a GPU the int64 kernels stay as they were validated.
_HOST_WIDTHS: Final = ((16, torch.complex128), *_DEVICE_WIDTHS)


FLAT_MIN_UNIT: Final = 1024
"""Smallest unit (bytes) of the flat view (:class:`_Flat`); below it a copy of one
index entry costs more than it moves, and the per-layer ops serve instead."""

_FLAT_PARTS: Final = 4
"""Calls a flat copy of the queue strategy is cut into: enough for the caller and the
helper to share it, few enough that a thread waits for the GIL a few times per batch,
not once per layer."""


@dataclass(frozen=True)
class _Flat:
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


def _flat(views: Sequence[torch.Tensor], layer_bytes: Sequence[int]) -> _Flat | None:
    """The :class:`_Flat` view of host layers (each ``[num_blocks, ...]`` with contiguous
    blocks), or ``None`` when they share no unit of :data:`FLAT_MIN_UNIT` bytes."""
    num_blocks = views[0].shape[0]
    ptrs = [v.data_ptr() for v in views]
    strides = [v.stride(0) * v.element_size() for v in views]
    base = min(ptrs)
    unit = math.gcd(*layer_bytes, *strides, *(p - base for p in ptrs))
    if unit < FLAT_MIN_UNIT or any(s <= 0 for s in strides):
        return None
    width, dtype = next(
        (w, d) for w, d in (*_HOST_WIDTHS, (1, torch.uint8)) if unit % w == 0 and base % w == 0
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
    return _Flat(
        rows=rows,
        np_rows=_numpy(rows),
        unit=unit,
        per_block=len(offsets),
        offsets=torch.tensor(offsets, dtype=torch.int64),
        strides=torch.tensor(steps, dtype=torch.int64),
    )


def _select(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(rows, 0, index, out=out)


def _select_shaped(view: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(view.index_select(0, index))


def _copy_into(rows: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    rows.index_copy_(0, index, src)


def _copy_rows(
    src: npt.NDArray[Any], dst: npt.NDArray[Any], block_ids: Sequence[int], first: int
) -> None:
    for row, block in enumerate(block_ids, first):
        dst[row] = src[block]


class BlockPool:
    """Numbered blocks over a list of per-layer tensors sharing the block dimension."""

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
        widths = _HOST_WIDTHS if self._host else _DEVICE_WIDTHS
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
            _flat([r[0] for r in self._rows if r is not None], self.layer_bytes)
            if self._host and all(r is not None for r in self._rows)
            else None
        )
        self._gather_pick = Chooser()
        self._scatter_pick = Chooser()
        # The one-launch device copy: False until first looked for (then it or None).
        self._kernel: LayerCopy | bool | None = False if device.type == "cuda" else None

    @classmethod
    def allocate(
        cls, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"
    ) -> BlockPool:
        """A pool of ``num_blocks`` in the canonical ``[B, 2, N, H, D]`` per-layer shape."""
        shape = (num_blocks, *layout.layer_block_shape)
        caches = [
            torch.zeros(shape, dtype=layout.torch_dtype, device=device)
            for _ in range(layout.num_layers)
        ]
        return cls(caches)

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

    # -- one block ----------------------------------------------------------------
    def get_kv_from_block(self, block_id: int) -> list[torch.Tensor]:
        """Copies of block ``block_id``'s KV, one tensor per layer (safe to keep)."""
        self._check_id(block_id)
        return [v[block_id].clone() for v in self._views]

    def put_kv_into_block(self, block_id: int, kv: Sequence[torch.Tensor]) -> None:
        """Overwrite block ``block_id`` with ``kv`` (one tensor per layer, as returned
        by :meth:`get_kv_from_block`)."""
        self._check_id(block_id)
        if len(kv) != self.num_layers:
            raise LayoutMismatchError(f"expected {self.num_layers} layer tensors, got {len(kv)}")
        for i, (v, t) in enumerate(zip(self._views, kv, strict=True)):
            if tuple(t.shape) != self.layer_shapes[i] or t.dtype != self.layer_dtypes[i]:
                raise LayoutMismatchError(
                    f"layer {i}: expected {self.layer_dtypes[i]} {self.layer_shapes[i]}, "
                    f"got {t.dtype} {tuple(t.shape)}"
                )
            v[block_id].copy_(t)

    # -- many blocks --------------------------------------------------------------
    def new_staging(self, n: int, *, pin_memory: bool = False) -> torch.Tensor:
        """A page-aligned host staging buffer for ``n`` packed blocks."""
        return page_aligned_empty(n, self.bytes_per_block, pin_memory=pin_memory)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack blocks ``block_ids`` (repeats allowed) into ``out`` (``uint8 [n,
        bytes_per_block]``)."""
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, self.bytes_per_block), dtype=torch.uint8, device=self.device)
        self._check_buffer(out, n)
        if n == 0:
            return out
        direct = out.device == self.device and self._aligned(out)
        # A buffer on another device, or at an odd address (a caller's slice), is
        # filled through an aligned temporary: one extra copy, only in that case.
        target = out if direct else torch.empty(out.shape, dtype=torch.uint8, device=self.device)
        nbytes = n * self.bytes_per_block
        packed = self._flat.packed(target) if self._flat is not None else None
        if self._flat is not None and packed is not None:
            self._flat_copy(self._gather_pick, _select, _take, block_ids, packed, nbytes)
        elif self._choosing(nbytes):
            index = self._index(block_ids)
            self._gather_pick.run(
                nbytes,
                partial(self._gather_team, index, target),
                partial(self._gather_queue, block_ids, index, target),
            )
        else:
            self._gather_team(self._index(block_ids), target)
        if target is not out:
            # Blocking: the caller reads ``out`` as soon as this returns. The transfer
            # worker overlaps copies with its own streams and events instead.
            out.copy_(target)
        return out

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Unpack ``src`` (``uint8 [n, bytes_per_block]``) into blocks ``block_ids``.

        The ids must be distinct: a block named twice ends up with unspecified bytes."""
        n = len(block_ids)
        self._check_buffer(src, n)
        if n == 0:
            return
        if src.device != self.device:
            src = src.to(self.device, non_blocking=src.is_pinned())
        if not self._aligned(src):
            src = src.clone()
        nbytes = n * self.bytes_per_block
        packed = self._flat.packed(src) if self._flat is not None else None
        if self._flat is not None and packed is not None:
            self._flat_copy(self._scatter_pick, _copy_into, _assign, block_ids, packed, nbytes)
            return
        index = self._index(block_ids)
        if self._choosing(nbytes):
            self._scatter_pick.run(
                nbytes,
                partial(self._scatter_team, index, src),
                partial(self._scatter_queue, index, src),
            )
        else:
            self._scatter_team(index, src)

    # -- device side (the data path's CUDA jobs) -----------------------------------
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

    def pack(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Pack the blocks ``index`` (from :meth:`device_index`) into ``out``, a ``uint8
        [n, bytes_per_block]`` buffer on the pool's device; queued on the current
        stream. One kernel for all layers where :mod:`kvoffload.cudacopy` serves this
        pool, else one op per layer."""
        self._check_buffer(out, index.numel())
        kernel = self._layer_copy()
        if kernel is not None:
            kernel.pack(index, out)
        else:
            self._gather_team(index, out)

    def unpack(self, index: torch.Tensor, src: torch.Tensor) -> None:
        """Unpack ``src`` (on the pool's device) into the blocks ``index``; queued on the
        current stream (one kernel, or one op per layer, as :meth:`pack`)."""
        self._check_buffer(src, index.numel())
        kernel = self._layer_copy()
        if kernel is not None:
            kernel.unpack(index, src)
        else:
            self._scatter_team(index, src)

    # -- one layer at a time (layer-wise loads) ------------------------------------
    def scatter_layer(self, layer: int, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Unpack layer ``layer``'s bytes of ``src`` (host ``uint8 [n, bytes_per_block]``
        packed rows) into blocks ``block_ids`` (distinct) of a host pool; blocking.
        Writes the bytes :meth:`scatter` writes for that layer.

        One C loop in the calling thread (numpy fancy assignment, the GIL released)
        rather than an OpenMP team: a layer-wise load runs beside the model's forward
        pass, whose OpenMP team already holds the cores; a second team would fight it
        region by region (see the module docstring)."""
        n = len(block_ids)
        self._check_layer(layer)
        self._check_buffer(src, n)
        if n == 0:
            return
        if src.device != self.device:
            raise ValueError(f"scatter_layer: src on {src.device}, the pool on {self.device}")
        index = self._index(block_ids)
        rows, np_rows = self._rows[layer], self._np_rows[layer]
        if rows is None or np_rows is None or not self._aligned(src):
            # A non-contiguous layer, a device pool run on the host (tests), or an odd
            # address: the layer's column through the shaped (or aligned) view.
            self.unpack_layer(layer, index, src if self._aligned(src) else src.clone())
            return
        _assign(np_rows, index.numpy(), _numpy(self._wide_column(src, layer, rows[1])))

    def unpack_layer(self, layer: int, index: torch.Tensor, src: torch.Tensor) -> None:
        """Unpack layer ``layer``'s bytes of ``src`` (``uint8 [n, bytes_per_block]`` on
        the pool's device, aligned) into the blocks ``index`` (from
        :meth:`device_index`); on a GPU queued on the current stream. One op."""
        self._check_layer(layer)
        self._check_buffer(src, index.numel())
        rows = self._rows[layer]
        if rows is not None:
            rows[0].index_copy_(0, index, self._wide_column(src, layer, rows[1]))
        else:
            self._views[layer].index_copy_(0, index, self._column(src, layer))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} not in 0..{self.num_layers - 1}")

    def _layer_copy(self) -> LayerCopy | None:
        """The one-launch copy for this pool, built on first use (``None`` on the host,
        without Triton, or for layouts it does not serve)."""
        if self._kernel is False:
            found = for_layers(self._views, self.layer_offsets, self.bytes_per_block)
            self._kernel = found if found is not None else None
        return self._kernel if isinstance(self._kernel, LayerCopy) else None

    # -- strategies ---------------------------------------------------------------
    def _choosing(self, nbytes: int) -> bool:
        return self._host and worth_choosing(nbytes)

    def _gather_team(self, index: torch.Tensor, target: torch.Tensor) -> None:
        """One op per layer; a CUDA pool's only path."""
        for i, view in enumerate(self._views):
            rows = self._rows[i]
            if rows is not None:
                _select(rows[0], index, self._wide_column(target, i, rows[1]))
            else:
                _select_shaped(view, index, self._column(target, i))

    def _scatter_team(self, index: torch.Tensor, src: torch.Tensor) -> None:
        """One op per layer; a CUDA pool's only path."""
        for i, view in enumerate(self._views):
            rows = self._rows[i]
            if rows is not None:
                rows[0].index_copy_(0, index, self._wide_column(src, i, rows[1]))
            else:
                view.index_copy_(0, index, self._column(src, i))

    def _flat_copy(
        self,
        pick: Chooser,
        team: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        queue: Callable[[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]], None],
        block_ids: Sequence[int],
        packed: torch.Tensor,
        nbytes: int,
    ) -> None:
        """One indexed copy between the flat view's rows and ``packed`` (its rows in
        packed order): ``team(rows, index, packed)``, one torch op; or, chosen by
        ``pick`` for large batches, ``queue(np_rows, index, packed)`` in
        :data:`_FLAT_PARTS` calls shared by two threads."""
        flat = self._flat
        assert flat is not None
        self._check_ids(block_ids)
        index = flat.index(block_ids)
        run_team = partial(team, flat.rows, index, packed)
        if not self._choosing(nbytes):
            run_team()
            return
        ids, buf = index.numpy(), _numpy(packed)
        parts = max(1, min(_FLAT_PARTS, nbytes // _TASK_BYTES))
        step = -(-len(ids) // parts)
        calls = [
            partial(queue, flat.np_rows, ids[s : s + step], buf[s : s + step])
            for s in range(0, len(ids), step)
        ]
        pick.run(nbytes, run_team, partial(run_queue, [calls]))

    def _gather_queue(
        self, block_ids: Sequence[int], index: torch.Tensor, target: torch.Tensor
    ) -> None:
        """Calls that each copy in the calling thread, run by two threads."""
        run_queue(self._gather_calls(block_ids, index, target))

    def _gather_calls(
        self, block_ids: Sequence[int], index: torch.Tensor, target: torch.Tensor
    ) -> Iterator[list[Callable[[], object]]]:
        splits: dict[int, tuple[torch.Tensor, ...]] = {}
        for i, view in enumerate(self._views):
            rows, np_rows = self._rows[i], self._np_rows[i]
            if rows is None or np_rows is None:
                # Block not contiguous in the layer: one shaped copy, torch's own threads.
                yield [partial(_select_shaped, view, index, self._column(target, i))]
                continue
            col = self._wide_column(target, i, rows[1])
            elems = rows[0].shape[1]
            per = SERIAL_ELEMS // elems if elems < SERIAL_ELEMS else 0  # rows per inline call
            if per:
                if per not in splits:
                    splits[per] = torch.split(index, per)
                yield [
                    partial(_select, rows[0], ix, o)
                    for ix, o in zip(splits[per], torch.split(col, per), strict=True)
                ]
            else:  # a row too long for one inline call: numpy, one row at a time
                np_col = _numpy(col)
                per = max(1, _TASK_BYTES // self.layer_bytes[i])
                yield [
                    partial(_copy_rows, np_rows, np_col, block_ids[s : s + per], s)
                    for s in range(0, len(block_ids), per)
                ]

    def _scatter_queue(self, index: torch.Tensor, src: torch.Tensor) -> None:
        """Numpy fancy assignments of about :data:`_TASK_BYTES`, run by two threads."""
        run_queue(self._scatter_calls(index, src))

    def _scatter_calls(
        self, index: torch.Tensor, src: torch.Tensor
    ) -> Iterator[list[Callable[[], object]]]:
        ids = index.numpy()
        for i, view in enumerate(self._views):
            rows, np_rows = self._rows[i], self._np_rows[i]
            if rows is None or np_rows is None:
                yield [partial(view.index_copy_, 0, index, self._column(src, i))]
                continue
            col = _numpy(self._wide_column(src, i, rows[1]))
            per = max(1, _TASK_BYTES // self.layer_bytes[i])
            yield [
                partial(_assign, np_rows, ids[s : s + per], col[s : s + per])
                for s in range(0, len(ids), per)
            ]

    # -- helpers ------------------------------------------------------------------
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

    def _check_buffer(self, buf: torch.Tensor, n: int) -> None:
        want = (n, self.bytes_per_block)
        if tuple(buf.shape) != want or buf.dtype != torch.uint8 or buf.stride(-1) != 1:
            raise LayoutMismatchError(
                f"staging buffer must be uint8 {want} with contiguous rows, "
                f"got {buf.dtype} {tuple(buf.shape)}"
            )
