"""The generated workloads, by :func:`~kvoffload.tools.workloads.make_workload` name:

- ``zipf``: popular shared prefixes (system prompts, documents) drawn with Zipf
  popularity, plus blocks unique to each request;
- ``multiturn``: chat sessions growing turn by turn, each request the whole history;
- ``scan``: no reuse at all, the worst case (hit ratio 0).

Keys chain with :func:`kvoffload.keys.chain_key`, so two requests share a key only when
they share the whole prefix up to it. Every stream is endless and the same for the
same arguments (seed included).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import accumulate
from typing import final

from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.tools.workload_base import Workload, at_least


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
        self.prefixes = at_least("prefixes", prefixes)
        self.prefix_blocks = at_least("prefix_blocks", prefix_blocks)
        self.suffix_blocks = at_least("suffix_blocks", suffix_blocks, 0)
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
        self.sessions = at_least("sessions", sessions)
        self.turn_blocks = at_least("turn_blocks", turn_blocks)
        self.max_turns = at_least("max_turns", max_turns)
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
        self.max_blocks = at_least("blocks", blocks)
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
