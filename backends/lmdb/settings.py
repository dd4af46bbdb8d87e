"""The ``lmdb`` tier's settings, importable without torch."""

from __future__ import annotations

from typing import Literal

from kvoffload.tierconfig import DiskTierConfig


class LmdbTierConfig(DiskTierConfig):
    """LMDB: one environment, key = block key, value = header + payload."""

    backend: Literal["lmdb"] = "lmdb"
    """Selects the LMDB backend."""
    readonly: bool = False
    """Open for reading only: several processes may read a tier one process writes."""


SETTINGS = LmdbTierConfig
"""This tier's settings model: the config validates a tier naming it with this."""
