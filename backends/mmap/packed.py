"""The packed ``mmap`` slab's write path and budget: each block in a page extent.

A packed slab (``compression`` other than ``none``) keeps more slots than full-size
blocks fill, and puts each block's stored bytes, rounded up to pages, in one extent
of its files' data pages (:class:`~kvoffload.backends.mmap.extents.PackedSpace`): the
manager budgets pages (:meth:`budget`), a store places each block and charges it its
extent, a freed slot gives its extent back at once (:meth:`released`). Reading an
extent back, and adopting the extents found at open, are the read path's and the
recovery scan's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from kvoffload.backends.mmap.files import ALIGN, align_up, pwritev_all
from kvoffload.backends.mmap.recovery import SlabRecovery

from kvoffload.codec import Packer
from kvoffload.exceptions import BackendError
from kvoffload.extents import pages_for
from kvoffload.keys import BlockKey
from kvoffload.record import pack_payloads

logger = logging.getLogger(__name__)


class PackedSlab(SlabRecovery):
    """What only a packed slab does: budget pages, free extents, place and write."""

    packer: Packer

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
                    view = out[k, : align_up(stored[idxs[k]])].data.cast("B")
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
                    pwritev_all(slab.fd, views, at)

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
        with self._lock:  # each block's extent, splinter included (extents.py)
            return [int(space.pages[slots[i]]) * ALIGN if starts[i] >= 0 else 0 for i in range(n)]
