"""A view over the engine's per-layer KV tensors as numbered blocks.

Runs on the worker side. The engine owns the tensors; :class:`BlockPool` only indexes
them. Block ``b`` of layer ``l`` is ``kv_caches[l].select(block_dim, b)``, whatever the
rest of the shape is (vLLM's CPU build: ``[B, H, N, C]`` int8 views, LBHNC; CUDA flash
attention: ``[2, B, N, H, D]`` with ``block_dim=1``; the canonical pool of
:meth:`BlockPool.allocate`: ``[B, 2, N, H, D]``).

A block's *packed* form, the unit every tier stores, is the concatenation of its
per-layer bytes, layer 0 first. The pool is built in three parts, one role each:
:mod:`kvoffload.blockrows` (the layout: per-layer row views, the flat view over every
layer, the checks), :mod:`kvoffload.blockcopy` (:meth:`~BlockPool.gather` and
:meth:`~BlockPool.scatter` of many blocks, with the host copy strategies and their
measurements), and this module's :class:`BlockPool` (one block at a time, the device
side's CUDA jobs, layer-wise loads). Every name is importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvoffload.blockcopy import SERIAL_ELEMS as SERIAL_ELEMS
from kvoffload.blockcopy import PoolCopies
from kvoffload.blockrows import FLAT_MIN_UNIT as FLAT_MIN_UNIT
from kvoffload.cudacopy import LayerCopy, for_layers
from kvoffload.exceptions import LayoutMismatchError
from kvoffload.hostcopy import QUEUE_MIN_BYTES as QUEUE_MIN_BYTES
from kvoffload.hostcopy import Chooser as Chooser
from kvoffload.hostcopy import as_numpy as _numpy
from kvoffload.hostcopy import assign as _assign
from kvoffload.hostcopy import byte_view as byte_view
from kvoffload.hostcopy import page_aligned_empty as page_aligned_empty
from kvoffload.hostcopy import run_queue as run_queue
from kvoffload.hostcopy import worth_choosing as worth_choosing
from kvoffload.layout import KVLayout


class BlockPool(PoolCopies):
    """Numbered blocks over a list of per-layer tensors sharing the block dimension."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_dim: int = 0) -> None:
        super().__init__(kv_caches, block_dim)
        # The one-launch device copy: False until first looked for (then it or None).
        self._kernel: LayerCopy | bool | None = False if self.device.type == "cuda" else None

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

    # -- staging buffers ----------------------------------------------------------
    def new_staging(self, n: int, *, pin_memory: bool = False) -> torch.Tensor:
        """A page-aligned host staging buffer for ``n`` packed blocks."""
        return page_aligned_empty(n, self.bytes_per_block, pin_memory=pin_memory)

    # -- device side (the data path's CUDA jobs) -----------------------------------
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

    def _layer_copy(self) -> LayerCopy | None:
        """The one-launch copy for this pool, built on first use (``None`` on the host,
        without Triton, or for layouts it does not serve)."""
        if self._kernel is False:
            found = for_layers(self._views, self.layer_offsets, self.bytes_per_block)
            self._kernel = found if found is not None else None
        return self._kernel if isinstance(self._kernel, LayerCopy) else None
