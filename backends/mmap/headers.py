"""The ``mmap`` tier's header tables: one 128-byte header per slot, kept in memory and
written to each slab file's table in whole 4 KiB pages.

A store seals its batch (builds the headers of payloads already written, puts them in
the tables, then writes their pages); a discard or a reclaim clears headers; a load's
``atime`` refresh and a packed slab's freed slots only mark pages, written with the
next header write or at close. The tables are the tier's only record of what it holds
(:mod:`kvoffload.record` says what a header holds), so a page goes out as a copy taken
under the lock, never torn by a change in flight.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Sequence

import numpy as np
from kvoffload.backends.mmap.files import ALIGN, SlabFile, SlabFiles, aligned_buffer

from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.record import HEADER_BYTES, HEADER_DTYPE, build_headers


class HeaderTables(SlabFiles):
    """The slab files' header tables, in memory and on disk."""

    _lock: threading.Lock
    """Guards the in-memory header tables, ``_seq`` and the page sets; held for
    memory work only, never across I/O."""
    _seq: int
    _dirty_pages: set[tuple[int, int]]
    """(file, page) with ``atime`` changes not yet on disk."""
    _cleared_pages: set[tuple[int, int]]
    """(file, page) with headers cleared in memory, to go out with the next write."""

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

    def _forget(self, slot: int) -> None:
        """Clear ``slot``'s header in memory, its page to be written with the next
        header write (under ``_lock``)."""
        f, local = self._locate(slot)
        f.headers[local] = np.zeros((), dtype=HEADER_DTYPE)
        self._cleared_pages.add((f.index, local * HEADER_BYTES // ALIGN))

    def _persist_header_pages(self, touched: dict[int, set[int]]) -> None:
        """Write the given header pages of each file (file index -> pages), then, with
        ``fsync`` on, ``fdatasync`` the file. Call without holding ``_lock``."""
        for index, pages in touched.items():
            f = self.files[index]
            self._write_header_pages(f, sorted(pages))
            if self.cfg.fsync:
                # Outside ``io_lock``: it makes durable whatever was written before it,
                # this batch's pages included, and concurrent stores' syncs may overlap.
                f.sync()

    def _write_header_pages(self, f: SlabFile, pages: list[int]) -> None:
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
                        copy = aligned_buffer(hi - lo)  # page-aligned, as O_DIRECT wants
                        copies.append((lo, copy))
                        copy[:] = table[lo:hi]
                    # The ``atime`` changes these pages held go out with them.
                    cleaned = written & self._dirty_pages
                    self._dirty_pages -= cleaned
                try:
                    for lo, copy in copies:
                        f.write_table(copy, lo)
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

    def _flush_atimes(self, f: SlabFile) -> None:
        """Write ``f``'s header pages with access times not yet on disk, and those
        holding headers cleared since the last write (a packed slab's freed slots):
        otherwise a clean reopen would find blocks the books had dropped."""
        with self._lock:
            cleared = {p for i, p in self._cleared_pages if i == f.index}
            self._cleared_pages -= {(f.index, p) for p in cleared}
            pages = sorted(cleared | {p for i, p in self._dirty_pages if i == f.index})
        if pages:
            self._write_header_pages(f, pages)
