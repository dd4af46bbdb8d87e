"""Layer-wise loads into a CUDA pool: each layer crosses as its own 2-D DMA and is
reported with an event; a stream that waits on layer N's event reads layer N's bytes,
bit-exact, while the compute stream is busy and later layers are still crossing.
Deselected without CUDA (CI has none); run on the GPU machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import make_keys
from support.cuda import BPB, LAYOUT, busy, cuda_content, cuda_offloader, cuda_pool, wait_blocks

from kvoffload.datapath import DataPath, LayerProgress, _memcpy2d

pytestmark = pytest.mark.cuda  # deselected without CUDA (tests/conftest.py)


def test_the_2d_copy_is_found() -> None:
    """Without it the layer-wise path still works, but every layer's bytes cross first."""
    assert _memcpy2d() is not None


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_unpack_layers_equals_unpack_one_event_per_layer(flash: bool) -> None:
    pool, _ = cuda_pool(flash)
    data = DataPath(BPB, pool)
    ids = list(range(0, 96, 3))
    src = cuda_content(ids, 7).cpu().pin_memory()
    pieces = [(0, src[:10]), (10, src[10:])]
    data.unpack(ids, pieces)
    whole = pool.gather(ids).clone()
    pool.scatter(ids, torch.zeros_like(whole))
    events: list[tuple[int, Any]] = []
    data.unpack_layers(ids, pieces, data.mark(), lambda layer, ev: events.append((layer, ev)))
    assert [layer for layer, _ in events] == list(range(LAYOUT.num_layers))
    assert all(isinstance(ev, torch.cuda.Event) and ev.query() for _, ev in events)
    assert torch.equal(pool.gather(ids), whole)
    assert torch.equal(whole.cpu(), src)


@pytest.mark.parametrize("flash", [False, True], ids=["canonical", "flash"])
def test_a_reader_waiting_per_layer_sees_each_layer_bit_exact(tmp_path: Path, flash: bool) -> None:
    """As the attention layers do: on a second stream, wait for layer N (no host wait
    for the bytes), then copy layer N's blocks out, queued behind a busy compute
    stream; every layer read equals what was stored."""
    pool, caches = cuda_pool(flash)
    ids = list(range(0, 128))
    want = cuda_content(ids, 11)
    pool.scatter(ids, want)
    keys = make_keys(len(ids), salt=3)
    targets = list(range(128, 256))
    index = torch.tensor(targets, device="cuda")
    with cuda_offloader(tmp_path, pool, cpu_blocks=160, mmap=False) as off:
        assert wait_blocks(off, off.submit_store(keys, ids)) == len(ids)
        for round_ in range(3):
            pool.scatter(targets, torch.zeros_like(want))
            reader = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(reader):
                busy(10)  # the model's earlier layers, still running
                progress = LayerProgress(pool.num_layers)
                plan = off.prepare_load(keys)
                job = off.submit_load(plan, targets, layers=progress)
                seen = []
                dim = 1 if flash else 0
                for layer in range(pool.num_layers):
                    progress.wait(layer, reader)  # the stream waits; the host goes on
                    seen.append(caches[layer].index_select(dim, index))
            assert wait_blocks(off, job) == len(ids), round_
            reader.synchronize()
            for layer, got in enumerate(seen):
                off_, nbytes = pool.layer_offsets[layer], pool.layer_bytes[layer]
                as_rows = got.movedim(dim, 0).contiguous().view(len(ids), -1)
                assert torch.equal(as_rows.view(torch.uint8), want[:, off_ : off_ + nbytes]), (
                    round_,
                    layer,
                )
