"""What a stress run asks for and what its blocks hold: the request stream a config
selects, and every block's deterministic contents, so that a loaded block can be
checked bit for bit against what it must be (:class:`BlockDataGenerator`)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvoffload.config import StressConfig
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout, dtype_from_name
from kvoffload.tools.workloads import Workload, make_workload

DATA_SEED = 0x6B766F
"""Seed of the block contents. Fixed, not the workload's ``--seed``: a block's bytes
are a function of its key alone, so a persistent tier filled by one run is valid data
for the next, whatever its seed (a warm restart, not a false integrity error)."""


def kv_like(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    """``n`` blocks of small normal values in the layout's dtype, as ``uint8`` rows:
    like a KV cache in that a byte-shuffling codec shrinks them (their high bytes
    repeat), unlike random bytes, which no codec does. Real KV's ratios are in
    docs/benchmarks.md ("Compression"); these come close for bf16."""
    gen = torch.Generator().manual_seed(seed)
    count = layout.bytes_per_block // layout.itemsize
    values = torch.randn((n, count), generator=gen) * 0.5
    return values.to(layout.torch_dtype).view(torch.uint8).reshape(n, layout.bytes_per_block)


class BlockDataGenerator:
    """Deterministic contents for any key, at memcpy speed.

    A block's bytes are a seeded random base rotated by an offset taken from the key,
    with the key itself stamped in the first bytes: different keys give different
    bytes, and regenerating costs two slice copies, not a random-number pass.
    """

    def __init__(
        self, bytes_per_block: int, seed: int, *, kind: str = "random", dtype: str = "bfloat16"
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.nbytes = bytes_per_block
        self.step = 1
        if kind == "kv":
            # Normal values of the cache's dtype (see StressConfig.data); rotated by
            # whole values, so each stays intact.
            dt = dtype_from_name(dtype)
            self.step = torch.empty(0, dtype=dt).element_size()
            values = torch.randn(bytes_per_block // self.step, generator=gen) * 0.5
            self.base = values.to(dt).view(torch.uint8).reshape(-1)
        else:
            self.base = torch.randint(0, 256, (bytes_per_block,), dtype=torch.uint8, generator=gen)

    def fill(self, key: BlockKey, row: torch.Tensor) -> None:
        """Write ``key``'s contents into ``row`` (``uint8 [bytes_per_block]``)."""
        shift = int.from_bytes(key[:8], "little") % (self.nbytes // self.step) * self.step
        row[: self.nbytes - shift].copy_(self.base[shift:])
        row[self.nbytes - shift :].copy_(self.base[:shift])
        stamp = min(len(key), self.nbytes)
        row[:stamp].copy_(torch.frombuffer(bytearray(key[:stamp]), dtype=torch.uint8))

    def matches(self, key: BlockKey, row: torch.Tensor, scratch: torch.Tensor) -> bool:
        self.fill(key, scratch)
        return torch.equal(row, scratch)


def workload_from_config(cfg: StressConfig, seed: int) -> Workload:
    """The request stream ``cfg`` selects (see :mod:`kvoffload.tools.workloads`)."""
    if cfg.workload == "zipf":
        return make_workload(
            "zipf",
            prefixes=cfg.prefixes,
            zipf_alpha=cfg.zipf_alpha,
            prefix_blocks=cfg.prefix_blocks,
            suffix_blocks=cfg.suffix_blocks,
            seed=seed,
        )
    if cfg.workload == "multiturn":
        return make_workload(
            "multiturn",
            sessions=cfg.sessions,
            turn_blocks=cfg.turn_blocks,
            max_turns=cfg.max_turns,
            seed=seed,
        )
    if cfg.workload == "scan":
        return make_workload("scan", blocks=cfg.scan_blocks, seed=seed)
    assert cfg.trace is not None  # the config validator requires it
    return make_workload("trace", path=Path(cfg.trace), max_blocks=cfg.pool_blocks)
