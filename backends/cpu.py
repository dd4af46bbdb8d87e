"""The ``cpu`` backend: one host slab of fixed-size slots, allocated once.

The slab is a single ``uint8 [num_slots, bytes_per_block]`` tensor, page-locked when
CUDA is present so GPU copies run as DMA; pinning is slow, so it happens once, at
start-up, never per block. Reads and writes are one vectorised ``index_select`` /
``index_copy_`` per batch: no Python object per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import torch

from kvoffload.backend import Backend
from kvoffload.config import CPUTierConfig, TierConfig
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
        self.slab = torch.empty(
            (self.num_slots, layout.bytes_per_block), dtype=torch.uint8, pin_memory=pin
        )
        if not pin:
            # Touch every page now (pinned memory already is): otherwise the first store
            # into each slot pays its page faults, and a fresh tier writes at a third
            # of the speed of a warm one, inside the transfer the engine waits for.
            self.slab.zero_()
        # Indexed copies over uint8 rows run several times slower than over int64 rows
        # of the same bytes; copy through the widest view the block size allows.
        self._width = next(w for w in (8, 4, 2, 1) if layout.bytes_per_block % w == 0)
        self._wide = self.slab.view(_WIDE[self._width])
        logger.info(
            "tier %s: cpu slab of %d slots x %d bytes (%s, %s)",
            self.name,
            self.num_slots,
            layout.bytes_per_block,
            format_size(self.slab.numel()),
            "pinned" if pin else "pageable",
        )

    def write(self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor) -> None:
        self.check_batch(slots, keys, src)
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64)
        if src.device != self.slab.device:
            src = src.to(self.slab.device)
        wide = self._as_wide(src)
        if wide is not None:
            self._wide.index_copy_(0, index, wide)
        else:
            self.slab.index_copy_(0, index, src)

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        index = torch.tensor(slots, dtype=torch.int64)
        wide = self._as_wide(dst) if dst.device == self.slab.device else None
        if wide is not None:
            torch.index_select(self._wide, 0, index, out=wide)
        else:
            dst.copy_(self.slab.index_select(0, index), non_blocking=self.pinned)
        # Host memory has no torn writes or bit rot to detect; the manager guarantees
        # the slot holds ``keys[i]``.
        return [True] * len(slots)

    def _as_wide(self, buf: torch.Tensor) -> torch.Tensor | None:
        """``buf`` viewed like ``_wide``, or ``None`` for a misaligned caller buffer."""
        if buf.data_ptr() % self._width or buf.stride(0) % self._width or buf.stride(1) != 1:
            return None
        return buf.view(_WIDE[self._width])

    def close(self) -> None:
        self.slab = torch.empty(0, dtype=torch.uint8)
        self._wide = self.slab


_WIDE: Final[dict[int, torch.dtype]] = {
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
