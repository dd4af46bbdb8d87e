"""The ``mmap`` tier's slab files and the positioned I/O on them.

Each slab file is ``[superblock: 4096 B][header table, padded to 4096][data]``. This
module opens them (probing ``O_DIRECT`` once, preallocating, writing a fresh
superblock or reading the header table back) and moves bytes: payload runs with
``pwritev``/``preadv`` (through a page-aligned bounce buffer where ``O_DIRECT`` needs
one), header-table pages with ``pwrite``, ``fdatasync``. What the bytes mean (headers,
extents, recovery) is for the modules above it.

Every system call on a slab file is made here, through this module's ``os``: the
packed crash test records each write by replacing it (tests/backends/test_packed_crash.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from kvoffload.backend import Backend
from kvoffload.config import MmapTierConfig
from kvoffload.exceptions import BackendError, ConfigError
from kvoffload.record import HEADER_BYTES, HEADER_DTYPE

logger = logging.getLogger(__name__)

ALIGN: Final = 4096
SUPER_MAGIC: Final = b"KVOFSLAB"
SUPER_VERSION: Final = 1
MAX_RUN_BYTES: Final = 8 * 1024 * 1024
"""Largest single ``pwritev``/``preadv``: big enough to reach sequential bandwidth,
small enough that a batch still spreads over all I/O threads."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as ``O_DIRECT`` requires of I/O buffers."""
    return mmap.mmap(-1, max(nbytes, ALIGN))


@dataclass
class SlabFile:
    index: int
    path: Path
    fd: int
    first_slot: int
    num_slots: int
    headers: np.ndarray[Any, np.dtype[np.void]]  # slot -> header, over ``header_buf``
    header_buf: mmap.mmap
    data_offset: int
    first_page: int = 0
    """A packed slab's first global data page in this file (extents.py)."""
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held from snapshotting header pages until they are written, so the table on
    disk only ever moves forward (see :meth:`HeaderTables._write_header_pages`)."""

    @property
    def table_bytes(self) -> int:
        return align_up(self.num_slots * HEADER_BYTES)

    def write_table(self, copy: mmap.mmap, offset: int) -> None:
        """Write ``copy`` over the header table's bytes from ``offset``."""
        if os.pwrite(self.fd, copy, ALIGN + offset) != len(copy):
            raise OSError(errno.ENOSPC, f"short header write in {self.path.name}")

    def sync(self) -> None:
        """Make durable whatever was written to the file before (``fdatasync``)."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
        del self.headers
        # A header view may still be referenced; the GC frees the memory then.
        with contextlib.suppress(BufferError):
            self.header_buf.close()


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    want = sum(len(v) for v in views)
    done = os.pwritev(fd, views, offset)
    if done != want:  # short writes happen on a full disk; report, do not retry
        raise OSError(errno.ENOSPC, f"short write: {done} of {want} bytes")


def preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    want = sum(len(v) for v in views)
    done = os.preadv(fd, views, offset)
    if done != want:
        raise OSError(errno.EIO, f"short read: {done} of {want} bytes")


def read_superblock(path: Path) -> dict[str, Any] | None:
    """The superblock of slab file ``path`` as a dict, or ``None`` if unusable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(ALIGN)
    except OSError:
        return None
    if len(raw) < 16 or raw[:8] != SUPER_MAGIC:
        return None
    length, crc = struct.unpack("<II", raw[8:16])
    body = raw[16 : 16 + length]
    if len(body) != length or zlib.crc32(body) != crc:
        return None
    meta: dict[str, Any] = json.loads(body)
    return meta


class SlabFiles(Backend):
    """The slab files of an ``mmap`` tier and their I/O; the backend's lowest part."""

    cfg: MmapTierConfig
    dir: Path
    payload_bytes: int
    stride: int
    """Bytes between slot starts: the payload rounded up to the page."""
    packed: bool
    direct: bool
    """Whether the files are open with ``O_DIRECT`` (probed once at open)."""
    files: list[SlabFile]
    _pool: ThreadPoolExecutor
    _bounce: list[mmap.mmap]
    _bounce_bytes: int
    _bounce_lock: threading.Lock
    _lockfd: int | None

    def _probe_direct_io(self) -> bool:
        if self.cfg.direct_io == "off":
            return False
        probe = self.dir / ".odirect-probe"
        buf = aligned_buffer(ALIGN)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                os.pwrite(fd, buf, 0)
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            if self.cfg.direct_io == "on":
                raise ConfigError(
                    f"tier {self.name!r}: direct_io = 'on' but {self.dir} refuses O_DIRECT "
                    f"({exc.strerror}); set direct_io: auto or off"
                ) from None
            logger.warning(
                "tier %s: %s refuses O_DIRECT (%s); using buffered I/O",
                self.name,
                self.dir,
                exc.strerror,
            )
            return False
        finally:
            buf.close()
            probe.unlink(missing_ok=True)

    def _superblock(self, index: int, first: int, count: int, pages: tuple[int, int]) -> bytes:
        meta: dict[str, Any] = {
            "version": SUPER_VERSION,
            "layout": self.layout.to_dict(),
            "fingerprint": self.layout.fingerprint.hex(),
            "stride": self.stride,
            "payload_bytes": self.payload_bytes,
            "file_index": index,
            "first_slot": first,
            "num_slots": count,
            "total_slots": self.num_slots,
        }
        if self.packed:  # a packed slab: these pages, and how to reopen it (tools)
            meta["packed"] = {
                "first_page": pages[0],
                "pages": pages[1],
                "capacity": self.cfg.capacity,
                "max_file_bytes": self.cfg.max_file_bytes,
            }
        body = json.dumps(meta, sort_keys=True).encode()
        head = SUPER_MAGIC + struct.pack("<II", len(body), zlib.crc32(body))
        return (head + body).ljust(ALIGN, b"\0")

    @staticmethod
    def read_superblock(path: Path) -> dict[str, Any] | None:
        """The superblock of slab file ``path`` as a dict, or ``None`` if unusable."""
        return read_superblock(path)

    def _open_file(
        self, index: int, path: Path, first: int, count: int, pages: tuple[int, int]
    ) -> SlabFile:
        table = align_up(count * HEADER_BYTES)
        data_offset = ALIGN + table
        size = data_offset + (pages[1] * ALIGN if self.packed else count * self.stride)
        want = self._superblock(index, first, count, pages)
        fresh = read_superblock(path) != json.loads(want[16:].rstrip(b"\0"))
        if fresh and path.exists():
            logger.warning(
                "tier %s: %s was written under another layout or capacity; starting it empty",
                self.name,
                path,
            )
        elif not fresh and path.stat().st_size < size:
            logger.warning("tier %s: %s is truncated; starting it empty", self.name, path)
            fresh = True
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o644)
        header_buf = aligned_buffer(table)
        headers = np.frombuffer(header_buf, dtype=HEADER_DTYPE, count=count)
        try:
            if fresh:
                os.ftruncate(fd, 0)
                self._preallocate(fd, size, path)
                sb = aligned_buffer(ALIGN)
                sb[:] = want
                os.pwrite(fd, sb, 0)
                sb.close()
                os.pwrite(fd, header_buf, ALIGN)  # all-zero table: no blocks
                os.fsync(fd)
            else:
                got = os.preadv(fd, [header_buf], ALIGN)
                if got != table:
                    raise OSError(errno.EIO, f"short header-table read ({got} of {table})")
        except OSError as exc:
            os.close(fd)
            del headers
            header_buf.close()
            raise ConfigError(
                f"tier {self.name!r}: path = {str(self.dir)!r}: cannot set up {path.name} "
                f"({size} bytes): {exc.strerror or exc}; free disk space or lower "
                "tiers[].capacity"
            ) from None
        return SlabFile(index, path, fd, first, count, headers, header_buf, data_offset, pages[0])

    def _preallocate(self, fd: int, size: int, path: Path) -> None:
        if self.cfg.preallocate:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)

    def _locate_all(
        self, slots: Sequence[int]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """File index and slot within the file of each slot, as arrays."""
        arr = np.asarray(slots, dtype=np.int64)
        firsts = np.array([f.first_slot for f in self.files], dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() >= self.num_slots):
            raise IndexError(f"slot out of range 0..{self.num_slots - 1}")
        files = np.searchsorted(firsts, arr, side="right") - 1
        return files, arr - firsts[files]

    def _by_file(self, files: np.ndarray[Any, Any]) -> list[tuple[SlabFile, np.ndarray[Any, Any]]]:
        """The batch positions in each slab file, from :meth:`_locate_all`'s files."""
        if len(self.files) == 1:
            return [(self.files[0], np.arange(len(files)))]
        return [
            (f, np.flatnonzero(files == f.index)) for f in self.files if (files == f.index).any()
        ]

    def _locate(self, slot: int) -> tuple[SlabFile, int]:
        for f in self.files:
            if slot < f.first_slot + f.num_slots:
                return f, slot - f.first_slot
        raise IndexError(f"slot {slot} out of range")

    def _run_batch(
        self,
        slots: Sequence[int],
        order: list[int],
        do_run: Callable[[SlabFile, int, list[int]], None],
    ) -> None:
        """Split sorted slots into runs of adjacent slots in one file and run them on
        the pool; any failure becomes a :class:`BackendError`."""
        # Runs as long as possible, but no fewer than one per I/O thread: a 64 MiB
        # batch cut into 8 MiB runs would leave half of 16 threads idle.
        per_thread = -(-len(slots) // self.cfg.io_threads)
        per_run = max(1, min(MAX_RUN_BYTES // self.stride, per_thread))
        runs: list[tuple[SlabFile, int, list[int]]] = []
        cur: list[int] = []
        cur_file: SlabFile | None = None
        for i in order:
            f, _ = self._locate(slots[i])
            if cur and cur_file is f and slots[i] == slots[cur[-1]] + 1 and len(cur) < per_run:
                cur.append(i)
                continue
            if cur and cur_file is not None:
                runs.append((cur_file, slots[cur[0]], cur))
            cur, cur_file = [i], f
        if cur and cur_file is not None:
            runs.append((cur_file, slots[cur[0]], cur))
        if self._pool is None:
            raise BackendError(f"tier {self.name!r} is closed")
        futures = [self._pool.submit(do_run, f, first, idxs) for f, first, idxs in runs]
        errors = [fut.exception() for fut in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise BackendError(f"tier {self.name!r}: I/O failed: {failed[0]}") from failed[0]

    def _run_chunks(self, chunks: list[list[int]], fn: Callable[[list[int]], None]) -> None:
        """Run ``fn`` on each chunk on the pool; any failure becomes a BackendError."""
        if self._pool is None:
            raise BackendError(f"tier {self.name!r} is closed")
        futures = [self._pool.submit(fn, c) for c in chunks]
        failed = [e for e in (fut.exception() for fut in futures) if e is not None]
        if failed:
            raise BackendError(f"tier {self.name!r}: I/O failed: {failed[0]}") from failed[0]

    def _in_place(self, views: list[memoryview]) -> bool:
        """Whether O_DIRECT can use the caller's rows as they are: each row fills its
        slot exactly and starts on a page (see ``page_aligned_empty``)."""
        if self.stride != self.payload_bytes:
            return False
        return all(np.frombuffer(v, dtype=np.uint8).ctypes.data % ALIGN == 0 for v in views)

    def _pwrite_run(self, f: SlabFile, offset: int, views: list[memoryview]) -> None:
        if self.direct and self._in_place(views):
            pwritev_all(f.fd, views, offset)
            return
        if not self.direct:
            if self.stride == self.payload_bytes:
                pwritev_all(f.fd, views, offset)
            else:  # payloads do not fill their slots: each goes to its own offset
                for k, view in enumerate(views):
                    pwritev_all(f.fd, [view], offset + k * self.stride)
            return
        # O_DIRECT wants page-aligned memory and lengths: stage through a bounce buffer
        # (a memcpy at ~10 GB/s, overlapped with other threads' disk I/O).
        with self._bounce_buffer() as bounce:
            pos = 0
            for view in views:
                bounce[pos : pos + len(view)] = view
                pos += self.stride
            pwritev_all(f.fd, [memoryview(bounce)[:pos]], offset)

    def _pread_run(self, f: SlabFile, offset: int, views: list[memoryview]) -> None:
        if self.direct and self._in_place(views):
            preadv_all(f.fd, views, offset)
            return
        if not self.direct:
            if self.stride == self.payload_bytes:
                preadv_all(f.fd, views, offset)
            else:
                for k, view in enumerate(views):
                    preadv_all(f.fd, [view], offset + k * self.stride)
            return
        with self._bounce_buffer() as bounce:
            total = self.stride * len(views)
            preadv_all(f.fd, [memoryview(bounce)[:total]], offset)
            pos = 0
            for view in views:
                view[:] = bounce[pos : pos + len(view)]
                pos += self.stride

    def _bounce_buffer(self) -> Bounce:
        return Bounce(self)

    def _release_buffers(self) -> None:
        """Free the bounce buffers and drop the directory's writer lock (at close,
        after the files are closed)."""
        for buf in getattr(self, "_bounce", []):
            buf.close()
        self._bounce = []
        lockfd = getattr(self, "_lockfd", None)
        if lockfd is not None:
            os.close(lockfd)
            self._lockfd = None


class Bounce:
    """Borrow one of the backend's preallocated aligned buffers for one run."""

    def __init__(self, backend: SlabFiles) -> None:
        self.backend = backend
        self.buf: mmap.mmap | None = None

    def __enter__(self) -> mmap.mmap:
        with self.backend._bounce_lock:
            free = self.backend._bounce
            # One buffer per I/O thread, so the list is empty only if runs are issued
            # from elsewhere too; never share one then: a new buffer is merely slower.
            self.buf = free.pop() if free else aligned_buffer(self.backend._bounce_bytes)
        return self.buf

    def __exit__(self, *exc: object) -> None:
        assert self.buf is not None
        with self.backend._bounce_lock:
            self.backend._bounce.append(self.buf)
