"""The next orders' bytes: cutting a settled job's buffers for the copies that follow it.

A job's outcome may hand on staging buffers (the bytes a write just wrote, the blocks
it displaced, what a load read from below); the books' next orders name which of them
their bytes come from (:attr:`Copy.source <kvoffload.plans.Copy.source>`) and which
rows (``write.rows``). :class:`Staging` gives each order its rows, taking a buffer
over whole where the rows are its own leading ones, and releases what nobody took.
Kept apart from the job bodies (:mod:`kvoffload.jobs`): it is buffer ownership
between jobs, not a job.
"""

from __future__ import annotations

from typing import Any

import torch

from kvoffload.hostcopy import Buffers
from kvoffload.plans import Copy, Write


class Staging:
    """Hands the buffers of settled outcomes on to the next orders (see the module
    docstring), acquiring and releasing through ``buffers``."""

    def __init__(self, buffers: Buffers) -> None:
        self.buffers = buffers

    def stage(self, orders: list[Copy], sources: dict[str, Any]) -> None:
        """Give each order whose bytes are in one of an outcome's buffers (``sources``,
        by :attr:`Copy.source`: ``written``, ``demoted``, ``loaded``) its rows of it, as
        ``write.buf``; release the buffers no order took over. This call owns the
        buffers in ``sources``; each order's ``buf`` is then the order's (released by
        its write, or by :meth:`release` if it never runs)."""
        left = dict(sources)
        for order in orders:
            w = order.write
            src = left.get(order.source)
            if src is None or not w.keys:
                continue
            assert w.rows is not None
            w.buf = self.cut(src, w.rows, keep=True)
            if w.buf.data_ptr() == src.data_ptr():
                left[order.source] = None  # taken over by the order
        for buf in left.values():
            if buf is not None:
                self.buffers.release(buf)

    def release(self, w: Write) -> None:
        """Release the buffer of an order that will not run."""
        if w.buf is not None:
            self.buffers.release(w.buf)
            w.buf = None

    def cut(self, buf: torch.Tensor, rows: list[int], *, keep: bool) -> torch.Tensor:
        """``buf``'s ``rows``, in that order: ``buf``'s own leading rows when they are
        (``keep``: the order takes ``buf`` over), else a copy (``buf`` stays with the
        caller, who releases it)."""
        if keep and rows == list(range(len(rows))):
            return buf[: len(rows)]
        sub = self.buffers.acquire(len(rows))
        torch.index_select(buf, 0, torch.tensor(rows, dtype=torch.int64), out=sub)
        return sub
