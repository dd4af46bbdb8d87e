"""The ``cpu`` tier's settings, importable without torch."""

from __future__ import annotations

from typing import Literal

from kvoffload.tierconfig import TierConfig


class CPUTierConfig(TierConfig):
    """Pinned host memory: one slab allocated once at start-up."""

    backend: Literal["cpu"] = "cpu"
    """Selects the pinned-CPU backend."""
    pin_memory: bool | None = None
    """Page-lock the slab for fast DMA. ``null``: only when CUDA is available."""


SETTINGS = CPUTierConfig
"""This tier's settings model: the config validates a tier naming it with this."""
