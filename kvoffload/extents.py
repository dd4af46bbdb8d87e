"""A best-fit allocator of variable-size page extents, for packing compressed blocks.

Why extents (issue 33): a compressed tier that still gives every block a full fixed
slot stores fewer bytes per block but holds no more blocks, so compression buys I/O
and no capacity. Here a block whose compressed payload takes ``n`` pages of
:data:`PAGE_BYTES` (4 KiB, so every extent is O_DIRECT-aligned) takes one contiguous
extent ``(start, n)`` and nothing more; the space it saves is free for other blocks.

Why best fit: the smallest free extent that holds ``n`` (lowest start among equals)
keeps large free extents whole for incompressible blocks, and under churn with mixed
compression ratios it fragments least of the simple policies; the lowest-start
tie-break packs blocks toward the front of the file, where a later shrink or scan is
cheapest. A remainder is split back as a free extent; a freed extent coalesces with
its free neighbours on both sides at once, so free extents are always maximal.

Cost per operation, ``F`` free extents, ``m = max_pages``:

* :meth:`ExtentAllocator.allocate`: O(m / 64) to find the smallest non-empty length
  class (one bit per class in an int), plus O(log F) amortised for that class's heap.
  Never a walk over the free extents.
* :meth:`ExtentAllocator.free`: O(1) dict operations to coalesce, plus O(log F) for a
  heap push.
* Construction from ``used`` extents: O(U log U) (one sort). ``largest_free`` is
  O(1) unless the largest free extent is longer than ``m`` pages, then O(number of
  such extents); :meth:`ExtentAllocator.check` is O(E log E), for tests and verify.

Free extents are indexed by start (``start -> length``), by end (``end -> start``,
for coalescing with a left neighbour) and by length class: one class per length
``1 .. m`` and one for every longer extent, each a min-heap of ``(length, start)``
with lazy deletion (an entry is live while ``by_start[start] == length``), rebuilt
when stale entries outnumber live ones.

How a crash-safe tier uses it: write the payload into the allocated extent first and
the header that names ``(start, n)`` second, so a crash between the two writes leaves
a block without a valid header, which is a miss, never data. At reopen the tier reads
the valid headers, resolves any overlap between them by sequence number (the newer
block wins; this class refuses overlaps rather than guessing), and passes the
survivors as ``used``; every other page is free. The allocator therefore holds no
persistent state of its own: the headers are the only record, and a block lost to a
crash simply returns its pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Final

from kvoffload.exceptions import BlockStateError

PAGE_BYTES: Final = 4096
"""The allocation unit: the O_DIRECT alignment of every extent's offset and length."""


def pages_for(nbytes: int) -> int:
    """Pages needed to store ``nbytes`` (at least one: an extent is never empty)."""
    return max(1, -(-nbytes // PAGE_BYTES))


class ExtentAllocator:
    """Free-space map over pages ``0 .. total_pages-1``, handing out contiguous extents.

    ``max_pages`` bounds a request (a block's uncompressed size in pages), which
    bounds the length classes searched. ``used`` are the extents a reopened tier found
    valid on disk; overlapping or out-of-range ones raise :class:`BlockStateError`.
    """

    __slots__ = (
        "_by_end",
        "_by_start",
        "_count",
        "_free_pages",
        "_heaps",
        "_nonempty",
        "_used",
        "max_pages",
        "total_pages",
    )

    def __init__(
        self, total_pages: int, *, max_pages: int, used: Iterable[tuple[int, int]] = ()
    ) -> None:
        if total_pages <= 0:
            raise ValueError(f"total_pages must be positive, got {total_pages}")
        if max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {max_pages}")
        self.total_pages = total_pages
        self.max_pages = max_pages
        self._by_start: dict[int, int] = {}  # free extent start -> length
        self._by_end: dict[int, int] = {}  # free extent end (exclusive) -> start
        # Class c holds free extents of length c (1 <= c <= max_pages); class
        # max_pages + 1 holds every longer one. Class 0 is never used.
        self._heaps: list[list[tuple[int, int]]] = [[] for _ in range(max_pages + 2)]
        self._count = [0] * (max_pages + 2)  # live extents per class
        self._nonempty = 0  # bit c set while class c holds a free extent
        self._free_pages = 0
        self._used: dict[int, int] = {}  # allocated extent start -> length
        cursor = 0
        previous: tuple[int, int] | None = None
        for start, n in sorted(used):
            if n <= 0 or n > max_pages or start < 0 or start + n > total_pages:
                raise BlockStateError(
                    f"used extent ({start}, {n}) is out of range: lengths 1..{max_pages}, "
                    f"pages 0..{total_pages - 1}"
                )
            if previous is not None and start < previous[0] + previous[1]:
                raise BlockStateError(
                    f"used extents {previous} and ({start}, {n}) overlap; the caller "
                    "resolves overlapping headers by sequence number before reopening"
                )
            if start > cursor:
                self._insert_free(cursor, start - cursor)
            self._used[start] = n
            cursor = start + n
            previous = (start, n)
        if cursor < total_pages:
            self._insert_free(cursor, total_pages - cursor)

    # -- public operations -------------------------------------------------------

    def allocate(self, n: int) -> int | None:
        """The start of a new extent of ``n`` pages, or ``None`` (allocating nothing)
        if no free extent holds ``n``. Best fit: the smallest free extent that holds
        ``n``, the lowest start among equals; the remainder stays free."""
        got = self.allocate_whole(n, 0)
        return None if got is None else got[0]

    def allocate_whole(self, n: int, splinter: int) -> tuple[int, int] | None:
        """:meth:`allocate`, but a remainder shorter than ``splinter`` pages goes with
        the extent (up to ``max_pages``): ``(start, pages)`` as allocated. Why: a caller
        that never asks for fewer than ``splinter`` pages could never use it, and left
        free it would sit between blocks, counted free and useless, until a neighbour
        is freed; taken, it is charged to the block that made it, and freed with it."""
        if not 1 <= n <= self.max_pages:
            raise ValueError(f"an extent is 1..{self.max_pages} pages, asked for {n}")
        above = self._nonempty >> n
        if not above:
            return None
        cls = n + (above & -above).bit_length() - 1
        length, start = self._top(cls)
        self._remove_free(start)
        if length > n and (length - n >= splinter or length > self.max_pages):
            self._insert_free(start + n, length - n)
        else:
            n = length
        self._used[start] = n
        return start, n

    def free(self, start: int, n: int) -> None:
        """Return an allocated extent, coalescing it with free neighbours on both sides.

        Only an extent exactly as allocated (or adopted from ``used``) may be freed:
        anything else (a double free, a piece of an extent, a range overlapping free
        space) raises :class:`BlockStateError` and changes nothing.
        """
        held = self._used.get(start)
        if held != n:
            what = "is not allocated" if held is None else f"was allocated as ({start}, {held})"
            raise BlockStateError(f"cannot free extent ({start}, {n}): {start} {what}")
        del self._used[start]
        left = self._by_end.get(start)
        if left is not None:
            n += start - left
            self._remove_free(left)
            start = left
        right = self._by_start.get(start + n)
        if right is not None:
            self._remove_free(start + n)
            n += right
        self._insert_free(start, n)

    def is_allocated(self, start: int, n: int) -> bool:
        """Whether ``(start, n)`` is an extent currently allocated exactly as given."""
        return self._used.get(start) == n

    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def used_pages(self) -> int:
        return self.total_pages - self._free_pages

    @property
    def free_extents(self) -> int:
        return len(self._by_start)

    @property
    def used_extents(self) -> int:
        return len(self._used)

    @property
    def largest_free(self) -> int:
        """Pages in the largest free extent (0 when nothing is free)."""
        if not self._nonempty:
            return 0
        cls = self._nonempty.bit_length() - 1
        if cls <= self.max_pages:
            return cls
        by_start = self._by_start
        return max(length for length, start in self._heaps[cls] if by_start.get(start) == length)

    def fragmentation(self) -> float:
        """``1 - largest_free / free_pages``: 0 when the free space is one extent (or
        there is none), towards 1 as it splinters into pieces too small to use."""
        if not self._free_pages:
            return 0.0
        return 1.0 - self.largest_free / self._free_pages

    def used(self) -> list[tuple[int, int]]:
        """The allocated extents, by start (what a reopen would pass as ``used``)."""
        return sorted(self._used.items())

    def free_list(self) -> list[tuple[int, int]]:
        """The free extents, by start."""
        return sorted(self._by_start.items())

    def check(self) -> list[str]:
        """Problems found (empty when consistent): every page free xor used exactly
        once, lengths positive, free extents coalesced, the indexes in agreement."""
        problems: list[str] = []
        extents = [(s, n, "free") for s, n in self._by_start.items()]
        extents += [(s, n, "used") for s, n in self._used.items()]
        extents.sort()
        cursor, prev_kind, prev = 0, "", (0, 0)
        for start, n, kind in extents:
            if n <= 0:
                problems.append(f"{kind} extent ({start}, {n}) has no pages")
            if start < cursor:
                problems.append(f"{prev_kind} extent {prev} overlaps {kind} extent ({start}, {n})")
            elif start > cursor:
                problems.append(f"pages {cursor}..{start - 1} are neither free nor used (leak)")
            elif kind == "free" and prev_kind == "free":
                problems.append(f"free extents {prev} and ({start}, {n}) are not coalesced")
            cursor, prev_kind, prev = max(cursor, start + n), kind, (start, n)
        if cursor != self.total_pages:
            problems.append(f"extents end at page {cursor}, not at {self.total_pages}")
        return problems + self._check_indexes()

    # -- internals ---------------------------------------------------------------

    def _check_indexes(self) -> list[str]:
        problems: list[str] = []
        if self._free_pages != sum(self._by_start.values()):
            problems.append(f"free_pages {self._free_pages} != the free extents' sum")
        ends = {s + n: s for s, n in self._by_start.items()}
        if ends != self._by_end:
            problems.append("the end index disagrees with the start index")
        counts = [0] * len(self._count)
        entries = [set(heap) for heap in self._heaps]
        for s, n in self._by_start.items():
            cls = self._class(n)
            counts[cls] += 1
            if (n, s) not in entries[cls]:
                problems.append(f"free extent ({s}, {n}) is missing from its length class")
        if counts != self._count:
            problems.append("the per-class counts disagree with the free extents")
        bits = sum(1 << c for c, k in enumerate(counts) if k)
        if bits != self._nonempty:
            problems.append("the non-empty class bits disagree with the free extents")
        return problems

    def _class(self, length: int) -> int:
        return min(length, self.max_pages + 1)

    def _top(self, cls: int) -> tuple[int, int]:
        """The live ``(length, start)`` heading class ``cls`` (which must be non-empty),
        dropping the stale entries above it."""
        heap, by_start = self._heaps[cls], self._by_start
        while by_start.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0]

    def _insert_free(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._free_pages += n
        cls = self._class(n)
        heap = self._heaps[cls]
        self._count[cls] += 1
        self._nonempty |= 1 << cls
        heapq.heappush(heap, (n, start))
        if len(heap) > 2 * self._count[cls] + 8:
            # Mostly stale: keep the live entries once each (a start freed, taken and
            # freed again at the same length may have been pushed twice).
            by_start = self._by_start
            heap[:] = sorted({(ln, s) for ln, s in heap if by_start.get(s) == ln})

    def _remove_free(self, start: int) -> None:
        """Drop a free extent from the indexes; its heap entry goes stale."""
        n = self._by_start.pop(start)
        del self._by_end[start + n]
        self._free_pages -= n
        cls = self._class(n)
        self._count[cls] -= 1
        if not self._count[cls]:
            self._nonempty &= ~(1 << cls)
