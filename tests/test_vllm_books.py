"""The channel between the connector's two sides (connectors/vllm/books.py): nobody
else gets in, nothing is unpickled, and no wait is unbounded.

A real books server on a real Unix socket, with a stand-in for the worker's books (its
``answer``), and real processes of another user (the tests run as root, as CI does).
"""

from __future__ import annotations

import os
import pickle
import socket
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvoffload.connectors.vllm.books import (
    BooksError,
    _address,
    _BooksServer,
    _key_path,
    _private_dir,
    _RemoteBooks,
)

NOBODY = 65534


class _Stub:
    """The worker's books: answers every question with 7, or with what ``answers``
    says; a lookup of request ``"stuck"`` waits until ``free`` is set."""

    def __init__(self) -> None:
        self.free = threading.Event()
        self.asked: list[tuple[str, Any]] = []

    def answer(self, op: str, arg: Any) -> int | None:
        self.asked.append((op, arg))
        if op == "lookup" and arg[0] == "stuck":
            self.free.wait(30)
            return 5
        if op == "sources":
            return len(arg)
        return 7


@pytest.fixture
def served() -> Iterator[tuple[str, _Stub, _BooksServer]]:
    engine_id = f"books-{uuid.uuid4().hex[:8]}"
    stub = _Stub()
    old = os.umask(0)  # the most permissive umask there is
    try:
        server = _BooksServer(SimpleNamespace(answer=stub.answer), engine_id, 0)  # type: ignore[arg-type]
    finally:
        os.umask(old)
    yield engine_id, stub, server
    stub.free.set()
    server.close()


def test_the_socket_and_its_key_are_private_under_umask_000(
    served: tuple[str, _Stub, _BooksServer],
) -> None:
    engine_id, _, _ = served
    for path, mode in (
        (_private_dir(), 0o700),
        (Path(_address(engine_id, 0)), 0o600),
        (_key_path(engine_id, 0), 0o600),
    ):
        info = os.lstat(path)
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (mode, os.getuid()), path
    assert len(_key_path(engine_id, 0).read_bytes()) == 32  # random, not the engine id


def test_another_user_can_neither_connect_nor_read_the_key(
    served: tuple[str, _Stub, _BooksServer],
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    engine_id, stub, _ = served
    key, address = _key_path(engine_id, 0), _address(engine_id, 0)  # root's paths
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user, trying both ways in
        errors = []
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                key.read_bytes()
            except PermissionError:
                errors.append("key")
            with socket.socket(socket.AF_UNIX) as sock:
                try:
                    sock.connect(address)
                except PermissionError:
                    errors.append("socket")
        finally:
            os.write(write, ",".join(errors).encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        seen = pipe.read().decode()
    os.waitpid(pid, 0)
    assert seen == "key,socket"
    assert stub.asked == []


class _Opens:
    """Unpickled, it would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_message_is_never_unpickled(
    served: tuple[str, _Stub, _BooksServer], tmp_path: Path
) -> None:
    """A pickle that would create a file when unpickled, sent with the right key: the
    server answers with an error, the file never appears, and it answers a real
    question next."""
    engine_id, stub, _ = served
    remote = _RemoteBooks(engine_id, 1)
    marker = tmp_path / "unpickled"
    try:
        (conn,) = remote.conns
        conn.send_bytes(pickle.dumps(_Opens(marker)))
        reply = conn.recv_bytes()
        assert b'"error"' in reply
        assert not marker.exists()
        assert remote.plan(1, "r", 0, 2) == 7
        assert stub.asked == [("plan", (1, "r", 0, 2))]
        with pytest.raises(BooksError, match="expected a request id"):
            remote._ask("release", 3)
    finally:
        conn.close()


def test_a_stuck_worker_costs_a_miss_and_its_late_answer_is_dropped(
    served: tuple[str, _Stub, _BooksServer],
) -> None:
    """The worker does not answer a lookup (stuck in a tier): after ``timeout_s`` the
    lookup is a miss, not a hung scheduler; the answer that comes later is not taken
    for the next question's."""
    engine_id, stub, _ = served
    remote = _RemoteBooks(engine_id, 1, timeout_s=0.2)
    try:
        assert remote.lookup("stuck", []) == 0
        assert remote.timeouts == 1
        stub.free.set()
        assert remote.sources("abc") == 3  # not the stuck lookup's 5
        assert remote.timeouts == 1
    finally:
        for conn in remote.conns:
            conn.close()
