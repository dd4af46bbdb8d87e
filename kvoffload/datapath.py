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

CUDA pool. Per direction one :class:`~kvoffload.devicelane.DeviceLane`: a non-default
stream shared by that direction's jobs, and static device buffers per job size:

- a job first waits for an event the engine's thread recorded on its own stream when
  it submitted the job, so a store reads the blocks only after the forward pass that
  wrote them, and a load overwrites blocks only after every kernel queued before it;
- the block index is built on the host, checked there, and uploaded from pinned memory
  without a device synchronisation (``torch.as_tensor(..., device=cuda)`` would be a
  pageable copy, which waits for the whole device, i.e. for the model);
- the engine's blocks are packed on the device into the lane's static rows (HBM copies
  cost ~1/30 of the bus time; one CUDA graph launch for all layers once a size has
  been seen, no ``cudaMalloc`` per job), and one DMA per group of consecutive slots
  crosses PCIe into (or out of) the pinned slab;
- the job records an event after its last copy and waits for it before it returns, so
  "finished" means the bytes landed; no slot or buffer is reused before then.

Copies with a DMA engine rather than a kernel writing host memory: a kernel takes SMs
from the model, and at the block sizes that matter the DMA reaches the bus limit.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.devicelane import DeviceLane
from kvoffload.hostcopy import Buffers

logger = logging.getLogger(__name__)

Piece = tuple[int, torch.Tensor]
"""``(pos, rows)``: host rows that hold (or receive) the job's blocks ``pos ..
pos + len(rows) - 1``, in order."""


def groups(slots: Sequence[int], start: int = 0) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: ``(position, first slot, count)``, the
    position counted from ``start``."""
    if len(slots) > 64:  # one numpy pass instead of a Python step per slot
        arr = np.asarray(slots, dtype=np.int64)
        starts = np.flatnonzero(np.diff(arr) != 1) + 1
        bounds = [0, *starts.tolist(), len(slots)]
        return [(start + a, slots[a], b - a) for a, b in itertools.pairwise(bounds)]
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and slot == out[-1][1] + out[-1][2]:
            pos, first, count = out[-1]
            out[-1] = (pos, first, count + 1)
        else:
            out.append((start + i, slot, 1))
    return out


class LayerProgress:
    """How far one layer-wise load has got, layer by layer: the load job reports each
    layer in order (:meth:`layer_done`) and then :meth:`finish`; the engine's thread
    waits for the one layer it is about to read (:meth:`wait`).

    On a host pool a reported layer has landed, and :meth:`wait` blocks until it is
    reported. On CUDA a reported layer carries the event its copies complete; the
    engine's thread blocks only until the job has *queued* them (an event not yet
    recorded cannot be waited on by a stream), then makes its current stream wait on
    the event: the host goes on launching the model's kernels. :meth:`finish` (always
    called, a failed load too) releases every waiter, so a step never waits past its
    loads; the layers a failed load never reported carry nothing to wait on, and the
    load's blocks are reported as load errors instead."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._events: list[Any] = []
        self._finished = False

    def layer_done(self, layer: int, event: Any = None) -> None:
        """Layer ``layer`` is in (host) or queued with ``event`` (CUDA); in order."""
        with self._cond:
            if layer != len(self._events):
                raise ValueError(f"layer {layer} reported after {len(self._events)} layers")
            self._events.append(event)
            self._cond.notify_all()

    def finish(self) -> None:
        """No more layers will be reported (the load ended, well or not)."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    @property
    def layers_done(self) -> int:
        with self._cond:
            return len(self._events)

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished

    def wait(self, layer: int, stream: Any = None, timeout: float | None = None) -> bool:
        """Return once layer ``layer`` (all of them when it is out of range) can be read
        on ``stream`` (CUDA: the stream waits on the layer's event) or the load ended:
        ``True``; ``False`` when ``timeout`` seconds passed first."""
        want = layer + 1 if 0 <= layer < self.num_layers else self.num_layers
        with self._cond:
            if not self._cond.wait_for(
                lambda: len(self._events) >= want or self._finished, timeout
            ):
                return False
            events = self._events[layer : layer + 1] if want == layer + 1 else self._events
        if stream is not None:
            for event in events:
                if event is not None:
                    stream.wait_event(event)
        return True


class LoadGate:
    """Settles the race between a load job about to copy into the engine's blocks and
    the engine giving up on that load (``load_timeout_ms``): exactly one of them wins.
    Once the engine has abandoned a load it recomputes those blocks, so a copy landing
    afterwards would overwrite fresh KV with stale bytes; once the copy has begun, the
    engine waits for it (a memory copy: bounded) rather than recompute over it."""

    _PENDING, _COPYING, _ABANDONED = range(3)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = self._PENDING

    def enter(self) -> bool:
        """The job is about to copy into the pool: ``False`` if the load was abandoned
        (copy nothing)."""
        with self._lock:
            if self._state == self._ABANDONED:
                return False
            self._state = self._COPYING
            return True

    def abandon(self) -> bool:
        """The engine gives up on the load: ``True`` if the job will never copy into the
        pool; ``False`` if its copy has begun (wait for the job)."""
        with self._lock:
            if self._state == self._PENDING:
                self._state = self._ABANDONED
                return True
            return self._state == self._ABANDONED


class StoreAbandonedError(RuntimeError):
    """A store job found its :class:`StoreGate` abandoned: it reads nothing and fails."""


class StoreGate:
    """Settles the race between a store job about to read the engine's blocks and the
    engine wanting those blocks back (a preemption reuses them at once; a finished
    request's are freed), which it may do once the job has read them or never will.

    The engine waits for the read (:meth:`wait`), not for the whole store: a disk tier
    may take long to write, or hang, after the blocks were read. A job that has not
    begun reading by the engine's deadline is abandoned and reads nothing (its store
    fails); one whose read has begun is waited for (a memory copy: bounded)."""

    _PENDING, _READING, _RELEASED, _ABANDONED = range(4)

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = self._PENDING
        self.since = time.monotonic()
        """When the store was submitted (``time.monotonic``): its deadline's start."""

    def enter(self) -> bool:
        """The job is about to read the engine's blocks: ``False`` if abandoned."""
        with self._cond:
            if self._state == self._ABANDONED:
                return False
            self._state = self._READING
            return True

    def release(self) -> None:
        """The job no longer reads the engine's blocks (read, failed or finished)."""
        with self._cond:
            if self._state != self._ABANDONED:
                self._state = self._RELEASED
            self._cond.notify_all()

    def released(self) -> bool:
        """Whether the engine's blocks are free of this job (read or abandoned)."""
        with self._cond:
            return self._state in (self._RELEASED, self._ABANDONED)

    def wait(self, timeout: float) -> bool:
        """Return once the engine's blocks are free of this job, waiting at most
        ``timeout`` seconds for a job that has not begun reading them (it is abandoned
        then) and for as long as a read in progress takes. ``True`` if abandoned."""
        with self._cond:
            self._cond.wait_for(lambda: self._state != self._PENDING, max(0.0, timeout))
            if self._state == self._PENDING:
                self._state = self._ABANDONED
                return True
            self._cond.wait_for(lambda: self._state != self._READING)
            return self._state == self._ABANDONED


def _ignore_layer(layer: int, event: Any) -> None:
    """``on_layer`` when nobody listens."""


_cudart: list[Any] = []  # [cudaMemcpy2DAsync or None], once looked up


def _memcpy2d() -> Any:
    """``cudaMemcpy2DAsync`` from the CUDA runtime torch loaded (``None`` if not found).
    Torch exposes no strided host-to-device copy that stays asynchronous: ``copy_`` of a
    non-contiguous pinned view goes through a pageable temporary."""
    if not _cudart:
        fn = None
        names = [
            line.split()[-1]
            for line in _maps()
            if "libcudart.so" in line and line.split()[-1].startswith("/")
        ]
        for name in [*dict.fromkeys(names), "libcudart.so.13", "libcudart.so.12"]:
            try:
                fn = ctypes.CDLL(name).cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            size, ptr = ctypes.c_size_t, ctypes.c_void_p
            # dst, dpitch, src, spitch, width, height, kind, stream
            fn.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int, ptr]
            fn.restype = ctypes.c_int
            break
        _cudart.append(fn)
    return _cudart[0]


def _maps() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


_HOST_TO_DEVICE: Final = 1  # cudaMemcpyHostToDevice


def _copy_columns(
    copy2d: Any, dst: torch.Tensor, rows: torch.Tensor, offset: int, width: int, stream: Any
) -> None:
    """Queue on ``stream`` the copy of bytes ``offset .. offset + width`` of each of
    ``rows`` (host) into the same bytes of the rows of ``dst`` (on the device)."""
    err = copy2d(
        dst.data_ptr() + offset,
        dst.stride(0),
        rows.data_ptr() + offset,
        rows.stride(0),
        width,
        rows.shape[0],
        _HOST_TO_DEVICE,
        stream.cuda_stream,
    )
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: CUDA error {err}")


class DataPath:
    """Copies between the engine's :class:`~kvoffload.blockpool.BlockPool` and host
    rows (tier slabs or staging buffers). See the module docstring."""

    def __init__(self, bytes_per_block: int, pool: BlockPool | None) -> None:
        self.bpb = bytes_per_block
        self.pool = pool
        self.cuda = pool is not None and pool.device.type == "cuda"
        self.buffers = Buffers(bytes_per_block, pin_memory=torch.cuda.is_available())
        self._streams: dict[str, Any] = {}
        self._lanes: dict[str, DeviceLane] = {}
        if self.cuda:
            assert pool is not None
            graphs = os.environ.get("KVOFFLOAD_CUDA_GRAPHS", "1") != "0"
            for lane in ("store", "load"):
                self._lanes[lane] = DeviceLane(pool, lane, graphs=graphs)
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
        self._lanes["store"].run(pool_ids, pieces, after)

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
        self._lanes["load"].run(pool_ids, pieces, after)

    def unpack_layers(
        self,
        pool_ids: Sequence[int],
        pieces: Sequence[Piece],
        after: Any = None,
        on_layer: Callable[[int, Any], None] | None = None,
    ) -> None:
        """As :meth:`unpack`, but layer by layer, layer 0 first, calling ``on_layer(layer,
        event)`` as each layer's bytes are in (host pool: ``event`` is ``None`` and the
        bytes landed) or queued (CUDA: ``event`` completes when they land, so a stream
        that waits on it reads the layer). Returns once every layer landed. A layer-wise
        load hands the engine layer N while it copies layer N+1.

        CUDA: per layer, one 2-D DMA per piece moves that layer's column of the pinned
        rows (``cudaMemcpy2DAsync``: row pitch ``bytes_per_block``, width the layer's
        bytes) into a device buffer, and one op scatters it into the pool. Without a
        2-D copy (no ``libcudart`` found) the rows cross in one go first and only the
        scatters go layer by layer."""
        pool = self._need_pool()
        report = on_layer if on_layer is not None else _ignore_layer
        if not pool_ids:
            for layer in range(pool.num_layers):
                report(layer, None)
            return
        if not self.cuda:
            for layer in range(pool.num_layers):
                for pos, rows in pieces:
                    pool.scatter_layer(layer, pool_ids[pos : pos + rows.shape[0]], rows)
                report(layer, None)
            return
        stream = self._streams["load"]
        copy2d = _memcpy2d()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            index = pool.device_index(pool_ids)
            packed = torch.empty((len(pool_ids), self.bpb), dtype=torch.uint8, device=pool.device)
            if copy2d is None:
                for pos, rows in pieces:
                    packed[pos : pos + rows.shape[0]].copy_(rows, non_blocking=True)
            for layer in range(pool.num_layers):
                if copy2d is not None:
                    off, width = pool.layer_offsets[layer], pool.layer_bytes[layer]
                    for pos, rows in pieces:
                        _copy_columns(
                            copy2d, packed[pos : pos + rows.shape[0]], rows, off, width, stream
                        )
                pool.unpack_layer(layer, index, packed)
                report(layer, stream.record_event())
            done = stream.record_event()
        done.synchronize()

    def _need_pool(self) -> BlockPool:
        if self.pool is None:
            raise ValueError("this Offloader has no block pool; pass pool= to store or load")
        return self.pool
