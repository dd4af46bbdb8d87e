"""Eviction policies for :class:`~kvoffload.lru_manager.LRUOffloadingManager`.

Each policy is its own small module; :func:`make_policy` maps the config's
``eviction`` name to a class.
"""

from __future__ import annotations

from typing import Final

from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.base import BlockState, EvictionPolicy
from kvoffload.policies.lru import LRUPolicy

POLICIES: Final[dict[str, type[EvictionPolicy]]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy called ``name``; ``ValueError`` lists the known names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {known}") from None
    return cls(capacity)


__all__ = ["POLICIES", "ARCPolicy", "BlockState", "EvictionPolicy", "LRUPolicy", "make_policy"]
