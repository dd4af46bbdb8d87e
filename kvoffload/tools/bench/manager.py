"""Scheduler-side bookkeeping cost: our manager against vLLM's own, on a recorded trace.

The manager runs on the engine's scheduler thread, once per request, so its cost per
block is paid on every step whether or not any byte moves. This measures it against
the baseline a vLLM user already has: vLLM's ``CPUOffloadingManager`` with its
``"lru"`` cache policy (``vllm.v1.kv_offload.cpu``), replaying the same requests at the
same capacity.

Both sides do the same request lifecycle, in the same order, untimed set-up aside:

1. look the request's keys up (ours: one ``lookup(keys)``; vLLM's API is one
   ``lookup(key)`` per block, stopping at the first block that is not a ``HIT``);
2. on the hit prefix: ``prepare_load``, ``touch``, ``complete_load``;
3. ``prepare_store(keys)`` then, unless it refused (``None``), ``complete_store(keys)``;
4. the end-of-request recency update: ours ``touch(keys)``; vLLM's
   ``on_request_finished`` (where its LRU policy re-ranks the request's blocks, head
   most recent, which is what our ``touch`` does), after ``on_new_request`` at the
   start; then both drain their events, as the connector does every step.

With the same capacity and these semantics the two keep the same blocks, so their hit
counts must be equal: the report carries both, and the tests hold them to it.

The default capacity, :data:`DEFAULT_CAPACITY` blocks, is a fifth of the trace slice's
working set (38,788 distinct blocks in 54,559 requested), so eviction runs on most
requests (36,753 blocks evicted) and 18% of blocks (9,806) still hit.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, Final

from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.slots import SlotAllocator
from kvoffload.tools.bench.harness import ratio
from kvoffload.tools.workloads import make_workload

logger = logging.getLogger(__name__)

DEFAULT_TRACE: Final = (
    Path(__file__).resolve().parents[3] / "tests" / "data" / "mooncake_conversation_head2000.jsonl"
)
"""The Mooncake slice the tests use; exists in a source checkout (editable install)."""
DEFAULT_CAPACITY: Final = 8000
"""Blocks the tier holds: well under the trace's working set, so eviction happens."""
DEFAULT_REPS: Final = 5

Replay = Callable[[Sequence[list[BlockKey]], int], tuple[int, int]]
"""``(requests, capacity) -> (elapsed ns, hit blocks)``, building its manager untimed."""


def load_trace(
    path: str | PathLike[str] = DEFAULT_TRACE,
    *,
    limit: int | None = None,
    max_blocks: int | None = None,
) -> list[list[BlockKey]]:
    """Every request of a Mooncake trace as its block keys (hashed once, untimed)."""
    return list(make_workload("trace", path=path, limit=limit, max_blocks=max_blocks))


def _timed(run: Callable[[], int]) -> tuple[int, int]:
    # A collection in the middle of one side's run would be charged to that side for
    # garbage the other may have made; collect first and keep the collector off.
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        hits = run()
        return time.perf_counter_ns() - start, hits
    finally:
        gc.enable()


def replay_ours(requests: Sequence[list[BlockKey]], capacity: int) -> tuple[int, int]:
    """Our :class:`LRUOffloadingManager`, built as :func:`kvoffload.tier.build_tiers`
    does (events on, LRU policy, a fresh :class:`SlotAllocator`)."""
    manager = LRUOffloadingManager(SlotAllocator(capacity), "lru", name="bench")

    def run() -> int:
        hits = 0
        for keys in requests:
            n = manager.lookup(keys)
            if n:
                hit = keys[:n]
                manager.prepare_load(hit)
                manager.touch(hit)
                manager.complete_load(hit)
                hits += n
            if manager.prepare_store(keys) is not None:
                manager.complete_store(keys)
            manager.touch(keys)
            manager.take_events()
        return hits

    return _timed(run)


def vllm_replay() -> Replay | None:
    """The same lifecycle on vLLM's ``CPUOffloadingManager`` (policy ``"lru"``, events
    on like ours), or ``None`` when vLLM cannot be imported here."""
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except Exception as exc:  # not installed, or not importable on this build
        logger.warning("vLLM's offloading manager not benchmarked: %s", exc)
        return None
    hit_result = LookupResult.HIT

    def replay(requests: Sequence[list[BlockKey]], capacity: int) -> tuple[int, int]:
        manager = CPUOffloadingManager(capacity, cache_policy="lru", enable_events=True)
        # vLLM keys carry a KV-cache-group suffix; build them, and the per-request
        # contexts its API threads through every call, before the clock starts.
        work = [
            ([make_offload_key(k, 0) for k in keys], ReqContext(req_id=str(i)))
            for i, keys in enumerate(requests)
        ]

        def run() -> int:
            hits = 0
            lookup = manager.lookup
            for keys, ctx in work:
                manager.on_new_request(ctx)
                n = 0
                for key in keys:
                    if lookup(key, ctx) is not hit_result:
                        break
                    n += 1
                if n:
                    hit = keys[:n]
                    manager.prepare_load(hit, ctx)
                    manager.touch(hit, ctx)
                    manager.complete_load(hit, ctx)
                    hits += n
                if manager.prepare_store(keys, ctx) is not None:
                    manager.complete_store(keys, ctx)
                manager.on_request_finished(ctx)
                list(manager.take_events())
            return hits

        return _timed(run)

    return replay


def bench_manager(
    trace: str | PathLike[str] = DEFAULT_TRACE,
    *,
    capacity: int = DEFAULT_CAPACITY,
    reps: int = DEFAULT_REPS,
    limit: int | None = None,
    max_blocks: int | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` through both managers ``reps`` times each, interleaved; best kept.

    ``manager_ns_per_block`` and ``vllm_lru_ns_per_block`` divide the whole replay's
    time by the blocks passed to lookup; ``manager_vs_vllm_lru`` is ours / theirs
    (below 1.0: ours is cheaper). The vLLM figures are ``None`` without vLLM.
    """
    requests = load_trace(trace, limit=limit, max_blocks=max_blocks)
    blocks = sum(len(keys) for keys in requests)
    theirs = vllm_replay()
    ours_ns: list[int] = []
    theirs_ns: list[int] = []
    ours_hits: set[int] = set()
    theirs_hits: set[int] = set()
    # Interleaved, so a slow spell of the machine hits both sides alike.
    for _ in range(reps):
        ns, hits = replay_ours(requests, capacity)
        ours_ns.append(ns)
        ours_hits.add(hits)
        if theirs is not None:
            ns, hits = theirs(requests, capacity)
            theirs_ns.append(ns)
            theirs_hits.add(hits)
    if len(ours_hits) > 1 or len(theirs_hits) > 1:
        raise AssertionError(f"replay is not deterministic: {ours_hits} / {theirs_hits}")
    ours_per_block = min(ours_ns) / blocks
    theirs_per_block = min(theirs_ns) / blocks if theirs_ns else None
    logger.info(
        "manager bench: %d requests, %d blocks, capacity %d: ours %.0f ns/block, vLLM %s",
        len(requests),
        blocks,
        capacity,
        ours_per_block,
        "-" if theirs_per_block is None else f"{theirs_per_block:.0f} ns/block",
    )
    return {
        "trace": str(trace),
        "requests": len(requests),
        "blocks": blocks,
        "distinct_blocks": len({k for keys in requests for k in keys}),
        "capacity_blocks": capacity,
        "reps": reps,
        "manager_hits": ours_hits.pop(),
        "vllm_lru_hits": theirs_hits.pop() if theirs_hits else None,
        "manager_ns_per_block": ours_per_block,
        "vllm_lru_ns_per_block": theirs_per_block,
        "manager_vs_vllm_lru": ratio(ours_per_block, theirs_per_block),
    }
