"""The worker side's state, and the process-wide registry where both roles find it.

One engine's worker side keeps its Offloader, its books (claims held and loads planned
for the scheduler side), its counters and its KV-event book in one :class:`Shared`,
registered in :data:`REGISTRY` by engine id (and rank). The scheduler side finds it
there when both roles share a process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and
asks it through :mod:`.remote` when they do not; :func:`connector_counters` and
:func:`connector_health` read it for tests and tools. A module of its own because it
is the one state both halves touch: neither :mod:`.scheduler` nor :mod:`.worker` owns
it alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.keys import BlockKey, namespaced
from kvoffload.offloader import LoadPlan, Offloader

from .answers import Answers
from .costs import Costs
from .events import EventBook
from .groups import Group
from .metrics import COUNTERS, snapshot

if TYPE_CHECKING:
    from .remote import BooksServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group's part of a claim or a load."""

    group: int
    plan: LoadPlan
    first: int
    """In a hold: the position of the plan's first block in the request. In a planned
    load: its offset in the load's positions (a windowed group loads the tail)."""


@dataclass
class Shared:
    """What the two roles of one engine share in its process."""

    offloader: Offloader
    events: EventBook
    namespace: bytes
    """This rank's layout fingerprint: every key the scheduler side sends is namespaced
    with it here, so each rank keeps (and finds) its own shard of a block."""
    groups: list[Group] = field(default_factory=lambda: [Group(0, "full", None, b"", ())])
    """The engine's KV cache groups (:mod:`.groups`)."""
    plans: dict[int, list[GroupPlan]] = field(default_factory=dict)
    """Loads planned by the scheduler side, by its plan id, until ``start_load_kv``:
    one plan per KV cache group."""
    abandoned_plans: set[int] = field(default_factory=set)
    """Plan ids the worker found missing when it loaded (their question came late):
    when one arrives it is unpinned at once."""
    holds: dict[str, dict[int, GroupPlan]] = field(default_factory=dict)
    """Decided claims, by request id and group: pinned until planned or released."""
    resident: dict[str, int] = field(default_factory=dict)
    """Per request looked up and not yet planned or released: the blocks of its prefix
    the cpu tier held at its first mention (the rest came from lower tiers), for vLLM's
    per-source hit counts; the scheduler side takes it (``sources``) right after the
    plan, whether or not vLLM asks for hit sources."""
    counters: dict[str, int | float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    server: BooksServer | None = None
    costs: Costs | None = None
    """The load-or-recompute estimates (``None``: every hit is loaded whole)."""
    books_timeout_s: float = 1.0
    """A lookup not answered in this time is a miss (:mod:`.answers`)."""
    waiting: dict[str, float] = field(default_factory=dict)
    """Per request whose lookup waits on prefetches: since when (``time.monotonic``)."""
    asked: dict[str, int] = field(default_factory=dict)
    """Per request still undecided: how many blocks its last lookup claimed."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``plans``, ``holds`` and ``counters``, which these threads race on: the
    scheduler side's questions (``lookup``, ``plan``, ``release``: the books server's
    thread, or the engine core's thread in single-process mode) add holds and plans
    and count; the worker's thread takes plans (``start_load_kv``) and counts; readers
    in any thread (:func:`connector_counters`, :func:`connector_health`, the worker's
    stats) read them. ``events`` is not guarded: only the worker's thread uses it. The
    Offloader guards its own state (its books' lock)."""

    def __post_init__(self) -> None:
        self.answers = Answers(self, self.books_timeout_s)
        self.generation = 0
        """Connector resets so far: the reset generation of the scheduler side's keys
        (:func:`kvoffload.keys.generation_keys`), for the operator endpoint's
        ``/query``."""
        """The scheduler side's questions, answered without blocking it."""
        self._told_skip = False

    def ns(self, keys: Sequence[BlockKey], group: int = 0) -> list[BlockKey]:
        """vLLM's block keys of KV cache group ``group`` as this rank's tiers hold
        them."""
        space = self.namespace + self.groups[group].tag
        return [namespaced(k, space) for k in keys]

    def bump(self, name: str, n: float = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def bump_many(self, **counts: float) -> None:
        """Add to several counters at once: a reader in another thread sees all of them
        or none (``blocks_loaded`` and ``tokens_loaded`` stay in step)."""
        with self.lock:
            for name, n in counts.items():
                self.counters[name] += n

    # The scheduler side's three questions, answered here (in this process, or for a
    # scheduler in another process through BooksServer).
    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        """The verified hit of ``req_id`` (pinned for it), or ``None`` while its
        blocks are being prefetched. A new lookup of the same request replaces its
        earlier hold (vLLM asks again when it could not allocate).

        With several KV cache groups the hit is the longest prefix every group can
        serve: a full-attention group's whole prefix, a windowed group's (sliding
        window, Mamba state) blocks right before the boundary."""
        self._unhold(req_id)
        keys = self._worth(req_id, keys)
        if not keys:
            self._settled(req_id)
            return 0
        off = self.offloader
        self._note_resident(req_id, keys)
        held: dict[int, GroupPlan] = {}
        pending = False
        hit = len(keys)
        for group in self.groups:
            if group.window is None:
                plan = off.claim((req_id, group.index), self.ns(keys, group.index))
                if plan is None:
                    pending = True
                else:
                    held[group.index] = GroupPlan(group.index, plan, 0)
                    hit = min(hit, plan.hits)
        windowed = [g for g in self.groups if g.window is not None]
        if windowed and not pending:
            hit = self._window_boundary(keys, hit, windowed)
            for group in windowed:
                assert group.window is not None
                first = max(0, hit - group.window)
                plan = off.claim((req_id, group.index), self.ns(keys[first:hit], group.index))
                if plan is None:
                    pending = True
                    continue
                held[group.index] = GroupPlan(group.index, plan, first)
                if plan.hits < hit - first:  # lost meanwhile: no hit this time
                    hit = 0
        if pending or hit == 0:
            for group_plan in held.values():
                off.unclaim(group_plan.plan)
            if pending:
                with self.lock:
                    self.waiting.setdefault(req_id, time.monotonic())
                return None
            self._settled(req_id)
            return 0
        self._settled(req_id)
        # Swapped in one step: a lookup of the same request that ran alongside this
        # one (two schedulers sharing these books, both sent one id) held its own
        # plans meanwhile; those are unpinned here, not leaked.
        with self.lock:
            earlier = self.holds.get(req_id, {})
            self.holds[req_id] = held
        for group_plan in earlier.values():
            off.unclaim(group_plan.plan)
        return hit

    def prefetch(self, req_id: str, keys: list[BlockKey]) -> int:
        """Start bringing ``req_id``'s prefix up from the lower tiers as soon as vLLM
        queues it, before its lookup: what is already in the cpu tier is left as it is
        (nothing pinned), what only a lower tier holds is prefetched, as a lookup would
        (the same in-flight bounds; the request's later lookup waits for the same
        prefetches, or finds them landed). A request that ends first releases them."""
        self.bump("prefetches_on_arrival")
        keys = self._worth(req_id, keys)
        self._note_resident(req_id, keys)
        for group in self.groups:
            if group.window is not None:  # a window needs its boundary: at lookup
                continue
            plan = self.offloader.claim((req_id, group.index), self.ns(keys, group.index))
            if plan is not None:  # decided at once: nothing to bring up
                self.offloader.unclaim(plan)
        return 0

    def _note_resident(self, req_id: str, keys: list[BlockKey]) -> None:
        """At ``req_id``'s first mention (its prefetch on arrival, else its first
        lookup), how much of its prefix the cpu tier holds: the rest of a hit comes
        from lower tiers (vLLM's hit sources), even once a prefetch brought it up."""
        with self.lock:
            known = req_id in self.resident
        if known or not keys:
            return
        resident = self.offloader.resident(self.ns(keys, self.groups[0].index))
        with self.lock:
            self.resident.setdefault(req_id, resident)

    def _window_boundary(self, keys: list[BlockKey], hit: int, windowed: list[Group]) -> int:
        """The largest boundary up to ``hit`` where every windowed group holds its
        window of blocks (0 if none)."""
        held = {g.index: self.offloader.held(self.ns(keys[:hit], g.index)) for g in windowed}
        for boundary in range(hit, 0, -1):
            if all(
                all(held[g.index][max(0, boundary - (g.window or 0)) : boundary]) for g in windowed
            ):
                return boundary
        return 0

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        """Turn ``req_id``'s hold into the load of its blocks ``[start, start + n)``
        under the scheduler's ``plan_id``; its length (``n`` unless the hold is gone,
        which the scheduler never causes)."""
        with self.lock:
            hold = self.holds.pop(req_id, None)
        plans: list[GroupPlan] = []
        if hold is None:
            logger.warning("kvoffload: no claim held for request %s; loading nothing", req_id)
        else:
            stop = start + n
            for group_plan in hold.values():
                first = max(start, group_plan.first)
                narrowed = self.offloader.narrow(
                    group_plan.plan, first - group_plan.first, stop - group_plan.first
                )
                plans.append(GroupPlan(group_plan.group, narrowed, first - start))
        with self.lock:
            late = plan_id in self.abandoned_plans
            self.abandoned_plans.discard(plan_id)
            if not late:
                self.plans[plan_id] = plans
                self.counters["blocks_planned"] += sum(p.plan.hits for p in plans)
        if late:
            for group_plan in plans:
                self.offloader.unclaim(group_plan.plan)
        return n if plans else 0

    def sources(self, req_id: str) -> int:
        """The blocks of ``req_id``'s hit the cpu tier held at its first lookup."""
        with self.lock:
            return self.resident.pop(req_id, 0)

    def reset(self) -> int:
        """A connector reset: drop every unpinned block of the first tier (how many),
        and tell the KV-event book (the old generation's blocks are announced removed).
        Counted in :attr:`generation` (the scheduler side's count, one reset each)."""
        self.generation += 1
        self.events.reset()
        return self.offloader.clear_first_tier()

    def _settled(self, req_id: str) -> None:
        """``req_id``'s lookup is decided: it waits no more."""
        with self.lock:
            self.waiting.pop(req_id, None)
            self.asked.pop(req_id, None)

    def release(self, req_id: str) -> int:
        """Forget ``req_id``'s claim: unpin its holds, cancel its prefetches."""
        self._settled(req_id)
        with self.lock:
            self.resident.pop(req_id, None)
        self._unhold(req_id)
        for group in self.groups:
            self.offloader.release((req_id, group.index))
        return 0

    def _unhold(self, req_id: str) -> None:
        with self.lock:
            hold = self.holds.pop(req_id, None)
        for group_plan in (hold or {}).values():
            self.offloader.unclaim(group_plan.plan)

    def answer(self, op: str, arg: Any) -> int | None:
        """One question from the scheduler side, by name (never blocking long)."""
        return self.answers.answer(op, arg)

    def _worth(self, req_id: str, keys: list[BlockKey]) -> list[BlockKey]:
        """``keys`` cut where loading stops beating recomputing (:mod:`.costs`): the
        blocks past the cut are computed, counted in ``skipped_slower_than_recompute``.

        A request already waiting for its prefetches (:attr:`waiting`) stops waiting
        once it has waited longer than computing the blocks still below would take:
        the wait so far bounds those tiers' rate (:meth:`Costs.bound`), which cuts the
        hit here and, until a read measures them again, the next hits from them. So a
        tier too slow to have been measured yet (its first reads still running) costs a
        request at most about twice its recompute, not its ``load_timeout_ms``."""
        costs = self.costs
        if costs is None:
            return keys
        tiers = self.offloader.locate(self.ns(keys, self.groups[0].index))
        n = costs.worth(tiers)
        with self.lock:
            since = self.waiting.get(req_id)
        lower = [t for t in tiers[:n] if t > 0]
        if since is not None and lower:
            waited = time.monotonic() - since
            recompute = costs.recompute_seconds(len(lower))
            if recompute is not None and waited > recompute:
                for t in set(lower):
                    costs.bound(t, lower.count(t) * costs.block_bytes, waited)
                n = costs.worth(tiers)
        with self.lock:
            shorter = n < self.asked.get(req_id, n)
            self.asked[req_id] = n
        if shorter:  # its claim of more blocks waits on prefetches: let it go
            for group in self.groups:
                self.offloader.release((req_id, group.index))
        if n >= len(tiers):
            return keys
        self.bump("skipped_slower_than_recompute", len(tiers) - n)
        if not self._told_skip:
            self._told_skip = True
            prefill, rates = costs.estimates()
            logger.info(
                "kvoffload: loading %d of %d held blocks; the rest is recomputed, faster "
                "here (prefill %.0f tokens/s; tier reads %s bytes/s). Counted in "
                "skipped_slower_than_recompute; load_or_recompute: false loads every hit",
                n,
                len(tiers),
                prefill or 0.0,
                {t: round(r) for t, r in sorted(rates.items())},
            )
        return keys[:n]


REGISTRY: dict[str, Shared] = {}
"""Worker-side state in this process, by :func:`registry_key`."""
REGISTRY_LOCK = threading.Lock()

# The names these had before (tests and test helpers import them).


def registry_key(engine_id: str, rank: int) -> str:
    """The engine id for rank 0 (the only rank of most engines), else ``<id>.rank<r>``."""
    return engine_id if rank == 0 else f"{engine_id}.rank{rank}"


def connector_counters() -> dict[str, dict[str, int | float]]:
    """This process's connector counters per engine id (see :func:`snapshot`): totals
    since the worker side started."""
    with REGISTRY_LOCK:  # engines register and close in other threads
        engines = dict(REGISTRY)
    # Read outside the registry's lock: a snapshot waits for the engine's own locks,
    # and the scheduler side takes the registry's lock every step.
    return {engine_id: snapshot(shared) for engine_id, shared in engines.items()}


def connector_health() -> dict[str, dict[str, Any]]:
    """This process's engines' pins and claims now: ``pinned`` (blocks per tier),
    ``holds`` (requests with a decided claim not yet loaded), ``prefetches`` (jobs in
    flight), ``claims`` (requests waiting on prefetches) and ``problems`` (the
    Offloader's consistency check). All zero and empty when the engine is idle."""
    with REGISTRY_LOCK:
        engines = dict(REGISTRY)
    report: dict[str, dict[str, Any]] = {}
    for engine_id, shared in engines.items():
        off = shared.offloader
        prefetches, claims = off.prefetches()
        with shared.lock:
            holds, plans = len(shared.holds), len(shared.plans)
        report[engine_id] = {
            "pinned": off.pinned(),
            "holds": holds,
            "plans": plans,
            "prefetches": prefetches,
            "claims": claims,
            "problems": off.check(),
        }
    return report


def close_slot(slot: str) -> None:
    """Unregister the worker side's state at ``slot``, stop its books server and close
    its Offloader; nothing if no worker side is registered there (in this process)."""
    with REGISTRY_LOCK:
        shared = REGISTRY.pop(slot, None)
    if shared is not None:
        if shared.server is not None:
            shared.server.close()
        shared.answers.close()
        shared.offloader.close()
        shared.events.close()
