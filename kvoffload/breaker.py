"""The books' circuit breakers: one per tier, fed by the outcome of its reads and writes.

A lower tier whose medium keeps failing (a dead disk, an unreachable server) would
otherwise cost every lookup, load and copy its error or its timeout. The breaker
counts failures in a row and, past ``breaker_errors``, bypasses the tier for
``breaker_backoff_ms``: lookups skip it, stores into it are dropped (counted). Kept
apart from :mod:`kvoffload.books` because it is a role of its own, with its own
clock; the books own it and call it under their lock only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvoffload.config import TierConfig
from kvoffload.plans import TierStats

logger = logging.getLogger(__name__)


class Breakers:
    """Every tier's circuit breaker (call under the books' lock). The first tier is
    never bypassed: it is the engine's own memory."""

    def __init__(self, configs: Sequence[TierConfig], stats: Sequence[TierStats]) -> None:
        self.configs = configs
        self.stats = stats
        # Failed reads or writes in a row, and until when (time.monotonic) the tier is
        # bypassed after they reached breaker_errors.
        self._failures = [0] * len(configs)
        self._bypass_until = [0.0] * len(configs)

    def bypassed(self, t: int) -> bool:
        """Whether tier ``t``'s breaker is open now."""
        return t > 0 and time.monotonic() < self._bypass_until[t]

    def health(self, t: int, ok: bool) -> None:
        """A read or write of tier ``t`` succeeded or failed (an I/O error, not a block
        found invalid): feeds the tier's circuit breaker. Enough failures in a row
        (``breaker_errors``) bypass the tier for ``breaker_backoff_ms``; when that has
        passed, the next operation is the probe: a success closes the breaker, a
        failure trips it again at once (the count is still over the limit)."""
        if ok:
            self._failures[t] = 0
            self.stats[t].breaker_open = 0
            return
        self._failures[t] += 1
        cfg = self.configs[t]
        now = time.monotonic()
        tripped = cfg.breaker_errors and self._failures[t] >= cfg.breaker_errors
        if tripped:  # open, or probed and failed again: open until a success
            self.stats[t].breaker_open = 1
        if tripped and now >= self._bypass_until[t]:
            self._bypass_until[t] = now + cfg.breaker_backoff_ms / 1e3
            self.stats[t].breaker_trips += 1
            logger.warning(
                "tier %s: %d failed reads or writes in a row; bypassing it for %.1f s",
                cfg.name,
                self._failures[t],
                cfg.breaker_backoff_ms / 1e3,
            )
