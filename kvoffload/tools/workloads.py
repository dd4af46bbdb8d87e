"""Request generators for ``kvoffload stress``: what a serving engine would ask the tiers for.

A workload is a seeded stream of requests; a request is the list of its block keys, a
prefix chain (block ``i`` is only useful when blocks ``0..i-1`` are too, exactly as in
prefix caching). Keys chain with :func:`kvoffload.keys.chain_key`, so two requests share
a key only when they share the whole prefix up to it. Everything here is pure Python
and runs on the scheduler side; no tier, tensor or clock is involved, so a workload can
also be replayed offline (:func:`prefix_hit_ratio`) to know what hit ratio to expect.

Built-in workloads, by :func:`make_workload` name:

- ``zipf``: popular shared prefixes (system prompts, documents) drawn with Zipf
  popularity, plus blocks unique to each request;
- ``multiturn``: chat sessions growing turn by turn, each request the whole history;
- ``scan``: no reuse at all, the worst case (hit ratio 0);
- ``trace``: a replay of a Mooncake-format JSONL trace (``tests/data/README.md``).

The base class is in :mod:`~kvoffload.tools.workload_base`, the generated streams in
:mod:`~kvoffload.tools.workload_synthetic`, the trace reader in
:mod:`~kvoffload.tools.workload_trace`; every name is importable from here.

:class:`ReplicaShare` wraps any of them: one replica's share of a stream that several
replicas split (``kvoffload stress --replicas N``).
"""

from __future__ import annotations

import inspect
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, final

from kvoffload.keys import BlockKey
from kvoffload.tools.workload_base import Workload, at_least
from kvoffload.tools.workload_synthetic import MultiTurnWorkload, ScanWorkload, ZipfWorkload
from kvoffload.tools.workload_trace import TRACE_TOKENS_PER_BLOCK as TRACE_TOKENS_PER_BLOCK
from kvoffload.tools.workload_trace import TraceWorkload

__all__ = [
    "WORKLOADS",
    "MultiTurnWorkload",
    "ReplicaShare",
    "ScanWorkload",
    "TraceWorkload",
    "Workload",
    "ZipfWorkload",
    "make_workload",
    "prefix_hit_ratio",
]


# ------------------------------------------------------------------------ replicas
@final
class ReplicaShare(Workload):
    """Replica ``replica``'s share of a request stream that ``replicas`` replicas split.

    Every replica builds the same ``stream`` (same workload, same seed), and a router
    seeded with ``seed`` alone sends each request of it to one replica drawn uniformly
    at random, as a load balancer without prefix affinity would. The shares are
    disjoint, together (interleaved in stream order) they are the whole stream, and
    they ask for the same prefixes (a ``zipf`` prompt, a ``multiturn`` session whose
    turns land on different replicas): what one replica computed is worth a hit in
    another exactly as often as in one replica that saw the whole stream.

    The router draws from its own generator (not the stream's, whose draws it would
    repeat), so a request's replica is independent of what it asks for. A replica
    generates and skips the other replicas' requests: ``replicas`` times the work of
    the stream alone, which is pure Python and small beside the tiers.
    """

    name = "share"

    def __init__(self, stream: Workload, *, replica: int, replicas: int, seed: int = 0) -> None:
        at_least("replicas", replicas)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
            raise ValueError(f"replica must be an integer in 0..{replicas - 1}, got {replica!r}")
        self.stream = stream
        self.replica = replica
        self.replicas = replicas
        self.max_blocks = stream.max_blocks
        self._router = random.Random(b"kvoffload-router:%d" % seed)
        self._ahead: list[BlockKey] | None = None  # our next request, already drawn
        self.position = 0
        """Requests of the whole stream drawn so far (every replica's)."""

    def _draw(self) -> None:
        while self._ahead is None and not self.stream.exhausted:
            keys = self.stream.next()
            self.position += 1
            if self._router.randrange(self.replicas) == self.replica:
                self._ahead = keys

    @property
    def finite(self) -> bool:
        return self.stream.finite

    @property
    def exhausted(self) -> bool:
        self._draw()
        return self._ahead is None

    def next(self) -> list[BlockKey]:
        self._draw()
        if self._ahead is None:
            raise IndexError(
                f"replica {self.replica}'s share is exhausted after {self.position} requests "
                "of the stream; check .exhausted first"
            )
        keys, self._ahead = self._ahead, None
        return keys


# ------------------------------------------------------------------------ registry
_WORKLOADS: dict[str, Callable[..., Workload]] = {
    cls.name: cls for cls in (ZipfWorkload, MultiTurnWorkload, ScanWorkload, TraceWorkload)
}
WORKLOADS: Final[Mapping[str, Callable[..., Workload]]] = MappingProxyType(_WORKLOADS)
"""Workload name -> constructor (read-only view; :func:`make_workload` builds them)."""


def make_workload(name: str, **params: Any) -> Workload:
    """Build the workload ``name`` with keyword ``params`` (``trace`` takes ``path``).

    Raises :class:`ValueError` naming the known workloads for an unknown name, and the
    accepted parameters for one the workload does not take: a typo in a stress config
    must not silently run a different workload.
    """
    factory = _WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(_WORKLOADS)}")
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {name!r} takes no parameter {', '.join(map(repr, unknown))}; "
            f"it takes: {', '.join(accepted)}"
        )
    return factory(**params)


# ---------------------------------------------------------------------- simulation
def prefix_hit_ratio(
    workload: Workload, capacity_blocks: int | None = None, *, requests: int | None = None
) -> float:
    """Hit ratio of an ideal single-tier LRU cache of ``capacity_blocks`` on ``workload``.

    The yardstick for a stress run's ``hit_rate``: what a perfect tier of that size
    would get on the same requests. Counted as prefix caching counts: a block hits only
    if it and every earlier block of its request are cached; every block of every
    request is then admitted (``None`` = infinite capacity, nothing evicted). Blocks
    are touched tail first, so a request's head block is its most recent one and
    eviction eats chains from the tail, as engines free them.

    Consumes ``requests`` requests of ``workload`` (a finite one: until exhausted;
    a generated one needs ``requests``). Returns hits / requested blocks.
    """
    if capacity_blocks is not None:
        at_least("capacity_blocks", capacity_blocks)
    if requests is None and not workload.finite:
        raise ValueError(f"workload {workload.name!r} never ends; pass requests=N")
    cache: OrderedDict[BlockKey, None] = OrderedDict()  # key -> None, least recent first
    hits = total = served = 0
    while not workload.exhausted and (requests is None or served < requests):
        keys = workload.next()
        served += 1
        total += len(keys)
        for key in keys:
            if key not in cache:
                break
            hits += 1
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits / total if total else 0.0
