"""``kvoffload stress``: a seeded offload workload whose every loaded block is checked.

A simulated engine: a :class:`~kvoffload.blockpool.BlockPool` stands in for the GPU
block pool, requests come from a :mod:`~kvoffload.workloads` stream (Zipf shared
prefixes, multi-turn chat, a no-reuse scan, or a replayed trace), and each request
(1) loads the longest prefix any tier holds into pool blocks, (2) "prefills" the rest
with deterministic data, (3) stores its blocks into every tier (write-through). Every
block loaded back is compared bit for bit with what the generator says it must be; a
single differing byte is an integrity error and fails the run.

The transfer-engine issue replaces the synchronous tier loop with the async Offloader;
the workload, generator and report stay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, StressConfig
from kvoffload.exceptions import BackendError, BlockStateError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.tier import Tier, build_tiers
from kvoffload.workloads import Workload, make_workload

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- data
DATA_SEED = 0x6B766F
"""Seed of the block contents. Fixed, not the workload's ``--seed``: a block's bytes
are a function of its key alone, so a persistent tier filled by one run is valid data
for the next, whatever its seed (a warm restart, not a false integrity error)."""


class BlockDataGenerator:
    """Deterministic contents for any key, at memcpy speed.

    A block's bytes are a seeded random base rotated by an offset taken from the key,
    with the key itself stamped in the first bytes: different keys give different
    bytes, and regenerating costs two slice copies, not a random-number pass.
    """

    def __init__(self, bytes_per_block: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.nbytes = bytes_per_block
        self.base = torch.randint(0, 256, (bytes_per_block,), dtype=torch.uint8, generator=gen)

    def fill(self, key: BlockKey, row: torch.Tensor) -> None:
        """Write ``key``'s contents into ``row`` (``uint8 [bytes_per_block]``)."""
        shift = int.from_bytes(key[:8], "little") % self.nbytes
        row[: self.nbytes - shift].copy_(self.base[shift:])
        row[self.nbytes - shift :].copy_(self.base[:shift])
        stamp = min(len(key), self.nbytes)
        row[:stamp].copy_(torch.frombuffer(bytearray(key[:stamp]), dtype=torch.uint8))

    def matches(self, key: BlockKey, row: torch.Tensor, scratch: torch.Tensor) -> bool:
        self.fill(key, scratch)
        return torch.equal(row, scratch)


def workload_from_config(cfg: StressConfig, seed: int) -> Workload:
    """The request stream ``cfg`` selects (see :mod:`kvoffload.workloads`)."""
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


# --------------------------------------------------------------------------- report
@dataclass
class TierReport:
    """Per-tier counters of one run."""

    name: str
    backend: str
    capacity_blocks: int
    hits: int = 0
    """Blocks loaded from this tier."""
    blocks_stored: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    stores_rejected: int = 0
    """Blocks not stored because no room could be made (all candidates pinned)."""
    store_errors: int = 0
    corrupt_blocks: int = 0
    """Blocks the backend reported invalid on load (served as misses)."""
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0


@dataclass
class StressReport:
    """Outcome of ``kvoffload stress``; :meth:`to_json` is the ``--json`` schema."""

    seed: int
    workload: str
    layout: dict[str, Any]
    bytes_per_block: int
    ops: int = 0
    duration_s: float = 0.0
    blocks_requested: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    integrity_errors: int = 0
    tiers: list[TierReport] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Prefix-block hit ratio: loaded blocks / requested blocks."""
        return self.blocks_loaded / self.blocks_requested if self.blocks_requested else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "tiers"}
        out["hit_rate"] = self.hit_rate
        out["tiers"] = [
            {**asdict(t), "write_gbps": t.write_gbps, "read_gbps": t.read_gbps} for t in self.tiers
        ]
        return out


# ---------------------------------------------------------------------------- runner
def layout_from_config(config: KVOffloadConfig) -> KVLayout:
    lc = config.stress.layout
    return KVLayout(
        num_layers=lc.num_layers,
        num_kv_heads=lc.num_kv_heads,
        head_dim=lc.head_dim,
        block_size=lc.block_size,
        dtype=lc.dtype,
        namespace="kvoffload-stress",
    )


ProgressFn = Callable[[int, float], None]


class StressRunner:
    """Runs the workload against the configured tiers; see the module docstring."""

    def __init__(self, config: KVOffloadConfig, *, seed: int | None = None) -> None:
        self.config = config
        self.cfg = config.stress
        self.seed = self.cfg.seed if seed is None else seed
        self.layout = layout_from_config(config)
        self.workload = workload_from_config(self.cfg, self.seed)
        self.pool = BlockPool.allocate(self.layout, self.cfg.pool_blocks)
        self.gen = BlockDataGenerator(self.layout.bytes_per_block, DATA_SEED)
        self.tiers: list[Tier] = build_tiers(config, self.layout)
        n = self.workload.max_blocks
        self.staging = self.pool.new_staging(n)
        self.check_buf = self.pool.new_staging(n)
        self.scratch = torch.empty(self.layout.bytes_per_block, dtype=torch.uint8)
        self.report = StressReport(
            seed=self.seed,
            workload=self.cfg.workload,
            layout=self.layout.to_dict(),
            bytes_per_block=self.layout.bytes_per_block,
            tiers=[
                TierReport(t.name, t.backend.config.backend, t.manager.capacity) for t in self.tiers
            ],
        )

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def run(
        self, *, ops: int, duration_s: float, progress: ProgressFn | None = None
    ) -> StressReport:
        start = time.perf_counter()
        deadline = start + duration_s
        rep = self.report
        workload = self.workload
        while rep.ops < ops and time.perf_counter() < deadline and not workload.exhausted:
            self._one_request(self.workload.next())
            rep.ops += 1
            if progress is not None:
                progress(rep.ops, time.perf_counter() - start)
        rep.duration_s = time.perf_counter() - start
        for tier in self.tiers:
            problems = tier.manager.check() + tier.backend.check()
            if problems:
                raise BlockStateError(f"tier {tier.name} inconsistent after stress: {problems}")
        return rep

    # One simulated request: load the longest held prefix, compute the rest, store all.
    def _one_request(self, keys: list[BlockKey]) -> None:
        rep = self.report
        n = len(keys)
        pool_ids = list(range(n))  # one request at a time: the first n pool blocks
        rep.blocks_requested += n
        hit = self._load_prefix(keys, pool_ids)
        # "Prefill": what was not loaded is computed, i.e. generated, into the pool.
        staging = self.staging[:n]
        for i in range(hit, n):
            self.gen.fill(keys[i], staging[i])
        if hit < n:
            self.pool.scatter(pool_ids[hit:], staging[hit:])
        # Store: the request's blocks leave the pool and go to every tier.
        self.pool.gather(pool_ids, staging)
        row_of = {k: i for i, k in enumerate(keys)}
        for tier, trep in zip(self.tiers, rep.tiers, strict=True):
            self._store(tier, trep, keys, row_of, staging)

    def _load_prefix(self, keys: list[BlockKey], pool_ids: list[int]) -> int:
        best, hit = None, 0
        for idx, tier in enumerate(self.tiers):
            h = tier.manager.lookup(keys)
            if h > hit:
                best, hit = idx, h
        if best is None:
            return 0
        tier, trep = self.tiers[best], self.report.tiers[best]
        prefix = keys[:hit]
        slots = tier.manager.prepare_load(prefix)
        buf = self.staging[:hit]
        t0 = time.perf_counter()
        failed = False
        try:
            ok = tier.backend.read(slots, prefix, buf)
        except BackendError:
            # An I/O error says nothing about the stored blocks: a miss, not a drop.
            logger.warning("tier %s: read of %d blocks failed; treating as a miss", tier.name, hit)
            ok, failed = [False] * hit, True
        trep.read_seconds += time.perf_counter() - t0
        valid = ok.index(False) if False in ok else hit
        if not failed:
            trep.corrupt_blocks += ok.count(False)
        tier.manager.touch(prefix[:valid])
        tier.manager.complete_load(prefix)
        if valid < hit and not failed:
            # A corrupt or mismatched block is a miss, now and after a restart.
            tier.drop([key for key, good in zip(prefix, ok, strict=True) if not good])
        if valid == 0:
            return 0
        self.pool.scatter(pool_ids[:valid], buf[:valid])
        trep.hits += valid
        trep.bytes_read += valid * self.layout.bytes_per_block
        self.report.blocks_loaded += valid
        # Verify what the pool now holds, through the public batched API.
        check = self.pool.gather(pool_ids[:valid], self.check_buf[:valid])
        for i in range(valid):
            if not self.gen.matches(keys[i], check[i], self.scratch):
                self.report.integrity_errors += 1
                logger.error("integrity error: block %s from tier %s", keys[i].hex(), tier.name)
        return valid

    def _store(
        self,
        tier: Tier,
        trep: TierReport,
        keys: list[BlockKey],
        row_of: dict[BlockKey, int],
        staging: torch.Tensor,
    ) -> None:
        out = tier.manager.prepare_store(keys)
        if out is None:
            trep.stores_rejected += len(keys)
            return
        trep.evictions += len(out.evicted)
        if not out.keys_to_store:
            return
        rows = [row_of[k] for k in out.keys_to_store]
        src = staging if len(rows) == len(keys) else staging[torch.tensor(rows)]
        t0 = time.perf_counter()
        try:
            tier.backend.write(out.slots, out.keys_to_store, src)
        except BackendError:
            logger.warning("tier %s: write of %d blocks failed", tier.name, len(rows))
            tier.manager.complete_store(out.keys_to_store, success=False)
            trep.store_errors += len(rows)
            return
        finally:
            trep.write_seconds += time.perf_counter() - t0
        tier.manager.complete_store(out.keys_to_store, success=True)
        trep.blocks_stored += len(rows)
        trep.bytes_written += len(rows) * self.layout.bytes_per_block
        self.report.blocks_stored += len(rows)
