"""The ``trace`` workload: a replay of a Mooncake-format JSONL trace
(``tests/data/README.md``), the whole file read and validated up front."""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from typing import Any, Final, final

from kvoffload.exceptions import ConfigError
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.tools.workload_base import Workload, at_least

TRACE_TOKENS_PER_BLOCK: Final = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces (informational: a replayed
block is one stress block, whatever the stress layout's ``block_size``)."""

_HASH_ID_LIMIT: Final = 1 << 64  # ids are hashed as 8 little-endian bytes
_NUMERIC_FIELDS: Final = ("timestamp", "input_length", "output_length")


@final
class TraceWorkload(Workload):
    """Replays a JSONL request trace in the Mooncake format (FAST'25 release).

    One JSON object per line, ``{"timestamp": ms, "input_length": tokens,
    "output_length": tokens, "hash_ids": [...]}``; ``hash_ids`` are remapped prefix-block
    hashes (512 tokens per block). Only ``hash_ids`` drives the replay: requests come
    in file order, one at a time, without the timestamps' pacing.

    Block ``i``'s key is ``chain_key`` over ids ``0..i`` starting from ``ROOT_KEY``, so
    an id is reusable only after the same prefix, as in the engine that produced the
    trace. The whole file (up to ``limit`` requests) is read and validated up front:
    a bad line fails at construction with a one-line :class:`ConfigError` naming the
    file and line, not after an hour of stress, and :attr:`max_blocks` is exact.

    ``max_blocks`` truncates longer requests to their first ``max_blocks`` blocks (a
    prefix of a chain is still a valid request). ``loop`` starts over after the last
    request instead of becoming :attr:`exhausted`; the second pass asks for keys the
    first one stored, so its hit ratio is that of a warm cache.
    """

    name = "trace"

    def __init__(
        self,
        path: str | PathLike[str],
        *,
        limit: int | None = None,
        max_blocks: int | None = None,
        loop: bool = False,
    ) -> None:
        self.path = Path(path)
        if limit is not None:
            at_least("limit", limit)
        if max_blocks is not None:
            at_least("max_blocks", max_blocks)
        self.loop = loop
        self.requests: list[tuple[int, ...]] = _read_trace(self.path, limit)  # hash_ids each
        if max_blocks is not None:
            self.requests = [ids[:max_blocks] for ids in self.requests]
        self.max_blocks = max(len(ids) for ids in self.requests)
        self.position = 0
        """Index in :attr:`requests` of the request :meth:`next` returns next."""
        self.passes = 0
        """Completed passes over the trace (``loop`` only)."""

    @property
    def finite(self) -> bool:
        return not self.loop

    @property
    def exhausted(self) -> bool:
        return not self.loop and self.position >= len(self.requests)

    def next(self) -> list[BlockKey]:
        if self.position >= len(self.requests):
            if not self.loop:
                raise IndexError(
                    f"trace {self.path} is exhausted after {len(self.requests)} requests; "
                    "check .exhausted first or pass loop=True"
                )
            self.position = 0
            self.passes += 1
        ids = self.requests[self.position]
        self.position += 1
        keys = []
        parent: BlockKey = ROOT_KEY
        for hash_id in ids:
            parent = chain_key(parent, hash_id.to_bytes(8, "little"))
            keys.append(parent)
        return keys


def _read_trace(path: Path, limit: int | None) -> list[tuple[int, ...]]:
    """``hash_ids`` of the first ``limit`` requests in ``path``, every line validated."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read trace file: {exc.strerror or exc}") from None
    requests: list[tuple[int, ...]] = []
    with handle:
        # Bytes, decoded line by line: a text-mode file decodes ahead in chunks, so a
        # bad byte would be blamed on a line before the one that holds it.
        for lineno, raw in enumerate(handle, start=1):
            if limit is not None and len(requests) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}: line {lineno}: not UTF-8 text: byte {exc.start} is "
                    f"{raw[exc.start]:#04x}"
                ) from None
            if not line.strip():
                continue  # a trailing newline, or a blank separator line
            requests.append(_parse_trace_line(path, lineno, line))
    if not requests:
        raise ConfigError(f"{path}: the trace holds no requests (one JSON object per line)")
    return requests


def _parse_trace_line(path: Path, lineno: int, line: str) -> tuple[int, ...]:
    where = f"{path}: line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}: a request must be a JSON object with hash_ids, got {type(obj).__name__}"
        )
    if "hash_ids" not in obj:
        raise ConfigError(f"{where}: hash_ids is missing; found keys: {', '.join(obj) or 'none'}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: hash_ids must be a list of integers, got {_short(ids)}")
    if not ids:
        raise ConfigError(f"{where}: hash_ids is empty; a request needs at least one block")
    for i, hash_id in enumerate(ids):
        # bool is an int to Python but never a block hash in a trace.
        if isinstance(hash_id, bool) or not isinstance(hash_id, int):
            raise ConfigError(f"{where}: hash_ids[{i}] = {_short(hash_id)}: not an integer")
        if not 0 <= hash_id < _HASH_ID_LIMIT:
            raise ConfigError(f"{where}: hash_ids[{i}] = {hash_id}: must be in 0..2**64-1")
    for name in _NUMERIC_FIELDS:
        value = obj.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}: {name} = {_short(value)}: must be a number >= 0")
    return tuple(ids)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
