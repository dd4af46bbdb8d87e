"""The books' cascade: which blocks go down into the next tier, and how they get there.

Each lower tier is fed from the tier above it, by its ``write_policy``
(``write_through``: a copy as soon as a block lands; ``on_evict``: the displaced
blocks, read before their slots are overwritten), gated by the admission filter
(``admit_after_hits``: the load counts kept here) and by backpressure
(``max_pending_stores``, ``max_store_delay_ms``: a copy the lane cannot take soon is
dropped, counted). Its answers are orders (a :class:`~kvoffload.plans.Write`, a
:class:`~kvoffload.plans.Copy`) for :mod:`kvoffload.books`, which owns it and calls it
under its lock only; it moves no byte and sees tiers only through their managers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from kvoffload.breaker import Breakers
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingManager
from kvoffload.plans import Copy, TierStats, Write, WriteOutcome

HIT_COUNTS: Final = 1 << 20
"""Most keys whose load count the admission filter remembers (least recent forgotten),
whatever the tiers hold; the bound in force is usually :func:`hit_counts_bound`."""

HIT_COUNTS_PER_BLOCK: Final = 4
"""Load counts remembered per block the tiers can hold together (see
:func:`hit_counts_bound`)."""

HIT_COUNTS_MIN: Final = 4096
"""Load counts remembered at least, however small the tiers."""


def hit_counts_bound(capacities: Sequence[int]) -> int:
    """How many keys the admission filter's load counts remember, for tiers holding
    ``capacities`` blocks: :data:`HIT_COUNTS_PER_BLOCK` per block they hold together
    (at least :data:`HIT_COUNTS_MIN`, at most :data:`HIT_COUNTS`).

    A count matters only while its block is held somewhere or may soon be computed
    again: beyond a few times what the whole hierarchy holds, the least recently loaded
    keys are long gone from every tier. Every distinct block loaded adds an entry (~150
    bytes with its key), so a flat 2^20 cap (~150 MiB) let a long run's memory grow
    linearly for hours: about 2 MiB a minute under ``kvoffload stress``'s multi-turn
    soak (tests/tools/test_soak.py), whose tiers hold 320 blocks."""
    return min(HIT_COUNTS, max(HIT_COUNTS_MIN, HIT_COUNTS_PER_BLOCK * sum(capacities)))


class Cascade:
    """The cascade's decisions over ``managers`` (see the module docstring).
    ``depth(t)`` is the number of store jobs queued or running for tier ``t``."""

    def __init__(
        self,
        managers: Sequence[OffloadingManager],
        configs: Sequence[TierConfig],
        stats: Sequence[TierStats],
        breakers: Breakers,
        depth: Callable[[int], int],
    ) -> None:
        self.managers = managers
        self.configs = configs
        self.stats = stats
        self.breakers = breakers
        self._depth = depth
        self._hit_counts: OrderedDict[BlockKey, int] = OrderedDict()
        # Bounded by what the tiers hold, not by a flat 2^20 (see hit_counts_bound).
        self._hit_counts_cap = hit_counts_bound([m.capacity for m in managers])
        # Load counts serve only the admission filter: without one, nobody counts them.
        self._counting = any(c.admit_after_hits for c in configs)
        self._job_seconds = [0.0] * len(managers)  # moving average per store job

    def timed(self, t: int, elapsed: float) -> None:
        """A store job into tier ``t`` took ``elapsed`` seconds, submit to done."""
        avg = self._job_seconds[t]
        self._job_seconds[t] = elapsed if avg == 0.0 else 0.8 * avg + 0.2 * elapsed

    def accepts(self, t: int, n: int) -> bool:
        """Whether tier ``t`` takes a new store job now; counts the drop if not."""
        cfg = self.configs[t]
        if self.breakers.bypassed(t):
            self.stats[t].bypassed_stores += n
            return False
        depth = self._depth(t)
        full = depth >= cfg.max_pending_stores
        if not full and cfg.max_store_delay_ms is not None:
            full = depth * self._job_seconds[t] * 1e3 > cfg.max_store_delay_ms
        if full:
            self.stats[t].dropped_stores += n
        return not full

    def admitted(self, t: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        need = self.configs[t].admit_after_hits
        if need == 0:
            return list(keys)
        counts = self._hit_counts
        admitted = [k for k in keys if counts.get(k, 0) >= need]
        self.stats[t].not_admitted += len(keys) - len(admitted)
        return admitted

    def ready_demotion(self, w: Write) -> None:
        """Decide, as ``w`` is planned, which of its displaced blocks go down: the next
        tier's (``on_evict``) admitted ones. ``w.evicted`` is narrowed to them and
        ``w.demote`` says whether there are any, so the job reads exactly those before
        overwriting their slots, and asks nobody. Also which displaced slots the write
        does not reuse (``w.released``: a budgeted tier's parked victims)."""
        if len(w.evicted) > len(w.slots):  # a budgeted tier's victims beyond its slots
            reused = set(w.slots)
            w.released = [slot for _, slot in w.evicted if slot not in reused]
        nxt = w.tier + 1
        if not (
            w.evicted and nxt < len(self.managers) and self.configs[nxt].write_policy == "on_evict"
        ):
            w.demote = False
            return
        admitted = set(self.admitted(nxt, [k for k, _ in w.evicted]))
        if len(admitted) < len(w.evicted):
            w.evicted = [e for e in w.evicted if e[0] in admitted]
        w.demote = bool(w.evicted)

    def after_write(self, out: WriteOutcome, stored: list[BlockKey]) -> list[Copy]:
        """The next tier's copies of a settled write whose ``stored`` keys landed: its
        displaced blocks read into ``out.demoted`` (``on_evict``), and what it wrote
        (``write_through``), from ``out.buf`` when the bytes sit in a buffer, else
        read back from the written tier."""
        w = out.write
        orders: list[Copy] = []
        nxt = w.tier + 1
        if nxt >= len(self.managers):
            return orders
        if out.demoted is not None:
            copy = self.plan_copy(nxt, out.evicted, buffered=True)
            if copy is not None:
                orders.append(Copy(copy, "demoted"))
        if stored and self.configs[nxt].write_policy == "write_through":
            admitted = self.admitted(nxt, stored)
            if admitted and out.buf is not None:
                row = {k: i for i, k in enumerate(w.keys)}
                rows = [row[k] for k in admitted]
                copy = self.plan_copy(nxt, admitted, buffered=True, rows=rows)
                if copy is not None:
                    orders.append(Copy(copy, "written"))
            elif admitted:
                copy = self.plan_copy(nxt, admitted, src_tier=w.tier)
                if copy is not None:
                    orders.append(Copy(copy, "tier"))
        return orders

    def plan_copy(
        self,
        t: int,
        keys: list[BlockKey],
        *,
        src_tier: int | None = None,
        buffered: bool = False,
        rows: list[int] | None = None,
    ) -> Write | None:
        """A copy of ``keys`` into tier ``t``: from a buffer whose row ``rows[i]``
        (default ``i``) holds ``keys[i]`` (``write.rows`` then says which rows to take),
        or from ``src_tier``, where the blocks are pinned until the copy has read them.
        Keys the tier already holds, or is writing, are left out; ``None`` when nothing
        is left, or the tier refuses (counted)."""
        manager = self.managers[t]
        keep = [i for i, k in enumerate(keys) if not manager.holds(k)]
        picked = [(rows[i] if rows is not None else i) for i in keep]
        keys = [keys[i] for i in keep]
        if not keys:
            return None
        if not self.accepts(t, len(keys)):  # counts the drop
            return None
        out = manager.prepare_store(keys)
        if out is None:
            self.stats[t].rejected_stores += len(keys)
            return None
        if out.keys_to_store != keys:  # repeated keys were merged
            first = {k: picked[i] for i, k in reversed(list(enumerate(keys)))}
            picked = [first[k] for k in out.keys_to_store]
        self.stats[t].evictions += len(out.evicted)
        write = Write(
            t,
            out.keys_to_store,
            out.slots,
            rows=picked if buffered else None,
            evicted=list(zip(out.evicted, out.evicted_slots, strict=True)),
            submitted=time.perf_counter(),
        )
        self.ready_demotion(write)
        if src_tier is not None:
            write.src_tier = src_tier
            write.src_slots = self.managers[src_tier].prepare_load(out.keys_to_store)
        return write

    def count_hits(self, loaded: Sequence[BlockKey]) -> list[Copy]:
        """Remember load counts for the admission filter; write-through copies of
        blocks that just reached a lower tier's ``admit_after_hits``."""
        if not loaded or not self._counting:
            return []
        counts = self._hit_counts
        for key in loaded:
            counts[key] = counts.get(key, 0) + 1
            counts.move_to_end(key)
        while len(counts) > self._hit_counts_cap:
            counts.popitem(last=False)
        orders: list[Copy] = []
        for t in range(1, len(self.managers)):
            cfg = self.configs[t]
            if cfg.admit_after_hits and cfg.write_policy == "write_through":
                ready = [k for k in loaded if counts[k] == cfg.admit_after_hits]
                src = self.managers[t - 1]
                ready = [k for k in ready if src.ready(k)]
                if ready:
                    copy = self.plan_copy(t, ready, src_tier=t - 1)
                    if copy is not None:
                        orders.append(Copy(copy, "tier"))
        return orders
