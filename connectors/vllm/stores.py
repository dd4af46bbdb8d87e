"""The scheduler side's view of each request, and which of its blocks each step stores.

:class:`ReqState` is what :class:`~.scheduler.TieredOffloadScheduler` knows of one
request: its blocks per KV cache group, what of them it has handed over for storing,
and its claim. :class:`StorePlanner` turns that into the step's :class:`~.metadata.Store`
orders: a full-attention group's blocks as they fill, a sliding-window group's window
before the request's replay boundary (where a repeat of its prompt hits), and the Mamba
states vLLM hands over at a boundary. Kept apart from :mod:`.scheduler` because it is
arithmetic on block positions, the same whichever way the lookups went.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.keys import BlockKey

from .events import EventBlocks
from .groups import FULL, MAMBA, SLIDING, Group
from .metadata import Store

if TYPE_CHECKING:
    from vllm.v1.request import Request

KeysOf = Callable[["Request", int, int], list[BlockKey]]
"""A request's first ``n`` keys under a reset generation."""
BlocksOf = Callable[["Request", Sequence[int]], EventBlocks | None]
"""What KV events need of a request's blocks at some positions (``None``: events off)."""


@dataclass
class ReqState:
    """Scheduler-side view of one request."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks (``0``: a block vLLM freed, or never
    allocated, outside a sliding window)."""
    stored_blocks: int = 0
    """Full blocks already handed to the worker for storing (or known held), in the
    full-attention groups."""
    stored_windows: set[tuple[int, int]] = field(default_factory=set)
    """(group, position) of the blocks of windowed groups handed for storing."""
    had_store: bool = False
    local_tokens: int = 0
    """GPU prefix-cache hit, from the last ``get_num_new_matched_tokens``."""
    background: bool = False
    """Its last lookup's hit loads in the background (vLLM's asynchronous load)."""
    claimed: bool = False
    """The worker may hold a claim (pins, or prefetches waited for) for this request
    that neither a plan nor a release has ended yet."""
    first_lookup: float | None = None
    """When this request was first looked up (``time.monotonic``): a consumer waits for
    a producer's blocks from then, up to ``producer_wait_ms``."""
    resident: int = 0
    """Blocks of its prefix the cpu tier held at its first mention (from the worker,
    at its load's plan): the rest of its hit came from the lower tiers."""
    generation: int = 0
    """The connector reset generation its KV is computed under (set at each lookup):
    its blocks are stored under it, so a request whose KV predates a reset stores
    where nothing after the reset looks."""

    def add_blocks(self, new_ids: Sequence[Sequence[int]], *, resumed: bool) -> None:
        """vLLM's new blocks for the request this step, per group (all of its blocks
        again when it resumed after a preemption)."""
        if resumed or not self.block_ids:
            self.block_ids = [list(ids) for ids in new_ids]
        else:
            for have, more in zip(self.block_ids, new_ids, strict=False):
                have.extend(more)

    def host_tokens(self, num_external_tokens: int, block_size: int) -> int:
        """Of a hit of ``num_external_tokens``, the tokens whose blocks the cpu tier
        held at the request's first mention (vLLM's ``host`` hit source)."""
        start = self.local_tokens // block_size
        return min(max(0, self.resident - start) * block_size, num_external_tokens)


class StorePlanner:
    """Which blocks of a request to store, by its KV cache groups (module docstring)."""

    def __init__(self, groups: list[Group], block_size: int, keys: KeysOf, blocks: BlocksOf):
        self.block_size = block_size
        self.full = [g.index for g in groups if g.kind == FULL]
        self.sliding = [g for g in groups if g.kind == SLIDING]
        self.mamba = {g.index for g in groups if g.kind == MAMBA}
        self.windowed = [g for g in groups if g.window is not None]
        self._keys = keys
        self._blocks = blocks

    def loaded(self, state: ReqState, stop: int) -> None:
        """The request's blocks up to ``stop`` are being loaded: held by the tiers
        already, so none of them (nor a window's blocks before ``stop``) is stored back."""
        state.stored_blocks = max(state.stored_blocks, stop)
        for group in self.windowed:
            assert group.window is not None
            first = max(0, stop - group.window)
            state.stored_windows.update((group.index, p) for p in range(first, stop))

    def step_stores(self, state: ReqState, done_tokens: int) -> list[Store]:
        """The stores of a step that brings ``state``'s request to ``done_tokens``
        computed: the full-attention groups' blocks filled since the last, and each
        sliding window before the replay boundary once the request is past it."""
        stores: list[Store] = []
        req = state.request
        held = min((len(state.block_ids[g]) for g in self.full), default=0)
        full = min(done_tokens // self.block_size, len(req.block_hashes), held)
        if full > state.stored_blocks:
            first = state.stored_blocks
            keys = self._keys(req, full, state.generation)[first:]
            blocks = self._blocks(req, range(first, full))
            for g in self.full:
                ids = state.block_ids[g][first:full]
                stores.append(Store(req.request_id, keys, ids, blocks, group=g))
            state.stored_blocks = full
            state.had_store = True
        if self.sliding:
            # The window before the request's replay boundary: where a repeat of
            # its prompt hits.
            boundary = self.replay_boundary(req)
            if done_tokens >= boundary * self.block_size:
                stores.extend(self.window_stores(state, boundary))
        return stores

    def replay_boundary(self, request: Request) -> int:
        """The block boundary a repeat of ``request``'s prompt would hit at."""
        return min(int(request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))

    def window_stores(self, state: ReqState, boundary: int) -> list[Store]:
        """Stores of each sliding-window group's blocks right before ``boundary`` not
        stored yet, fenced; none for a group whose window there is not whole."""
        stores = []
        req = state.request
        for group in self.sliding:
            assert group.window is not None
            first = max(0, boundary - group.window)
            ids = state.block_ids[group.index][first:boundary]
            if boundary == 0 or len(ids) < boundary - first or 0 in ids:
                continue
            todo = [
                p for p in range(first, boundary) if (group.index, p) not in state.stored_windows
            ]
            if not todo:
                continue
            keys = self._keys(req, boundary, state.generation)
            stores.append(
                Store(
                    req.request_id,
                    [keys[p] for p in todo],
                    [ids[p - first] for p in todo],
                    self._blocks(req, todo),
                    group=group.index,
                    fenced=True,
                )
            )
            state.stored_windows.update((group.index, p) for p in todo)
            state.had_store = True
        return stores

    def state_stores(self, state: ReqState, handoffs: list[tuple[int, int, int]]) -> list[Store]:
        """Stores of the Mamba states vLLM handed over this step: ``(group, block,
        boundary tokens)``, each the state after the block before the boundary."""
        stores: list[Store] = []
        req = state.request
        for group, block_id, boundary in handoffs:
            pos = boundary // self.block_size - 1
            if group not in self.mamba or block_id == 0 or boundary % self.block_size:
                continue
            if pos < 0 or pos >= len(req.block_hashes) or (group, pos) in state.stored_windows:
                continue
            key = self._keys(req, pos + 1, state.generation)[pos]
            blocks = self._blocks(req, [pos])
            stores.append(
                Store(req.request_id, [key], [block_id], blocks, group=group, fenced=True)
            )
            state.stored_windows.add((group, pos))
            state.had_store = True
        return stores
