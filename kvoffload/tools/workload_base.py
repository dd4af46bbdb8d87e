"""What a workload is: a seeded stream of requests, each the block keys of a prefix
chain (block ``i`` is only useful when blocks ``0..i-1`` are too, exactly as in
prefix caching). The built-in streams (:mod:`~kvoffload.tools.workload_synthetic`,
:mod:`~kvoffload.tools.workload_trace`) and :class:`~kvoffload.tools.workloads.ReplicaShare`
subclass :class:`Workload`; :mod:`~kvoffload.tools.workloads` names them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from kvoffload.keys import BlockKey


class Workload(ABC):
    """A deterministic stream of requests, each a prefix chain of block keys.

    Subclasses set :attr:`max_blocks` in ``__init__`` and implement :meth:`next`. The
    same constructor arguments (seed included) always give the same stream, so a
    stress failure can be replayed request for request.
    """

    name: ClassVar[str]
    """The :func:`make_workload` name."""

    max_blocks: int
    """Upper bound on ``len(next())``: the stress runner sizes its block pool and
    staging buffers with it before the first request."""

    @abstractmethod
    def next(self) -> list[BlockKey]:
        """The block keys of the next request (never empty, at most :attr:`max_blocks`).

        Raises :class:`IndexError` when :attr:`exhausted`; check that first.
        """

    @property
    def finite(self) -> bool:
        """Whether the stream ends (a trace without ``loop``); generated ones never do."""
        return False

    @property
    def exhausted(self) -> bool:
        """True once a :attr:`finite` workload has no request left."""
        return False

    def __iter__(self) -> Iterator[list[BlockKey]]:
        """Requests until :attr:`exhausted` (forever for generated workloads)."""
        while not self.exhausted:
            yield self.next()


def at_least(name: str, value: int, minimum: int = 1) -> int:
    """``value``, checked to be an integer of at least ``minimum``."""
    # Constructors are called from config (already validated) and from Python; the
    # latter deserves the same one-line refusal instead of an IndexError later on.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
