"""KV cache groups (connectors/vllm/groups.py, and the hit across groups in
connectors/vllm/shared.py), on vLLM's own spec classes and real tensors and tiers.

The engines themselves run in tests/e2e/test_model_families.py; here the parts are
checked where a wrong answer is easy to see: each group's kind and window, one pool
row per shared layer address, and a hit only where every group holds what it needs.
"""

from __future__ import annotations

import pytest
import torch
from kvoffload.connectors.vllm.events import EventBook
from kvoffload.connectors.vllm.groups import (
    FULL,
    MAMBA,
    SLIDING,
    Group,
    groups_from_vllm,
    refuse_unservable,
)
from kvoffload.connectors.vllm.groups import pool_from_vllm as pool_of
from kvoffload.connectors.vllm.shared import Shared
from support.blocks import BPB, LAYOUT, POOL, make_keys, make_offloader, store_and_settle

from kvoffload.blockpool import BlockPool
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey

# Without vLLM this module skips; under CI=true that fails the run (support/ci_rules.py).
kv = pytest.importorskip("vllm.v1.kv_cache_interface")

BLOCK = 32


def _full() -> object:
    return kv.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )


def _sliding(window: int = 64) -> object:
    return kv.SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=window
    )


def _mamba() -> object:
    return kv.MambaSpec(
        block_size=BLOCK,
        shapes=((3, 160), (4, 32, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )


def _config(*specs: object) -> object:
    groups = [kv.KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_each_group_kind_has_its_window_and_its_own_keys() -> None:
    groups = groups_from_vllm(_config(_sliding(64), _full(), _mamba()), BLOCK)  # type: ignore[arg-type]
    assert [(g.kind, g.window) for g in groups] == [(SLIDING, 2), (FULL, None), (MAMBA, 1)]
    assert len({g.tag for g in groups}) == 3
    assert all(g.tag for g in groups)
    # A window of 65 tokens reaches into a third block.
    assert groups_from_vllm(_config(_sliding(65), _full()), BLOCK)[0].window == 3  # type: ignore[arg-type]
    # One group: the keys of a dense model, as before groups.
    (only,) = groups_from_vllm(_config(_full()), BLOCK)  # type: ignore[arg-type]
    assert (only.kind, only.tag) == (FULL, b"")


def test_a_group_of_other_blocks_keeps_its_block_size() -> None:
    """A group whose blocks are not the engine's (a Mamba group with vLLM's prefix
    caching off) says so: the connector then keys nothing."""
    odd = kv.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = groups_from_vllm(_config(_sliding(), odd), BLOCK)  # type: ignore[arg-type]
    assert [g.block_size for g in groups] == [BLOCK, 16]


def test_the_pool_has_one_row_per_shared_layer_address() -> None:
    """Two groups of two layers overlaid as vLLM's hybrid manager lays them out (each
    group's layer l at the same address): the pool has two layers, and writing block
    b of the pool writes block b of both groups' views."""
    blocks, page = 8, 256
    raw = torch.zeros(2 * blocks * page, dtype=torch.uint8)
    views = {}
    for group in range(2):
        for layer in range(2):
            base = raw[layer * blocks * page : (layer + 1) * blocks * page]
            views[f"g{group}.l{layer}"] = base.view(torch.bfloat16).view(blocks, 4, page // 8)
    pool, index = pool_of(views)
    assert pool.num_layers == 2
    assert pool.bytes_per_block == 2 * page
    assert index == {"g0.l0": 0, "g1.l0": 0, "g0.l1": 1, "g1.l1": 1}
    data = torch.arange(2 * page, dtype=torch.int64).remainder(251).to(torch.uint8)
    pool.scatter([5], data.view(1, -1))
    assert bytes(views["g1.l1"][5].view(torch.uint8).flatten()) == bytes(data[page:])
    assert bytes(views["g0.l0"][5].view(torch.uint8).flatten()) == bytes(data[:page])
    assert not views["g0.l0"][4].any()


def test_a_layer_not_laid_out_block_first_is_refused() -> None:
    kv_first = torch.zeros(2, 8, 32, dtype=torch.bfloat16)  # [K/V, blocks, ...]
    with pytest.raises(ConfigError, match="not the block"):
        pool_of({"a": kv_first[1], "b": kv_first.transpose(0, 1)})


def _books() -> Shared:
    pool = BlockPool.allocate(LAYOUT, POOL)
    off = make_offloader([{"name": "cpu", "backend": "cpu", "capacity": 64 * BPB}], pool)
    groups = [
        Group(0, FULL, None, b"|full", ()),
        Group(1, SLIDING, 2, b"|sliding", ()),
    ]
    return Shared(off, EventBook(enabled=False, cap=0), b"ns", groups=groups)


def _store(shared: Shared, keys: list[BlockKey], group: int, positions: range) -> None:
    ids = [1 + p for p in positions]
    store_and_settle(shared.offloader, shared.ns([keys[p] for p in positions], group), ids)


def test_a_hit_is_the_longest_boundary_every_group_serves() -> None:
    """Full attention holds 10 blocks; the sliding group only its window before
    boundary 7: the hit is 7. Once it also holds the window before 10, the hit is
    10. Each answer pins what it claimed until released or planned."""
    shared = _books()
    keys = make_keys(10, salt=7)
    try:
        _store(shared, keys, 0, range(10))
        _store(shared, keys, 1, range(5, 7))
        assert shared.lookup("a", keys) == 7
        # The load of blocks [3, 7): the full group loads 4 blocks, the sliding group
        # its window [5, 7), the last 2 of the load's positions.
        assert shared.plan(1, "a", 3, 4) == 4
        (full, sliding) = sorted(shared.plans.pop(1), key=lambda p: p.group)
        assert (full.plan.hits, full.first) == (4, 0)
        assert (sliding.plan.hits, sliding.first) == (2, 2)
        for p in (full, sliding):
            shared.offloader.unclaim(p.plan)
        _store(shared, keys, 1, range(8, 10))
        assert shared.lookup("b", keys) == 10
        shared.release("b")
        # No window anywhere for another prompt: no hit, nothing left pinned.
        _store(shared, make_keys(4, salt=8), 0, range(4))
        assert shared.lookup("c", make_keys(4, salt=8)) == 0
        assert shared.offloader.pinned() == [0]
    finally:
        shared.offloader.close()


# ------------------------------------------------------- specs kept, specs refused
def _attn(**kw: object) -> dict[str, object]:
    return {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16, **kw}


def _mla(**kw: object) -> object:
    return kv.MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kw
    )


def _uniform(**specs: object) -> object:
    return kv.UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs=specs)


def test_a_uniform_group_is_the_kind_its_layers_share() -> None:
    """vLLM's ``UniformTypeKVCacheSpecs`` (layers of one kind, each with its own shape):
    MLA layers beside their indexer's, or sliding windows of one size with different
    heads. Each layer's shape is in the group's keys. Beside them, full attention with
    sinks (the sink's own KV is model parameters, in blocks no request holds) is full
    attention, and MLA's sliding window a sliding window."""
    indexer = _mla(cache_role=kv.SparseCacheRole.INDEXER)
    windows = _uniform(
        a=kv.SlidingWindowSpec(**_attn(sliding_window=64)),
        b=kv.SlidingWindowSpec(**_attn(sliding_window=64, head_size=128)),
    )
    sink = kv.SinkFullAttentionSpec(**_attn(sink_len=BLOCK))
    sliding_mla = kv.SlidingWindowMLASpec(
        block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=64
    )
    config = _config(_uniform(attn=_mla(), index=indexer), windows, sink, sliding_mla)
    groups = groups_from_vllm(config, BLOCK)  # type: ignore[arg-type]
    assert [(g.kind, g.window) for g in groups] == [
        (FULL, None),
        (SLIDING, 2),
        (FULL, None),
        (SLIDING, 2),
    ]
    assert b"MLAAttentionSpec:1x576:" in groups[0].tag
    assert b"sliding:64:0:64:" in groups[1].tag
    assert b"sliding:64:0:128:" in groups[1].tag
    assert groups[0].spec_kind == "mla_attention"


class _NewAttentionSpec(kv.FullAttentionSpec):  # type: ignore[misc,name-defined]
    """A spec kvoffload does not know (a platform's own, a later vLLM's)."""


REFUSED = {
    "RSWASpec": lambda: kv.RSWASpec(**_attn(rswa_window=128)),
    "HiddenStateCacheSpec": lambda: kv.HiddenStateCacheSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    ),
    "CrossAttentionSpec": lambda: kv.CrossAttentionSpec(**_attn()),
    "EncoderOnlyAttentionSpec": lambda: kv.EncoderOnlyAttentionSpec(**_attn()),
    "CircularBufferSpec": lambda: kv.CircularBufferSpec(**_attn()),
    "HiSparseHotSpec": lambda: kv.HiSparseHotSpec(
        block_size=BLOCK, page_size=4096, blocks_per_request=4
    ),
    "SlidingWindowMLASpec": lambda: kv.SlidingWindowMLASpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.bfloat16,
        sliding_window=64,
        bounded_replay=True,
    ),
    "FullAttentionSpec": lambda: kv.FullAttentionSpec(**_attn(non_causal=True)),
    "MLAAttentionSpec": lambda: _mla(tokens_per_state=4, model_version="deepseek_v4"),
    "_NewAttentionSpec": lambda: _NewAttentionSpec(**_attn()),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_spec_kvoffload_cannot_keep_is_refused_in_one_line(name: str) -> None:
    """Reference sliding window (a decoded block's KV depends on where the prompt
    ended), a hidden-state cache, cross- and encoder-only attention, specs vLLM does
    not prefix-cache (a ring buffer, HiSparse's hot cache, DeepSeek-V4's bounded
    replay), non-causal full attention, compressed MLA states, and a spec kvoffload
    does not know: each is refused, naming the spec, its group and layer, and the fix,
    never taken for full attention."""
    config = _config(_full(), REFUSED[name]())
    with pytest.raises(ConfigError) as err:
        groups_from_vllm(config, BLOCK)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message
    assert f"group 1 (layer layer1): kvoffload cannot keep its {name} (" in message
    assert "remove kv_transfer_config" in message


def test_a_uniform_group_of_mixed_kinds_is_refused_naming_the_layer() -> None:
    """vLLM groups a reference sliding window layer with full attention layers (both
    are full attention to its allocator): the group is refused at that layer."""
    mixed = _uniform(
        full=kv.FullAttentionSpec(**_attn()), rswa=kv.RSWASpec(**_attn(rswa_window=64))
    )
    with pytest.raises(ConfigError, match=r"group 0 \(layer layer0\), layer rswa: .* RSWASpec"):
        groups_from_vllm(_config(mixed), BLOCK)  # type: ignore[arg-type]
    kinds = _uniform(full=kv.FullAttentionSpec(**_attn()), window=_sliding(64))
    with pytest.raises(ConfigError, match=r"UniformTypeKVCacheSpecs \(its layers are not of one"):
        groups_from_vllm(_config(kinds), BLOCK)  # type: ignore[arg-type]


def test_mla_at_tensor_parallelism_with_several_groups_is_refused() -> None:
    """Ranks above 0 of a replicated MLA cache never report a background load
    finished, and several groups load every hit in the background: refused at start.
    One group, one rank, pipeline parallelism (each rank its own tiers) or no MLA is
    served."""
    two = groups_from_vllm(_config(_mla(), _sliding(64)), BLOCK)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        refuse_unservable(two, mla=True, tensor_parallel=2, pipeline_parallel=1)
    message = str(err.value)
    assert "\n" not in message
    assert "MLA model at tensor_parallel_size 2 with 2 KV cache groups (full, sliding)" in message
    assert "use tensor_parallel_size 1, or a model with one KV cache group" in message
    one = groups_from_vllm(_config(_mla()), BLOCK)  # type: ignore[arg-type]
    refuse_unservable(one, mla=True, tensor_parallel=2, pipeline_parallel=1)
    refuse_unservable(two, mla=True, tensor_parallel=1, pipeline_parallel=1)
    refuse_unservable(two, mla=True, tensor_parallel=2, pipeline_parallel=2)
    refuse_unservable(two, mla=False, tensor_parallel=2, pipeline_parallel=1)
