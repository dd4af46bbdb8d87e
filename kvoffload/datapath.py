"""The data path: buffers, copies, streams and events. It moves bytes; it never sees a
manager, a key's state or a lock.

The Offloader's books decide *what* moves (which pool blocks, which slots of which
tier); this module decides *how*, with one rule: **one copy between the engine and the
first tier.** A store gathers the engine's blocks straight into the cpu tier's slab
slots; a load scatters straight from them (:meth:`~kvoffload.backend.Backend.rows`
gives the slab as plain rows). A lower tier reads and writes those rows directly too,
so between a disk and the engine a block passes through at most one host buffer.

Host pool (vLLM's CPU build): the gather or scatter from the pool into the slab rows
*is* the one copy. Slots come in groups of consecutive rows (the slot allocator hands
out neighbours, and LRU frees whole earlier batches), one copy call per group.

CUDA pool. Per direction one non-default stream, shared by that lane's jobs:

- a job first waits for an event the engine's thread recorded on its own stream when
  it submitted the job, so a store reads the blocks only after the forward pass that
  wrote them, and a load overwrites blocks only after every kernel queued before it;
- the block index is built on the host, checked there, and uploaded from pinned memory
  without a device synchronisation (``torch.as_tensor(..., device=cuda)`` would be a
  pageable copy, which waits for the whole device, i.e. for the model);
- the engine's blocks are packed on the device into a temporary from torch's caching
  allocator (no ``cudaMalloc`` per job once warm; HBM copies cost ~1/30 of the bus
  time), and one DMA per group of consecutive slots crosses PCIe into (or out of) the
  pinned slab;
- the job records an event after its last copy and waits for it before it returns, so
  "finished" means the bytes landed; no slot or buffer is reused before then.

Copies with a DMA engine rather than a kernel writing host memory: a kernel takes SMs
from the model, and at the block sizes that matter the DMA reaches the bus limit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Final

import torch

from kvoffload.blockpool import BlockPool, page_aligned_empty

logger = logging.getLogger(__name__)

Piece = tuple[int, torch.Tensor]
"""``(pos, rows)``: host rows that hold (or receive) the job's blocks ``pos ..
pos + len(rows) - 1``, in order."""


def groups(slots: Sequence[int], start: int = 0) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: ``(position, first slot, count)``, the
    position counted from ``start``."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and slot == out[-1][1] + out[-1][2]:
            pos, first, count = out[-1]
            out[-1] = (pos, first, count + 1)
        else:
            out.append((start + i, slot, 1))
    return out


class Buffers:
    """Reusable page-aligned (pinned under CUDA) staging buffers, so that a transfer
    does not pay page faults on fresh memory every time. Thread-safe."""

    KEEP_BYTES: Final = 512 * 1024**2
    """Free buffers kept for reuse, in bytes; beyond it they go back to the allocator."""

    def __init__(self, bytes_per_block: int, *, pin_memory: bool) -> None:
        self.bpb = bytes_per_block
        self.pin = pin_memory
        self._free: list[torch.Tensor] = []  # sorted by rows, smallest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self._lock = threading.Lock()

    def acquire(self, n: int) -> torch.Tensor:
        """A ``uint8 [n, bytes_per_block]`` page-aligned view; give it back with
        :meth:`release`."""
        with self._lock:
            for i, whole in enumerate(self._free):
                if whole.shape[0] >= n:
                    del self._free[i]
                    break
            else:
                whole = page_aligned_empty(max(n, 16), self.bpb, pin_memory=self.pin)
            self._lent[whole.data_ptr()] = whole
        return whole[:n]

    def release(self, view: torch.Tensor) -> None:
        with self._lock:
            whole = self._lent.pop(view.data_ptr())
            kept = sum(b.numel() for b in self._free)
            if kept + whole.numel() <= self.KEEP_BYTES:
                self._free.append(whole)
                self._free.sort(key=lambda b: b.shape[0])


class DataPath:
    """Copies between the engine's :class:`~kvoffload.blockpool.BlockPool` and host
    rows (tier slabs or staging buffers). See the module docstring."""

    def __init__(self, bytes_per_block: int, pool: BlockPool | None) -> None:
        self.bpb = bytes_per_block
        self.pool = pool
        self.cuda = pool is not None and pool.device.type == "cuda"
        self.buffers = Buffers(bytes_per_block, pin_memory=torch.cuda.is_available())
        self._streams: dict[str, Any] = {}
        if self.cuda:
            assert pool is not None
            for lane in ("store", "load"):
                self._streams[lane] = torch.cuda.Stream(device=pool.device)  # type: ignore[no-untyped-call]

    # -- engine thread -----------------------------------------------------------------
    def mark(self) -> Any:
        """An event on the engine's current stream (CUDA), recorded now, in the engine's
        thread: a job waits for it, so it sees every kernel the engine queued before
        submitting it. ``None`` on a host pool (host copies are synchronous)."""
        if not self.cuda:
            return None
        assert self.pool is not None
        return torch.cuda.current_stream(self.pool.device).record_event()

    # -- lane threads ------------------------------------------------------------------
    def pack(self, pool_ids: Sequence[int], pieces: Sequence[Piece], after: Any = None) -> None:
        """Gather pool blocks ``pool_ids`` into ``pieces`` (whose rows together cover
        ``pool_ids`` in order); returns once the bytes are there."""
        pool = self._need_pool()
        if not pool_ids:
            return
        if not self.cuda:
            for pos, rows in pieces:
                pool.gather(pool_ids[pos : pos + rows.shape[0]], rows)
            return
        stream = self._streams["store"]
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            index = pool.device_index(pool_ids)
            packed = torch.empty((len(pool_ids), self.bpb), dtype=torch.uint8, device=pool.device)
            pool.pack(index, packed)
            for pos, rows in pieces:
                rows.copy_(packed[pos : pos + rows.shape[0]], non_blocking=True)
            done = stream.record_event()
        done.synchronize()

    def unpack(self, pool_ids: Sequence[int], pieces: Sequence[Piece], after: Any = None) -> None:
        """Scatter ``pieces`` (covering ``pool_ids`` in order) into pool blocks
        ``pool_ids`` (distinct); returns once the bytes are there."""
        pool = self._need_pool()
        if not pool_ids:
            return
        if not self.cuda:
            for pos, rows in pieces:
                pool.scatter(pool_ids[pos : pos + rows.shape[0]], rows)
            return
        stream = self._streams["load"]
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            index = pool.device_index(pool_ids)
            packed = torch.empty((len(pool_ids), self.bpb), dtype=torch.uint8, device=pool.device)
            for pos, rows in pieces:
                packed[pos : pos + rows.shape[0]].copy_(rows, non_blocking=True)
            pool.unpack(index, packed)
            done = stream.record_event()
        done.synchronize()

    def _need_pool(self) -> BlockPool:
        if self.pool is None:
            raise ValueError("this Offloader has no block pool; pass pool= to store or load")
        return self.pool
