"""KV events across ranks: each rank's report of a step kept apart
(:class:`TieredOffloadKVEvents`, the worker side's ``KVConnectorKVEvents``), and each
event published once every rank that keeps tiers has reported it
(:class:`KVEventTally`, scheduler side). Apart from :mod:`.events` (what the events
say) because this is only how they travel: vLLM's aggregation of a step's worker
outputs counts only the ranks that sent events that step (docs/vllm.md, "KV cache
events", tensor parallelism).
"""

from __future__ import annotations

import itertools
import os
import socket
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Final

import msgspec
from vllm.distributed.kv_events import BlockRemoved, KVCacheEvent, KVConnectorKVEvents


class _Report(list[KVCacheEvent]):
    """One rank's events as its :meth:`TieredOffloadKVEvents.get_all_events` hands them
    to vLLM's output aggregator, which passes the list on, as it is, to the first
    rank's ``add_events``: the list says whose events they are."""

    __slots__ = ("source",)

    def __init__(self, events: Iterable[KVCacheEvent], source: Hashable) -> None:
        super().__init__(events)
        self.source = source


_anonymous = itertools.count()


def _this_process() -> str:
    """Who reports a worker's events: its process. vLLM runs each rank of an engine
    in a process of its own (``mp``, Ray, ``external_launcher``; ``uni`` has one
    rank), and the process id is read when a report is made, so a worker forked
    from a parent that imported this module is told apart from it."""
    return f"{socket.gethostname()}/{os.getpid()}"


class TieredOffloadKVEvents(KVConnectorKVEvents):  # type: ignore[misc]  # vLLM: Any
    """One step's KV events from the worker side, carried to the scheduler side in the
    step's ``KVConnectorOutput``. vLLM combines the ranks that sent events that step
    (``KVOutputAggregator``: the first one's object takes the others' ``add_events``
    and ``increment_workers``); each rank's events stay apart here, by reporter
    (``source``: the rank's process unless given), for :class:`KVEventTally`."""

    def __init__(
        self,
        events: Iterable[KVCacheEvent] = (),
        workers: int = 1,
        *,
        source: Hashable | None = None,
    ) -> None:
        self._reports: list[tuple[Hashable, list[KVCacheEvent]]] = [
            (_this_process() if source is None else source, list(events))
        ]
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Another rank's events (vLLM's aggregator passes its ``get_all_events``); a
        list that does not say whose is one reporter of its own."""
        source = getattr(events, "source", None)
        if source is None:
            source = ("anonymous", next(_anonymous))
        self._reports.append((source, list(events)))

    def reports(self) -> list[tuple[Hashable, list[KVCacheEvent]]]:
        """Each reporter's events of this step, in the order they were reported."""
        return [(source, list(events)) for source, events in self._reports]

    def aggregate(self) -> TieredOffloadKVEvents:
        """Keep what every worker of this one step reported, as vLLM's own aggregator
        does (with one worker, everything, duplicates included). Ranks that finish a
        store in different steps defeat it: the scheduler side uses
        :class:`KVEventTally`, which counts across steps."""
        events = self.get_all_events()
        if self._workers > 1:
            counts = Counter(events)
            events = [e for e in dict.fromkeys(events) for _ in range(counts[e] // self._workers)]
            self._reports = [(("aggregated", self._workers), events)]
            self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every event, in report order; one reporter's say whose they are."""
        if len(self._reports) == 1:
            source, events = self._reports[0]
            return _Report(events, source)
        return [e for _, events in self._reports for e in events]

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports = [(self._reports[0][0], [])]
        self._workers = 1


MAX_PENDING_EVENTS: Final = 1 << 18
"""Most events :class:`KVEventTally` keeps that some rank has reported and another not
yet. Ranks report a store within a step or two of each other, so the tally normally
holds a few steps' events (a 100k-token prefill of 16-token blocks into two tiers is
about 12,500); more means the ranks' tiers diverged (an event some rank will never
report), and the oldest are dropped. At about 400 bytes an event (32-token blocks),
about 100 MiB at most."""


def _one_block_each(events: Iterable[KVCacheEvent]) -> Iterator[KVCacheEvent]:
    """``events`` with each removal of several blocks split into one per block: a rank
    tells the blocks an eviction took in one event, and another rank's eviction may
    take the same blocks in other batches (``BlockStored`` is one block already)."""
    for event in events:
        if isinstance(event, BlockRemoved) and len(event.block_hashes) > 1:
            for h in event.block_hashes:
                yield msgspec.structs.replace(event, block_hashes=[h])
        else:
            yield event


def _removals_joined(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Consecutive removals of one tier and group as one event, as a rank tells them."""
    out: list[KVCacheEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and msgspec.structs.replace(last, block_hashes=[])
            == msgspec.structs.replace(event, block_hashes=[])
        ):
            out[-1] = msgspec.structs.replace(
                last, block_hashes=[*last.block_hashes, *event.block_hashes]
            )
        else:
            out.append(event)
    return out


class KVEventTally:
    """Scheduler side: each KV event once every rank that keeps tiers has reported it,
    whichever steps they report it in, never twice.

    vLLM's aggregation keeps, within one step, what every rank that sent events *that
    step* reported (``KVOutputAggregator`` counts only those), so with tensor
    parallelism a block whose stores finish in different steps on two ranks was
    announced twice (each rank alone in its step) or not at all (each step's other
    rank sent other events). The tally counts each event per reporter across steps:
    an event is published once ``ranks`` reporters have each reported it once more
    than it was published for them, so a rank that reports a block stored, removed and
    stored again before another rank reports it once counts toward the next
    publication, not this one. A removal is counted the same way (block by block), so
    the blocks announced per tier are those every rank's tier has stored and not every
    rank's evicted since: once the ranks have caught up, what every rank's tier holds."""

    def __init__(self, ranks: int, cap: int = MAX_PENDING_EVENTS) -> None:
        self.ranks = ranks
        """Ranks whose workers keep tiers and report events: every rank, or rank 0
        alone for a cache every rank holds alike (MLA)."""
        self.cap = cap
        self.dropped = 0
        """Events dropped before every rank reported them (the tally was full)."""
        self._pending: OrderedDict[KVCacheEvent, Counter[Hashable]] = OrderedDict()

    def add(self, events: object) -> list[KVCacheEvent]:
        """The events one step's combined output (``KVConnectorOutput.kv_cache_events``)
        completes; nothing for anything but :class:`TieredOffloadKVEvents`."""
        if not isinstance(events, TieredOffloadKVEvents):
            return []
        if self.ranks <= 1:
            return list(events.get_all_events())
        done: list[KVCacheEvent] = []
        pending = self._pending
        for source, reported in events.reports():
            for event in _one_block_each(reported):
                seen = pending.get(event)
                if seen is None:
                    seen = pending[event] = Counter()
                seen[source] += 1
                if len(seen) < self.ranks:
                    continue
                done.append(event)
                for who in list(seen):
                    seen[who] -= 1
                    if not seen[who]:
                        del seen[who]
                if not seen:
                    del pending[event]
        while len(pending) > self.cap:
            pending.popitem(last=False)
            self.dropped += 1
        return _removals_joined(done)

    def pending(self) -> int:
        """Events some rank reported and not every rank yet."""
        return len(self._pending)
