"""The books over a Unix socket: how a scheduler side in another process asks the
worker side what it holds.

In vLLM's default mode the worker runs in its own process (on the CPU build always:
its platform turns the ``uni`` executor into ``mp``), so the scheduler side cannot
call the worker's :class:`~.shared._Shared` directly. :class:`_BooksServer` (worker
side, one per engine and rank) answers its three questions, ``lookup``, ``plan`` and
``release``, and :class:`_RemoteBooks` (scheduler side) asks every rank and combines
the answers. Microseconds per question against a step of milliseconds, and the books
stay where the bytes are. Kept apart from both halves because it is their wire
protocol: the server and the client must change together.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.keys import BlockKey

if TYPE_CHECKING:
    from .shared import _Shared


def _address(engine_id: str, rank: int) -> str:
    return str(Path(tempfile.gettempdir()) / f"kvoffload-{engine_id}-{rank}.sock")


def _authkey(engine_id: str) -> bytes:
    return hashlib.blake2b(engine_id.encode(), digest_size=16, person=b"kvoffload").digest()


class _BooksServer:
    """Answers a scheduler in another process (vLLM's default on its CPU build runs the
    worker in its own process): one Unix socket per engine and rank, one thread,
    requests ``("lookup", (req_id, keys))``, ``("plan", (plan_id, req_id, start, n))``,
    ``("release", req_id)``, ``("sources", req_id)`` and ``("reset", None)`` answered
    in order.
    Microseconds per call against a step of milliseconds, and the books stay where the
    bytes are."""

    def __init__(self, shared: _Shared, engine_id: str, rank: int) -> None:
        self.address = _address(engine_id, rank)
        Path(self.address).unlink(missing_ok=True)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=_authkey(engine_id))
        self.shared = shared
        self._closed = False
        self._conn: Any = None  # the scheduler's connection being served
        self.thread = threading.Thread(target=self._serve, name="kvoffload-books", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # closed
            self._conn = conn
            with conn:
                while True:
                    try:
                        op, arg = conn.recv()
                    except (EOFError, OSError):
                        break
                    try:
                        answer: object = self.shared.answer(op, arg)
                    except Exception as exc:  # the scheduler re-raises it
                        answer = exc
                    conn.send(answer)

    def close(self) -> None:
        """Stop the thread. Closing a socket does not wake a thread blocked in
        ``accept`` or ``recv`` on it (Linux), and a thread left blocked would keep the
        closed Offloader, and through it the engine's KV cache, alive: shut the sockets
        down first, which wakes both."""
        self._closed = True
        socks = [getattr(getattr(self.listener, "_listener", None), "_socket", None)]
        if self._conn is not None and not self._conn.closed:
            socks.append(self._conn)
        for sock in socks:
            if sock is None:
                continue
            try:
                with socket.socket(fileno=os.dup(sock.fileno())) as dup:
                    dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed or never connected
        self.listener.close()
        Path(self.address).unlink(missing_ok=True)
        self.thread.join(timeout=5)


class _RemoteBooks:
    """The scheduler side's handle on the workers' books in other processes: one
    connection per rank. Each rank holds its own shard of every block, so a block is
    loadable only where every rank has it: the answers are the minimum over ranks (the
    questions go to all ranks before any answer is read)."""

    def __init__(self, engine_id: str, ranks: int) -> None:
        self.conns = [self._connect(engine_id, rank) for rank in range(ranks)]
        self.lock = threading.Lock()

    @staticmethod
    def _connect(engine_id: str, rank: int) -> Any:
        address = _address(engine_id, rank)
        deadline = time.monotonic() + 60
        while True:
            try:
                return Client(address, family="AF_UNIX", authkey=_authkey(engine_id))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"TieredOffloadConnector: no worker-side books at {address} after "
                        "60 s; is the worker of this rank running with this connector?"
                    ) from None
                time.sleep(0.05)

    def _ask(self, op: str, arg: object) -> int | None:
        """Every rank's answer: ``None`` if any rank has not decided, else the least."""
        with self.lock:
            for conn in self.conns:
                conn.send((op, arg))
            answers = [conn.recv() for conn in self.conns]
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        if any(a is None for a in answers):
            return None
        return min(int(a) for a in answers)

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        return self._ask("lookup", (req_id, keys))

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        return self._ask("plan", (plan_id, req_id, start, n)) or 0

    def release(self, req_id: str) -> int:
        self._ask("release", req_id)
        return 0

    def sources(self, req_id: str) -> int:
        return self._ask("sources", req_id) or 0

    def reset(self) -> int:
        return self._ask("reset", None) or 0
