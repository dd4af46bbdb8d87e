"""The contract every :class:`~kvoffload.backend.Backend` must honour, as pytest tests.

Subclass :class:`BackendContract` and provide a ``backend_factory`` fixture returning
``(layout, num_slots) -> Backend``. Each test builds fresh backends, so the suite
needs nothing else. What it pins down: slot accounting, batched round trips in any
slot order, overwrites, rejection of mis-shaped batches, a clean ``check()``, and
safety under the transfer worker's threading: writes, reads and discards of disjoint
slots may run at once from different threads.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeAlias

import pytest
import torch

from kvoffload.backend import Backend
from kvoffload.exceptions import BlockStateError, LayoutMismatchError
from kvoffload.keys import BlockKey, namespaced
from kvoffload.layout import KVLayout
from kvoffload.registry import get_backend_class
from kvoffload.tools.stress import kv_like

BackendFactory: TypeAlias = Callable[[KVLayout, int], Backend]

LAYOUTS: dict[str, KVLayout] = {
    "bf16": KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16"),
    "fp32": KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, block_size=2, dtype="float32"),
    # 12-byte blocks: not a multiple of 8, so copies cannot use the widest views.
    "odd": KVLayout(num_layers=1, num_kv_heads=1, head_dim=3, block_size=1, dtype="float16"),
}


def make_backend(
    name: str, layout: KVLayout, num_slots: int, tmp_path: Path, **extra: Any
) -> Backend:
    """Build registered backend ``name`` with room for exactly ``num_slots`` blocks.

    Backends whose config has a ``path`` field get a fresh directory under ``tmp_path``.
    """
    cls = get_backend_class(name)
    data: dict[str, Any] = {
        "name": f"contract-{name}",
        "backend": name,
        "capacity": num_slots * cls.slot_bytes(layout),
        **extra,
    }
    if "path" in cls.config_model.model_fields and "path" not in data:
        data["path"] = str(tmp_path / f"tier-{name}")
    return cls(cls.config_model.model_validate(data), layout)


def _keys(n: int, salt: int = 0) -> list[BlockKey]:
    return [namespaced(b"contract-%d" % salt, i.to_bytes(4, "little")) for i in range(n)]


def _payload(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    """Random bytes in odd rows (no codec shrinks them: a compressing tier stores them
    raw) and KV-like values in even ones (it compresses those), so every test covers
    both forms of a record."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randint(0, 256, (n, layout.bytes_per_block), dtype=torch.uint8, generator=gen)
    out[::2] = kv_like(layout, (n + 1) // 2, seed)
    return out


class BackendContract:
    """Shared tests; see the module docstring for how to adopt them."""

    @pytest.fixture(params=sorted(LAYOUTS))
    def layout(self, request: pytest.FixtureRequest) -> KVLayout:
        return LAYOUTS[request.param]

    @pytest.fixture
    def backend(self, backend_factory: BackendFactory, layout: KVLayout) -> Iterator[Backend]:
        be = backend_factory(layout, 8)
        yield be
        be.close()

    def test_capacity_is_what_was_asked(self, backend: Backend, layout: KVLayout) -> None:
        assert backend.num_slots == 8
        assert backend.num_free == 8
        assert backend.capacity_bytes >= 8 * layout.bytes_per_block

    def test_allocate_until_full_then_none(self, backend: Backend) -> None:
        first = backend.allocate(5)
        rest = backend.allocate(3)
        assert first is not None
        assert rest is not None
        assert sorted(first + rest) == list(range(8))
        assert backend.allocate(1) is None
        backend.free(first[:2])
        assert backend.num_free == 2
        again = backend.allocate(2)
        assert again is not None
        assert sorted(again) == sorted(first[:2])

    def test_allocate_more_than_free_allocates_nothing(self, backend: Backend) -> None:
        assert backend.allocate(9) is None
        assert backend.num_free == 8

    def test_double_free_raises(self, backend: Backend) -> None:
        slots = backend.allocate(1)
        assert slots is not None
        backend.free(slots)
        with pytest.raises(BlockStateError):
            backend.free(slots)

    def test_round_trip_in_any_slot_order(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(8)
        assert slots is not None
        order = [5, 0, 7, 2, 1, 6, 3, 4]
        write_slots = [slots[i] for i in order]
        keys = _keys(8)
        data = _payload(layout, 8, seed=1)
        backend.write(write_slots, keys, data)
        # Read back in reverse order, into a fresh buffer.
        back = torch.zeros_like(data)
        valid = backend.read(write_slots[::-1], keys[::-1], back)
        assert valid == [True] * 8
        assert torch.equal(back, data.flip(0))

    def test_partial_batches_and_subsets(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(6)
        assert slots is not None
        keys = _keys(6)
        data = _payload(layout, 6, seed=2)
        backend.write(slots[:3], keys[:3], data[:3])
        backend.write(slots[3:], keys[3:], data[3:])
        out = torch.zeros((2, layout.bytes_per_block), dtype=torch.uint8)
        assert backend.read([slots[4], slots[1]], [keys[4], keys[1]], out) == [True, True]
        assert torch.equal(out[0], data[4])
        assert torch.equal(out[1], data[1])

    def test_overwrite_replaces_contents(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(2)
        assert slots is not None
        old, new = _payload(layout, 2, seed=3), _payload(layout, 2, seed=4)
        backend.write(slots, _keys(2), old)
        backend.free(slots)
        again = backend.allocate(2)
        assert again is not None
        keys = _keys(2, salt=1)
        backend.write(again, keys, new)
        out = torch.zeros_like(new)
        assert backend.read(again, keys, out) == [True, True]
        assert torch.equal(out, new)

    def test_empty_batch_is_a_no_op(self, backend: Backend, layout: KVLayout) -> None:
        empty = torch.empty((0, layout.bytes_per_block), dtype=torch.uint8)
        backend.write([], [], empty)
        assert backend.read([], [], empty) == []

    def test_misshaped_batch_is_rejected(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(2)
        assert slots is not None
        short = torch.zeros((2, layout.bytes_per_block - 1), dtype=torch.uint8)
        with pytest.raises(LayoutMismatchError):
            backend.write(slots, _keys(2), short)
        wrong_dtype = torch.zeros((2, layout.bytes_per_block), dtype=torch.float32)
        with pytest.raises(LayoutMismatchError):
            backend.read(slots, _keys(2), wrong_dtype)
        with pytest.raises(LayoutMismatchError):
            backend.write(
                slots, _keys(1), torch.zeros((2, layout.bytes_per_block), dtype=torch.uint8)
            )

    def test_unaligned_caller_buffer(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(2)
        assert slots is not None
        keys = _keys(2)
        # Rows that start one byte into a bigger allocation: no wide views possible.
        raw = torch.zeros(2 * layout.bytes_per_block + 1, dtype=torch.uint8)
        src = raw[1:].view(2, layout.bytes_per_block)
        src.copy_(_payload(layout, 2, seed=5))
        backend.write(slots, keys, src)
        raw2 = torch.zeros_like(raw)
        dst = raw2[1:].view(2, layout.bytes_per_block)
        assert backend.read(slots, keys, dst) == [True, True]
        assert torch.equal(dst, src)

    def test_check_is_clean_after_use(self, backend: Backend, layout: KVLayout) -> None:
        slots = backend.allocate(4)
        assert slots is not None
        backend.write(slots, _keys(4), _payload(layout, 4, seed=6))
        backend.free(slots[:2])
        assert backend.check() == []

    def test_concurrent_disjoint_writes_reads_and_discards(
        self, backend_factory: BackendFactory, layout: KVLayout
    ) -> None:
        """Threads each own some slots and, all at once, write random subsets of them
        (distinct contents every round), read back random subsets of what they hold and
        (one of them) discard some: what the offloader's store lane, load lane,
        promotion writes and evictions do to one tier. Every read must be valid and
        bit-exact, and ``check()`` clean afterwards."""
        threads, per_thread = 4, 6
        be = backend_factory(layout, threads * per_thread)
        try:
            slots = be.allocate(threads * per_thread)
            assert slots is not None
            # Interleaved ownership: threads share files, header pages and neighbours.
            # Threads 0 and 1 own contiguous halves instead, so their batches coalesce
            # into multi-slot runs.
            owned = [slots[t::threads] for t in range(threads)]
            pair = sorted(owned[0] + owned[1])
            owned[0], owned[1] = pair[:per_thread], pair[per_thread:]
            start = threading.Barrier(threads, timeout=30)
            deadline = time.monotonic() + _CONCURRENT_SECONDS

            def worker(t: int) -> dict[int, tuple[BlockKey, torch.Tensor]]:
                rng = random.Random(t)
                gen = torch.Generator().manual_seed(1000 + t)
                mine = owned[t]
                held: dict[int, tuple[BlockKey, torch.Tensor]] = {}
                start.wait()
                for rnd in range(_CONCURRENT_MAX_ROUNDS):
                    if rnd >= _CONCURRENT_MIN_ROUNDS and time.monotonic() > deadline:
                        break
                    batch = rng.sample(mine, rng.randint(1, len(mine)))
                    keys = [
                        namespaced(b"contract-mt", struct.pack("<III", t, rnd, s)) for s in batch
                    ]
                    data = torch.randint(
                        0,
                        256,
                        (len(batch), layout.bytes_per_block),
                        dtype=torch.uint8,
                        generator=gen,
                    )
                    be.write(batch, keys, data)
                    for i, s in enumerate(batch):
                        held[s] = (keys[i], data[i].clone())
                    want = rng.sample(sorted(held), rng.randint(1, len(held)))
                    out = torch.full((len(want), layout.bytes_per_block), 0xA5, dtype=torch.uint8)
                    valid = be.read(want, [held[s][0] for s in want], out)
                    assert valid == [True] * len(want), f"thread {t} round {rnd}: {valid}"
                    for i, s in enumerate(want):
                        assert torch.equal(out[i], held[s][1]), (
                            f"thread {t} round {rnd}: slot {s} read back other bytes"
                        )
                    if t == threads - 1 and len(held) > 1 and rng.random() < 0.5:
                        gone = rng.sample(sorted(held), rng.randint(1, len(held) - 1))
                        be.discard(gone)
                        for s in gone:
                            del held[s]
                return held

            with ThreadPoolExecutor(threads, thread_name_prefix="contract-mt") as pool:
                results = [f.result() for f in [pool.submit(worker, t) for t in range(threads)]]
            # Quiet now: everything still held reads back exactly, in one batch.
            final = {s: kv for held in results for s, kv in held.items()}
            order = sorted(final)
            out = torch.zeros((len(order), layout.bytes_per_block), dtype=torch.uint8)
            assert be.read(order, [final[s][0] for s in order], out) == [True] * len(order)
            for i, s in enumerate(order):
                assert torch.equal(out[i], final[s][1]), f"slot {s} read back other bytes"
            assert be.check() == []
        finally:
            be.close()


_CONCURRENT_SECONDS = 0.4
"""Per layout; with the round limits below, keeps the threaded test near a second per
backend even where every store waits for an fsync."""
_CONCURRENT_MIN_ROUNDS = 15
_CONCURRENT_MAX_ROUNDS = 400
