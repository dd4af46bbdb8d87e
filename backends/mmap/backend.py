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

import logging
import mmap
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from kvoffload.backends.mmap.extents import PackedSpace
from kvoffload.backends.mmap.files import ALIGN as ALIGN
from kvoffload.backends.mmap.files import MAX_RUN_BYTES as MAX_RUN_BYTES
from kvoffload.backends.mmap.files import SUPER_MAGIC as SUPER_MAGIC
from kvoffload.backends.mmap.files import SUPER_VERSION as SUPER_VERSION
from kvoffload.backends.mmap.files import SlabFile, align_up, aligned_buffer, preadv_all
from kvoffload.backends.mmap.packed import PackedSlab
from kvoffload.backends.mmap.recovery import PACKING as PACKING

from kvoffload.backend import BackendStats, RecoveredBlock
from kvoffload.codec import Packer, codec_named
from kvoffload.config import MmapTierConfig, TierConfig
from kvoffload.dirlock import lock_tier_dir
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import (
    HEADER_BYTES,
    MAGIC,
    check_headers,
    header_crc,
    payload_checksum,
    seal_rows,
    stored_lengths,
)

logger = logging.getLogger(__name__)


class MmapBackend(PackedSlab):
    """Slots in preallocated slab files under ``config.path``; survives restarts.

    Built in layers, one module each: the files and their I/O
    (:mod:`~kvoffload.backends.mmap.files`), the header tables
    (:mod:`~kvoffload.backends.mmap.headers`), opening and recovery
    (:mod:`~kvoffload.backends.mmap.recovery`), the packed write path
    (:mod:`~kvoffload.backends.mmap.packed`); this class is the tier's API."""

    config_model = MmapTierConfig
    persistent = True

    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        # The payload rounded up to the page, plus its header-table entry.
        return align_up(layout.bytes_per_block) + HEADER_BYTES

    def slots_for(self, full_slots: int) -> int:
        return full_slots * self._packing()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots // self._packing() * self.slot_bytes(self.layout)

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.space: PackedSpace | None = None  # set by _open_files when packed
        self._cleared_pages: set[tuple[int, int]] = set()
        super().__init__(config, layout)
        assert isinstance(config, MmapTierConfig)
        self.cfg = config
        self.dir = Path(config.path)
        self.payload_bytes = layout.bytes_per_block
        self.stride = align_up(self.payload_bytes)  # bytes between slot starts
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
            aligned_buffer(self._bounce_bytes) for _ in range(config.io_threads)
        ]
        self._bounce_lock = threading.Lock()
        self.files: list[SlabFile] = []
        try:
            self._open_files()
        except BaseException:
            self.close()
            raise

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

        def do_run(f: SlabFile, first: int, idxs: list[int]) -> None:
            views = [memoryview(rows[i]) for i in idxs]
            for i, view in zip(idxs, views, strict=True):
                checksums[i] = payload_checksum(view)
            offset = f.data_offset + (first - f.first_slot) * self.stride
            self._pwrite_run(f, offset, views)

        self._run_batch(slots, order, do_run)
        self._seal(slots, keys, checksums, stored, codecs, None)
        self.count_stored(n * self.payload_bytes, sum(stored))
        return None

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
                    view = memoryview(bounce)[: align_up(size)]
                    preadv_all(slab.fd, [view], at)
                    sums[i] = payload_checksum(view[:size])
                    if sums[i] != int(want[i]):
                        continue
                    if packed[i]:
                        undecodable[i] = not self.packer.decompress_into(view[:size], rows[i])
                    else:
                        rows[i][:] = np.frombuffer(view[:size], dtype=np.uint8)

        # The I/O threads only read and checksum (and decompress what verifies); the
        # headers are checked afterwards as arrays, for the reason in ``build_headers``.
        def do_run(f: SlabFile, first: int, idxs: list[int]) -> None:
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
                    view = memoryview(bounce)[: align_up(size)]
                    preadv_all(f.fd, [view], at)
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

    def stats(self, *, held: bool = True) -> BackendStats:
        """The stored bytes, the codec's figures, and the logical and stored payload
        bytes of the blocks the header tables describe (a compressed block's slot holds
        its stored bytes and an unused tail)."""
        if not held:  # the header tables' scan only for whoever asks what is held
            return BackendStats(self.stored_counters(), self.packer.stats())
        count = stored = 0
        with self._lock:
            for f in self.files:
                used = f.headers[f.headers["magic"] == MAGIC]
                count += len(used)
                stored += int(stored_lengths(used).sum())
        footprint = count * self.payload_bytes, stored
        return BackendStats(self.stored_counters(), self.packer.stats(), footprint)

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
            f.close()
        self.files = []
        self._release_buffers()
