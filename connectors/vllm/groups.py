"""vLLM's KV cache groups as kvoffload sees them: what each group needs for a hit,
the key namespace of its blocks, and one block pool over all of them.

vLLM's hybrid KV cache manager splits a model's layers into groups by kind (full
attention, sliding window, Mamba state), each with its own block table, all drawing
block ids from one pool of pages: block ``b`` belongs to one group at a time, and the
groups' layers overlay each other in one allocation (layer ``l`` of every group at the
same address). kvoffload's unit stays one block of one group across that group's
layers. Since the groups overlay, that is one block of the pool over the distinct
layer addresses (:func:`pool_from_vllm`), whatever group holds it: tiers, records and
checksums never learn what kind of group a block belongs to. Only the key says it
(:attr:`Group.tag`), and the scheduler side decides which blocks of a group to keep:

- **full attention** (MLA included): every block of the prefix (``window`` None);
- **sliding window**: the ``window`` blocks before a hit boundary, the only ones the
  layer reads past it; the rest vLLM itself frees;
- **Mamba state** (``"align"`` mode): the state at a block boundary, one block
  (``window`` 1), handed over by vLLM's scheduler as it is computed.

A group of layers of one kind with their own shapes (``UniformTypeKVCacheSpecs``) is
that kind. Any other spec (reference sliding window, cross-attention, a hidden-state
cache, a spec vLLM does not prefix-cache, one kvoffload does not know) is refused at
start with a ``ConfigError`` naming it, never taken for another kind (:func:`_kind`);
so is a setup the connector would hang in (:func:`refuse_unservable`).

Kept apart from :mod:`.config`, which reads the engine's settings, because this reads
the KV cache vLLM allocated (``KVCacheConfig``) and its tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import vllm.v1.kv_cache_interface as kv

from kvoffload.blockpool import BlockPool
from kvoffload.exceptions import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

FULL = "full"
SLIDING = "sliding"
MAMBA = "mamba"


@dataclass(frozen=True)
class Group:
    """One KV cache group of the engine."""

    index: int
    kind: str
    """:data:`FULL`, :data:`SLIDING` or :data:`MAMBA`."""
    window: int | None
    """Blocks right before a hit boundary that a hit needs from this group (``None``:
    every block of the prefix)."""
    tag: bytes
    """Added to the layout fingerprint in this group's keys (empty for the only group
    of a model with one, so that its keys are what they were before groups)."""
    layers: tuple[str, ...]
    block_size: int = 0
    """Tokens per block of this group (0: the engine's)."""
    spec_kind: str | None = None
    """vLLM's kind of the group's ``KVCacheSpec`` (``"full_attention"``,
    ``"sliding_window"``...), for KV events; ``None``: from ``kind``."""
    spec_window: int | None = None
    """The spec's sliding window in tokens, for KV events (``None``: none)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SUPPORTED = "full attention (sinks too), MLA, sliding window, chunked local attention or Mamba"
_FIX = (
    "remove kv_transfer_config to run without kvoffload, or serve a model whose KV cache "
    f"groups are all {_SUPPORTED}"
)

_REFUSED: dict[type[Any], str] = {
    kv.RSWASpec: "reference sliding window attention: a block decoded past the prompt "
    "was computed with the prompt visible and the gap masked, so its KV depends on "
    "where the prompt ended, not on its tokens alone, and vLLM frees such blocks "
    "during the decode",
    kv.HiddenStateCacheSpec: "a hidden-state cache for extract_hidden_states, not attention KV",
    kv.CrossAttentionSpec: "cross-attention over encoder outputs, which vLLM never prefix-caches",
    kv.EncoderOnlyAttentionSpec: "encoder-only attention, which keeps no KV cache",
}
"""Specs kvoffload knows and refuses, and why."""

_ATTENTION: tuple[type[Any], ...] = (
    kv.FullAttentionSpec,
    kv.SinkFullAttentionSpec,
    kv.MLAAttentionSpec,
    kv.SlidingWindowSpec,
    kv.SlidingWindowMLASpec,
    kv.ChunkedLocalAttentionSpec,
)
"""Attention specs whose blocks hold the KV of the block's tokens, a function of the
prefix and the model alone. A sink's keys and values are model parameters, kept in
blocks of their own that no request's block table holds (vLLM's own prefix cache
reuses a sink layer's blocks as full attention's). Matched by exact type: a subclass
may change what a block holds (as MLA's and RSWA's do), so one kvoffload does not
know is refused, not taken for its base."""


def _where(index: int, layers: Sequence[str]) -> str:
    """A group named in an error: its index and its first layer."""
    if not layers:
        return f"group {index}"
    more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
    return f"group {index} (layer {layers[0]}{more})"


def _refusal(where: str, spec: Any, why: str) -> ConfigError:
    return ConfigError(
        f"kvoffload.connectors.vllm: KV cache {where}: kvoffload cannot keep its "
        f"{type(spec).__name__} ({why}); {_FIX}"
    )


def _kind(spec: Any, block_size: int, where: str = "group") -> tuple[str, int | None, str]:
    """The group kind, window in blocks and a description for the fingerprint of a
    vLLM ``KVCacheSpec``; ``ConfigError`` for a spec kvoffload cannot keep.

    A spec that is not ``prefix_cacheable`` is refused: vLLM keeps no reusable block of
    it, so a hit of the other groups would leave its state unrestored (a wrong
    answer); an inert connector instead would hold its tiers' memory and threads for
    nothing and keep the operator believing the engine offloads, with no setting to
    change (unlike vLLM's prefix caching off for a Mamba hybrid, see the connector's
    ``inert``). A ``UniformTypeKVCacheSpecs`` (layers of one kind with their own
    shapes) is the kind its layers share."""
    if not spec.prefix_cacheable:
        raise _refusal(
            where,
            spec,
            "vLLM does not prefix-cache it (prefix_cacheable is False), so a hit could "
            "not restore its state",
        )
    if isinstance(spec, kv.UniformTypeKVCacheSpecs):
        if not spec.kv_cache_specs:
            raise _refusal(where, spec, "it has no layers")
        inner = [
            (name, _kind(layer, block_size, f"{where}, layer {name}"))
            for name, layer in spec.kv_cache_specs.items()
        ]
        kinds = {(kind, window) for _, (kind, window, _) in inner}
        if len(kinds) > 1:
            seen = ", ".join(f"{name}: {kind}" for name, (kind, _, _) in inner)
            raise _refusal(where, spec, f"its layers are not of one kind ({seen})")
        ((kind, window),) = kinds
        descs = dict.fromkeys(desc for _, (_, _, desc) in inner)
        return kind, window, "uniform[" + ";".join(descs) + "]"
    name = type(spec).__name__
    if type(spec) is kv.MambaSpec:
        mode = spec.mamba_cache_mode
        desc = f"mamba:{mode}:{spec.shapes}:{[str(d) for d in spec.dtypes]}"
        return MAMBA, 1, desc
    if type(spec) not in _ATTENTION:
        why = _REFUSED.get(type(spec), "a KV cache spec kvoffload does not know")
        raise _refusal(where, spec, why)
    if getattr(spec, "non_causal", False):
        raise _refusal(
            where,
            spec,
            "its layers attend non-causally, so a block's KV depends on the tokens after it",
        )
    if spec.tokens_per_state != 1:
        raise _refusal(
            where,
            spec,
            f"tokens_per_state {spec.tokens_per_state} (compressed or pooled states)",
        )
    version = getattr(spec, "model_version", None)
    if version is not None:
        raise _refusal(where, spec, f"the {version} cache layout (model_version {version!r})")
    window = getattr(spec, "sliding_window", None)
    if window is not None:
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        blocks = max(_cdiv(window, block_size), _cdiv(window - 1 + extra, block_size))
        return SLIDING, blocks, f"sliding:{window}:{extra}:{spec.head_size}:{spec.dtype}"
    chunk = getattr(spec, "attention_chunk_size", None)
    if chunk is not None:
        blocks = _cdiv(chunk, block_size)
        return SLIDING, blocks, f"chunked:{chunk}:{spec.head_size}:{spec.dtype}"
    return FULL, None, f"{name}:{spec.num_kv_heads}x{spec.head_size}:{spec.dtype}"


def unkeyable(groups: list[Group], block_size: int, hash_block: int | None, warn: bool) -> bool:
    """Whether the engine's blocks cannot be keyed, so the connector idles (warned
    about once, by the scheduler side). Keys are one per ``request.block_hashes`` entry,
    one per engine block, in every group: with another hash size, or a group of other
    blocks (vLLM's prefix caching off for a Mamba hybrid: a state block per request,
    hashes of max_model_len tokens), there is nothing to key."""
    sizes = {g.block_size for g in groups if g.block_size} | {hash_block or 0}
    other = sorted(sizes - {0, block_size})
    if other and warn:
        logger.warning(
            "kvoffload: this engine's KV cache groups or vLLM's block hashes use "
            "blocks of %s tokens besides its %d-token blocks: the connector stores "
            "and loads nothing (turn vLLM's prefix caching on to get hits)",
            other,
            block_size,
        )
    return bool(other)


def groups_from_vllm(kv_cache_config: KVCacheConfig | None, block_size: int) -> list[Group]:
    """The engine's KV cache groups; one full-attention group when vLLM gave no
    ``KVCacheConfig``. A group whose blocks are not the engine's (a Mamba group with
    vLLM's prefix caching off holds one block per request) keeps its own
    ``block_size``: the connector then has nothing to key (see the connector's
    ``inert``). ``ConfigError`` for a group kvoffload cannot keep (:func:`_kind`)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return [Group(0, FULL, None, b"", ())]
    specs = kv_cache_config.kv_cache_groups
    groups = []
    for i, group in enumerate(specs):
        spec = group.kv_cache_spec
        kind, window, desc = _kind(spec, block_size, _where(i, group.layer_names))
        tag = b"" if len(specs) == 1 else f"|group{i}:{desc}".encode()
        spec_kind, spec_window = _event_spec(spec)
        groups.append(
            Group(
                i,
                kind,
                window,
                tag,
                tuple(group.layer_names),
                spec.block_size,
                spec_kind,
                spec_window,
            )
        )
    return groups


def refuse_unservable(
    groups: Sequence[Group], *, mla: bool, tensor_parallel: int, pipeline_parallel: int
) -> None:
    """``ConfigError`` at start for a setup the connector would hang in.

    An MLA cache at tensor parallelism (and no pipeline parallelism) is the same on
    every rank, so rank 0 alone keeps it and sends its loads to the other ranks
    (the connector's ``replicated``). A model with several KV cache groups loads
    every hit in the background, as vLLM's asynchronous loads, and vLLM waits for
    every rank to report such a load finished; the ranks above 0 of a replicated
    cache never do, so the first hit would hang its request for good."""
    if mla and tensor_parallel > 1 and pipeline_parallel == 1 and len(groups) > 1:
        kinds = ", ".join(g.kind for g in groups)
        raise ConfigError(
            f"kvoffload.connectors.vllm: an MLA model at tensor_parallel_size "
            f"{tensor_parallel} with {len(groups)} KV cache groups ({kinds}) would hang "
            "its first hit (ranks above 0 of a replicated MLA cache never report a "
            "background load finished); use tensor_parallel_size 1, or a model with "
            "one KV cache group"
        )


def _event_spec(spec: Any) -> tuple[str | None, int | None]:
    """vLLM's description of a ``KVCacheSpec`` in its KV events: its kind and sliding
    window (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``)."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )
    except ImportError:  # a vLLM without them: events leave them out
        return None, None
    return str(get_kv_cache_spec_kind(spec).value), get_kv_cache_spec_sliding_window(spec)


def describe(groups: list[Group]) -> str:
    """The groups for a layout's namespace: a cache written under one model's groups
    is never read under another's."""
    return ",".join(g.tag.decode().removeprefix("|") for g in groups)


def pool_from_vllm(kv_caches: dict[str, torch.Tensor]) -> tuple[BlockPool, dict[str, int]]:
    """One block pool over the engine's KV cache, and each layer's index in it.

    Layers whose tensors start at the same address (one layer of each group, under
    vLLM's hybrid manager) are one pool layer: a row of the page's bytes per block,
    read whole (a Mamba group's padding included), so block ``b`` of the pool is
    block ``b`` of whichever group holds it, across that group's layers."""
    rows: dict[int, torch.Tensor] = {}
    index: dict[str, int] = {}
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"KV cache layer {name}: a {type(tensor).__name__}, not a tensor; "
                "this vLLM build keeps a layer's cache in a form kvoffload cannot read"
            )
        ptr = tensor.data_ptr()
        if ptr not in rows:
            rows[ptr] = _page_rows(name, tensor)
        index[name] = list(rows).index(ptr)
    return BlockPool(list(rows.values())), index


def _page_rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s blocks as ``uint8 [num_blocks, page]`` rows over its storage: its
    first dimension must be the block and its blocks a page apart."""
    blocks = tensor.shape[0]
    page = tensor.stride(0) * tensor.element_size()
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()
    # Elements of one block, from its first: all within the page.
    span = 1 + sum(
        (n - 1) * abs(s) for n, s in zip(tensor.shape[1:], tensor.stride()[1:], strict=True)
    )
    if page <= 0 or span > tensor.stride(0) or start + blocks * page > storage.nbytes():
        raise ConfigError(
            f"KV cache layer {name}: shape {tuple(tensor.shape)}, stride "
            f"{tensor.stride()}: its first dimension is not the block; kvoffload reads "
            "a hybrid model's KV cache only in a block-first layout"
        )
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    rows.set_(storage, start, (blocks, page), (page, 1))
    return rows
