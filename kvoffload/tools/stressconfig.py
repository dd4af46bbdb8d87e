"""The ``stress`` section of the config: the simulated model's KV layout and the
defaults of ``kvoffload stress`` (its workload, pool and run length).

Data only, and torch-free: :class:`~kvoffload.config.KVOffloadConfig` holds a
:class:`StressConfig`, so validating any config validates this section, and the config
sits below every tool. The stress run and the maintenance tools read it from here.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol

from pydantic import BaseModel, Field, model_validator

from kvoffload.layout import DTYPE_NAMES, KVLayout
from kvoffload.tierconfig import MODEL_CONFIG


class LayoutConfig(BaseModel):
    """The simulated model's KV layout, for ``kvoffload stress``."""

    model_config = MODEL_CONFIG

    num_layers: int = Field(default=8, gt=0)
    """Attention layers."""
    num_kv_heads: int = Field(default=8, gt=0)
    """KV heads per layer (after GQA)."""
    head_dim: int = Field(default=128, gt=0)
    """Elements per head."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per block (vLLM's CPU attention needs multiples of 32)."""
    dtype: Literal[DTYPE_NAMES] = "bfloat16"  # type: ignore[valid-type]
    """Element type of the KV cache."""


LAYOUT_PRESETS: Final[dict[str, dict[str, Any]]] = {
    "tiny": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
    "small": {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
    "qwen2.5-0.5b": {"num_layers": 24, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
    "llama3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
}
"""Simulated model layouts for ``stress.preset`` / ``--preset`` (all bfloat16). Block
bytes: tiny 16 KiB, small 512 KiB, qwen2.5-0.5b 192 KiB, llama3-8b 2 MiB: Llama-3-8B's
real per-block geometry (32 layers, 8 KV heads of 128, 16 tokens); it is scaled to fit
memory through the block counts (``pool_blocks``, tier capacities), not the layout."""


class StressConfig(BaseModel):
    """Defaults of ``kvoffload stress``; the CLI's flags override them."""

    model_config = MODEL_CONFIG

    layout: LayoutConfig = LayoutConfig()
    """Simulated KV layout."""
    preset: Literal["tiny", "small", "qwen2.5-0.5b", "llama3-8b"] | None = None
    """A named layout instead of ``layout`` (``--preset``): see ``LAYOUT_PRESETS``."""
    concurrency: int = Field(default=4, ge=1, le=1024)
    """Simulated requests in flight at once (``--concurrency``); each holds its own
    pool blocks from lookup until its store has finished."""
    pool_blocks: int = Field(default=256, gt=0)
    """Blocks in the simulated GPU block pool (one request must fit)."""
    ops: int = Field(default=2000, gt=0)
    """Requests to run (``--ops``)."""
    duration_s: float = Field(default=45.0, gt=0)
    """Upper bound on the run's wall time in seconds (``--duration``)."""
    seed: int = 0
    """Seed of the workload and the data generator (``--seed``)."""
    prefixes: int = Field(default=48, gt=0)
    """Distinct shared prefixes (system prompts, documents) requests draw from."""
    zipf_alpha: float = Field(default=1.1, gt=0)
    """Skew of prefix popularity: prefix ``k`` is drawn with weight ``1/k**alpha``."""
    prefix_blocks: int = Field(default=24, gt=0)
    """Most blocks a shared prefix has; each request reuses a random leading part."""
    suffix_blocks: int = Field(default=4, ge=0)
    """Blocks unique to each request, after its shared prefix."""
    data: Literal["random", "kv"] = "random"
    """Block contents (``--data``): ``random`` bytes, which no codec shrinks (a
    compressed tier's worst case), or ``kv``: normal values in the layout's dtype,
    which a byte-shuffling codec shrinks about as much as a real cache's (real KV's
    ratios: docs/benchmarks.md, "Compression")."""
    workload: Literal["zipf", "multiturn", "scan", "trace"] = "zipf"
    """Request stream (``--workload``): ``zipf`` shared prefixes, ``multiturn`` chat
    sessions growing turn by turn, ``scan`` no reuse at all (the worst case), ``trace``
    a JSONL request trace in the Mooncake format (``trace``)."""
    trace: str | None = None
    """JSONL trace file for ``workload: trace`` (``--trace``); each hash_id is one block."""
    sessions: int = Field(default=16, gt=0)
    """``multiturn``: chat sessions in flight at once."""
    turn_blocks: int = Field(default=2, gt=0)
    """``multiturn``: blocks each turn appends to its session's history."""
    max_turns: int = Field(default=12, gt=0)
    """``multiturn``: turns after which a session ends and a new one starts."""
    scan_blocks: int = Field(default=16, gt=0)
    """``scan``: blocks per request, all of them new."""

    def resolved_layout(self) -> LayoutConfig:
        """``layout``, or the preset's layout when ``preset`` is set."""
        if self.preset is None:
            return self.layout
        return LayoutConfig(**LAYOUT_PRESETS[self.preset])

    @model_validator(mode="after")
    def _pool_fits_a_request(self) -> StressConfig:
        if self.preset is not None and "layout" in self.model_fields_set:
            raise ValueError(
                f"stress.preset = {self.preset!r} and stress.layout are both set; "
                "keep one (the preset names a whole layout)"
            )
        # A trace's longest request is known only once the file is read: the stress
        # runner checks it then.
        need = {
            "zipf": (self.prefix_blocks + self.suffix_blocks, "prefix_blocks + suffix_blocks"),
            "multiturn": (self.turn_blocks * self.max_turns, "turn_blocks x max_turns"),
            "scan": (self.scan_blocks, "scan_blocks"),
        }.get(self.workload)
        if need is not None and self.pool_blocks < need[0]:
            raise ValueError(
                f"pool_blocks = {self.pool_blocks} cannot hold one request of up to {need[0]} "
                f"blocks ({need[1]}); set pool_blocks >= {need[0]}"
            )
        if self.workload == "trace" and not self.trace:
            raise ValueError("workload = 'trace' needs trace: a JSONL trace file (or --trace)")
        return self


class HasStress(Protocol):
    """What :func:`layout_from_config` reads: a config with a ``stress`` section
    (:class:`~kvoffload.config.KVOffloadConfig`, which sits above this module)."""

    @property
    def stress(self) -> StressConfig: ...


def layout_from_config(config: HasStress) -> KVLayout:
    """The KV layout the config's ``stress`` section simulates (its preset or layout).

    What ``kvoffload stress`` writes its blocks under, and what the maintenance tools open
    a tier with when the tier stores no layout of its own. It lives with the settings it
    reads, below both tools, so neither has to import the other for it. The namespace
    keeps the simulated blocks apart from an engine's with the same shape.
    """
    lc = config.stress.resolved_layout()
    return KVLayout(
        num_layers=lc.num_layers,
        num_kv_heads=lc.num_kv_heads,
        head_dim=lc.head_dim,
        block_size=lc.block_size,
        dtype=lc.dtype,
        namespace="kvoffload-stress",
    )
