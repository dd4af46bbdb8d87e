"""Where a packed ``mmap`` slab keeps its blocks: one page extent per block.

Why (issue 33): a compressed slab that gives each block a full fixed slot stores fewer
bytes per block but holds no more blocks. A *packed* slab (``compression`` other than
``none``) keeps more slots than full-size blocks would fill and puts each block's
stored bytes, rounded up to 4 KiB pages, in one contiguous extent of its files' data
pages (:class:`~kvoffload.extents.ExtentAllocator`, best fit): the pages a block's
compression saves are free for other blocks. The tier's manager budgets those pages
(:meth:`~kvoffload.backend.Backend.budget`).

Pages are numbered across the slab's files (file ``f``'s data pages are global pages
``first_page[f] ..``); an extent never crosses a file. A block's header records the
first page of its extent (:data:`~kvoffload.record.FLAG_EXTENT`); its length is its
stored bytes rounded up to pages. The headers are the only record: at open,
:func:`resolve` keeps the valid headers whose extents do not overlap a newer one's.

Not thread-safe: the backend calls it under its lock, for memory work only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload.extents import ExtentAllocator

MAX_SPARE = 127
"""Most pages a placement takes along beyond a block's own (what a header's flags
can record, so that a reopen restores the extent and the charge exactly)."""


class PackedSpace:
    """The extents of a packed slab: free space per file, and each slot's extent."""

    def __init__(self, file_pages: Sequence[int], num_slots: int, max_pages: int) -> None:
        self.max_pages = max_pages
        self.first_page = [0]
        for pages in file_pages:
            self.first_page.append(self.first_page[-1] + pages)
        self.total_pages = self.first_page[-1]
        self.files = [ExtentAllocator(p, max_pages=max_pages) for p in file_pages]
        self.start = np.full(num_slots, -1, dtype=np.int64)  # slot -> first global page
        self.pages = np.zeros(num_slots, dtype=np.int64)  # slot -> pages (0: none)
        # The fewest pages any block has asked for: a free remainder shorter than that
        # could serve no block, so a placement takes it along (ExtentAllocator
        # .allocate_whole); a block's extent may thus be a few pages longer than its
        # stored bytes, and it is charged for them.
        self.smallest = max_pages

    def adopt(self, slots: Sequence[int], starts: Sequence[int], pages: Sequence[int]) -> None:
        """Start over from the extents a reopen found valid (none overlapping)."""
        slot_arr = np.asarray(slots, dtype=np.int64)
        start_arr = np.asarray(starts, dtype=np.int64)
        page_arr = np.asarray(pages, dtype=np.int64)
        self.start[slot_arr], self.pages[slot_arr] = start_arr, page_arr
        # As arrays: 100,000 blocks come back at every reopen of a big tier.
        files = np.searchsorted(np.asarray(self.first_page), start_arr, side="right") - 1
        used: list[list[tuple[int, int]]] = []
        for f in range(len(self.files)):
            mine = files == f
            local = (start_arr[mine] - self.first_page[f]).tolist()
            used.append(list(zip(local, page_arr[mine].tolist(), strict=True)))
        self.files = [
            ExtentAllocator(a.total_pages, max_pages=self.max_pages, used=u)
            for a, u in zip(self.files, used, strict=True)
        ]

    def file_of(self, page: int) -> int:
        """The file holding global page ``page``."""
        return bisect.bisect_right(self.first_page, page) - 1

    def place(self, slot: int, pages: int) -> int | None:
        """A new extent of at least ``pages`` for ``slot`` (whatever it held is freed
        first): its first global page, or ``None`` when no file has a free extent that
        long (the slot then holds nothing). Files with the most free pages are tried
        first; :attr:`pages` says how long the extent is."""
        self.release(slot)
        self.smallest = min(self.smallest, pages)
        order = sorted(range(len(self.files)), key=lambda f: -self.files[f].free_pages)
        for f in order:
            got = self.files[f].allocate_whole(pages, min(self.smallest, MAX_SPARE + 1))
            if got is not None:
                start = self.first_page[f] + got[0]
                self.start[slot], self.pages[slot] = start, got[1]
                return start
        return None

    def release(self, slot: int) -> bool:
        """Free ``slot``'s extent; whether it had one."""
        n = int(self.pages[slot])
        if not n:
            return False
        start = int(self.start[slot])
        f = self.file_of(start)
        self.files[f].free(start - self.first_page[f], n)
        self.start[slot], self.pages[slot] = -1, 0
        return True

    def extent(self, slot: int) -> tuple[int, int] | None:
        """``(first global page, pages)`` of ``slot``'s block, if it has one."""
        n = int(self.pages[slot])
        return (int(self.start[slot]), n) if n else None

    @property
    def used_pages(self) -> int:
        return sum(a.used_pages for a in self.files)

    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self.files)

    def largest_free(self) -> int:
        return max(a.largest_free for a in self.files)

    def check(self) -> list[str]:
        """Problems found: each allocator's own, and slots' extents in step with them."""
        problems = [f"file {f}: {p}" for f, a in enumerate(self.files) for p in a.check()]
        held = np.flatnonzero(self.pages > 0)
        if len(held) != sum(a.used_extents for a in self.files):
            problems.append(f"{len(held)} slots hold extents, the files count another number")
        for slot in held.tolist():
            start, n = int(self.start[slot]), int(self.pages[slot])
            f = self.file_of(start)
            if not self.files[f].is_allocated(start - self.first_page[f], n):
                problems.append(f"slot {slot}: extent ({start}, {n}) is not allocated")
        return problems


def resolve(
    starts: np.ndarray[Any, Any], pages: np.ndarray[Any, Any], seqs: np.ndarray[Any, Any]
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which of a reopen's candidate extents to keep: each is kept unless it overlaps
    one with a higher sequence number that is kept (a newer block was written over its
    pages, or over part of them, after it was freed). One sort when nothing overlaps,
    the common case after a clean stop; otherwise one pass, newest first, over a map
    of the pages taken."""
    n = len(starts)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    order = np.argsort(starts, kind="stable")
    ends = (starts + pages)[order]
    if not (starts[order][1:] < np.maximum.accumulate(ends)[:-1]).any():
        return keep
    taken = np.zeros(int((starts + pages).max()), dtype=bool)
    for i in np.argsort(-seqs.astype(np.int64), kind="stable").tolist():
        lo, hi = int(starts[i]), int(starts[i] + pages[i])
        if taken[lo:hi].any():
            keep[i] = False
        else:
            taken[lo:hi] = True
    return keep
