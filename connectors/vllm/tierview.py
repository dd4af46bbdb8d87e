"""What the operator endpoint reads of the tiers: usage per tier, and prefix matches.

:mod:`.admin` serves ``/tiers`` from :func:`tiers_report` and ``/query`` from
:func:`match`; :mod:`.canary` takes its slot through :class:`BooksView`. All of it
reads the worker's Offloader as it is now, from the endpoint's threads, and changes
nothing a request sees: no claim, no pin, no recency, no counter.

**The books' lock.** A tier's manager is only ever called under the Offloader's books'
lock (lane threads and the scheduler's questions change it under that lock), which
only the books take: :class:`BooksView` asks the Offloader for snapshots
(``Offloader.ready_by_tier``, ``blocks_by_tier``) and for a probe's slot
(``probe_slot``, ``give_back_slot``), each one short bookkeeping transaction of the
books', never across I/O.

**Shared servers** keep their own books: what a ``redis`` tier holds is asked of the
server (one batched ``EXISTS``, bounded by its ``socket_timeout_ms``), as the
engine's own lookup asks it, outside the lock and without touching the books'
remembered answer (so a lookup running meanwhile is not changed). While its breaker
is open the engine does not ask it, and neither does the endpoint: it counts as
holding nothing. How many blocks the server holds is the server's to say (its
``INFO``/``DBSIZE``): ``/tiers`` reports ``null`` there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final

from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.tier import Tier

logger = logging.getLogger(__name__)

ERROR_COUNTERS: Final = ("store_errors", "corrupt_blocks", "lost_blocks", "server_errors")
"""The tier counters (:data:`kvoffload.metrics.TIER_METRICS`) that count failures,
summed in a tier's ``errors``: writes that raised, blocks found damaged, blocks a
server lost, batches a server failed."""


def medium(tier: Tier) -> str:
    """A tier's medium in the names a router's index uses (Dynamo's indexer, the
    Mooncake RFC: ``cpu``, ``disk``): the KV events' ``CPU`` (memory) and ``STORAGE``
    (a persistent backend: a disk, or a shared server; :mod:`.events`), lower-cased
    as Dynamo reports them."""
    return "disk" if tier.backend.persistent else "cpu"


class BooksView:
    """The few reads of the Offloader's books the endpoint needs, each one snapshot of
    theirs (see the module docstring)."""

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader

    def held(self, keys: Sequence[BlockKey]) -> list[list[bool]]:
        """Per tier, per key: whether the tier holds the block ready to load. Local
        tiers from their books (one transaction for all of them); a shared server's
        tier from the server (``[False] * n`` while its breaker is open or the server
        cannot answer)."""
        tiers = self.offloader.tiers
        local, bypassed = self.offloader.ready_by_tier(keys)
        out: list[list[bool]] = []
        for i, (tier, answer) in enumerate(zip(tiers, local, strict=True)):
            if answer is None:
                answer = [False] * len(keys) if bypassed[i] else self._ask_server(tier, keys)
            out.append(answer)
        return out

    @staticmethod
    def _ask_server(tier: Tier, keys: Sequence[BlockKey]) -> list[bool]:
        try:
            return [bool(x) for x in tier.backend.exists(keys)] if keys else []
        except Exception as exc:  # a dead server holds nothing for this answer
            logger.debug("kvoffload: /query: tier %s did not answer: %s", tier.name, exc)
            return [False] * len(keys)

    def blocks(self) -> list[int | None]:
        """Per tier: the blocks its books hold (``None`` for a shared server's tier),
        read in one transaction."""
        return self.offloader.blocks_by_tier()

    def take_slot(self, t: int, key: BlockKey) -> list[int] | None:
        """Room in tier ``t`` for ``key``, as a store makes it (a free slot, else the
        least recent unpinned block evicted); ``None`` if there is none. The key is
        then being written: never found, loaded or evicted until given back."""
        return self.offloader.probe_slot(t, key)

    def give_back_slot(self, t: int, key: BlockKey, slots: list[int]) -> None:
        """Forget ``key`` in tier ``t`` as a failed store would (no "stored" record),
        and discard what its slot holds on a local medium, so a restart never
        recovers it."""
        self.offloader.give_back_slot(t, key, slots)


def tiers_report(offloader: Offloader, view: BooksView) -> list[dict[str, Any]]:
    """``/tiers``: per tier, what it holds, how it serves, and what went wrong."""
    counters, _ = offloader.counters()
    bpb = offloader.bpb
    out: list[dict[str, Any]] = []
    for tier, blocks in zip(offloader.tiers, view.blocks(), strict=True):
        values = counters[tier.name]
        footprint = tier.backend.stats().held if blocks is not None else None
        if blocks is not None and footprint is None:
            footprint = (blocks * bpb, blocks * bpb)  # stored as given: raw bytes
        hits, misses = values["hits"], values["misses"]
        out.append(
            {
                "name": tier.name,
                "backend": tier.backend.config.backend,
                "medium": medium(tier),
                "capacity_blocks": tier.manager.capacity,
                "blocks": blocks,
                "logical_bytes": None if footprint is None else footprint[0],
                "stored_bytes": None if footprint is None else footprint[1],
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                # The breaker_open gauge: from a trip until a read or write succeeds.
                "breaker": "open" if values.get("breaker_open") else "closed",
                "errors": sum(int(values[name]) for name in ERROR_COUNTERS),
                "counters": values,
            }
        )
    return out


WALK: Final = ("cpu", "disk", "remote")
"""The places ``/query`` walks a prompt through, in order (see :func:`match`)."""


def place(tier: Tier) -> str:
    """Where ``/query``'s walk reads a tier: ``cpu`` (memory), ``disk`` (a local
    persistent backend: ``mmap``, ``lmdb``; the KV events' ``STORAGE`` / ``LOCAL``,
    Dynamo's ``disk`` tree) or ``remote`` (a shared server's tier: ``STORAGE`` /
    ``REMOTE``, whose events Dynamo drops, so it is reported past Dynamo's fields)."""
    if tier.backend.server_booked:
        return "remote"
    return medium(tier)


def match(
    offloader: Offloader, view: BooksView, keys: Sequence[BlockKey]
) -> tuple[list[int], dict[str, int]]:
    """For the blocks ``keys`` (a prompt's, in order): per tier, the length of the
    prefix it holds alone; and per place of :data:`WALK`, how far Dynamo's walk gets
    (cumulative, in blocks): the prefix the ``cpu`` tiers hold together, then on
    through the blocks after it the ``disk`` tiers hold, then the ``remote`` ones.
    Dynamo's indexer answers its ``cpu`` and ``disk`` exactly so from the KV events
    (after its ``gpu``, which the worker side cannot see: the walk starts at 0), and a
    router compares the two; a block past a gap of its place counts for none."""
    held = view.held(keys)
    per_tier = [_prefix(h) for h in held]
    walk: dict[str, int] = {}
    at = 0
    for name in WALK:
        rows = [h for t, h in zip(offloader.tiers, held, strict=True) if place(t) == name]
        while at < len(keys) and any(row[at] for row in rows):
            at += 1
        walk[name] = at
    return per_tier, walk


def _prefix(flags: Sequence[bool]) -> int:
    """How many leading ``flags`` are true."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
