"""Layer-wise loads on a host pool: ``BlockPool.scatter_layer``, ``DataPath.unpack_layers``
and ``Offloader.submit_load(layers=...)`` write the bytes the whole-block path writes,
report every layer once and in order, and end as a miss (never a hang, never an
exception) when the copy fails or a block is corrupt. The CUDA variant is in
``tests/gpu/test_cuda_layerwise.py``; the connector's hooks in a real engine in
``tests/e2e/test_vllm_connector.py``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import (
    BPB,
    LAYOUT,
    assert_pool_holds,
    corrupt_mmap_payload,
    make_keys,
    make_offloader,
    store_and_settle,
    three_tiers,
)

from kvoffload.blockpool import BlockPool
from kvoffload.datapath import DataPath, LayerProgress
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

# Four layers, so that order is visible; 32 KiB blocks.
WIDE = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, namespace="t-lw")


def _random_rows(n: int, bpb: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, bpb), dtype=torch.uint8, generator=gen)


def _pools(kind: str) -> tuple[BlockPool, BlockPool]:
    """Two equal pools of 32 blocks: canonical rows, K and V apart (``[2, B, ...]``, a
    layer's block not contiguous) or canonical through the device code (no host
    row views)."""
    if kind == "split":
        shape = [2, 32, *WIDE.layer_block_shape[1:]]

        def make() -> BlockPool:
            caches = [torch.zeros(shape, dtype=WIDE.torch_dtype) for _ in range(4)]
            return BlockPool(caches, block_dim=1)

        return make(), make()
    return BlockPool.allocate(WIDE, 32), BlockPool.allocate(WIDE, 32)


@pytest.mark.parametrize("kind", ["rows", "split", "device_code"])
def test_scatter_layer_by_layer_equals_scatter(kind: str, monkeypatch: Any) -> None:
    if kind == "device_code":
        monkeypatch.setattr(BlockPool, "_host_paths", False)
    whole, by_layer = _pools(kind)
    ids = [7, 3, 30, 12, 0, 19]
    src = _random_rows(len(ids), WIDE.bytes_per_block, 1)
    whole.scatter(ids, src)
    for layer in range(by_layer.num_layers):
        by_layer.scatter_layer(layer, ids, src)
        # Only this layer (and those before it) moved so far.
        for later in range(layer + 1, by_layer.num_layers):
            assert not any(by_layer.get_kv_from_block(ids[0])[later].flatten().tolist())
    assert torch.equal(whole.gather(list(range(32))), by_layer.gather(list(range(32))))


def test_scatter_layer_from_an_odd_address_and_bad_arguments() -> None:
    whole, by_layer = _pools("rows")
    backing = _random_rows(3 * WIDE.bytes_per_block + 1, 1, 2).view(-1)
    src = backing[1:].view(3, WIDE.bytes_per_block)  # misaligned by one byte
    whole.scatter([1, 2, 3], src)
    for layer in range(4):
        by_layer.scatter_layer(layer, [1, 2, 3], src)
    assert torch.equal(whole.gather([1, 2, 3]), by_layer.gather([1, 2, 3]))
    with pytest.raises(IndexError):
        by_layer.scatter_layer(4, [1], src[:1])
    with pytest.raises(IndexError):
        by_layer.scatter_layer(0, [32], src[:1])


def test_unpack_layers_reports_each_layer_once_in_order_after_it_landed() -> None:
    whole, by_layer = _pools("rows")
    ids = list(range(20, 28))
    src = _random_rows(len(ids), WIDE.bytes_per_block, 3)
    pieces = [(0, src[:3]), (3, src[3:])]  # two runs of slab rows
    DataPath(WIDE.bytes_per_block, whole).unpack(ids, pieces)
    seen: list[int] = []

    def on_layer(layer: int, event: Any) -> None:
        assert event is None  # host: the layer is in, nothing to wait on
        # This layer's bytes are there already; the next layer's are not.
        got = by_layer.gather(ids)
        off, nbytes = by_layer.layer_offsets[layer], by_layer.layer_bytes[layer]
        assert torch.equal(got[:, off : off + nbytes], src[:, off : off + nbytes])
        if layer + 1 < by_layer.num_layers:
            nxt = by_layer.layer_offsets[layer + 1]
            assert not got[:, nxt:].any()
        seen.append(layer)

    DataPath(WIDE.bytes_per_block, by_layer).unpack_layers(ids, pieces, None, on_layer)
    assert seen == [0, 1, 2, 3]
    assert torch.equal(whole.gather(ids), by_layer.gather(ids))


def test_layer_progress_wait_returns_per_layer_and_on_finish() -> None:
    progress = LayerProgress(3)
    woke: list[int] = []

    def waiter(layer: int) -> None:
        progress.wait(layer)
        woke.append(layer)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in (0, 2, -1)]
    for t in threads:
        t.start()
    progress.layer_done(0)
    threads[0].join(5)
    assert woke == [0]
    with pytest.raises(ValueError, match="layer 2 reported after 1"):
        progress.layer_done(2)  # out of order
    progress.layer_done(1)
    progress.finish()  # layer 2 never comes (a failed load): every waiter is released
    for t in threads:
        t.join(5)
    assert sorted(woke) == [-1, 0, 2]
    assert progress.layers_done == 2
    assert progress.finished


def _layerwise_load(off: Offloader, keys: list[Any], ids: list[int]) -> tuple[int, LayerProgress]:
    """Load ``keys`` into ``ids`` layer by layer while another thread waits for each
    layer in order (as the attention layers do): the blocks loaded and the progress."""
    assert off.pool is not None
    progress = LayerProgress(off.pool.num_layers)
    plan = off.prepare_load(keys)
    job = off.submit_load(plan, ids[: plan.hits], layers=progress)
    assert job is not None
    for layer in range(off.pool.num_layers):
        progress.wait(layer)  # returns: reported, or the load ended
    (res,) = off.wait([job], timeout=30)
    assert res.success, res.error
    assert progress.finished
    return res.nbytes // BPB, progress


def test_layerwise_load_from_the_cpu_tier_is_bit_exact(tmp_path: Path) -> None:
    pool = BlockPool.allocate(LAYOUT, 64)
    with make_offloader(three_tiers(tmp_path, cpu_blocks=16)[:1], pool) as off:
        keys = make_keys(8, salt=5)
        store_and_settle(off, keys, list(range(8)))
        loaded, progress = _layerwise_load(off, keys, list(range(40, 48)))
        assert loaded == 8
        assert progress.layers_done == LAYOUT.num_layers
        assert_pool_holds(pool, keys, list(range(40, 48)))
        assert off.pinned() == [0]


def test_layerwise_load_stops_at_a_corrupt_block_below(tmp_path: Path) -> None:
    """From a lower tier (promoted through the staging buffer): the valid prefix loads
    layer by layer, the corrupt block ends it, and it is dropped as usual."""
    pool = BlockPool.allocate(LAYOUT, 64)
    with make_offloader(three_tiers(tmp_path, cpu_blocks=8)[:2], pool) as off:
        keys = make_keys(16, salt=6)
        store_and_settle(off, keys[:8], list(range(8)))
        store_and_settle(off, keys[8:], list(range(8)))
        assert off.drain()
        corrupt_mmap_payload(off, keys[3])  # in the mmap tier only now
        loaded, progress = _layerwise_load(off, keys, list(range(16, 32)))
        assert loaded == 3
        assert progress.layers_done == LAYOUT.num_layers  # the prefix's layers
        assert_pool_holds(pool, keys[:3], list(range(16, 19)))
        assert off.stats[1].corrupt_blocks == 1


def test_a_failed_layerwise_copy_is_a_miss_and_releases_the_waiters(tmp_path: Path) -> None:
    """A pool id out of range makes the copy raise inside the job: the result says 0
    blocks (the engine reports them as load errors), no exception escapes, no layer
    is reported, and a thread waiting for the last layer is released."""
    pool = BlockPool.allocate(LAYOUT, 64)
    with make_offloader(three_tiers(tmp_path, cpu_blocks=16)[:1], pool) as off:
        keys = make_keys(4, salt=7)
        store_and_settle(off, keys, list(range(4)))
        loaded, progress = _layerwise_load(off, keys, [10, 11, 12, 64])
        assert loaded == 0
        assert progress.layers_done == 0
        assert off.pinned() == [0]
        assert off.lookup(keys) == 4  # still held: the copy failed, not the tier
        plan = off.prepare_load(keys)
        with pytest.raises(ValueError, match="progress of 3 layers"):
            off.submit_load(plan, [0, 1, 2, 3], layers=LayerProgress(3))
        off.cancel_load(plan)


def test_the_connector_option_is_validated() -> None:
    pytest.importorskip("vllm")  # at run time: CI=true forbids skip markers
    from kvoffload.connectors.vllm.config import config_from_vllm, options_from_vllm

    from kvoffload.exceptions import ConfigError

    assert options_from_vllm({}) == {
        "layerwise_loads": False,
        "prefetch_on_arrival": True,
        "load_or_recompute": True,
    }
    assert options_from_vllm({"layerwise_loads": True})["layerwise_loads"] is True
    config_from_vllm({"layerwise_loads": True})  # a known key beside the config
    with pytest.raises(ConfigError, match="layerwise_loads = 'yes': expected true or false"):
        options_from_vllm({"layerwise_loads": "yes"})
    with pytest.raises(ConfigError, match="layerwise_load"):  # the allowed keys are named
        config_from_vllm({"layerwise_load": True})
