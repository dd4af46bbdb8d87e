"""Host-memory copy helpers shared by the block pool and the memory tiers.

Why a module of its own: :mod:`kvoffload.blockpool` (the engine's blocks) and the
``cpu`` backend (the slab) copy host rows the same way, with the same two strategies
and the same chooser between them (the measurements are in ``blockpool``'s docstring).
Backends sit below the block pool in the layering, so the shared pieces live here,
below both, instead of the backend reaching up into the pool's module.

Also here: page-aligned and pinned host rows. A large pinned slab is allocated
pageable, first-touched by torch's threads and then registered with CUDA
(``cudaHostRegister``), which is several times faster than ``cudaHostAlloc`` of the
same size (a single-threaded fault-in), see :func:`host_rows`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt
import torch

logger = logging.getLogger(__name__)

PAGE: Final = 4096

QUEUE_MIN_BYTES: Final = 4 * 2**20
"""Host batches from this size choose between the team and the queue strategies;
smaller ones take the team's per-layer ops (a helper thread costs tens of us to wake)."""

_helper_lock = threading.Lock()
_helper: ThreadPoolExecutor | None = None


def page_aligned_empty(n: int, row_bytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """``uint8 [n, row_bytes]`` starting on a page boundary.

    Disk tiers using ``O_DIRECT`` can then read and write the rows in place (when
    ``row_bytes`` is a multiple of the page) instead of through a bounce buffer.
    """
    raw = torch.empty(n * row_bytes + PAGE, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + n * row_bytes].view(n, row_bytes)


_pooled_lock = threading.Lock()
_pooled = [0]


def _count_pooled(nbytes: int) -> None:
    with _pooled_lock:
        _pooled[0] += nbytes


def pooled_bytes() -> int:
    """Bytes every :class:`Buffers` pool of this process holds (lent or kept): bounded
    by each pool's ``keep_bytes`` plus what is lent at once, and resident."""
    with _pooled_lock:
        return _pooled[0]


class Buffers:
    """Reusable page-aligned (optionally pinned) rows, so that a transfer or a pack
    does not pay page faults on fresh memory every time. Thread-safe.

    The one pool of host buffers: the data path stages device transfers in one
    (pinned under CUDA), and the tiers that store a record as one value (LMDB,
    Redis) pack header and payload into one. ``np.empty``-like: pages a small batch
    never touches are never faulted in."""

    KEEP_BYTES: Final = 512 * 1024**2
    """Free buffers kept for reuse by default, in bytes; beyond it they go back."""

    def __init__(
        self, bytes_per_block: int, *, pin_memory: bool = False, keep_bytes: int = KEEP_BYTES
    ) -> None:
        self.bpb = bytes_per_block
        self.pin = pin_memory
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # sorted by rows, smallest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self._lock = threading.Lock()

    def acquire(self, n: int, *, spare_rows: int = 16) -> torch.Tensor:
        """A ``uint8 [n, bytes_per_block]`` page-aligned view; give it back with
        :meth:`release`."""
        with self._lock:
            for i, whole in enumerate(self._free):
                if whole.shape[0] >= n:
                    del self._free[i]
                    break
            else:
                # Rows rounded up to a power of two: the pool then holds a few sizes
                # that every later batch reuses. Sized to each batch, a workload whose
                # batches grow (multi-turn chat) kept allocating buffers one size up,
                # and its resident memory crept up for minutes after warm-up (the
                # soak, 2026-11-26).
                rows = 1 << (max(n, spare_rows) - 1).bit_length()
                whole = page_aligned_empty(rows, self.bpb, pin_memory=self.pin)
                # Touched now, so that what the pool holds is resident from the
                # start and :func:`pooled_bytes` is what it adds to the process's
                # resident memory (a soak tells a pool's high-water mark from a leak
                # by it); a memset of a buffer allocated once.
                whole.zero_()
                _count_pooled(whole.numel())
            self._lent[whole.data_ptr()] = whole
        return whole[:n]

    def release(self, view: torch.Tensor) -> None:
        with self._lock:
            whole = self._lent.pop(view.data_ptr())
            kept = sum(b.numel() for b in self._free)
            if kept + whole.numel() <= self.keep_bytes:
                self._free.append(whole)
                self._free.sort(key=lambda b: b.shape[0])
            else:
                _count_pooled(-whole.numel())


def byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy ``memoryview`` of a contiguous CPU tensor's bytes (for ``os.pwritev``,
    hashing and file writes)."""
    arr: Any = t.numpy()
    return memoryview(arr).cast("B")


def run_queue(batches: Iterable[Sequence[Callable[[], object]]]) -> None:
    """Run independent host copy calls on the calling thread and one helper thread.

    Each call must release the GIL while it copies (torch ops and numpy copies do). Both
    threads pop from one queue, so a thread the OS pauses holds up only the call it is
    in. The helper is woken as soon as the first batch is queued: waking it takes 1-5 ms,
    time the caller spends queueing the other batches. The caller never depends on the
    helper: if it is busy with another transfer, the caller empties the queue itself and
    withdraws the request.
    """
    queue: deque[Callable[[], object]] = deque()
    future: Future[None] | None = None
    try:
        for batch in batches:
            queue.extend(batch)
            if future is None and len(queue) > 1:
                future = _copy_helper().submit(_drain, queue)
        _drain(queue)
    finally:
        queue.clear()  # after an error: the helper stops at its current call
        if future is not None and not future.cancel():
            future.result()  # wait for the helper's last call; re-raise its error


def worth_choosing(nbytes: int) -> bool:
    """Whether a host batch of ``nbytes`` picks between the team and the queue (see the
    module docstring): large enough, and torch allowed more than one thread."""
    return nbytes >= QUEUE_MIN_BYTES and torch.get_num_threads() > 1


def _drain(queue: deque[Callable[[], object]]) -> None:
    while True:
        try:
            task = queue.popleft()  # atomic: the two threads never get the same task
        except IndexError:
            return
        task()


def _forget_helper() -> None:
    """In a forked child the helper thread does not exist: start a new one on demand."""
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def _copy_helper() -> ThreadPoolExecutor:
    """The process's one helper thread for host copies (created on first use)."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvoffload-copy")
        return _helper


class Chooser:
    """Keeps the faster of the host strategies (0: team, 1: queue) by timing them.

    A strategy's speed is the best of its last :attr:`KEEP` timings: on a shared machine
    noise only ever adds time (the reason ``bench_cpu`` keeps best times too), and the
    first batch also pays for first-touch page faults. Each strategy is timed on one of
    the first two batches; then the faster runs, and the other is timed again after 2
    batches, then after 4, 8, ... up to :attr:`MAX_GAP` while it keeps losing (back to 2
    when it wins), so a change of load is noticed without paying the slower strategy
    often. Races between two threads only blur the bookkeeping: both strategies write
    the same bytes.
    """

    KEEP: ClassVar[int] = 3
    MAX_GAP: ClassVar[int] = 64

    def __init__(self) -> None:
        self.rates: tuple[deque[float], deque[float]] = (
            deque(maxlen=self.KEEP),
            deque(maxlen=self.KEEP),
        )  # bytes/s of each strategy's latest batches
        self.best = 0
        self._gap = 2  # batches between timings of the other strategy
        self._left = 2  # batches until the next one

    def pick(self) -> int:
        for choice, rates in enumerate(self.rates):
            if not rates:
                return choice
        return 1 - self.best if self._left <= 0 else self.best

    def record(self, choice: int, rate: float) -> None:
        self.rates[choice].append(rate)
        team, queue = self.rates
        if not team or not queue:
            return
        probed = self._left <= 0 and choice != self.best
        self.best = 0 if max(team) >= max(queue) else 1
        if probed:
            self._gap = 2 if self.best == choice else min(2 * self._gap, self.MAX_GAP)
            self._left = self._gap
        else:
            self._left -= 1

    def run(self, nbytes: int, team: Callable[[], object], queue: Callable[[], object]) -> None:
        choice = self.pick()
        start = time.perf_counter()
        (queue if choice else team)()
        self.record(choice, nbytes / max(time.perf_counter() - start, 1e-9))


REGISTER_MIN_BYTES: Final = 1 << 30
"""Pinned slabs from this size are registered rather than allocated pinned."""


def host_rows(n: int, row_bytes: int, *, pin: bool) -> torch.Tensor:
    """``uint8 [n, row_bytes]`` host rows on a page boundary, every page touched
    (a fresh slab would otherwise pay its page faults inside the first transfers), and
    page-locked when ``pin`` (so GPU copies are DMA). Large pinned slabs are first
    touched in parallel by torch's threads and then registered with
    ``cudaHostRegister`` (see :func:`unpin`), small ones come from ``cudaHostAlloc``."""
    nbytes = n * row_bytes
    if pin and nbytes < REGISTER_MIN_BYTES:
        return page_aligned_empty(n, row_bytes, pin_memory=True)
    rows = page_aligned_empty(n, row_bytes)
    rows.zero_()  # torch's threads fault the pages in
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(rows.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
        if int(err) != 0:
            logger.warning("cudaHostRegister of %d bytes failed (%s); slab not pinned", nbytes, err)
    return rows


def unpin(rows: torch.Tensor) -> None:
    """Undo :func:`host_rows`' registration (nothing for memory it did not register)."""
    if rows.numel() >= REGISTER_MIN_BYTES and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(rows.data_ptr())  # type: ignore[no-untyped-call]


def select(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(rows, 0, index, out=out)


def assign(dst: npt.NDArray[Any], index: npt.NDArray[np.int64], src: npt.NDArray[Any]) -> None:
    dst[index] = src


def take(src: npt.NDArray[Any], index: npt.NDArray[np.int64], dst: npt.NDArray[Any]) -> None:
    """``dst = src[index]`` without a temporary. ``dst`` must be C-contiguous and the
    index checked: ``mode="clip"`` would clamp a bad one silently, and ``"raise"``
    always buffers the output."""
    np.take(src, index, axis=0, out=dst, mode="clip")


def as_numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    """``t``'s memory as a numpy array, 16-byte elements as int64 pairs (numpy then
    copies plain integers: bit-exact whatever the bytes)."""
    if t.dtype == torch.complex128:
        t = t.view(torch.int64)
    arr: npt.NDArray[Any] = t.detach().numpy()
    return arr


WIDE: Final[dict[int, torch.dtype]] = {
    16: torch.complex128,  # only ever copied, never computed on
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}
"""The dtype whose elements are ``width`` bytes, for copying rows in wide units."""
