"""The copies of many blocks between a :class:`~kvoffload.blockpool.BlockPool` and a
staging buffer: :meth:`PoolCopies.gather` and :meth:`PoolCopies.scatter`, and the host
strategies they choose between.

:meth:`~PoolCopies.gather` and :meth:`~PoolCopies.scatter` move many blocks between the
pool and a ``uint8 [n, bytes_per_block]`` staging buffer, writing straight into the
staging buffer's per-layer columns (:mod:`kvoffload.blockrows`) so no intermediate copy
is made. On a GPU that is one ``index_select`` / ``index_copy_`` per layer over int64
rows.

On the host, copies are bound by memory bandwidth, and two things decide whether they
reach it. Figures: ratios to a plain ``dst.copy_(src)`` of the same bytes (torch, two
threads), ``kvoffload/tools/bench/cpu.py`` on a 2-core VM, blocks of 64 KiB-2 MiB drawn at
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

**One call per batch** (:class:`~kvoffload.blockrows.FlatRows`). Where the layers'
addresses, block strides and sizes share a unit of 1 KiB or more (vLLM's large
per-layer allocations: a page), the host pool is one row tensor over all layers, and a
batch is one ``index_select`` / ``index_copy_`` (team) or a few numpy calls (queue) for
every layer at once. Per-layer calls each hand the GIL back and wait to get it again:
beside an engine thread that steps Python code (a background load) that wait, up to 5
ms, took a 30-layer load of 136 MB from ~10 ms to 280-460 ms in vLLM. The per-layer
paths below remain for pools without such a unit.

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

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Final

import numpy.typing as npt
import torch

from kvoffload.blockrows import PoolLayout
from kvoffload.hostcopy import Chooser, run_queue, worth_choosing
from kvoffload.hostcopy import as_numpy as _numpy
from kvoffload.hostcopy import assign as _assign
from kvoffload.hostcopy import take as _take

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

_FLAT_PARTS: Final = 4
"""Calls a flat copy of the queue strategy is cut into: enough for the caller and the
helper to share it, few enough that a thread waits for the GIL a few times per batch,
not once per layer."""


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


class PoolCopies(PoolLayout):
    """A pool's copies of many blocks to and from staging buffers (see the module docs)."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_dim: int = 0) -> None:
        super().__init__(kv_caches, block_dim)
        self._gather_pick = Chooser()
        self._scatter_pick = Chooser()

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
