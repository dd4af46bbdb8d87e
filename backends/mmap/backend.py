"""The ``mmap`` backend: an SSD slab of preallocated files with fixed-size slots.

Worker side. Each slab file is::

    [superblock: 4096 B][header table: 128 B per slot, padded to 4096][slot 0][slot 1]...

A slot is the payload rounded up to 4096 bytes, so every payload I/O is aligned and can
use ``O_DIRECT`` (probed once at open; buffered I/O is the fallback, and the log says
which is in use). Headers (:mod:`kvoffload.record`) live in a table apart from the
payloads, so small blocks pay no 4 KiB header page each and a reopen reads one
contiguous table per file instead of one header per slot.

Crash safety: a store writes the payloads, then the headers that describe them. The
header's checksum covers the payload, so a payload torn by a crash, or overwritten in
place after its block was evicted, fails verification and is reclaimed, never served.
With ``fsync`` on, one ``fdatasync`` per file per batch makes a completed store durable.
On open the header tables are read back, validated (magic, CRC, layout fingerprint,
newest copy of each key) and handed to the manager in approximate LRU order (``atime``).

Speed: slots named in a batch are sorted, and runs of adjacent slots become one
``pwritev``/``preadv`` (up to 8 MiB), issued from a thread pool, because the GIL is
released during the syscall. A thread pool rather than ``aiofiles``: ``aiofiles`` runs
the same syscalls in a thread pool, behind an event loop we have no other use for
(see docs/benchmarks.md). The I/O threads only move and checksum payloads; headers are
filled and checked for the whole batch at once, as array operations
(:func:`~kvoffload.record.build_headers`): one numpy scalar access per field per block
cost more than the disk at 16 and 64 KiB blocks.

Threads: writes, reads and discards of disjoint slots may run at once from several
threads (the transfer worker's store and load lanes). Each I/O run borrows its own
bounce buffer; ``_lock`` guards only in-memory state (header tables, counters) and is
never held across I/O, so a load never waits for a store's ``fdatasync``.
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
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from kvoffload.backends.mmap.extents import PackedSpace, resolve

from kvoffload.backend import Backend, RecoveredBlock
from kvoffload.codec import CodecStats, Packer, codec_named
from kvoffload.config import MmapTierConfig, TierConfig
from kvoffload.dirlock import lock_tier_dir
from kvoffload.exceptions import BackendError, ConfigError
from kvoffload.extents import pages_for
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import (
    FLAG_EXTENT,
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    READABLE_VERSIONS,
    build_headers,
    check_headers,
    extent_pages,
    header_crc,
    pack_payloads,
    payload_checksum,
    seal_rows,
    stored_lengths,
)

logger = logging.getLogger(__name__)

ALIGN: Final = 4096
SUPER_MAGIC: Final = b"KVOFSLAB"
SUPER_VERSION: Final = 1
MAX_RUN_BYTES: Final = 8 * 1024 * 1024
PACKING: Final = 4
"""A packed slab keeps this many slots per full-size block its capacity holds (fewer
for blocks of under 4 pages, since an extent is at least a page): compression can
then fit up to this many times the blocks, and the slots' headers cost 128 bytes each
(0.2% of a 256 KiB block's space, 3% of a 16 KiB one's)."""
"""Largest single ``pwritev``/``preadv``: big enough to reach sequential bandwidth,
small enough that a batch still spreads over all I/O threads."""


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as ``O_DIRECT`` requires of I/O buffers."""
    return mmap.mmap(-1, max(nbytes, ALIGN))


@dataclass
class _SlabFile:
    index: int
    path: Path
    fd: int
    first_slot: int
    num_slots: int
    headers: np.ndarray[Any, np.dtype[np.void]]  # slot -> header, over ``header_buf``
    header_buf: mmap.mmap
    data_offset: int
    first_page: int = 0
    """A packed slab's first global data page in this file (mmap_extents.py)."""
    io_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held from snapshotting header pages until they are written, so the table on
    disk only ever moves forward (see :meth:`MmapBackend._write_header_pages`)."""

    @property
    def table_bytes(self) -> int:
        return _align_up(self.num_slots * HEADER_BYTES)


class MmapBackend(Backend):
    """Slots in preallocated slab files under ``config.path``; survives restarts."""

    config_model = MmapTierConfig
    persistent = True

    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        # The payload rounded up to the page, plus its header-table entry.
        return _align_up(layout.bytes_per_block) + HEADER_BYTES

    def _packing(self) -> int:
        """Slots per full-size block: :data:`PACKING` when packed, else 1."""
        if not self._is_packed():
            return 1
        return max(1, min(PACKING, _align_up(self.layout.bytes_per_block) // ALIGN))

    def _is_packed(self) -> bool:
        """Packed when compressed, or when the slab already there is packed and fits
        this config: turning ``compression`` off then keeps every block (new ones are
        stored raw, in extents). Turning it on over a fixed-slot slab starts a packed
        one, empty: compression that bought no capacity would not be what was asked."""
        packed = self.__dict__.get("_packed_cache")
        if packed is None:
            cfg = self.config
            packed = getattr(cfg, "compression", "none") != "none"
            if not packed:
                meta = self.read_superblock(Path(getattr(cfg, "path", "")) / "slab-000.kvo")
                old = None if meta is None else meta.get("packed")
                packed = old is not None and (old["capacity"], old["max_file_bytes"]) == (
                    cfg.capacity,
                    getattr(cfg, "max_file_bytes", None),
                )
            self.__dict__["_packed_cache"] = packed
        return bool(packed)

    def slots_for(self, full_slots: int) -> int:
        return full_slots * self._packing()

    def budget(self) -> tuple[int, int] | None:
        """The data pages, less a reserve the budget never hands out: two full-size
        blocks, or 1/128 of the pages if more. Why: the budget counts pages, a block
        needs them contiguous. Simulated churn (1000 blocks of 64 pages, a mix of
        ratios, one block per store) left 6.4% of stores with no run long enough at
        no reserve and none at 0.5% (docs/benchmarks.md, "Packed slabs")."""
        if self.space is None:
            return None
        pages = self.space.total_pages
        ppb = self.stride // ALIGN
        reserve = max(2 * ppb, pages // 128)
        return max(ppb, pages - reserve) * ALIGN, self.stride

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots // self._packing() * self.slot_bytes(self.layout)

    def released(self, slots: Sequence[int]) -> None:
        """A packed slab's freed slots give back their extents at once; their headers
        are cleared in memory now and on disk with the next header write (until then
        a reopen resolves any overlap by sequence number, and checksums the rest)."""
        if self.space is None:
            return
        with self._lock:
            for slot in slots:
                if self.space.release(slot):
                    self._forget(slot)

    def _forget(self, slot: int) -> None:
        """Clear ``slot``'s header in memory, its page to be written with the next
        header write (under ``_lock``)."""
        f, local = self._locate(slot)
        f.headers[local] = np.zeros((), dtype=HEADER_DTYPE)
        self._cleared_pages.add((f.index, local * HEADER_BYTES // ALIGN))

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.space: PackedSpace | None = None  # set by _open_files when packed
        self._cleared_pages: set[tuple[int, int]] = set()
        super().__init__(config, layout)
        assert isinstance(config, MmapTierConfig)
        self.cfg = config
        self.dir = Path(config.path)
        self.payload_bytes = layout.bytes_per_block
        self.stride = _align_up(self.payload_bytes)  # bytes between slot starts
        self.packed = self._is_packed()
        self.packer = Packer(codec_named(config.compression), layout.itemsize)
        self.record_access = True
        """Whether loads refresh ``atime``; maintenance scans turn it off so that a
        ``verify`` does not flatten the LRU order a restart will restore."""
        # Blocks failing verification are counted by the Offloader, which sees every
        # tier's reads (its ``corrupt_blocks``); here they are only logged, the first
        # at warning level.
        self._warned_corrupt = False
        # The in-memory header tables, ``_seq`` and ``_dirty_pages``. Held
        # for memory work only, never across I/O: a load updating ``atime`` must not
        # wait for a concurrent store's header write and fdatasync.
        self._lock = threading.Lock()
        self._seq = 0
        self._dirty_pages: set[tuple[int, int]] = set()  # (file, page) with atime changes
        self._recovered: list[RecoveredBlock] = []
        self._lockfd: int | None = lock_tier_dir(self.dir, self.name)
        self.direct = self._probe_direct_io()
        logger.info(
            "tier %s: mmap slab in %s, %d slots of %d bytes, %s I/O, %d threads, fsync %s",
            self.name,
            self.dir,
            self.num_slots,
            self.stride,
            "O_DIRECT" if self.direct else "buffered",
            config.io_threads,
            "on" if config.fsync else "off",
        )
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvo-{self.name}")
        self._bounce_bytes = max(MAX_RUN_BYTES, self.stride)
        self._bounce: list[mmap.mmap] = [
            _aligned_buffer(self._bounce_bytes) for _ in range(config.io_threads)
        ]
        self._bounce_lock = threading.Lock()
        self.files: list[_SlabFile] = []
        try:
            self._open_files()
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------
    def _probe_direct_io(self) -> bool:
        if self.cfg.direct_io == "off":
            return False
        probe = self.dir / ".odirect-probe"
        buf = _aligned_buffer(ALIGN)
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

    @classmethod
    def stored_layout(cls, config: TierConfig) -> KVLayout | None:
        """The layout the tier at ``config.path`` was written under, if any."""
        meta = cls.read_superblock(Path(getattr(config, "path", "")) / "slab-000.kvo")
        if meta is None:
            return None
        return KVLayout(**meta["layout"])

    @classmethod
    def existing_config(cls, config: TierConfig, *, write: bool) -> TierConfig | None:
        meta = cls.read_superblock(Path(getattr(config, "path", "")) / "slab-000.kvo")
        if meta is None:
            return None
        layout = KVLayout(**meta["layout"])
        packed = meta.get("packed")
        if packed is not None:
            update = {k: packed[k] for k in ("capacity", "max_file_bytes")}
            if getattr(config, "compression", "none") == "none":
                # Opened to be read: any codec reads every block; the geometry is a
                # packed one only with one named.
                update["compression"] = "zstd"
            return config.model_copy(update=update)
        return config.model_copy(
            update={
                "capacity": meta["total_slots"] * cls.slot_bytes(layout),
                # the same split into files: the first file holds exactly this many
                "max_file_bytes": meta["num_slots"] * (meta["stride"] + HEADER_BYTES),
                # fixed slots (a slab written before packing read compressed blocks too)
                "compression": "none",
            }
        )

    def _geometry(self) -> list[tuple[int, int]]:
        """``(slots, data pages)`` of each slab file. Each file stands for as many
        full-size blocks as ``max_file_bytes`` holds; a packed one keeps
        :meth:`_packing` slots for each and fills the rest of its bytes with pages."""
        unit = self.stride + HEADER_BYTES
        k = self._packing()
        per_file = max(1, self.cfg.max_file_bytes // unit)
        left = self.num_slots // k
        out: list[tuple[int, int]] = []
        while left > 0:
            units = min(per_file, left)
            out.append((units * k, (units * unit - units * k * HEADER_BYTES) // ALIGN))
            left -= units
        return out

    def _open_files(self) -> None:
        first = 0
        first_page = 0
        expected_names = set()
        geometry = self._geometry()
        for index, (count, pages) in enumerate(geometry):
            path = self.dir / f"slab-{index:03d}.kvo"
            expected_names.add(path.name)
            self.files.append(self._open_file(index, path, first, count, (first_page, pages)))
            first += count
            first_page += pages
        if self.packed:
            self.space = PackedSpace(
                [pages for _, pages in geometry], self.num_slots, self.stride // ALIGN
            )
        # Slab files of an earlier, larger geometry hold nothing this tier can use.
        for stale in self.dir.glob("slab-*.kvo"):
            if stale.name not in expected_names:
                stale.unlink()
        self._recovered = self._recover_headers()

    def _open_file(
        self, index: int, path: Path, first: int, count: int, pages: tuple[int, int]
    ) -> _SlabFile:
        table = _align_up(count * HEADER_BYTES)
        data_offset = ALIGN + table
        size = data_offset + (pages[1] * ALIGN if self.packed else count * self.stride)
        want = self._superblock(index, first, count, pages)
        fresh = self.read_superblock(path) != json.loads(want[16:].rstrip(b"\0"))
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
        header_buf = _aligned_buffer(table)
        headers = np.frombuffer(header_buf, dtype=HEADER_DTYPE, count=count)
        try:
            if fresh:
                os.ftruncate(fd, 0)
                self._preallocate(fd, size, path)
                sb = _aligned_buffer(ALIGN)
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
        return _SlabFile(index, path, fd, first, count, headers, header_buf, data_offset, pages[0])

    def _preallocate(self, fd: int, size: int, path: Path) -> None:
        if self.cfg.preallocate:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)

    def _recover_headers(self) -> list[RecoveredBlock]:
        fp = np.array([self.layout.fingerprint], dtype="V16")[0]
        best: dict[bytes, tuple[int, int, float]] = {}  # key -> (seq, slot, atime)
        reclaim: list[int] = []
        max_seq = 0
        for f in self.files:
            h = f.headers
            used = h["magic"] != b""
            stored = stored_lengths(h)
            ok = (
                used
                & (h["magic"] == MAGIC)
                & np.isin(h["version"], READABLE_VERSIONS)
                & (h["layout"] == fp)
                & (h["length"] == self.payload_bytes)
                & np.where(h["codec"] == 0, stored == self.payload_bytes, stored > 0)
                & (stored <= self.payload_bytes)
                & (h["key_len"] > 0)
                & (h["key_len"] <= 64)
            )
            if self.packed:
                ok &= self._placed(h, stored)
            else:
                ok &= h["flags"] & FLAG_EXTENT == 0
            candidates = np.flatnonzero(ok)
            good = np.zeros(f.num_slots, dtype=bool)
            raw = h.view(np.uint8).reshape(f.num_slots, HEADER_BYTES)
            hcrc = h["hcrc"]
            for local in candidates.tolist():
                if header_crc(raw[local].tobytes()) == int(hcrc[local]):
                    good[local] = True
            for local in np.flatnonzero(used & ~good).tolist():
                reclaim.append(f.first_slot + local)
            locals_ = np.flatnonzero(good)
            seqs, atimes, key_lens = h["seq"][locals_], h["atime"][locals_], h["key_len"][locals_]
            keys = h["key"][locals_]
            for j, local in enumerate(locals_.tolist()):
                key = keys[j].tobytes()[: int(key_lens[j])]
                seq = int(seqs[j])
                max_seq = max(max_seq, seq)
                slot = f.first_slot + local
                prev = best.get(key)
                if prev is None or seq > prev[0]:
                    if prev is not None:
                        reclaim.append(prev[1])
                    best[key] = (seq, slot, float(atimes[j]))
                else:
                    reclaim.append(slot)
        charges: dict[int, int] = {}
        if self.space is not None:
            kept = self._adopt_extents([v for v in best.values()])
            budget = self.budget()
            total = sum(kept.values())
            if budget is not None and total > budget[0]:
                # More than the budget (a crash before cleared headers reached the
                # disk, or a reserve that grew): the least recently used go, so the
                # books can take the rest.
                # (atime, seq): a batch shares one write time; its order is its seq.
                for _, slot, _ in sorted(best.values(), key=lambda v: (v[2], v[0])):
                    if total <= budget[0]:
                        break
                    if slot in kept:
                        total -= kept.pop(slot)
                        self.space.release(slot)
            for key in [k for k, v in best.items() if v[1] not in kept]:
                reclaim.append(best.pop(key)[1])
            charges = kept
        self._seq = max_seq
        if reclaim:
            logger.warning(
                "tier %s: reclaimed %d slots with torn, foreign or superseded headers",
                self.name,
                len(reclaim),
            )
            self._clear_headers(reclaim)
        blocks = sorted(
            (
                RecoveredBlock(BlockKey(key), slot, atime, charges.get(slot, 0))
                for key, (_, slot, atime) in best.items()
            ),
            key=lambda b: b.atime,
        )
        self.slots.reserve(b.slot for b in blocks)
        if blocks:
            logger.info("tier %s: recovered %d blocks from %s", self.name, len(blocks), self.dir)
        return blocks

    def _placed(
        self, h: np.ndarray[Any, np.dtype[np.void]], stored: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which of a packed file's headers name an extent that lies in one file."""
        assert self.space is not None
        first = np.array(self.space.first_page, dtype=np.int64)
        start = h["wtime"].astype(np.int64)
        pages = extent_pages(h)
        last = start + pages - 1
        inside = (
            (h["flags"] & FLAG_EXTENT != 0)
            & (pages <= self.space.max_pages)
            & (last < self.space.total_pages)
        )
        same_file = np.searchsorted(first, start, "right") == np.searchsorted(first, last, "right")
        return np.asarray(inside & same_file)

    def _adopt_extents(self, found: list[tuple[int, int, float]]) -> dict[int, int]:
        """Keep the newest of any overlapping extents among the headers that survived
        (``(seq, slot, atime)`` each), adopt them into the free-space map, and return
        each kept slot's charge (its extent's bytes)."""
        assert self.space is not None
        slots = np.array([slot for _, slot, _ in found], dtype=np.int64)
        seqs = np.array([seq for seq, _, _ in found], dtype=np.uint64)
        starts = np.zeros(len(found), dtype=np.int64)
        pages = np.zeros(len(found), dtype=np.int64)
        if len(found):
            files, locals_ = self._locate_all(slots.tolist())
            for f, idx in self._by_file(files):
                recs = f.headers[locals_[idx]]
                starts[idx] = recs["wtime"].astype(np.int64)
                pages[idx] = extent_pages(recs)
        keep = resolve(starts, pages, seqs)
        self.space.adopt(slots[keep].tolist(), starts[keep].tolist(), pages[keep].tolist())
        return dict(zip(slots[keep].tolist(), (pages[keep] * ALIGN).tolist(), strict=True))

    def payload_at(self, slot: int) -> tuple[Path, int]:
        """The slab file and byte offset where ``slot``'s payload sits (its extent's,
        in a packed slab), for tools and tests that look at the bytes on disk."""
        if self.space is not None:
            extent = self.space.extent(slot)
            if extent is None:
                raise KeyError(f"tier {self.name!r}: slot {slot} holds no extent")
            f = self.files[self.space.file_of(extent[0])]
            return f.path, f.data_offset + (extent[0] - f.first_page) * ALIGN
        f, local = self._locate(slot)
        return f.path, f.data_offset + local * self.stride

    # -- Backend interface --------------------------------------------------------
    def recover(self) -> list[RecoveredBlock]:
        blocks, self._recovered = self._recovered, []
        return blocks

    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        self.check_batch(slots, keys, src)
        if not slots:
            return [] if self.packed else None
        if self.packed:
            return self._write_packed(slots, keys, src.numpy())
        rows = src.numpy()
        order = sorted(range(len(slots)), key=slots.__getitem__)
        n = len(slots)
        checksums: list[int] = [0] * n
        stored: list[int] = [self.payload_bytes] * n
        codecs: list[int] = [0] * n

        def do_run(f: _SlabFile, first: int, idxs: list[int]) -> None:
            views = [memoryview(rows[i]) for i in idxs]
            for i, view in zip(idxs, views, strict=True):
                checksums[i] = payload_checksum(view)
            offset = f.data_offset + (first - f.first_slot) * self.stride
            self._pwrite_run(f, offset, views)

        self._run_batch(slots, order, do_run)
        self._seal(slots, keys, checksums, stored, codecs, None)
        self.count_stored(n * self.payload_bytes, sum(stored))
        return None

    def _seal(
        self,
        slots: Sequence[int],
        keys: Sequence[BlockKey],
        checksums: list[int],
        stored: list[int],
        codecs: list[int],
        extents: list[int] | None,
        spare: list[int] | None = None,
    ) -> None:
        """Describe a batch whose payloads are written: its headers into the tables,
        then onto disk (with any headers cleared since the last write)."""
        now = time.time()
        key_bytes = [bytes(k) for k in keys]
        files, locals_ = self._locate_all(slots)
        touched: dict[int, set[int]] = {}
        with self._lock:
            headers = build_headers(
                key_bytes,
                length=self.payload_bytes,
                first_seq=self._seq + 1,
                now=now,
                layout_fp=self.layout.fingerprint,
                checksums=checksums,
                stored=stored,
                codecs=codecs,
                extents=extents,
                spare=spare,
            )
            self._seq += len(slots)
            for f, idx in self._by_file(files):
                local = locals_[idx]
                f.headers[local] = headers[idx]
                touched[f.index] = set((local * HEADER_BYTES // ALIGN).tolist())
            for index, page in self._cleared_pages:
                touched.setdefault(index, set()).add(page)
            self._cleared_pages.clear()
        try:
            self._persist_header_pages(touched)
        except OSError as exc:
            # Headers may be half on disk; the in-memory ones of this batch must not
            # be trusted either. Clear them so the slots read as empty.
            with self._lock:
                for slot in slots:
                    f, local = self._locate(slot)
                    f.headers[local] = np.zeros((), dtype=HEADER_DTYPE)
            raise BackendError(f"tier {self.name!r}: header write failed: {exc}") from exc

    def _write_packed(
        self, slots: Sequence[int], keys: Sequence[BlockKey], rows: np.ndarray[Any, Any]
    ) -> list[int]:
        """A packed slab's write: each I/O thread compresses a chunk of the batch into
        its bounce buffer, places each block in an extent of its stored pages (its
        slot's old extent freed first; under the lock, per chunk, so the books learn
        nothing per block), and writes adjacent extents with one ``pwritev``. Then the
        headers of the blocks placed. Returns each block's charge: its extent's bytes,
        or 0 where no free extent was long enough (not stored)."""
        n = len(slots)
        stored, codecs, sums, starts = [0] * n, [0] * n, [0] * n, [-1] * n
        per = max(1, min(self._bounce_bytes // self.stride, -(-n // self.cfg.io_threads)))
        space = self.space
        assert space is not None

        def do_chunk(idxs: list[int]) -> None:
            with self._bounce_buffer() as bounce:
                out = np.frombuffer(bounce, dtype=np.uint8)[: len(idxs) * self.stride]
                out = out.reshape(len(idxs), self.stride)
                got = pack_payloads([rows[i] for i in idxs], out, self.packer)
                with self._lock:
                    for k, i in enumerate(idxs):
                        stored[i], codecs[i], sums[i] = got[0][k], got[1][k], got[2][k]
                        start = space.place(slots[i], pages_for(stored[i]))
                        starts[i] = -1 if start is None else start
                runs: list[tuple[int, int, list[memoryview]]] = []  # file, page, views
                for k in sorted(range(len(idxs)), key=lambda k: starts[idxs[k]]):
                    start = starts[idxs[k]]
                    if start < 0:
                        continue
                    view = out[k, : _align_up(stored[idxs[k]])].data.cast("B")
                    f = space.file_of(start)
                    if runs and runs[-1][0] == f and runs[-1][1] == start:
                        runs[-1][2].append(view)
                        runs[-1] = (f, start + len(view) // ALIGN, runs[-1][2])
                        continue
                    runs.append((f, start + len(view) // ALIGN, [view]))
                for f, end, views in runs:
                    slab = self.files[f]
                    pages = sum(len(v) for v in views) // ALIGN
                    at = slab.data_offset + (end - pages - slab.first_page) * ALIGN
                    self._pwritev_all(slab.fd, views, at)

        with self._lock:  # every old extent first: together they make the longest runs
            for slot in slots:
                if space.release(slot):
                    self._forget(slot)
            cleared, self._cleared_pages = self._cleared_pages, set()
        # Headers of freed blocks cleared on disk before their pages take new payloads:
        # a process killed mid-write then leaves no header naming reused pages, so a
        # reopen never finds more blocks than the books held (without fsync a power
        # loss may reorder these writes: the checksums and the overlap rule remain).
        by_file: dict[int, set[int]] = {}
        for index, page in cleared:
            by_file.setdefault(index, set()).add(page)
        try:
            for index, pages in by_file.items():
                self._write_header_pages(self.files[index], sorted(pages))
        except OSError as exc:
            with self._lock:
                self._cleared_pages |= cleared
            raise BackendError(f"tier {self.name!r}: header write failed: {exc}") from exc
        self._run_chunks([list(range(i, min(n, i + per))) for i in range(0, n, per)], do_chunk)
        placed = [i for i in range(n) if starts[i] >= 0]
        if len(placed) < n:
            logger.debug(
                "tier %s: no free extent for %d of %d blocks", self.name, n - len(placed), n
            )
        if placed:
            with self._lock:
                spare = [int(space.pages[slots[i]]) - pages_for(stored[i]) for i in placed]
            self._seal(
                [slots[i] for i in placed],
                [keys[i] for i in placed],
                [sums[i] for i in placed],
                [stored[i] for i in placed],
                [codecs[i] for i in placed],
                [starts[i] for i in placed],
                spare,
            )
        self.count_stored(len(placed) * self.payload_bytes, sum(stored[i] for i in placed))
        with self._lock:  # each block's extent, splinter included (mmap_extents.py)
            return [int(space.pages[slots[i]]) * ALIGN if starts[i] >= 0 else 0 for i in range(n)]

    def _run_chunks(self, chunks: list[list[int]], fn: Callable[[list[int]], None]) -> None:
        """Run ``fn`` on each chunk on the pool; any failure becomes a BackendError."""
        if self._pool is None:
            raise BackendError(f"tier {self.name!r} is closed")
        futures = [self._pool.submit(fn, c) for c in chunks]
        failed = [e for e in (fut.exception() for fut in futures) if e is not None]
        if failed:
            raise BackendError(f"tier {self.name!r}: I/O failed: {failed[0]}") from failed[0]

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        rows = dst.numpy()
        n = len(slots)
        order = sorted(range(n), key=slots.__getitem__)
        sums: list[int] = [0] * n
        files, locals_ = self._locate_all(slots)
        # How each block is stored, from the table in memory: a compressed block is
        # read (its stored bytes only) into a bounce buffer and decompressed into its
        # row; a raw one straight into its row, as before compression existed.
        codec = np.zeros(n, dtype=np.uint8)
        stored = np.full(n, self.payload_bytes, dtype=np.int64)
        want = np.zeros(n, dtype=np.uint64)
        starts = np.full(n, -1, dtype=np.int64)  # a packed slab's extents
        with self._lock:
            for f, idx in self._by_file(files):
                recs = f.headers[locals_[idx]]
                codec[idx], stored[idx], want[idx] = (
                    recs["codec"],
                    stored_lengths(recs),
                    recs["checksum"],
                )
            if self.space is not None:
                starts[:] = self.space.start[np.asarray(slots, dtype=np.int64)]
        packed = (codec != 0) & (stored > 0) & (stored < self.payload_bytes)
        undecodable = np.zeros(n, dtype=bool)

        def do_extents(idxs: list[int]) -> None:
            # A packed slab: each block's extent into the bounce buffer, checksummed,
            # then decompressed (or copied, if stored raw) into its row.
            with self._bounce_buffer() as bounce:
                for i in idxs:
                    size = int(stored[i])
                    if starts[i] < 0 or not 0 < size <= self.payload_bytes:
                        continue  # nothing placed: fails the header check below
                    space = self.space
                    assert space is not None
                    slab = self.files[space.file_of(int(starts[i]))]
                    at = slab.data_offset + (int(starts[i]) - slab.first_page) * ALIGN
                    view = memoryview(bounce)[: _align_up(size)]
                    self._preadv_all(slab.fd, [view], at)
                    sums[i] = payload_checksum(view[:size])
                    if sums[i] != int(want[i]):
                        continue
                    if packed[i]:
                        undecodable[i] = not self.packer.decompress_into(view[:size], rows[i])
                    else:
                        rows[i][:] = np.frombuffer(view[:size], dtype=np.uint8)

        # The I/O threads only read and checksum (and decompress what verifies); the
        # headers are checked afterwards as arrays, for the reason in ``build_headers``.
        def do_run(f: _SlabFile, first: int, idxs: list[int]) -> None:
            offset = f.data_offset + (first - f.first_slot) * self.stride
            if not packed[idxs].any():
                views = [memoryview(rows[i]) for i in idxs]
                self._pread_run(f, offset, views)
                for i, view in zip(idxs, views, strict=True):
                    sums[i] = payload_checksum(view)
                return
            with self._bounce_buffer() as bounce:
                for k, i in enumerate(idxs):
                    at = offset + k * self.stride
                    if not packed[i]:
                        self._pread_run(f, at, [memoryview(rows[i])])
                        sums[i] = payload_checksum(rows[i])
                        continue
                    size = int(stored[i])
                    view = memoryview(bounce)[: _align_up(size)]
                    self._preadv_all(f.fd, [view], at)
                    sums[i] = payload_checksum(view[:size])
                    # Decompressed only once verified: damage never reaches blosc2.
                    if sums[i] == int(want[i]) and not self.packer.decompress_into(
                        view[:size], rows[i]
                    ):
                        undecodable[i] = True

        if self.space is not None:
            order = sorted(range(n), key=lambda i: int(starts[i]))  # disk order
            per = max(1, -(-n // self.cfg.io_threads))
            self._run_chunks([order[i : i + per] for i in range(0, n, per)], do_extents)
        else:
            self._run_batch(slots, order, do_run)
        valid_arr = np.zeros(n, dtype=bool)
        now = time.time()
        key_list = [bytes(k) for k in keys]
        with self._lock:
            for f, idx in self._by_file(files):
                local = locals_[idx]
                recs = f.headers[local]
                ok = (
                    check_headers(
                        recs,
                        [key_list[i] for i in idx.tolist()],
                        layout_fp=self.layout.fingerprint,
                        length=self.payload_bytes,
                        checksums=np.array(sums, dtype=np.uint64)[idx],
                        stored=stored[idx],
                    )
                    & ~undecodable[idx]
                )
                valid_arr[idx] = ok
                if self.record_access and ok.any():
                    fresh = local[ok]
                    f.headers["atime"][fresh] = now
                    seal_rows(f.headers, fresh.tolist())
                    pages = set((fresh * HEADER_BYTES // ALIGN).tolist())
                    self._dirty_pages.update((f.index, p) for p in pages)
        valid = valid_arr.tolist()
        bad = len(slots) - int(valid_arr.sum())
        if bad:
            log = logger.debug if self._warned_corrupt else logger.warning
            self._warned_corrupt = True
            log(
                "tier %s: %d of %d blocks failed verification; served as misses",
                self.name,
                bad,
                len(slots),
            )
        return valid

    def discard(self, slots: Sequence[int]) -> None:
        self._clear_headers(list(slots))

    def io_counters(self) -> dict[str, int]:
        return self.stored_counters()

    def codec_stats(self) -> CodecStats:
        return self.packer.stats()

    def footprint(self) -> tuple[int, int]:
        """Logical and stored payload bytes of the blocks the header tables describe
        (a compressed block's slot holds its stored bytes and an unused tail)."""
        count = stored = 0
        with self._lock:
            for f in self.files:
                used = f.headers[f.headers["magic"] == MAGIC]
                count += len(used)
                stored += int(stored_lengths(used).sum())
        return count * self.payload_bytes, stored

    def check(self) -> list[str]:
        problems = super().check()
        with self._lock:
            if self.space is not None:
                problems += self.space.check()
            for f in self.files:
                for local in np.flatnonzero(f.headers["magic"] == MAGIC).tolist():
                    raw = f.headers[local].tobytes()
                    if header_crc(raw) != int(f.headers["hcrc"][local]):
                        problems.append(f"slot {f.first_slot + local}: header CRC mismatch")
        return problems

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self._pool = None  # type: ignore[assignment]
        for f in getattr(self, "files", []):
            try:
                self._flush_atimes(f)
            except OSError as exc:
                logger.warning("tier %s: could not persist access times: %s", self.name, exc)
            os.close(f.fd)
            del f.headers
            # A header view may still be referenced; the GC frees the memory then.
            with contextlib.suppress(BufferError):
                f.header_buf.close()
        self.files = []
        for buf in getattr(self, "_bounce", []):
            buf.close()
        self._bounce = []
        lockfd = getattr(self, "_lockfd", None)
        if lockfd is not None:
            os.close(lockfd)
            self._lockfd = None

    # -- I/O helpers --------------------------------------------------------------
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

    def _by_file(self, files: np.ndarray[Any, Any]) -> list[tuple[_SlabFile, np.ndarray[Any, Any]]]:
        """The batch positions in each slab file, from :meth:`_locate_all`'s files."""
        if len(self.files) == 1:
            return [(self.files[0], np.arange(len(files)))]
        return [
            (f, np.flatnonzero(files == f.index)) for f in self.files if (files == f.index).any()
        ]

    def _locate(self, slot: int) -> tuple[_SlabFile, int]:
        for f in self.files:
            if slot < f.first_slot + f.num_slots:
                return f, slot - f.first_slot
        raise IndexError(f"slot {slot} out of range")

    def _run_batch(
        self,
        slots: Sequence[int],
        order: list[int],
        do_run: Callable[[_SlabFile, int, list[int]], None],
    ) -> None:
        """Split sorted slots into runs of adjacent slots in one file and run them on
        the pool; any failure becomes a :class:`BackendError`."""
        # Runs as long as possible, but no fewer than one per I/O thread: a 64 MiB
        # batch cut into 8 MiB runs would leave half of 16 threads idle.
        per_thread = -(-len(slots) // self.cfg.io_threads)
        per_run = max(1, min(MAX_RUN_BYTES // self.stride, per_thread))
        runs: list[tuple[_SlabFile, int, list[int]]] = []
        cur: list[int] = []
        cur_file: _SlabFile | None = None
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

    def _in_place(self, views: list[memoryview]) -> bool:
        """Whether O_DIRECT can use the caller's rows as they are: each row fills its
        slot exactly and starts on a page (see ``page_aligned_empty``)."""
        if self.stride != self.payload_bytes:
            return False
        return all(np.frombuffer(v, dtype=np.uint8).ctypes.data % ALIGN == 0 for v in views)

    def _pwrite_run(self, f: _SlabFile, offset: int, views: list[memoryview]) -> None:
        if self.direct and self._in_place(views):
            self._pwritev_all(f.fd, views, offset)
            return
        if not self.direct:
            if self.stride == self.payload_bytes:
                self._pwritev_all(f.fd, views, offset)
            else:  # payloads do not fill their slots: each goes to its own offset
                for k, view in enumerate(views):
                    self._pwritev_all(f.fd, [view], offset + k * self.stride)
            return
        # O_DIRECT wants page-aligned memory and lengths: stage through a bounce buffer
        # (a memcpy at ~10 GB/s, overlapped with other threads' disk I/O).
        with self._bounce_buffer() as bounce:
            pos = 0
            for view in views:
                bounce[pos : pos + len(view)] = view
                pos += self.stride
            self._pwritev_all(f.fd, [memoryview(bounce)[:pos]], offset)

    def _pread_run(self, f: _SlabFile, offset: int, views: list[memoryview]) -> None:
        if self.direct and self._in_place(views):
            self._preadv_all(f.fd, views, offset)
            return
        if not self.direct:
            if self.stride == self.payload_bytes:
                self._preadv_all(f.fd, views, offset)
            else:
                for k, view in enumerate(views):
                    self._preadv_all(f.fd, [view], offset + k * self.stride)
            return
        with self._bounce_buffer() as bounce:
            total = self.stride * len(views)
            self._preadv_all(f.fd, [memoryview(bounce)[:total]], offset)
            pos = 0
            for view in views:
                view[:] = bounce[pos : pos + len(view)]
                pos += self.stride

    @staticmethod
    def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
        want = sum(len(v) for v in views)
        done = os.pwritev(fd, views, offset)
        if done != want:  # short writes happen on a full disk; report, do not retry
            raise OSError(errno.ENOSPC, f"short write: {done} of {want} bytes")

    @staticmethod
    def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
        want = sum(len(v) for v in views)
        done = os.preadv(fd, views, offset)
        if done != want:
            raise OSError(errno.EIO, f"short read: {done} of {want} bytes")

    def _bounce_buffer(self) -> _Bounce:
        return _Bounce(self)

    def _persist_header_pages(self, touched: dict[int, set[int]]) -> None:
        """Write the given header pages of each file (file index -> pages), then, with
        ``fsync`` on, ``fdatasync`` the file. Call without holding ``_lock``."""
        for index, pages in touched.items():
            f = self.files[index]
            self._write_header_pages(f, sorted(pages))
            if self.cfg.fsync:
                # Outside ``io_lock``: it makes durable whatever was written before it,
                # this batch's pages included, and concurrent stores' syncs may overlap.
                os.fdatasync(f.fd)

    def _write_header_pages(self, f: _SlabFile, pages: list[int]) -> None:
        """Write whole 4 KiB pages of the header table (coalescing adjacent ones).

        Other threads change the table meanwhile (stores fill headers, loads refresh
        ``atime``), always under ``_lock``; the pages are therefore copied under it and
        written from the copy, so no header is torn by a change in flight. ``io_lock``
        spans copy and write: a later copy is never overwritten on disk by an earlier
        one, so a header that reached the table is on disk after any later write of
        its page."""
        ranges: list[tuple[int, int]] = []
        start = prev = pages[0]
        for page in [*pages[1:], None]:
            if page is not None and page == prev + 1:
                prev = page
                continue
            ranges.append((start * ALIGN, (prev + 1) * ALIGN))
            if page is not None:
                start = prev = page
        written = {(f.index, p) for p in pages}
        with f.io_lock:
            copies: list[tuple[int, mmap.mmap]] = []
            try:
                with self._lock, memoryview(f.header_buf) as table:
                    for lo, hi in ranges:
                        copy = _aligned_buffer(hi - lo)  # page-aligned, as O_DIRECT wants
                        copies.append((lo, copy))
                        copy[:] = table[lo:hi]
                    # The ``atime`` changes these pages held go out with them.
                    cleaned = written & self._dirty_pages
                    self._dirty_pages -= cleaned
                try:
                    for lo, copy in copies:
                        if os.pwrite(f.fd, copy, ALIGN + lo) != len(copy):
                            raise OSError(errno.ENOSPC, f"short header write in {f.path.name}")
                except OSError:
                    with self._lock:
                        self._dirty_pages |= cleaned
                    raise
            finally:
                for _, copy in copies:
                    copy.close()

    def _clear_headers(self, slots: list[int]) -> None:
        touched: dict[int, set[int]] = {}
        with self._lock:
            for slot in slots:
                f, local = self._locate(slot)
                f.headers[local] = np.zeros((), dtype=HEADER_DTYPE)
                touched.setdefault(f.index, set()).add(local * HEADER_BYTES // ALIGN)
        self._persist_header_pages(touched)

    def _flush_atimes(self, f: _SlabFile) -> None:
        """Write ``f``'s header pages with access times not yet on disk, and those
        holding headers cleared since the last write (a packed slab's freed slots):
        otherwise a clean reopen would find blocks the books had dropped."""
        with self._lock:
            cleared = {p for i, p in self._cleared_pages if i == f.index}
            self._cleared_pages -= {(f.index, p) for p in cleared}
            pages = sorted(cleared | {p for i, p in self._dirty_pages if i == f.index})
        if pages:
            self._write_header_pages(f, pages)


class _Bounce:
    """Borrow one of the backend's preallocated aligned buffers for one run."""

    def __init__(self, backend: MmapBackend) -> None:
        self.backend = backend
        self.buf: mmap.mmap | None = None

    def __enter__(self) -> mmap.mmap:
        with self.backend._bounce_lock:
            free = self.backend._bounce
            # One buffer per I/O thread, so the list is empty only if runs are issued
            # from elsewhere too; never share one then: a new buffer is merely slower.
            self.buf = free.pop() if free else _aligned_buffer(self.backend._bounce_bytes)
        return self.buf

    def __exit__(self, *exc: object) -> None:
        assert self.buf is not None
        with self.backend._bounce_lock:
            self.backend._bounce.append(self.buf)
