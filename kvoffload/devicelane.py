"""One direction of the CUDA data path: the device-side work of a job, queued with as
few Python operations as possible, on a stream per calling thread.

Why a module of its own: on a GPU the bus is not what limits a job, Python is. A job
moves 32 layers of many blocks; queued op by op that is an index upload plus one
``index_select`` (or ``index_copy_``) per layer, about 0.7 ms of Python for a 64 MiB job
against 1.2 ms on the bus, serialised by the GIL with the engine's thread and the other
lanes (see the H100 figures in ``docs/benchmarks.md``). A :class:`DeviceLane` therefore
keeps, per job size, *static* device buffers (the block index and the packed rows) and
records the per-layer ops into a CUDA graph once, so a job is:

1. the block ids written into a pinned host index (numpy, no tensor per job) and one
   asynchronous upload into the static index: no device synchronisation, no
   ``cudaMalloc``;
2. one graph launch that packs (or unpacks) every layer, on the device (HBM);
3. one DMA per run of consecutive host rows.

Per thread. Each thread that runs jobs (the Offloader gives each direction two) has
its own stream, static buffers and graphs: no lock, and one thread's pack (or unpack)
runs on the device while the other thread's DMA is on the bus, so the HBM pass hides
behind the bus instead of adding to it (measured on an H100: a 32 MiB pack took
0.1-0.4 ms against 0.6 ms of DMA).

Sizes. Jobs are cut into chunks of at most :data:`CHUNK_BYTES` (and at least
:data:`MIN_ROWS` blocks), and a chunk of ``n`` blocks uses the buffers and graph of
the next power of two from :data:`MIN_ROWS`: a handful of graphs per thread, and less
than ``2 * max(CHUNK_BYTES, MIN_ROWS * block)`` of device memory per thread, allocated
as sizes are first used (the data path's only device memory: at most 64 MiB per thread
for 64 KiB to 2 MiB blocks, 256 MiB for the Offloader's four lane threads).

The index is padded with the chunk's last block: a pack copies that block again into
rows nobody reads; an unpack first copies the last row into the padding
rows, so the extra writes put the same bytes into the same block. Why at least 32
rows: torch's ``index_select`` / ``index_copy_`` use a kernel with one thread block
per 128 elements of a row for 16 indices or fewer, which packed 2 MiB blocks at 86 GB/s
on an H100, against 513 GB/s with 32 indices.

A graph is recorded on a stream of its own the second time a size is used (the first
runs the ops eagerly, which also loads their kernels), in thread-local capture mode so
the engine and the other lanes go on launching meanwhile. If recording fails, the lane
logs it once and stays eager: the same ops, one by one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.blockpool import BlockPool

logger = logging.getLogger(__name__)

CHUNK_BYTES: Final = 32 * 2**20
"""Bytes of blocks one graph launch packs or unpacks, unless :data:`MIN_ROWS` blocks
are more."""

MIN_ROWS: Final = 32
"""The smallest static size, in blocks (see the module docstring for why 32)."""

Piece = tuple[int, torch.Tensor]
"""``(pos, rows)``: host rows holding (or receiving) the job's blocks ``pos ..
pos + len(rows) - 1`` (as :data:`kvoffload.datapath.Piece`)."""


def chunk_rows(bytes_per_block: int) -> int:
    """Blocks per chunk: the largest power of two whose blocks fit :data:`CHUNK_BYTES`,
    and at least :data:`MIN_ROWS`."""
    rows = MIN_ROWS
    while rows * 2 * bytes_per_block <= CHUNK_BYTES:
        rows *= 2
    return rows


def size_for(n: int, limit: int) -> int:
    """The static size serving ``n`` blocks (``1 <= n <= limit``)."""
    rows = min(MIN_ROWS, limit)
    while rows < n:
        rows *= 2
    return rows


class _Size:
    """Static buffers of one size, and their graph once recorded."""

    __slots__ = ("graph", "index", "packed", "uses")

    def __init__(self, rows: int, bytes_per_block: int, device: torch.device) -> None:
        self.index = torch.zeros(rows, dtype=torch.int64, device=device)
        self.packed = torch.empty((rows, bytes_per_block), dtype=torch.uint8, device=device)
        self.graph: Any = None
        self.uses = 0


class _Thread:
    """One thread's stream, static sizes and pinned host index."""

    def __init__(self, device: torch.device, rows: int) -> None:
        cuda = device.type == "cuda"
        # A host pool gets no stream (tests run the same chunking and padding there).
        self.stream: Any = torch.cuda.Stream(device=device) if cuda else None  # type: ignore[no-untyped-call]
        self.capture: Any = None  # the stream graphs are recorded on, made on first use
        self.sizes: dict[int, _Size] = {}
        self.pinned = torch.zeros(rows, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self.ids: npt.NDArray[np.int64] = self.pinned.numpy()

    def index_rows(self, rows: int) -> None:
        """Grow the pinned host index to ``rows`` (doubling). The thread waited for its
        last job's uploads, so the old one is free."""
        if self.pinned.shape[0] < rows:
            have = self.pinned.shape[0]
            while have < rows:
                have *= 2
            self.pinned = torch.zeros(have, dtype=torch.int64, pin_memory=torch.cuda.is_available())
            self.ids = self.pinned.numpy()


class DeviceLane:
    """One direction (``"store"``: pool -> host rows, ``"load"``: host rows -> pool) of
    the CUDA data path. See the module docstring."""

    def __init__(self, pool: BlockPool, direction: str, *, graphs: bool = True) -> None:
        if direction not in ("store", "load"):
            raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
        self.pool = pool
        self.direction = direction
        self.bpb = pool.bytes_per_block
        self.graphs = graphs and pool.device.type == "cuda"
        self.chunk = chunk_rows(self.bpb)
        self._local = threading.local()
        self._threads: list[_Thread] = []  # every thread's state (for tests and stats)
        self._threads_lock = threading.Lock()

    # -- a job -------------------------------------------------------------------------
    def run(self, pool_ids: Sequence[int], pieces: Sequence[Piece], after: Any = None) -> None:
        """Pack ``pool_ids`` into ``pieces`` (store) or unpack ``pieces`` into them
        (load), after the engine's event ``after``; returns once the bytes are there."""
        n = len(pool_ids)
        if not n:
            return
        self.pool.check_ids(pool_ids)
        me = self._me()
        me.index_rows(-(-n // self.chunk) * self.chunk)
        on_stream = torch.cuda.stream(me.stream) if me.stream is not None else nullcontext()
        with on_stream:
            if after is not None:
                me.stream.wait_event(after)
            for start in range(0, n, self.chunk):
                self._chunk(me, pool_ids, start, min(n, start + self.chunk), pieces)
            done = me.stream.record_event() if me.stream is not None else None
        if done is not None:
            done.synchronize()

    def _chunk(
        self, me: _Thread, pool_ids: Sequence[int], start: int, stop: int, pieces: Sequence[Piece]
    ) -> None:
        """Queue blocks ``start .. stop - 1`` of the job on the thread's stream. Each
        chunk has host index rows of its own (``start`` is a multiple of the chunk), so
        no chunk rewrites what an earlier upload still has to read."""
        n = stop - start
        rows = size_for(n, self.chunk)
        size = me.sizes.get(rows)
        if size is None:
            size = me.sizes[rows] = _Size(rows, self.bpb, self.pool.device)
        me.ids[start:stop] = pool_ids[start:stop]
        me.ids[stop : start + rows] = pool_ids[stop - 1]
        size.index.copy_(me.pinned[start : start + rows], non_blocking=True)
        # The pieces' rows that fall in this chunk, with the matching static rows.
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pos, r in pieces:
            lo, hi = max(pos, start), min(pos + r.shape[0], stop)
            if lo < hi:
                pairs.append((r[lo - pos : hi - pos], size.packed[lo - start : hi - start]))
        if self.direction == "store":
            self._launch(me, size)
            for host_rows, dev_rows in pairs:
                host_rows.copy_(dev_rows, non_blocking=True)
        else:
            for host_rows, dev_rows in pairs:
                dev_rows.copy_(host_rows, non_blocking=True)
            if rows > n:
                size.packed[n:rows].copy_(size.packed[n - 1 : n].expand(rows - n, self.bpb))
            self._launch(me, size)

    def _launch(self, me: _Thread, size: _Size) -> None:
        """The size's per-layer ops: one graph launch once recorded, else one by one."""
        size.uses += 1
        if size.graph is None and self.graphs and size.uses == 2:
            size.graph = self._record(me, size)
        if size.graph is not None:
            size.graph.replay()
        else:
            self._ops()(size.index, size.packed)

    def _ops(self) -> Callable[[torch.Tensor, torch.Tensor], None]:
        return self.pool.pack if self.direction == "store" else self.pool.unpack

    def _record(self, me: _Thread, size: _Size) -> Any:
        """Record the size's ops into a graph (``None``, and eager from now on, if
        recording fails)."""
        if me.capture is None:
            me.capture = torch.cuda.Stream(device=self.pool.device)  # type: ignore[no-untyped-call]
        graph = torch.cuda.CUDAGraph()
        me.capture.wait_stream(me.stream)  # nothing to wait for, but keeps the order plain
        try:
            with torch.cuda.stream(me.capture):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._ops()(size.index, size.packed)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            logger.warning(
                "kvoffload: could not record the %s copies as a CUDA graph (%s); "
                "launching them one by one",
                self.direction,
                exc,
            )
            self.graphs = False
            return None
        me.stream.wait_stream(me.capture)
        return graph

    def _me(self) -> _Thread:
        me: _Thread | None = getattr(self._local, "state", None)
        if me is None:
            me = _Thread(self.pool.device, self.chunk)
            self._local.state = me
            with self._threads_lock:
                self._threads.append(me)
        return me

    def device_bytes(self) -> int:
        """Device memory held by the static buffers of every thread."""
        with self._threads_lock:
            sizes = [s for t in self._threads for s in t.sizes.values()]
        return sum(s.packed.numel() + 8 * s.index.numel() for s in sizes)
