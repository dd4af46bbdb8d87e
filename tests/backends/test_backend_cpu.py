"""The ``cpu`` backend: the contract, plus what is specific to one host slab."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvoffload.backends.cpu import CPUBackend

from kvoffload.config import CPUTierConfig
from kvoffload.exceptions import ConfigError
from kvoffload.layout import KVLayout
from kvoffload.testing import BackendContract, BackendFactory, make_backend


class TestCPUContract(BackendContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, num_slots: make_backend("cpu", layout, num_slots, tmp_path)


def test_one_slab_sized_from_capacity() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    # 10.5 blocks of capacity: the half block is not usable.
    cfg = CPUTierConfig(name="c", capacity=layout.bytes_per_block * 21 // 2)
    be = CPUBackend(cfg, layout)
    assert be.num_slots == 10
    assert tuple(be.slab.shape) == (10, layout.bytes_per_block)
    assert be.slab.dtype == torch.uint8
    # No CUDA here: auto pinning must not pin.
    assert be.pinned is torch.cuda.is_available()


def test_pin_memory_without_cuda_falls_back_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("covers the CPU-only path: with CUDA, pin_memory pins")
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2)
    be = CPUBackend(CPUTierConfig(name="c", capacity=1 << 16, pin_memory=True), layout)
    assert be.pinned is False
    assert "CUDA is absent" in caplog.text


def test_capacity_below_one_block_is_refused() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2)
    with pytest.raises(ConfigError, match=r"tier .c.: capacity = .* holds no block"):
        CPUBackend(CPUTierConfig(name="c", capacity=layout.bytes_per_block - 1), layout)
