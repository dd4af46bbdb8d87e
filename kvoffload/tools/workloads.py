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

:class:`ReplicaShare` wraps any of them: one replica's share of a stream that several
replicas split (``kvoffload stress --replicas N``).
"""

from __future__ import annotations

import inspect
import json
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Final, final

from kvoffload.exceptions import ConfigError
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key

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


class Workload(ABC):
    """A deterministic stream of requests, each a prefix chain of block keys.

    Subclasses set :attr:`max_blocks` in ``__init__`` and implement :meth:`next`. The
    same constructor arguments (seed included) always give the same stream, so a
    stress failure can be replayed request for request.
    """

    name: ClassVar[str]
    """The :func:`make_workload` name."""

    max_blocks: int
    """Upper bound on ``len(next())``: the stress runner sizes its block pool and
    staging buffers with it before the first request."""

    @abstractmethod
    def next(self) -> list[BlockKey]:
        """The block keys of the next request (never empty, at most :attr:`max_blocks`).

        Raises :class:`IndexError` when :attr:`exhausted`; check that first.
        """

    @property
    def finite(self) -> bool:
        """Whether the stream ends (a trace without ``loop``); generated ones never do."""
        return False

    @property
    def exhausted(self) -> bool:
        """True once a :attr:`finite` workload has no request left."""
        return False

    def __iter__(self) -> Iterator[list[BlockKey]]:
        """Requests until :attr:`exhausted` (forever for generated workloads)."""
        while not self.exhausted:
            yield self.next()


def _at_least(name: str, value: int, minimum: int = 1) -> int:
    # Constructors are called from config (already validated) and from Python; the
    # latter deserves the same one-line refusal instead of an IndexError later on.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------------- zipf
@final
class ZipfWorkload(Workload):
    """Requests = a leading part of a popular shared prefix + blocks of their own.

    Prefix ``k`` (0-based) is picked with weight ``1/(k+1)**zipf_alpha``; each request
    reuses a random leading part (1..``prefix_blocks`` blocks) of it and appends
    ``suffix_blocks`` blocks nobody else has. Prefix keys depend on the prefix number
    only, not on the seed, so a persistent tier filled by one run serves the next.

    This is the stress runner's original workload, moved here unchanged: for the same
    arguments it yields the very keys ``stress.ZipfPrefixWorkload(cfg, seed)`` did.
    """

    name = "zipf"

    def __init__(
        self,
        *,
        prefixes: int = 48,
        zipf_alpha: float = 1.1,
        prefix_blocks: int = 24,
        suffix_blocks: int = 4,
        seed: int = 0,
    ) -> None:
        self.prefixes = _at_least("prefixes", prefixes)
        self.prefix_blocks = _at_least("prefix_blocks", prefix_blocks)
        self.suffix_blocks = _at_least("suffix_blocks", suffix_blocks, 0)
        if not zipf_alpha > 0:
            raise ValueError(f"zipf_alpha must be > 0, got {zipf_alpha!r}")
        self.zipf_alpha = zipf_alpha
        self.max_blocks = prefix_blocks + suffix_blocks
        self.rng = random.Random(seed)
        self._cum = list(accumulate(1.0 / (k + 1) ** zipf_alpha for k in range(prefixes)))
        self._chains: dict[int, list[BlockKey]] = {}  # prefix number -> its full key chain
        self._count = 0

    def _chain(self, prefix: int) -> list[BlockKey]:
        chain = self._chains.get(prefix)
        if chain is None:
            parent = chain_key(ROOT_KEY, b"prefix-%d" % prefix)
            chain = []
            for i in range(self.prefix_blocks):
                parent = chain_key(parent, i.to_bytes(4, "little"))
                chain.append(parent)
            self._chains[prefix] = chain
        return chain

    def next(self) -> list[BlockKey]:
        # The order of the two rng draws is part of the stream; keep it.
        prefix = self.rng.choices(range(self.prefixes), cum_weights=self._cum)[0]
        n_prefix = self.rng.randint(1, self.prefix_blocks)
        keys = list(self._chain(prefix)[:n_prefix])
        parent = keys[-1]
        self._count += 1
        for i in range(self.suffix_blocks):
            parent = chain_key(parent, b"req%d:%d" % (self._count, i))
            keys.append(parent)
        return keys


# ----------------------------------------------------------------------- multiturn
@final
class MultiTurnWorkload(Workload):
    """Chat sessions that grow turn by turn: the reuse pattern of a chatbot.

    ``sessions`` conversations are open at once. Each request picks one uniformly at
    random, appends ``turn_blocks`` new blocks (the last answer and the new question)
    to its history and asks for the whole history, so every request's prefix is that
    session's previous request. A session ends after ``max_turns`` turns, or when one
    more turn would pass ``max_blocks``; the next time its slot is picked, a fresh
    session takes its place. Old histories stop being asked for, which is what makes
    eviction matter.

    Session keys fold in the seed and a session serial number, so no two sessions (and
    no two seeds) share a block.
    """

    name = "multiturn"

    def __init__(
        self,
        *,
        sessions: int = 16,
        turn_blocks: int = 2,
        max_turns: int = 12,
        max_blocks: int | None = None,
        seed: int = 0,
    ) -> None:
        self.sessions = _at_least("sessions", sessions)
        self.turn_blocks = _at_least("turn_blocks", turn_blocks)
        self.max_turns = _at_least("max_turns", max_turns)
        cap = turn_blocks * max_turns if max_blocks is None else max_blocks
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < turn_blocks:
            raise ValueError(
                f"max_blocks must be an integer >= turn_blocks = {turn_blocks} (one turn "
                f"must fit), got {max_blocks!r}"
            )
        # The longest history a session can actually reach, a whole number of turns.
        self.max_blocks = min(cap // turn_blocks, max_turns) * turn_blocks
        self.seed = seed
        self.rng = random.Random(seed)
        self.sessions_started = 0
        """Sessions opened so far, the initial ``sessions`` included."""
        self._open = [self._new_session() for _ in range(sessions)]  # slot -> open session

    def _new_session(self) -> _Session:
        self.sessions_started += 1
        # The serial number makes the session's keys its own even where the "content"
        # of its turns repeats another session's.
        root = chain_key(ROOT_KEY, b"multiturn:%d:%d" % (self.seed, self.sessions_started))
        return _Session(root)

    def next(self) -> list[BlockKey]:
        slot = self.rng.randrange(self.sessions)
        session = self._open[slot]
        if len(session.keys) + self.turn_blocks > self.max_blocks:
            session = self._open[slot] = self._new_session()
        parent = session.keys[-1] if session.keys else session.root
        turn = len(session.keys) // self.turn_blocks
        for i in range(self.turn_blocks):
            parent = chain_key(parent, b"turn%d:%d" % (turn, i))
            session.keys.append(parent)
        return list(session.keys)  # a copy: the session keeps growing after we return


@dataclass(slots=True)
class _Session:
    root: BlockKey
    """Parent key of the session's first block."""
    keys: list[BlockKey] = field(default_factory=list)
    """The history so far: what the session's last request asked for."""


# ---------------------------------------------------------------------------- scan
@final
class ScanWorkload(Workload):
    """Every request is ``blocks`` blocks never seen before: no reuse, hit ratio 0.

    The worst case for a cache: every store is wasted work and every block evicted
    unread. It measures the tiers' store path and eviction churn, and any hit it
    reports within one run is a bug. Keys fold in the seed, so a persistent tier
    filled by a run with one seed gives hits to a rerun with the same seed only.
    """

    name = "scan"

    def __init__(self, *, blocks: int = 16, seed: int = 0) -> None:
        self.max_blocks = _at_least("blocks", blocks)
        self._root = chain_key(ROOT_KEY, b"scan:%d" % seed)
        self._count = 0

    def next(self) -> list[BlockKey]:
        self._count += 1
        parent = chain_key(self._root, b"req%d" % self._count)
        keys = []
        for i in range(self.max_blocks):
            parent = chain_key(parent, i.to_bytes(4, "little"))
            keys.append(parent)
        return keys


# --------------------------------------------------------------------------- trace
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
            _at_least("limit", limit)
        if max_blocks is not None:
            _at_least("max_blocks", max_blocks)
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
        _at_least("replicas", replicas)
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
        _at_least("capacity_blocks", capacity_blocks)
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
