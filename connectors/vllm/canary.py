"""Readiness: a canary block stored, loaded and verified on every tier, off the step.

The operator endpoint's ``/ready`` (:mod:`.admin`) asks :class:`Canary` whether every
tier of this rank's Offloader can take a block and give it back intact, within
``admin_ready_timeout_ms``. A process that is alive but whose disk is full, whose Redis
server is dead or frozen, or whose slab is damaged would pass a liveness probe and
still serve nothing but misses; this is the check that sees it.

Per tier, one canary round (on a thread of its own, never the engine's or the HTTP
thread, so a frozen medium hangs only that thread):

1. the tier's books make room for one block under the canary's key
   (``prepare_store``): a free slot, or the least recent unpinned block evicted (the
   most a canary takes from real blocks: one slot, and only when the tier is full);
2. the backend writes a fresh pattern there, reads it back, and the bytes are
   compared (the backend's own checks, checksum, key and layout, run too);
3. the books forget the block as a failed store would (``complete_store(success=
   False)``: the slot is free again, no "stored" record, so no KV event), and a
   persistent tier's record is discarded (``discard``) so a restart never recovers
   it; a shared server's value is deleted.

The canary's key is :func:`canary_key`: a random token of this process under the
canary's namespace and the rank's layout fingerprint. No request's key is ever made
that way (theirs are vLLM's block hashes under the fingerprint), and no two
processes share it, so replicas probing one Redis server never read each other's
canaries. The round touches no counter: a probe is invisible in ``/tiers`` and the
Prometheus metrics, and never trips a breaker.

A round not done by the deadline is reported as ``timeout``; its thread finishes (or
stays stuck in the medium) on its own, and until it has, later probes of that tier
wait for it instead of starting another, so a frozen tier holds one thread, never a
growing pile. The books' lock is held for the bookkeeping steps only, never across
the I/O, as everywhere in the Offloader.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from kvoffload.keys import BlockKey, key_from_hash, namespaced
from kvoffload.offloader import Offloader
from kvoffload.tier import Tier

from .tierview import BooksView

logger = logging.getLogger(__name__)

CANARY_SPACE: Final = b"kvoffload-admin-canary"
"""The canary keys' namespace (:func:`canary_key`)."""


def canary_key(token: bytes, fingerprint: bytes) -> BlockKey:
    """The key of this process's canary on a rank: ``token`` (random per process) under
    the canary namespace and the rank's layout ``fingerprint``."""
    return namespaced(namespaced(key_from_hash(token), CANARY_SPACE), fingerprint)


@dataclass
class _Round:
    """One canary round on one tier, run by its own thread."""

    started: float
    """``time.monotonic()`` at its start."""
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    """Why it failed; ``None`` once done means it passed."""
    seconds: float = 0.0


class Canary:
    """Probes each tier of ``offloader`` with :func:`canary_key` (see the module
    docstring). ``fingerprint``: the rank's layout fingerprint."""

    def __init__(self, offloader: Offloader, fingerprint: bytes) -> None:
        self.offloader = offloader
        self.view = BooksView(offloader)
        self.key = canary_key(secrets.token_bytes(16), fingerprint)
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}  # tier index -> its latest round
        self._count = 0  # rounds started, for each round's own pattern

    def probe(self, timeout_s: float) -> list[dict[str, Any]]:
        """Run (or join) a round on every tier and wait up to ``timeout_s`` for all;
        per tier, in tier order: ``name``, ``ok`` and, when not ok, ``error``
        (``timeout: ...`` or what failed); ``seconds`` for a round that finished."""
        deadline = time.monotonic() + timeout_s
        rounds = [self._round(t) for t in range(len(self.offloader.tiers))]
        report: list[dict[str, Any]] = []
        for tier, (rnd, joined) in zip(self.offloader.tiers, rounds, strict=True):
            finished = rnd.done.wait(max(0.0, deadline - time.monotonic()))
            entry: dict[str, Any] = {"name": tier.name, "ok": finished and rnd.error is None}
            if not finished:
                since = time.monotonic() - rnd.started
                earlier = " (a round begun before this probe)" if joined else ""
                entry["error"] = (
                    f"timeout: the canary round{earlier} has not finished after {since:.1f} s "
                    f"(admin_ready_timeout_ms = {timeout_s * 1e3:.0f})"
                )
            elif rnd.error is not None:
                entry["error"] = rnd.error
            if finished:
                entry["seconds"] = round(rnd.seconds, 6)
            report.append(entry)
        return report

    def _round(self, t: int) -> tuple[_Round, bool]:
        """Tier ``t``'s round for this probe: the one still running (joined: ``True``),
        else a new one, started now."""
        with self._lock:
            running = self._rounds.get(t)
            if running is not None and not running.done.is_set():
                return running, True
            self._count += 1
            rnd = self._rounds[t] = _Round(time.monotonic())
            count = self._count
        tier = self.offloader.tiers[t]
        threading.Thread(
            target=self._run,
            args=(t, tier, rnd, count),
            name=f"kvoffload-canary-{tier.name}",
            daemon=True,
        ).start()
        return rnd, False

    def _run(self, t: int, tier: Tier, rnd: _Round, count: int) -> None:
        try:
            rnd.error = self._store_load_verify(t, tier, count)
        except Exception as exc:  # the boundary: a probe reports, never raises
            logger.debug("kvoffload: canary on tier %s failed", tier.name, exc_info=True)
            rnd.error = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            rnd.seconds = time.monotonic() - rnd.started
            rnd.done.set()

    def _store_load_verify(self, t: int, tier: Tier, count: int) -> str | None:
        """One round on tier ``t`` (see the module docstring); why it failed, or
        ``None``."""
        bpb = self.offloader.bpb
        gen = torch.Generator().manual_seed(count)
        # A fresh random kilobyte, then zeros: a packed tier stores it in one page, so
        # the room any store makes holds it, however its free pages are split (a raw,
        # full-size block could find no run of pages long enough: a false alarm).
        row = torch.zeros((1, bpb), dtype=torch.uint8)
        head = min(bpb, 1024)
        row[0, :head] = torch.randint(0, 256, (head,), dtype=torch.uint8, generator=gen)
        slots = self.view.take_slot(t, self.key)
        if slots is None:
            return "error: no room for a canary block (every block of the tier is pinned)"
        try:
            sizes = tier.backend.write(slots, [self.key], row)
            if sizes is not None and not sizes[0]:  # a packed tier's pages in pieces
                return "error: no room for a canary block (the tier's free pages are in pieces)"
            back = torch.empty_like(row)
            valid = tier.backend.read(slots, [self.key], back)
            if not valid[0]:
                return "error: the block read back failed the tier's checks"
            if not torch.equal(back, row):
                return "error: the block read back differs from the block written"
            return None
        finally:
            self.view.give_back_slot(t, self.key, slots)
            if tier.backend.server_booked:
                self._delete(tier)

    def _delete(self, tier: Tier) -> None:
        """Remove the canary's value from a shared server (its books free no slot
        there); left for the server's eviction if the server cannot take it now."""
        delete = getattr(tier.backend, "delete", None)
        if not callable(delete):
            return
        try:
            delete([self.key])
        except Exception:  # the server failed the round already, or will next time
            logger.debug("kvoffload: canary value left on tier %s", tier.name, exc_info=True)
