"""Issue 23: the shared tier's store / removal records, and the worker side's book
that turns every tier's records into self-describing vLLM KV events.

The shared tier's manager runs over a fake server (a dict of keys); the book over
records handed to it as an Offloader would (``take_events``)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent
from kvoffload.server_events import EventfulServerManager

A, B, C, D = (BlockKey(bytes([i]) * 16) for i in range(1, 5))


class FakeServer:
    """A server's presence answers: ``keys`` it holds; ``down`` fails every question."""

    def __init__(self) -> None:
        self.keys: set[BlockKey] = set()
        self.down = False

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        if self.down:
            raise BackendError("server down")
        return [k in self.keys for k in keys]


def store(manager: EventfulServerManager, server: FakeServer, keys: list[BlockKey]) -> None:
    todo = manager.prepare_store(keys)
    assert todo is not None
    server.keys.update(todo.keys_to_store)
    manager.complete_store(todo.keys_to_store)


def told(manager: EventfulServerManager) -> list[tuple[bool, list[BlockKey]]]:
    return [(ev.removed, list(ev.keys)) for ev in manager.take_events()]


def test_the_shared_tier_tells_what_this_engine_stored_and_what_it_found_gone() -> None:
    server = FakeServer()
    manager = EventfulServerManager(server, 100, name="redis")
    store(manager, server, [A, B])
    assert told(manager) == [(False, [A, B])]
    store(manager, server, [A, C])  # A again: told once
    assert told(manager) == [(False, [C])]

    server.keys.discard(A)  # the server evicted it
    server.down = True
    assert manager.refresh([A, B, C]) is False  # no answer: nothing known
    assert told(manager) == []
    server.down = False
    assert manager.refresh([A, B, C]) is True
    assert told(manager) == [(True, [A])]
    assert manager.refresh([A]) is True
    assert told(manager) == []  # told once

    server.keys.add(D)  # another engine's block: its events, not ours
    assert manager.refresh([D]) is True
    assert told(manager) == []

    manager.remove([B])  # found corrupt and dropped here
    assert told(manager) == [(True, [B])]
    manager.complete_store([D], success=False)
    assert told(manager) == []


def test_the_shared_tier_forgets_its_oldest_told_block_past_its_capacity() -> None:
    server = FakeServer()
    manager = EventfulServerManager(server, 2, name="redis")
    store(manager, server, [A, B])
    store(manager, server, [C])
    assert told(manager) == [(False, [A, B]), (False, [C]), (True, [A])]


# ------------------------------------------------------------------ the worker's book
pytest.importorskip("vllm")

from kvoffload.connectors.vllm.events import EventBlocks, EventBook  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402


def tier(name: str, *, persistent: bool = False, server: bool = False) -> Any:
    return SimpleNamespace(
        name=name, backend=SimpleNamespace(persistent=persistent, server_booked=server)
    )


CPU, DISK, REDIS = (
    tier("cpu"),
    tier("disk", persistent=True),
    tier("redis", persistent=True, server=True),
)


class Records:
    """An Offloader's ``take_events``: the records handed in, once (and no tiers to
    keep journals for)."""

    tiers: tuple[Any, ...] = ()

    def __init__(self) -> None:
        self.records: list[tuple[Any, OffloadingEvent]] = []

    def add(self, t: Any, keys: list[BlockKey], removed: bool = False) -> Records:
        self.records.append((t, OffloadingEvent(tuple(keys), t.name, removed)))
        return self

    def take_events(self) -> list[tuple[Any, OffloadingEvent]]:
        records, self.records = self.records, []
        return records


def blocks(n: int, block_size: int = 2) -> EventBlocks:
    hashes: list[bytes | int] = [bytes([0xA0 + i]) * 32 for i in range(n)]
    return EventBlocks(
        hashes, [None, *hashes[:-1]], list(range(n * block_size)), block_size, 7, "adapter"
    )


def test_each_tier_gets_its_medium_and_locality_and_full_payloads() -> None:
    book = EventBook(enabled=True, cap=8)
    book.remember([A, B], blocks(2))
    rec = Records().add(CPU, [A, B]).add(DISK, [A]).add(REDIS, [B]).add(REDIS, [B], removed=True)
    events, unknown = book.take(rec)  # type: ignore[arg-type]
    assert unknown == 0
    where = [(type(e), e.medium, e.locality, e.ownership) for e in events]
    assert where == [
        (BlockStored, "CPU", "LOCAL", None),
        (BlockStored, "CPU", "LOCAL", None),
        (BlockStored, "STORAGE", "LOCAL", None),
        (BlockStored, "STORAGE", "REMOTE", None),
        (BlockRemoved, "STORAGE", "REMOTE", None),
    ]
    second = events[1]
    assert isinstance(second, BlockStored)
    assert second.token_ids == [2, 3]
    assert (second.block_size, second.lora_id, second.lora_name) == (2, 7, "adapter")
    assert second.parent_block_hash == events[0].block_hashes[0]  # type: ignore[union-attr]
    assert second.kv_cache_spec_kind == "full_attention"


def test_a_block_held_by_a_tier_is_never_forgotten() -> None:
    """Its removal can always be told, however many blocks came and went since."""
    book = EventBook(enabled=True, cap=2)
    book.remember([A], blocks(1))
    book.take(Records().add(DISK, [A]))  # type: ignore[arg-type]
    for key in (B, C, D):  # loose blocks (no tier holds them) beyond the cap
        book.remember([key], blocks(1))
        book.take(Records())  # type: ignore[arg-type]
    events, unknown = book.take(Records().add(DISK, [A], removed=True))  # type: ignore[arg-type]
    assert unknown == 0
    assert len(events) == 1
    # Loose ones beyond the cap are forgotten: B was the oldest.
    _, unknown = book.take(Records().add(CPU, [B]))  # type: ignore[arg-type]
    assert unknown == 1
