"""The books channel's wire: where its socket and key live, who may use them, and the
shape of a message. Both ends (:mod:`.remote`: the worker's server, the scheduler's
client) speak it, so they change together.

Nobody else gets in. The socket and its key live in a directory only this user may
enter (``$TMPDIR/kvoffload-<uid>``, mode 0700 whatever the umask, refused if another
user owns it or may write it); the key is 32 random bytes per engine and rank, in a
file of mode 0600, that the client proves it has (``multiprocessing.connection``'s
challenge, which exchanges raw bytes) within :data:`CHALLENGE_TIMEOUT_S`. Every
message is a JSON object of a fixed shape (:func:`encode_question`), never
unpickled, and one that does not parse (malformed, or nested past the recursion
limit) has no number and is answered with an error.

One engine id, one server per rank: the socket's path is the engine id's, so a
second engine given the same id is refused at start (:func:`refuse_if_served`)
rather than taking over the first one's socket and key, which would leave the first
engine's scheduler asking the wrong worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import struct
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey

MAX_MESSAGE: Final = 64 * 2**20
"""Largest message either side reads (a lookup of a million-token prompt is ~5 MB)."""

QUESTIONS: Final = ("lookup", "prefetch", "plan", "release", "sources", "reset")

CHALLENGE_TIMEOUT_S: Final = 1.0
"""Longest the server waits on a new client's key challenge. A real client answers at
once (one HMAC, in the call that connects); the server has one thread, and a client
that connects and says nothing must not hold it. One dropped by mistake (a scheduler
descheduled for a second) connects again (:meth:`.remote.RemoteBooks._connect`)."""


def private_dir() -> Path:
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


def socket_address(engine_id: str, rank: int) -> str:
    return str(private_dir() / f"{engine_id}-{rank}.sock")


def key_file(engine_id: str, rank: int) -> Path:
    return private_dir() / f"{engine_id}-{rank}.key"


def new_key(engine_id: str, rank: int) -> bytes:
    """A fresh random key for this engine and rank, written mode 0600."""
    key = secrets.token_bytes(32)
    path = key_file(engine_id, rank)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key)
    finally:
        os.close(fd)
    return key


def encode_question(n: int, op: str, arg: Any) -> bytes:
    """A question as JSON: keys (bytes) as hex."""
    if op in ("lookup", "prefetch"):
        req_id, keys = arg
        arg = [req_id, [bytes(k).hex() for k in keys]]
    return json.dumps({"n": n, "op": op, "arg": arg}).encode()


def question_number(data: bytes) -> int:
    """A question's number, for its answer even when the rest is malformed (-1 if it
    has none). JSON nested past the recursion limit raises ``RecursionError``, not
    ``ValueError``: anything that fails to parse has no number."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return -1
    n = msg.get("n") if isinstance(msg, dict) else None
    return n if isinstance(n, int) else -1


def decode_question(data: bytes) -> tuple[int, str, Any]:
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


def set_timeout(conn: Connection, seconds: float) -> None:
    """A receive and send timeout on ``conn``'s socket (0: none). ``Connection``
    reads and writes the descriptor directly, so a Python socket timeout (which makes
    it non-blocking) would not do: the kernel's ``SO_RCVTIMEO`` makes a blocked read
    fail with ``EAGAIN`` after ``seconds`` instead."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def taken_message(engine_id: str, rank: int, address: str) -> str:
    return (
        f"kvoffload: engine id {engine_id!r} rank {rank}: another engine's books server "
        f"already listens at {address}; give each engine a unique `engine_id` in vLLM's "
        "kv_transfer_config"
    )


def refuse_if_served(address: str, engine_id: str, rank: int) -> None:
    """``ConfigError`` if a live server listens at ``address``. A socket file nobody
    listens on (its process died) refuses the connection and may be replaced; a
    listener that does not take the connection at once (its backlog full) is alive.
    A check, not a lock: it catches an engine started with another's id, not two
    started within the same millisecond."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            return
        except OSError:
            pass
    raise ConfigError(taken_message(engine_id, rank, address))


# The names these had before (tests import them).
