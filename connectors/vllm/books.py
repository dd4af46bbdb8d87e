"""The books over a Unix socket: how a scheduler side in another process asks the
worker side what it holds.

In vLLM's default mode the worker runs in its own process (on the CPU build always:
its platform turns the ``uni`` executor into ``mp``), so the scheduler side cannot
call the worker's :class:`~.shared._Shared` directly. :class:`_BooksServer` (worker
side, one per engine and rank) answers its questions (``lookup``, ``plan``,
``release``, ``sources``, ``reset``), and :class:`_RemoteBooks` (scheduler side) asks
every rank and combines the answers. Microseconds per question against a step of
milliseconds, and the books stay where the bytes are. Kept apart from both halves
because it is their wire protocol: the server and the client must change together.

Nobody else gets in. The socket and its key live in a directory only this user may
enter (``$TMPDIR/kvoffload-<uid>``, mode 0700 whatever the umask, refused if another
user owns it or may write it); the key is 32 random bytes per engine and rank, in a
file of mode 0600, that the client proves it has (``multiprocessing.connection``'s
challenge, which exchanges raw bytes). Every message is a JSON object of a fixed
shape (:func:`_encode_question`), never unpickled.

No wait is unbounded. A question not answered within ``timeout_s`` costs a miss (a
lookup answers 0): a worker stuck in a tier never hangs the scheduler. Answers carry
the question's number, and late ones are dropped when they arrive.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Final, Protocol

from kvoffload.keys import BlockKey

MAX_MESSAGE: Final = 64 * 2**20
"""Largest message either side reads (a lookup of a million-token prompt is ~5 MB)."""

QUESTIONS: Final = ("lookup", "prefetch", "plan", "release", "sources", "reset")


def _private_dir() -> Path:
    """``$TMPDIR/kvoffload-<uid>``, made mode 0700 if new; ``PermissionError`` if it
    is not a directory this user owns and alone may enter."""
    path = Path(tempfile.gettempdir()) / f"kvoffload-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(
            f"{path}: not a directory of user {os.getuid()}; kvoffload keeps its books "
            "sockets there and will not use it: remove it"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # mkdir's mode is cut by the umask, and may be too open
    return path


def _address(engine_id: str, rank: int) -> str:
    return str(_private_dir() / f"{engine_id}-{rank}.sock")


def _key_path(engine_id: str, rank: int) -> Path:
    return _private_dir() / f"{engine_id}-{rank}.key"


def _new_key(engine_id: str, rank: int) -> bytes:
    """A fresh random key for this engine and rank, written mode 0600."""
    key = secrets.token_bytes(32)
    path = _key_path(engine_id, rank)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
    finally:
        os.close(fd)
    return key


def _encode_question(n: int, op: str, arg: Any) -> bytes:
    """A question as JSON: keys (bytes) as hex."""
    if op in ("lookup", "prefetch"):
        req_id, keys = arg
        arg = [req_id, [bytes(k).hex() for k in keys]]
    return json.dumps({"n": n, "op": op, "arg": arg}).encode()


def _number(data: bytes) -> int:
    """A question's number, for its answer even when the rest is malformed (-1 if it
    has none)."""
    try:
        msg = json.loads(data)
    except ValueError:
        return -1
    n = msg.get("n") if isinstance(msg, dict) else None
    return n if isinstance(n, int) else -1


def _decode_question(data: bytes) -> tuple[int, str, Any]:
    """The number, name and arguments of a question; ``ValueError`` for anything but
    one of :data:`QUESTIONS` with arguments of its types."""
    msg = json.loads(data)
    if not isinstance(msg, dict) or set(msg) != {"n", "op", "arg"}:
        raise ValueError("not a question")
    n, op, arg = msg["n"], msg["op"], msg["arg"]
    if not isinstance(n, int) or op not in QUESTIONS:
        raise ValueError(f"unknown question {op!r}")
    if op in ("lookup", "prefetch"):
        if not isinstance(arg, list) or len(arg) != 2:
            raise ValueError(f"{op}: expected a request id and hex keys")
        req_id, keys = arg
        if not isinstance(req_id, str) or not isinstance(keys, list):
            raise ValueError(f"{op}: expected a request id and hex keys")
        if not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{op}: expected a request id and hex keys")
        arg = (req_id, [BlockKey(bytes.fromhex(k)) for k in keys])
    elif op == "plan":
        if not (
            isinstance(arg, list)
            and len(arg) == 4
            and isinstance(arg[1], str)
            and all(isinstance(v, int) for v in (arg[0], arg[2], arg[3]))
        ):
            raise ValueError("plan: expected plan id, request id, start, count")
        arg = tuple(arg)
    elif op in ("release", "sources"):
        if not isinstance(arg, str):
            raise ValueError(f"{op}: expected a request id")
    elif arg is not None:
        raise ValueError("reset: expected no argument")
    return n, op, arg


class _Answers(Protocol):
    """What :class:`_BooksServer` serves: the worker side's answers
    (``.shared._Shared.answer``; named by its shape, so that this module does not
    import the one that imports it)."""

    def answer(self, op: str, arg: Any) -> Any: ...


class _BooksServer:
    """Answers a scheduler in another process (vLLM's default on its CPU build runs the
    worker in its own process): one Unix socket per engine and rank, one thread,
    questions (:func:`_decode_question`) answered in order, each with its number.
    Microseconds per call against a step of milliseconds, and the books stay where the
    bytes are."""

    def __init__(self, shared: _Answers, engine_id: str, rank: int) -> None:
        self.address = _address(engine_id, rank)
        self.key_path = _key_path(engine_id, rank)
        Path(self.address).unlink(missing_ok=True)
        key = _new_key(engine_id, rank)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=key)
        os.chmod(self.address, 0o600)
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
                        data = conn.recv_bytes(MAX_MESSAGE)
                    except (EOFError, OSError):
                        break
                    n = _number(data)
                    try:
                        n, op, arg = _decode_question(data)
                        reply: dict[str, Any] = {"n": n, "value": self.shared.answer(op, arg)}
                    except Exception as exc:  # the scheduler raises it
                        reply = {"n": n, "error": f"{type(exc).__name__}: {exc}"}
                    conn.send_bytes(json.dumps(reply).encode())

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
        self.key_path.unlink(missing_ok=True)
        self.thread.join(timeout=5)


class BooksError(RuntimeError):
    """A worker's books answered a question with an error."""


class _RemoteBooks:
    """The scheduler side's handle on the workers' books in other processes: one
    connection per rank. Each rank holds its own shard of every block, so a block is
    loadable only where every rank has it: the answers are the minimum over ranks (the
    questions go to all ranks before any answer is read). A rank that does not answer
    within ``timeout_s`` makes the answer 0 (a miss)."""

    def __init__(self, engine_id: str, ranks: int, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.conns: list[Connection] = [self._connect(engine_id, rank) for rank in range(ranks)]
        self.lock = threading.Lock()
        self._n = 0
        self.timeouts = 0
        """Questions some rank did not answer in time."""

    @staticmethod
    def _connect(engine_id: str, rank: int) -> Connection:
        address = _address(engine_id, rank)
        deadline = time.monotonic() + 60
        while True:
            try:
                key = _key_path(engine_id, rank).read_bytes()
                return Client(address, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionRefusedError):
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

    def _ask(self, op: str, arg: object) -> int | None:
        """Every rank's answer: ``None`` if any rank has not decided, else the least;
        0 if any rank did not answer in time."""
        with self.lock:
            self._n += 1
            n = self._n
            data = _encode_question(n, op, arg)
            for conn in self.conns:
                conn.send_bytes(data)
            deadline = time.monotonic() + self.timeout_s
            replies = [self._reply(conn, n, deadline) for conn in self.conns]
        if any(r is None for r in replies):
            self.timeouts += 1
            return 0
        answers: list[Any] = []
        for reply in replies:
            assert reply is not None
            if "error" in reply:
                raise BooksError(f"kvoffload books: {op}: {reply['error']}")
            answers.append(reply.get("value"))
        if any(a is None for a in answers):
            return None
        return min(int(a) for a in answers)

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        return self._ask("lookup", (req_id, keys))

    def prefetch(self, req_id: str, keys: list[BlockKey]) -> int:
        return self._ask("prefetch", (req_id, keys)) or 0

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        return self._ask("plan", [plan_id, req_id, start, n]) or 0

    def release(self, req_id: str) -> int:
        self._ask("release", req_id)
        return 0

    def sources(self, req_id: str) -> int:
        return self._ask("sources", req_id) or 0

    def reset(self) -> int:
        return self._ask("reset", None) or 0
