"""The worker side's state, and the process-wide registry where both roles find it.

One engine's worker side keeps its Offloader, its books (claims held and loads planned
for the scheduler side), its counters and its KV-event book in one :class:`_Shared`,
registered in :data:`_REGISTRY` by engine id (and rank). The scheduler side finds it
there when both roles share a process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and
asks it through :mod:`.books` when they do not; :func:`connector_counters` and
:func:`connector_health` read it for tests and tools. A module of its own because it
is the one state both halves touch: neither :mod:`.scheduler` nor :mod:`.worker` owns
it alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.keys import BlockKey, namespaced
from kvoffload.offloader import LoadPlan, Offloader

from .events import _EventBook
from .metrics import COUNTERS, _snapshot

if TYPE_CHECKING:
    from .books import _BooksServer

logger = logging.getLogger(__name__)


@dataclass
class _Shared:
    """What the two roles of one engine share in its process."""

    offloader: Offloader
    events: _EventBook
    namespace: bytes
    """This rank's layout fingerprint: every key the scheduler side sends is namespaced
    with it here, so each rank keeps (and finds) its own shard of a block."""
    plans: dict[int, LoadPlan] = field(default_factory=dict)
    """Loads planned by the scheduler side, by its plan id, until ``start_load_kv``."""
    holds: dict[str, LoadPlan] = field(default_factory=dict)
    """Decided claims, by request id: pinned until planned or released."""
    counters: dict[str, int | float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    server: _BooksServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``plans``, ``holds`` and ``counters``, which these threads race on: the
    scheduler side's questions (``lookup``, ``plan``, ``release``: the books server's
    thread, or the engine core's thread in single-process mode) add holds and plans
    and count; the worker's thread takes plans (``start_load_kv``) and counts; readers
    in any thread (:func:`connector_counters`, :func:`connector_health`, the worker's
    stats) read them. ``events`` is not guarded: only the worker's thread uses it. The
    Offloader guards its own state (its books' lock)."""

    def ns(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """vLLM's block keys as this rank's tiers hold them."""
        return [namespaced(k, self.namespace) for k in keys]

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
    # scheduler in another process through _BooksServer).
    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        """The verified hit of ``req_id`` (pinned for it), or ``None`` while its
        blocks are being prefetched. A new lookup of the same request replaces its
        earlier hold (vLLM asks again when it could not allocate)."""
        self.bump("lookups")
        self._unhold(req_id)
        plan = self.offloader.claim(req_id, self.ns(keys))
        if plan is None:
            return None
        if plan.hits:
            # Swapped in one step: a lookup of the same request that ran alongside this
            # one (two schedulers sharing these books, both sent one id) held its own
            # plan meanwhile; that one is unpinned here, not leaked.
            with self.lock:
                earlier = self.holds.get(req_id)
                self.holds[req_id] = plan
            if earlier is not None:
                self.offloader.unclaim(earlier)
        else:
            self.offloader.unclaim(plan)
        return plan.hits

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        """Turn ``req_id``'s hold into the load of its blocks ``[start, start + n)``
        under the scheduler's ``plan_id``; its length (``n`` unless the hold is gone,
        which the scheduler never causes)."""
        with self.lock:
            hold = self.holds.pop(req_id, None)
        if hold is None:
            logger.warning("kvoffload: no claim held for request %s; loading nothing", req_id)
            plan = LoadPlan([], [], 0)
        else:
            plan = self.offloader.narrow(hold, start, start + n)
        with self.lock:
            self.plans[plan_id] = plan
            self.counters["blocks_planned"] += plan.hits
        return plan.hits

    def release(self, req_id: str) -> int:
        """Forget ``req_id``'s claim: unpin its hold, cancel its prefetches."""
        self._unhold(req_id)
        self.offloader.release(req_id)
        return 0

    def _unhold(self, req_id: str) -> None:
        with self.lock:
            hold = self.holds.pop(req_id, None)
        if hold is not None:
            self.offloader.unclaim(hold)

    def answer(self, op: str, arg: Any) -> int | None:
        """One question from the scheduler side, by name."""
        if op == "lookup":
            return self.lookup(*arg)
        if op == "plan":
            return self.plan(*arg)
        if op == "release":
            return self.release(arg)
        raise ValueError(f"kvoffload books: unknown question {op!r}")


_REGISTRY: dict[str, _Shared] = {}
"""Worker-side state in this process, by :func:`_registry_key`."""
_REGISTRY_LOCK = threading.Lock()


def _registry_key(engine_id: str, rank: int) -> str:
    """The engine id for rank 0 (the only rank of most engines), else ``<id>.rank<r>``."""
    return engine_id if rank == 0 else f"{engine_id}.rank{rank}"


def connector_counters() -> dict[str, dict[str, int | float]]:
    """This process's connector counters per engine id (see :func:`_snapshot`): totals
    since the worker side started."""
    with _REGISTRY_LOCK:  # engines register and close in other threads
        engines = dict(_REGISTRY)
    # Read outside the registry's lock: a snapshot waits for the engine's own locks,
    # and the scheduler side takes the registry's lock every step.
    return {engine_id: _snapshot(shared) for engine_id, shared in engines.items()}


def connector_health() -> dict[str, dict[str, Any]]:
    """This process's engines' pins and claims now: ``pinned`` (blocks per tier),
    ``holds`` (requests with a decided claim not yet loaded), ``prefetches`` (jobs in
    flight), ``claims`` (requests waiting on prefetches) and ``problems`` (the
    Offloader's consistency check). All zero and empty when the engine is idle."""
    with _REGISTRY_LOCK:
        engines = dict(_REGISTRY)
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


def _close(slot: str) -> None:
    """Unregister the worker side's state at ``slot``, stop its books server and close
    its Offloader; nothing if no worker side is registered there (in this process)."""
    with _REGISTRY_LOCK:
        shared = _REGISTRY.pop(slot, None)
    if shared is not None:
        if shared.server is not None:
            shared.server.close()
        shared.offloader.close()
