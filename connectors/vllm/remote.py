"""The books over a Unix socket: how a scheduler side in another process asks the
worker side what it holds.

In vLLM's default mode the worker runs in its own process (on the CPU build always:
its platform turns the ``uni`` executor into ``mp``), so the scheduler side cannot
call the worker's :class:`~.shared.Shared` directly. :class:`BooksServer` (worker
side, one per engine and rank) answers its questions (``lookup``, ``plan``,
``release``, ``sources``, ``reset``), and :class:`RemoteBooks` (scheduler side) asks
every rank and combines the answers. Microseconds per question against a step of
milliseconds, and the books stay where the bytes are. Kept apart from both halves
because it is their protocol: the server and the client must change together. Who
may connect and what a message looks like is the wire's (:mod:`.channel`).

No wait is unbounded. A question not answered within ``timeout_s`` costs a miss (a
lookup answers 0): a worker stuck in a tier never hangs the scheduler. Answers carry
the question's number, and late ones are dropped when they arrive. A lookup across
ranks ends when its slowest rank has decided (:class:`RemoteBooks`). A client that
does not answer the key challenge in time is dropped, and a message the server cannot
read costs its sender an error answer or its connection, never the server its thread.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
)
from pathlib import Path
from typing import Any, Protocol

from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey

from .channel import (
    CHALLENGE_TIMEOUT_S,
    MAX_MESSAGE,
    decode_question,
    encode_question,
    key_file,
    new_key,
    question_number,
    refuse_if_served,
    set_timeout,
    socket_address,
    taken_message,
)

logger = logging.getLogger(__name__)


class _Answers(Protocol):
    """What :class:`BooksServer` serves: the worker side's answers
    (``.shared.Shared.answer``; named by its shape, so that this module does not
    import the one that imports it)."""

    def answer(self, op: str, arg: Any) -> Any: ...


class BooksServer:
    """Answers a scheduler in another process (vLLM's default on its CPU build runs the
    worker in its own process): one Unix socket per engine and rank, one thread,
    questions (:func:`decode_question`) answered in order, each with its number.
    Microseconds per call against a step of milliseconds, and the books stay where the
    bytes are. One connection is served at a time (there is one scheduler); what a
    client sends can cost it its connection, never the thread."""

    challenge_timeout_s: float = CHALLENGE_TIMEOUT_S

    def __init__(self, shared: _Answers, engine_id: str, rank: int) -> None:
        self.address = socket_address(engine_id, rank)
        self.key_path = key_file(engine_id, rank)
        refuse_if_served(self.address, engine_id, rank)
        # A stale socket and key (their server is gone): the key file is written only
        # once the new socket listens, so a client never reads an old key for it.
        Path(self.address).unlink(missing_ok=True)
        self.key_path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.address)
        except OSError as exc:  # another server bound it since the check
            self._sock.close()
            raise ConfigError(taken_message(engine_id, rank, self.address)) from exc
        os.chmod(self.address, 0o600)
        self._sock.listen(8)
        self._key = new_key(engine_id, rank)
        self.shared = shared
        self._stopping = threading.Event()
        self._conn: Connection | None = None  # the connection being served
        self.thread = threading.Thread(target=self._serve, name="kvoffload-books", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                logger.warning("kvoffload books %s: accept failed: %s", self.address, exc)
                time.sleep(0.1)  # out of descriptors, say: not a busy loop
                continue
            conn = self._conn = Connection(sock.detach())
            try:
                with conn:
                    if self._challenge(conn):
                        self._answer_all(conn)
            except Exception:  # a bug of ours: that connection goes, the server stays
                logger.exception("kvoffload books %s: connection dropped", self.address)
            finally:
                self._conn = None

    def _challenge(self, conn: Connection) -> bool:
        """Whether the client proves it has the key within ``challenge_timeout_s``
        (a receive and send timeout on the socket, lifted once it has)."""
        try:
            set_timeout(conn, self.challenge_timeout_s)
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            set_timeout(conn, 0.0)
        except (AuthenticationError, EOFError, OSError) as exc:
            logger.debug("kvoffload books %s: client refused: %r", self.address, exc)
            return False
        return True

    def _answer_all(self, conn: Connection) -> None:
        """Answer ``conn``'s questions until it closes; a message too long for
        :data:`MAX_MESSAGE` ends it (its bytes would have to be read to go on)."""
        while not self._stopping.is_set():
            try:
                data = conn.recv_bytes(MAX_MESSAGE)
                conn.send_bytes(self._reply(data))
            except (EOFError, OSError):
                return  # closed by the client, or by close()

    def _reply(self, data: bytes) -> bytes:
        """The answer to one message: its value, or an error for anything malformed
        or failing (the scheduler raises it)."""
        n = question_number(data)
        try:
            n, op, arg = decode_question(data)
            return json.dumps({"n": n, "value": self.shared.answer(op, arg)}).encode()
        except Exception as exc:
            return json.dumps({"n": n, "error": f"{type(exc).__name__}: {exc}"}).encode()

    def close(self) -> None:
        """Stop the thread. Closing a socket does not wake a thread blocked in
        ``accept`` or ``recv`` on it (Linux), and a thread left blocked would keep the
        closed Offloader, and through it the engine's KV cache, alive: shut the sockets
        down first, which wakes both."""
        self._stopping.set()
        for sock in (self._sock, self._conn):
            try:
                with socket.socket(fileno=os.dup(sock.fileno())) as dup:  # type: ignore[union-attr]
                    dup.shutdown(socket.SHUT_RDWR)
            except (AttributeError, OSError):
                pass  # none, already closed or never connected
        self._sock.close()
        Path(self.address).unlink(missing_ok=True)
        self.key_path.unlink(missing_ok=True)
        self.thread.join(timeout=5)


class BooksError(RuntimeError):
    """A worker's books answered a question with an error."""


@dataclass
class _Lookup:
    """One request's lookup while some rank has not decided it."""

    keys: list[BlockKey]
    decided: dict[int, int] = field(default_factory=dict)
    """By rank, the answers already given (each rank holds its claim meanwhile)."""


class RemoteBooks:
    """The scheduler side's handle on the workers' books in other processes: one
    connection per rank. Each rank holds its own shard of every block, so a block is
    loadable only where every rank has it: the answers are the minimum over ranks (the
    questions go to all ranks before any answer is read). A rank that does not answer
    within ``timeout_s`` makes the answer 0 (a miss).

    A lookup is decided once every rank has decided it. A rank's decided answer is
    kept until then, and only the undecided ranks are asked again: asking every rank
    each time would start over whenever one rank is slow, and ranks slow in turn would
    keep a request waiting forever. So the lookup takes as long as its slowest rank,
    which its own books bound (``books_timeout_ms`` for a lookup hanging in a tier, a
    claim's bounded prefetch rounds). One rank's 0 decides it at once. A rank keeps
    the claim of its kept answer pinned until the scheduler's ``plan`` or
    ``release``, which go to every rank as before."""

    def __init__(self, engine_id: str, ranks: int, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.conns: list[Connection] = [self._connect(engine_id, rank) for rank in range(ranks)]
        self.lock = threading.RLock()
        self._n = 0
        self._lookups: dict[str, _Lookup] = {}
        self.timeouts = 0
        """Questions some rank did not answer in time."""

    @staticmethod
    def _connect(engine_id: str, rank: int) -> Connection:
        """A connection to the rank's server, once it is up (60 s at most). A failed
        challenge is tried again: the key read may be a server's that just stopped,
        or the server dropped this client as too slow (:data:`CHALLENGE_TIMEOUT_S`)."""
        address = socket_address(engine_id, rank)
        deadline = time.monotonic() + 60
        while True:
            try:
                key = key_file(engine_id, rank).read_bytes()
                return Client(address, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionError, EOFError, AuthenticationError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"TieredOffloadConnector: no worker-side books at {address} after "
                        "60 s; is the worker of this rank running with this connector?"
                    ) from None
                time.sleep(0.05)

    def _reply(self, conn: Connection, n: int, deadline: float) -> dict[str, Any] | None:
        """The answer to question ``n`` on ``conn``, dropping older ones; ``None`` if
        it has not come by ``deadline``."""
        while conn.poll(max(0.0, deadline - time.monotonic())):
            reply = json.loads(conn.recv_bytes(MAX_MESSAGE))
            if not isinstance(reply, dict) or not isinstance(reply.get("n"), int):
                raise BooksError(f"kvoffload books: a malformed answer {reply!r}")
            if reply["n"] == n:
                return reply
        return None

    def _values(self, op: str, arg: object, ranks: list[int]) -> list[Any] | None:
        """The answers of ``ranks``, ``None`` if any did not answer in time."""
        with self.lock:
            self._n += 1
            n = self._n
            data = encode_question(n, op, arg)
            for rank in ranks:
                self.conns[rank].send_bytes(data)
            deadline = time.monotonic() + self.timeout_s
            replies = [self._reply(self.conns[rank], n, deadline) for rank in ranks]
        if any(r is None for r in replies):
            self.timeouts += 1
            return None
        values: list[Any] = []
        for reply in replies:
            assert reply is not None
            if "error" in reply:
                raise BooksError(f"kvoffload books: {op}: {reply['error']}")
            values.append(reply.get("value"))
        return values

    def _ask(self, op: str, arg: object) -> int | None:
        """Every rank's answer: ``None`` if any rank has not decided, else the least;
        0 if any rank did not answer in time."""
        values = self._values(op, arg, list(range(len(self.conns))))
        if values is None:
            return 0
        if any(v is None for v in values):
            return None
        return min(int(v) for v in values)

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        """The least hit over ranks, once every rank has decided (see the class)."""
        with self.lock:
            asked = self._lookups.get(req_id)
            if asked is None or asked.keys != keys:  # other keys: every rank anew
                asked = self._lookups[req_id] = _Lookup(list(keys))
            ranks = [r for r in range(len(self.conns)) if r not in asked.decided]
            try:
                values = self._values("lookup", (req_id, keys), ranks)
            except BaseException:
                del self._lookups[req_id]
                raise
            if values is None:  # a rank did not answer in time: a miss
                del self._lookups[req_id]
                return 0
            for rank, value in zip(ranks, values, strict=True):
                if value is not None:
                    asked.decided[rank] = int(value)
            hits = asked.decided.values()
            if len(hits) < len(self.conns) and 0 not in hits:
                return None
            del self._lookups[req_id]
            return min(hits)

    def _forget(self, req_id: str) -> None:
        with self.lock:
            self._lookups.pop(req_id, None)

    def prefetch(self, req_id: str, keys: list[BlockKey]) -> int:
        return self._ask("prefetch", (req_id, keys)) or 0

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        self._forget(req_id)
        return self._ask("plan", [plan_id, req_id, start, n]) or 0

    def release(self, req_id: str) -> int:
        self._forget(req_id)
        self._ask("release", req_id)
        return 0

    def sources(self, req_id: str) -> int:
        return self._ask("sources", req_id) or 0

    def reset(self) -> int:
        return self._ask("reset", None) or 0


# The names these had before (tests import them).
