"""The step's metadata: what the scheduler side tells the worker side each step.

vLLM hands one :class:`TieredOffloadMetadata` per step from the scheduler side
(:mod:`.scheduler`, which builds it) to the worker side (:mod:`.worker`, which carries
it out), pickled across processes in vLLM's default mode. It is the one thing both
halves share besides the books, so it lives in a module of its own that each imports,
as vLLM keeps its own connectors' metadata apart from either half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload.keys import BlockKey

from .events import EventBlocks


@dataclass
class Load:
    """One planned load: the blocks the worker loads for a request this step."""

    req_id: str
    plan_id: int
    block_ids: list[list[int]]
    """Per KV cache group, the GPU blocks of the loaded positions ``[start, start +
    n)``: a group whose hit needs only the blocks before the boundary (a window) loads
    into the tail of its list."""
    resumed: bool = False
    """The request was preempted earlier: this load brings its work back."""
    events: EventBlocks | None = None
    """The loaded positions' blocks (hashes, parents, tokens) for KV events, ``None``
    when they are off."""
    background: bool = False
    """vLLM's asynchronous load: the request waits (``WAITING_FOR_REMOTE_KVS``) while
    the worker loads it in the background, and the worker reports it done
    (``finished_recving``); its failed blocks are load errors, or, with several KV
    cache groups, the whole load fails (``failed_recving``: vLLM cannot map a failed
    block back to its request there)."""


@dataclass
class Store:
    """One store: blocks of a request the worker hands to the tiers this step."""

    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    events: EventBlocks | None = None
    """The blocks of ``keys`` (hashes, parents, tokens) for KV events, ``None`` when
    they are off (the metadata stays the keys and block ids)."""
    group: int = 0
    """The KV cache group of the blocks (their keys are namespaced by it)."""
    fenced: bool = False
    """vLLM may reuse these blocks while the request runs (a sliding window's block
    leaving the window, a Mamba state block): the worker reads them before the next
    step's forward pass."""


@dataclass
class TieredOffloadMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM: Any
    """One step's instructions from the scheduler side to the worker side."""

    loads: list[Load] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    prefill: tuple[int, float] | None = None
    """A recent step's tokens and seconds, scheduled to output in (a sample of the
    engine's prefill throughput, :mod:`.costs`), if there is one."""
    preempted: set[str] = field(default_factory=set)
    """Requests vLLM preempted for this step: their blocks may be reused by its
    forward pass, so ``handle_preemptions`` waits for their stores to read them."""
