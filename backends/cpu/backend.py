"""The ``cpu`` backend: one host slab of fixed-size slots, allocated once.

The slab is a single ``uint8 [num_slots, bytes_per_block]`` tensor, page-locked when
CUDA is present so GPU copies run as DMA; pinning is slow, so it happens once, at
start-up, never per block. Reads and writes are one vectorised ``index_select`` /
``index_copy_`` per batch: no Python object per block. Both go through the slab viewed
as rows of 16-byte elements where the block size allows: ``index_copy_`` copies element
by element, and over int64 rows a batched write ran at 0.55x of a plain copy of the same
bytes, over 16-byte elements at 0.85-0.9x (``kvoffload/tools/bench/cpu.py``).

Large host batches also choose, like :mod:`kvoffload.blockpool`'s gather and scatter,
between that one op (torch's OpenMP threads) and the same copy cut into numpy calls that
the calling thread and one helper take from a queue (``rows[slots] = src`` and
``np.take``, each one C loop over whole rows): the op wins on an idle machine, the queue
when another process holds a core (reads of 2 MiB blocks, one OpenMP region per row,
fell to 0.4x there; the queue held 0.9-1.0x).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import torch

from kvoffload.backend import Backend
from kvoffload.config import CPUTierConfig, TierConfig
from kvoffload.hostcopy import (
    WIDE,
    Chooser,
    as_numpy,
    assign,
    host_rows,
    run_queue,
    select,
    take,
    unpin,
    worth_choosing,
)
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.sizes import format_size

logger = logging.getLogger(__name__)


class CPUBackend(Backend):
    """Pinned (or pageable) host memory. Contents do not survive the process."""

    config_model = CPUTierConfig

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        want_pin = getattr(config, "pin_memory", None)
        pin = torch.cuda.is_available() if want_pin is None else bool(want_pin)
        if pin and not torch.cuda.is_available():
            logger.warning(
                "tier %s: pin_memory requested but CUDA is absent; not pinning", self.name
            )
            pin = False
        self.pinned = pin
        # Page-aligned rows (a disk tier can then read and write slots in place with
        # O_DIRECT), every page touched now: otherwise the first store into each slot
        # pays its page faults, and a fresh tier writes at a third of the speed of a
        # warm one, inside the transfer the engine waits for.
        t0 = time.perf_counter()
        self.slab = host_rows(self.num_slots, layout.bytes_per_block, pin=pin)
        self.setup_seconds = time.perf_counter() - t0
        """Time taken to allocate (and pin) the slab at start."""
        # Indexed copies over uint8 rows run several times slower than over 16-byte
        # rows of the same bytes; copy through the widest view the block size allows.
        self._width = next(w for w in (16, 8, 4, 2, 1) if layout.bytes_per_block % w == 0)
        self._wide = self.slab.view(WIDE[self._width])
        self._write_pick = Chooser()
        self._read_pick = Chooser()
        logger.info(
            "tier %s: cpu slab of %d slots x %d bytes (%s, %s, ready in %.2f s)",
            self.name,
            self.num_slots,
            layout.bytes_per_block,
            format_size(self.slab.numel()),
            "pinned" if pin else "pageable",
            self.setup_seconds,
        )

    def write(self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor) -> None:
        self.check_batch(slots, keys, src)
        if not slots:
            return
        index = self._index(slots)
        if src.device != self.slab.device:
            src = src.to(self.slab.device)
        wide = self._as_wide(src)
        if wide is None:
            self.slab.index_copy_(0, index, src)
            return
        nbytes = len(slots) * self.layout.bytes_per_block
        team = partial(self._wide.index_copy_, 0, index, wide)
        if worth_choosing(nbytes):
            self._write_pick.run(nbytes, team, partial(self._write_queue, index, wide))
        else:
            team()

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        index = self._index(slots)
        wide = self._as_wide(dst) if dst.device == self.slab.device else None
        if wide is not None:
            nbytes = len(slots) * self.layout.bytes_per_block
            team = partial(select, self._wide, index, wide)
            if worth_choosing(nbytes) and wide.is_contiguous():
                self._read_pick.run(nbytes, team, partial(self._read_queue, index, wide))
            else:
                team()
        else:
            dst.copy_(self.slab.index_select(0, index), non_blocking=self.pinned)
        # Host memory has no torn writes or bit rot to detect; the manager guarantees
        # the slot holds ``keys[i]``.
        return [True] * len(slots)

    def rows(self, start: int, n: int) -> torch.Tensor | None:
        if start < 0 or n < 0 or start + n > self.num_slots:
            raise IndexError(f"tier {self.name!r}: slots must be in 0..{self.num_slots - 1}")
        return self.slab[start : start + n]

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.int64)
        # np.take(mode="clip") of the queue read would clamp a bad slot silently.
        if int(index.min()) < 0 or int(index.max()) >= self.num_slots:
            raise IndexError(f"tier {self.name!r}: slots must be in 0..{self.num_slots - 1}")
        return index

    def _write_queue(self, index: torch.Tensor, wide: torch.Tensor) -> None:
        slots, rows, src = index.numpy(), as_numpy(self._wide), as_numpy(wide)
        per = self._rows_per_call()
        run_queue(
            [
                [
                    partial(assign, rows, slots[s : s + per], src[s : s + per])
                    for s in range(0, len(slots), per)
                ]
            ]
        )

    def _read_queue(self, index: torch.Tensor, wide: torch.Tensor) -> None:
        slots, rows, dst = index.numpy(), as_numpy(self._wide), as_numpy(wide)
        per = self._rows_per_call()
        run_queue(
            [
                [
                    partial(take, rows, slots[s : s + per], dst[s : s + per])
                    for s in range(0, len(slots), per)
                ]
            ]
        )

    def _rows_per_call(self) -> int:
        """Rows per numpy call of the queue: about 4 MiB."""
        return max(1, (4 << 20) // self.layout.bytes_per_block)

    def _as_wide(self, buf: torch.Tensor) -> torch.Tensor | None:
        """``buf`` viewed like ``_wide``, or ``None`` for a misaligned caller buffer."""
        w = self._width
        if buf.data_ptr() % w or buf.stride(0) % w or buf.stride(1) != 1:
            return None
        if buf.storage_offset() % w:  # ``view(dtype)`` checks the storage offset
            return None
        return buf.view(WIDE[self._width])

    def close(self) -> None:
        if self.pinned and self.slab.numel():
            unpin(self.slab)
        self.slab = torch.empty(0, dtype=torch.uint8)
        self._wide = self.slab
