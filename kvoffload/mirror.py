"""What the books' counters mirror from outside the books, as they are read.

A tier's :class:`~kvoffload.plans.TierStats` are counted by the books as they settle
jobs, except two kinds of field: the counters the backend keeps itself (round trips,
server errors, stored bytes: :attr:`~kvoffload.backend.BackendStats.counters`) and the
gauges of what the tier holds now (:func:`~kvoffload.metrics.tier_state`). Those are
copied in one way, backend to stats, when the stats are read (:meth:`Books.counters
<kvoffload.books.Books.counters>`), under the books' lock; the backends' own counts
are read before it, outside it. Kept apart so the books' module keeps to its
transactions.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.metrics import BACKEND_METRICS, tier_state
from kvoffload.plans import TierStats


def mirror(
    stats: TierStats, io: Mapping[str, int], capacity_bytes: int, manager: OffloadingManager
) -> None:
    """Copy a backend's counts (``io``) and its tier's gauges into ``stats`` (call
    under the books' lock, so that two readers never write them out of order)."""
    for name, value in io.items():
        if name in BACKEND_METRICS:
            setattr(stats, name, value)
    if "stored_bytes" not in io:
        # A backend that never compresses (the cpu slab, most plugins) stores what it
        # was given: both are the books' bytes_written.
        stats.logical_bytes = stats.stored_bytes = stats.bytes_written
    # What the tier holds now, against what it could hold (blocks per GiB).
    for name, value in tier_state(held(manager), capacity_bytes).items():
        setattr(stats, name, value)


def held(manager: OffloadingManager) -> int | None:
    """Blocks a tier's books hold; ``None`` for books kept by a server."""
    return len(manager) if isinstance(manager, LRUOffloadingManager) else None
