"""What a persistent tier's blocks are, kept beside the tier for KV events after a restart.

A tier's keys are one-way digests of vLLM's block hashes, so a restarted engine knows
which keys its disk tier recovered but not the hash, parent hash and tokens a router
needs to file them (docs/fleet.md). With KV events on, each persistent tier of this
host (``mmap``, ``lmdb``; not a shared server's) keeps a journal, ``kv-events.journal``
in the tier's directory: one record per block it announced stored, appended as it is
announced. At start the records of the blocks the tier recovered are read back and
the blocks announced stored again (:meth:`Journals.recovered`), and the file is
rewritten with those alone; it is rewritten likewise once it has twice as many records
as the tier has slots.

A record is its length (4 bytes, little-endian) and a msgpack array: key, hash,
parent hash, tokens (``int32``, native order), LoRA id and name, KV cache group,
reset generation. Appends are flushed each step, not synced: a crash can lose the
last records, whose blocks are then not announced after the restart (a router
underestimates the tier, never routes to a block that is gone). A truncated or
unreadable record ends the reading there. A read-only tier's journal is read, never
written.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

import msgspec

from kvoffload.keys import BlockKey
from kvoffload.tier import Tier

logger = logging.getLogger(__name__)

JOURNAL_NAME: Final = "kv-events.journal"
_LENGTH: Final = struct.Struct("<I")


class Described(Protocol):
    """What a journal record says of a block (the event book's ``_Block``)."""

    block_hash: bytes | int
    parent: bytes | int | None
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    group: int
    generation: int


Record = tuple[
    BlockKey, bytes | int, bytes | int | None, list[int], int | None, str | None, int, int
]
"""A block as read back: key, hash, parent, tokens, LoRA id and name, group, generation."""


def _pack(fields: list[Any]) -> bytes:
    payload = msgspec.msgpack.encode(fields)
    return _LENGTH.pack(len(payload)) + payload


def _encode(key: BlockKey, b: Described) -> bytes:
    tokens = b.tokens.tobytes()
    return _pack(
        [key, b.block_hash, b.parent, tokens, b.lora_id, b.lora_name, b.group, b.generation]
    )


def _encode_record(r: Record) -> bytes:
    key, h, parent, tokens, lora_id, lora_name, group, gen = r
    return _pack([key, h, parent, array("i", tokens).tobytes(), lora_id, lora_name, group, gen])


def _read(path: Path) -> dict[BlockKey, Record]:
    """Every readable record of ``path`` (the last one of a key wins)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    out: dict[BlockKey, Record] = {}
    at = 0
    while at + _LENGTH.size <= len(data):
        (n,) = _LENGTH.unpack_from(data, at)
        payload = data[at + _LENGTH.size : at + _LENGTH.size + n]
        if len(payload) < n:
            break  # a record cut short by a crash
        try:
            key, h, parent, raw, lora_id, lora_name, group, gen = msgspec.msgpack.decode(payload)
            tokens = array("i")
            tokens.frombytes(raw)
        except (msgspec.DecodeError, ValueError, TypeError):
            logger.warning("kvoffload: %s: unreadable record at byte %d; reading stops", path, at)
            break
        out[BlockKey(key)] = (
            BlockKey(key),
            h,
            parent,
            tokens.tolist(),
            lora_id,
            lora_name,
            group,
            gen,
        )
        at += _LENGTH.size + n
    return out


class _Journal:
    """One persistent tier's journal (the module docstring)."""

    def __init__(self, tier: Tier, directory: Path) -> None:
        self.tier = tier
        self.path = directory / JOURNAL_NAME
        self.readonly = bool(getattr(tier.backend.config, "readonly", False))
        self.limit = 2 * max(1, tier.manager.capacity) + 1024
        self.keys: set[BlockKey] = set()
        """The keys with a record in the file."""
        self.records = 0
        """Records in the file (a key's rewritten records count again)."""
        self._file: BinaryIO | None = None

    def recovered(self) -> list[Record]:
        """The records of the blocks the tier holds now; the file rewritten with those."""
        records = _read(self.path)
        held = [records[k] for k in self.tier.manager.held_keys() if k in records]
        self.keys = {r[0] for r in held}
        if not self.readonly:
            self._rewrite(b"".join(_encode_record(r) for r in held))
        self.records = len(held)
        return held

    def wrote(self, blocks: Iterable[tuple[BlockKey, Described]]) -> None:
        """Append the records of ``blocks`` the file does not have yet."""
        if self.readonly:
            return
        new = [(k, b) for k, b in blocks if k not in self.keys]
        if not new:
            return
        if self._file is None:
            self._file = self.path.open("ab")
        self._file.write(b"".join(_encode(k, b) for k, b in new))
        self._file.flush()
        self.keys.update(k for k, _ in new)
        self.records += len(new)

    def compact(self, known: Mapping[BlockKey, Described]) -> None:
        """Rewrite the file with the records of the blocks the tier holds, once it has
        :attr:`limit` records (a block the event book no longer knows loses its own)."""
        if self.readonly or self.records < self.limit:
            return
        held = [(k, known[k]) for k in self.tier.manager.held_keys() if k in known]
        self._rewrite(b"".join(_encode(k, b) for k, b in held))
        self.keys = {k for k, _ in held}
        self.records = len(held)

    def _rewrite(self, data: bytes) -> None:
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _directory(tier: Tier) -> Path | None:
    """A persistent tier of this host's directory; ``None`` for any other tier."""
    backend = tier.backend
    if not backend.persistent or backend.server_booked:
        return None
    path = getattr(getattr(backend, "config", None), "path", None)
    return None if path is None else Path(path)


class Journals:
    """The journals of every persistent tier of this host (module docstring)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._by_tier: dict[str, _Journal] = {}
        for tier in tiers:
            directory = _directory(tier)
            if directory is not None:
                self._by_tier[tier.name] = _Journal(tier, directory)

    def recovered(self, tiers: Sequence[Tier]) -> Iterator[tuple[Tier, Record]]:
        """Each block a persistent tier recovered at start that its journal describes."""
        for tier in tiers:
            journal = self._by_tier.get(tier.name)
            if journal is not None:
                for record in journal.recovered():
                    yield tier, record

    def wrote(self, tier: Tier, blocks: Iterable[tuple[BlockKey, Any]]) -> None:
        journal = self._by_tier.get(tier.name)
        if journal is not None:
            journal.wrote(blocks)

    def compact(self, known: Mapping[BlockKey, Described]) -> None:
        for journal in self._by_tier.values():
            journal.compact(known)

    def close(self) -> None:
        for journal in self._by_tier.values():
            journal.close()
