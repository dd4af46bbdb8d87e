"""Eviction policies for :class:`~kvoffload.lru_manager.LRUOffloadingManager`.

Each policy is its own small module; :func:`make_policy` maps the config's
``eviction`` name to a class.
"""

from __future__ import annotations

from typing import Final, get_args

from kvoffload.policies.arc import ARCPolicy
from kvoffload.policies.base import BlockState, EvictionPolicy
from kvoffload.policies.lru import LRUPolicy
from kvoffload.tierconfig import PolicyName

POLICIES: Final[dict[str, type[EvictionPolicy]]] = {"lru": LRUPolicy, "arc": ARCPolicy}
"""``eviction`` name -> policy: exactly the names of the config's :data:`PolicyName`."""
if set(POLICIES) != set(get_args(PolicyName)):  # the config offers what is here, no more
    raise TypeError(
        f"kvoffload.policies.POLICIES has {sorted(POLICIES)} but the config's eviction "
        f"takes {sorted(get_args(PolicyName))} (kvoffload.tierconfig.PolicyName)"
    )


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy called ``name``; ``ValueError`` lists the known names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {known}") from None
    return cls(capacity)


__all__ = ["POLICIES", "ARCPolicy", "BlockState", "EvictionPolicy", "LRUPolicy", "make_policy"]
