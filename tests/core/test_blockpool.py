"""The block API and batched gather/scatter, over several layouts and dtypes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from kvoffload.backends.cpu import CPUBackend

from kvoffload import blockcopy, blockpool
from kvoffload.blockpool import BlockPool, Chooser, run_queue
from kvoffload.config import CPUTierConfig
from kvoffload.exceptions import LayoutMismatchError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _random_(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return t


def _pools(dtype: torch.dtype, num_blocks: int = 10) -> dict[str, tuple[list[torch.Tensor], int]]:
    """Per-layer tensors in the layouts engines use, with their block dimension."""
    layers, h, n, d = 3, 2, 4, 8
    return {
        # canonical: [B, 2, N, H, D]
        "canonical": ([torch.empty(num_blocks, 2, n, h, d, dtype=dtype) for _ in range(layers)], 0),
        # CUDA flash attention: [2, B, N, H, D], block dim 1, K and V far apart
        "flash": ([torch.empty(2, num_blocks, n, h, d, dtype=dtype) for _ in range(layers)], 1),
        # vLLM CPU (LBHNC): per-layer [B, H, N, 2*D] int8 views into one shared buffer
        "lbhnc": (_lbhnc_views(dtype, layers, num_blocks, h, n, d), 0),
    }


def _lbhnc_views(
    dtype: torch.dtype, layers: int, blocks: int, h: int, n: int, d: int
) -> list[torch.Tensor]:
    item = torch.empty((), dtype=dtype).element_size()
    c = 2 * d * item
    buf = torch.empty(layers * blocks * h * n * c, dtype=torch.int8)
    per_layer = blocks * h * n * c
    return [buf[i * per_layer : (i + 1) * per_layer].view(blocks, h, n, c) for i in range(layers)]


def _fill(caches: list[torch.Tensor], seed: int) -> None:
    """Random contents for every layer (int8 byte views get random bytes)."""
    for i, t in enumerate(caches):
        if t.dtype == torch.int8:
            gen = torch.Generator().manual_seed(seed + i)
            t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=gen))
        else:
            _random_(t, seed=seed + i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
def test_get_put_round_trip(kind: str, dtype: torch.dtype) -> None:
    caches, block_dim = _pools(dtype)[kind]
    _fill(caches, seed=0)
    pool = BlockPool(caches, block_dim=block_dim)
    kv = pool.get_kv_from_block(3)
    assert len(kv) == 3
    # copies, not views: changing them does not touch the pool
    before = [t.clone() for t in kv]
    kv[0].zero_()
    assert torch.equal(pool.get_kv_from_block(3)[0], before[0])
    pool.put_kv_into_block(7, before)
    after = pool.get_kv_from_block(7)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # block 7 in the engine's own tensors holds block 3's data
    for t in caches:
        assert torch.equal(t.select(block_dim, 7), t.select(block_dim, 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
def test_gather_scatter_round_trip(kind: str, dtype: torch.dtype) -> None:
    src_caches, block_dim = _pools(dtype)[kind]
    _fill(src_caches, seed=10)
    src = BlockPool(src_caches, block_dim=block_dim)
    dst_caches, _ = _pools(dtype)[kind]
    for t in dst_caches:
        t.zero_()
    dst = BlockPool(dst_caches, block_dim=block_dim)
    ids = [9, 0, 4, 5]
    staging = src.gather(ids)
    assert staging.shape == (4, src.bytes_per_block)
    assert staging.dtype == torch.uint8
    # packed form: layer 0's bytes first, then layer 1's ...
    first_layer = src_caches[0].select(block_dim, 9).contiguous().view(-1).view(torch.uint8)
    assert torch.equal(staging[0, : src.layer_bytes[0]], first_layer)
    targets = [1, 2, 8, 6]
    dst.scatter(targets, staging)
    for s, d in zip(ids, targets, strict=True):
        for a, b in zip(src.get_kv_from_block(s), dst.get_kv_from_block(d), strict=True):
            assert torch.equal(a, b)
    # blocks not scattered into stay untouched
    assert all(t.select(block_dim, 0).count_nonzero() == 0 for t in dst_caches)


def test_gather_into_misaligned_buffer_still_correct() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    pool = BlockPool.allocate(layout, 6)
    for i, v in enumerate(pool._views):
        _random_(v, seed=i)
    raw = torch.zeros(3 * pool.bytes_per_block + 1, dtype=torch.uint8)
    out = raw[1:].view(3, pool.bytes_per_block)  # rows start at an odd address
    pool.gather([5, 1, 2], out)
    assert torch.equal(out, pool.gather([5, 1, 2]))
    other = BlockPool.allocate(layout, 6)
    other.scatter([0, 3, 4], out)
    assert torch.equal(other.gather([0, 3, 4]), out)


def test_allocate_matches_layout() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=32, dtype="bfloat16")
    pool = BlockPool.allocate(layout, 5)
    assert pool.num_blocks == 5
    assert pool.num_layers == 4
    assert pool.bytes_per_block == layout.bytes_per_block == 4 * 2 * 32 * 2 * 16 * 2
    pool.check_layout(layout)
    other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(LayoutMismatchError, match="bytes"):
        pool.check_layout(other)


def test_bad_inputs_are_rejected() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float16")
    pool = BlockPool.allocate(layout, 4)
    kv = pool.get_kv_from_block(0)
    with pytest.raises(LayoutMismatchError, match="expected 2 layer tensors"):
        pool.put_kv_into_block(1, kv[:1])
    with pytest.raises(LayoutMismatchError, match="layer 1"):
        pool.put_kv_into_block(1, [kv[0], kv[1].float()])
    with pytest.raises(IndexError):
        pool.get_kv_from_block(4)
    with pytest.raises(IndexError):
        pool.gather([0, 4])
    with pytest.raises(LayoutMismatchError, match="staging buffer"):
        pool.scatter([0], torch.zeros((1, pool.bytes_per_block + 1), dtype=torch.uint8))
    with pytest.raises(LayoutMismatchError, match="blocks"):
        BlockPool([torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(LayoutMismatchError, match="at least one"):
        BlockPool([])


def test_empty_batches() -> None:
    pool = BlockPool.allocate(KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2), 2)
    assert pool.gather([]).shape == (0, pool.bytes_per_block)
    pool.scatter([], torch.empty((0, pool.bytes_per_block), dtype=torch.uint8))


# -- host strategies, checked block by block against get_kv_from_block ----------------


class _DevicePathPool(BlockPool):
    """Runs, on CPU tensors, the per-layer int64 ops a CUDA pool runs."""

    _host_paths = False


STRATEGIES = ["team", "queue", "queue-rows", "device"]
"""``team``: one torch op per layer over 16-byte rows. ``queue``: inline ``index_select``
calls of a few rows (gather) / numpy assignments (scatter) on two threads. ``queue-rows``:
the queue's numpy row copies, which it uses for rows too long for one inline call.
``device``: a CUDA pool's code."""

GATHER_IDS = {
    "runs-and-scattered": [3, 4, 5, 6, 11, 0, 1, 9, 14, 15, 7],
    "one-block": [7],
    "single-block-runs": [2, 9, 4, 12],
    "reversed": list(range(15, -1, -1)),
    "all-in-order": list(range(16)),
    "repeats": [5, 5, 2, 5, 0, 0, 15],
}
SCATTER_IDS = {k: v for k, v in GATHER_IDS.items() if len(set(v)) == len(v)}


def _strategy_pool(
    strategy: str, caches: list[torch.Tensor], block_dim: int, monkeypatch: pytest.MonkeyPatch
) -> BlockPool:
    if strategy == "device":
        return _DevicePathPool(caches, block_dim=block_dim)
    # Every batch picks, and always the strategy under test.
    monkeypatch.setattr(BlockPool, "_choosing", lambda self, nbytes: True)
    monkeypatch.setattr(Chooser, "pick", lambda self: 0 if strategy == "team" else 1)
    if strategy == "queue":
        monkeypatch.setattr(blockcopy, "SERIAL_ELEMS", 40)  # 1-2 rows per call here
    elif strategy == "queue-rows":
        monkeypatch.setattr(blockcopy, "SERIAL_ELEMS", 1)  # every row "too long"
        monkeypatch.setattr(blockcopy, "_TASK_BYTES", 1)  # one row per numpy task
    return BlockPool(caches, block_dim=block_dim)


def _fill_bytes(caches: list[torch.Tensor], seed: int) -> None:
    """Random bytes, NaN payloads and all, so a copy that went through floating point
    registers or converted anything would show."""
    for i, t in enumerate(caches):
        gen = torch.Generator().manual_seed(seed + i)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _packed(pool: BlockPool, block_id: int) -> torch.Tensor:
    """The reference packed form: the block's per-layer copies, bytes concatenated."""
    kv = pool.get_kv_from_block(block_id)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in kv])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ids", list(GATHER_IDS.values()), ids=list(GATHER_IDS))
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_block_by_block(
    kind: str, dtype: torch.dtype, ids: list[int], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, block_dim = _pools(dtype, num_blocks=16)[kind]
    _fill_bytes(caches, seed=1)
    pool = _strategy_pool(strategy, caches, block_dim, monkeypatch)
    # Into a fresh buffer and into rows 3.. of a bigger staging buffer (not at its start).
    whole = pool.new_staging(len(ids) + 3)
    for out in (pool.gather(ids), pool.gather(ids, whole[3:])):
        for row, block in zip(out, ids, strict=True):
            assert torch.equal(row, _packed(pool, block))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ids", list(SCATTER_IDS.values()), ids=list(SCATTER_IDS))
@pytest.mark.parametrize("kind", ["canonical", "flash", "lbhnc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_matches_block_by_block(
    kind: str, dtype: torch.dtype, ids: list[int], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, block_dim = _pools(dtype, num_blocks=16)[kind]
    _fill_bytes(caches, seed=2)
    pool = _strategy_pool(strategy, caches, block_dim, monkeypatch)
    before = {b: _packed(pool, b) for b in range(16)}
    src = pool.new_staging(len(ids))
    gen = torch.Generator().manual_seed(3)
    src.copy_(torch.randint(0, 256, tuple(src.shape), dtype=torch.uint8, generator=gen))
    pool.scatter(ids, src)
    for row, block in zip(src, ids, strict=True):
        assert torch.equal(_packed(pool, block), row)
    for block in set(range(16)) - set(ids):
        assert torch.equal(_packed(pool, block), before[block])


@pytest.mark.parametrize("strategy", ["team", "queue", "device"])
def test_misaligned_buffers_under_each_strategy(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, _ = _pools(torch.bfloat16, num_blocks=16)["canonical"]
    _fill_bytes(caches, seed=4)
    pool = _strategy_pool(strategy, caches, 0, monkeypatch)
    ids = [9, 3, 4, 5, 0]
    raw = torch.zeros(len(ids) * pool.bytes_per_block + 8, dtype=torch.uint8)
    out = raw[8:].view(len(ids), pool.bytes_per_block)  # 8-byte aligned, not 16
    pool.gather(ids, out)
    for row, block in zip(out, ids, strict=True):
        assert torch.equal(row, _packed(pool, block))
    # The way back, from a misaligned buffer too, with new bytes and in reverse.
    raw2 = torch.zeros_like(raw)
    src = raw2[8:].view(len(ids), pool.bytes_per_block)
    src.copy_(out.flip(0) ^ 0x5A)
    pool.scatter(ids[::-1], src)
    for row, block in zip(src, ids[::-1], strict=True):
        assert torch.equal(_packed(pool, block), row)


def test_large_batches_choose_by_speed_and_stay_exact() -> None:
    """Without any patching: batches over QUEUE_MIN_BYTES run both strategies in turn
    (the chooser times each), with the same bytes every time."""
    layout = KVLayout(num_layers=3, num_kv_heads=4, head_dim=64, block_size=16)  # 96 KiB
    n = blockpool.QUEUE_MIN_BYTES // layout.bytes_per_block + 2
    pool = BlockPool.allocate(layout, 2 * n)
    _fill_bytes([v for v in pool._views], seed=5)
    ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n].tolist()
    first = pool.gather(ids).clone()
    for _ in range(3):
        assert torch.equal(pool.gather(ids), first)
    other = BlockPool.allocate(layout, 2 * n)
    for _ in range(3):
        other.scatter(ids, first)
        assert torch.equal(other.gather(ids), first)
    if torch.get_num_threads() > 1:
        assert all(pool._gather_pick.rates)
        assert all(other._scatter_pick.rates)


def test_chooser_keeps_the_faster_and_backs_off() -> None:
    c = Chooser()
    speed = {0: 1.0, 1: 5.0}  # team slow at first (a first batch pays page faults)

    def batch() -> int:
        choice = c.pick()
        c.record(choice, speed[choice])
        return choice

    assert [batch(), batch()] == [0, 1]  # each timed once
    speed[0] = 10.0  # the team is faster in fact
    # The queue (best so far) runs once more; then the team is timed again, wins, and
    # the queue is re-timed after 2 batches, then 4, 8, ... while it keeps losing.
    picks = [batch() for _ in range(19)]
    assert picks == [1, 0, 0, 0, 1] + [0] * 4 + [1] + [0] * 8 + [1]
    # Load arrives: the team slows down. Its best of the last 3 timings drops below the
    # queue's after 3 slow batches, and the queue takes over.
    speed[0] = 2.0
    assert [batch() for _ in range(4)] == [0, 0, 0, 1]
    assert c.best == 1


def test_run_queue_runs_each_call_once_and_reraises() -> None:
    lock = threading.Lock()
    done: list[int] = []

    def call(i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                done.append(i)

        return run

    run_queue([[call(i) for i in range(50)], [call(i) for i in range(50, 120)]])
    assert sorted(done) == list(range(120))

    def boom() -> None:
        raise ValueError("copy failed")

    with pytest.raises(ValueError, match="copy failed"):
        run_queue([[call(0), boom, *(call(i) for i in range(10))]])
    run_queue([[]])  # nothing to do


def test_cpu_tier_queue_read_write_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu tier picks between the same two strategies (16-byte index ops, or numpy
    calls on two threads); both must move exact bytes, in any slot order."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    tier = CPUBackend(CPUTierConfig(name="c", capacity=12 * layout.bytes_per_block), layout)
    slots = tier.allocate(12)
    assert slots is not None
    order = [slots[i] for i in (7, 0, 11, 3, 4, 5, 10, 1)]
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(len(order))]
    data = torch.randint(0, 256, (len(order), layout.bytes_per_block), dtype=torch.uint8)
    monkeypatch.setattr("kvoffload.backends.cpu.backend.worth_choosing", lambda nbytes: True)
    monkeypatch.setattr("kvoffload.backends.cpu.backend.CPUBackend._rows_per_call", lambda self: 3)
    for write_with, read_with in ((0, 1), (1, 0), (1, 1)):
        monkeypatch.setattr(tier._write_pick, "pick", lambda w=write_with: w)
        monkeypatch.setattr(tier._read_pick, "pick", lambda r=read_with: r)
        tier.write(order, keys, data)
        back = torch.zeros_like(data)
        assert tier.read(order[::-1], keys[::-1], back) == [True] * len(order)
        assert torch.equal(back, data.flip(0))
        data = data ^ 0x3C
    with pytest.raises(IndexError):
        tier.read([tier.num_slots], keys[:1], back[:1])
    tier.close()
