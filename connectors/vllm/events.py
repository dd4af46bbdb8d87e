"""KV cache events: the tiers' store and eviction records as vLLM ``BlockStored`` /
``BlockRemoved`` events (with ``kv_events_config.enable_kv_cache_events``).

The worker side holds the tiers, so it is where their records are turned into events
(:class:`_EventBook`, kept in :class:`~.shared._Shared`); the events then ride the
step's ``KVConnectorOutput`` to the scheduler side (:class:`TieredOffloadKVEvents`),
which hands them to vLLM's publisher. A module of its own because both roles use it
and neither owns it: the worker side makes the events, the scheduler side publishes them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Final

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.tier import Tier

MAX_EVENT_HASHES: Final = 1 << 20
"""Most keys whose vLLM block hash the worker side keeps for KV events (about 200 bytes
each), when the tiers' capacities add up to more blocks."""


BlockHash = bytes | int
"""A vLLM block hash as ``request.block_hashes`` holds it (bytes; ints in older vLLM)."""


def _medium(tier: Tier) -> str:
    """vLLM's event medium for a tier: memory, or storage for a persistent backend."""
    return str(MEDIUM_STORAGE if tier.backend.persistent else MEDIUM_CPU)


class _EventBook:
    """Worker side: turns the tiers' own store / eviction records into vLLM KV events.

    Every tier's manager records the keys it made ready (``removed=False``) and the keys
    it evicted or dropped (``removed=True``), whoever caused it: engine stores, copies
    down the chain, promotions, eviction, corruption. The Offloader records them only
    when events are enabled (``Offloader(events=True)``), and they are drained here
    every step. Keys are namespaced digests that cannot be turned
    back into vLLM's hashes, so the scheduler side sends each store's and load's hashes
    along (only when events are enabled) and they are remembered here per key: the
    ``cap`` most recently stored or loaded, ``cap`` being what the tiers hold together,
    so that a key is normally forgotten only after it has left them. The oldest are
    forgotten after each step's records are translated, not as new keys arrive: a
    step's stores evict the oldest blocks, whose removal must still be told. Nor are
    keys forgotten when no tier holds them: an ``on_evict`` tier's copy of an evicted
    block is queued only after the eviction is recorded, and would be missed. A record
    for a key whose hash is unknown (a block recovered from disk at start and not
    loaded since, or forgotten) emits nothing and is counted."""

    def __init__(self, *, enabled: bool, cap: int) -> None:
        self.enabled = enabled
        self.cap = cap
        self.hashes: OrderedDict[BlockKey, BlockHash] = OrderedDict()

    def remember(self, keys: Sequence[BlockKey], hashes: Sequence[BlockHash]) -> None:
        for key, block_hash in zip(keys, hashes, strict=True):
            self.hashes[key] = block_hash
            self.hashes.move_to_end(key)

    def take(self, off: Offloader) -> tuple[list[KVCacheEvent], int]:
        """The events since the previous call, and how many records had no known hash."""
        records = off.take_events()
        if not self.enabled:
            return [], 0
        events: list[KVCacheEvent] = []
        unknown = 0
        for tier, ev in records:
            known = [self.hashes.get(key) for key in ev.keys]
            hashes = [_external_hash(h) for h in known if h is not None]
            unknown += len(known) - len(hashes)
            medium = _medium(tier)
            if ev.removed:
                if hashes:
                    events.append(
                        BlockRemoved(
                            block_hashes=hashes, medium=medium, group_idx=0, ownership=tier.name
                        )
                    )
                continue
            # The shape of vLLM's own OffloadingConnector's default events: one per
            # block, its hash only (no parent, tokens or block size are known here).
            events.extend(
                BlockStored(
                    block_hashes=[h],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=0,
                    ownership=tier.name,
                )
                for h in hashes
            )
        while len(self.hashes) > self.cap:
            self.hashes.popitem(last=False)
        return events, unknown


def _external_hash(block_hash: BlockHash) -> Any:
    """The hash as vLLM publishes it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return maybe_convert_block_hash(block_hash) if isinstance(block_hash, bytes) else block_hash


class TieredOffloadKVEvents(KVConnectorKVEvents):  # type: ignore[misc]  # vLLM: Any
    """One step's KV events from the worker side, carried to the scheduler side in the
    step's ``KVConnectorOutput`` (vLLM combines the workers' with ``add_events`` and
    ``increment_workers``)."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), workers: int = 1) -> None:
        self._events = list(events)
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TieredOffloadKVEvents:
        """Keep what every worker reported, as vLLM's aggregator does (with one worker,
        everything, duplicates included)."""
        if self._workers > 1:
            counts = Counter(self._events)
            self._events = [
                e for e in dict.fromkeys(self._events) for _ in range(counts[e] // self._workers)
            ]
            self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1
