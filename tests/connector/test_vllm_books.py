"""The channel between the connector's two sides (connectors/vllm/remote.py and its
wire, channel.py): nobody else gets in, nothing is unpickled, no wait is unbounded,
and nothing a client sends stops the server.

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
from kvoffload.connectors.vllm.channel import key_file, private_dir, socket_address
from kvoffload.connectors.vllm.remote import BooksError, BooksServer, RemoteBooks

from kvoffload.exceptions import ConfigError

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
def served() -> Iterator[tuple[str, _Stub, BooksServer]]:
    engine_id = f"books-{uuid.uuid4().hex[:8]}"
    stub = _Stub()
    old = os.umask(0)  # the most permissive umask there is
    try:
        server = BooksServer(SimpleNamespace(answer=stub.answer), engine_id, 0)  # type: ignore[arg-type]
    finally:
        os.umask(old)
    yield engine_id, stub, server
    stub.free.set()
    server.close()


def test_the_socket_and_its_key_are_private_under_umask_000(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    engine_id, _, _ = served
    for path, mode in (
        (private_dir(), 0o700),
        (Path(socket_address(engine_id, 0)), 0o600),
        (key_file(engine_id, 0), 0o600),
    ):
        info = os.lstat(path)
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (mode, os.getuid()), path
    assert len(key_file(engine_id, 0).read_bytes()) == 32  # random, not the engine id


def test_another_user_can_neither_connect_nor_read_the_key(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    engine_id, stub, _ = served
    key, address = key_file(engine_id, 0), socket_address(engine_id, 0)  # root's paths
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
    served: tuple[str, _Stub, BooksServer], tmp_path: Path
) -> None:
    """A pickle that would create a file when unpickled, sent with the right key: the
    server answers with an error, the file never appears, and it answers a real
    question next."""
    engine_id, stub, _ = served
    remote = RemoteBooks(engine_id, 1)
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
    served: tuple[str, _Stub, BooksServer],
) -> None:
    """The worker does not answer a lookup (stuck in a tier): after ``timeout_s`` the
    lookup is a miss, not a hung scheduler; the answer that comes later is not taken
    for the next question's."""
    engine_id, stub, _ = served
    remote = RemoteBooks(engine_id, 1, timeout_s=0.2)
    try:
        assert remote.lookup("stuck", []) == 0
        assert remote.timeouts == 1
        stub.free.set()
        assert remote.sources("abc") == 3  # not the stuck lookup's 5
        assert remote.timeouts == 1
    finally:
        for conn in remote.conns:
            conn.close()


class _Turns(_Stub):
    """Rank ``rank`` of a TP group whose lookups are slow in turn: its ``k``-th lookup
    is undecided (``None``) when ``k + rank`` is even, else it answers ``hit``. Two
    ranks together: on every ask exactly one of them has not decided."""

    def __init__(self, rank: int, hit: int) -> None:
        super().__init__()
        self.rank, self.hit, self.lookups = rank, hit, 0

    def answer(self, op: str, arg: Any) -> int | None:
        self.asked.append((op, arg))
        if op != "lookup":
            return 7
        k, self.lookups = self.lookups, self.lookups + 1
        if self.hit < 0 or (k + self.rank) % 2 == 0:
            return None  # a hit < 0: never decides
        return self.hit


@pytest.fixture
def two_ranks() -> Iterator[tuple[str, list[_Turns], RemoteBooks]]:
    """Two ranks of one engine, each on its own real server; rank 0 would hit 4
    blocks, rank 1 6."""
    engine_id = f"books-{uuid.uuid4().hex[:8]}"
    stubs = [_Turns(0, 4), _Turns(1, 6)]
    servers = [
        BooksServer(SimpleNamespace(answer=stub.answer), engine_id, rank)  # type: ignore[arg-type]
        for rank, stub in enumerate(stubs)
    ]
    remote = RemoteBooks(engine_id, 2, timeout_s=30)
    yield engine_id, stubs, remote
    for conn in remote.conns:
        conn.close()
    for server in servers:
        server.close()


def _ops(stub: _Stub, op: str) -> list[Any]:
    return [arg for name, arg in stub.asked if name == op]


def test_ranks_slow_in_turn_still_decide(
    two_ranks: tuple[str, list[_Turns], RemoteBooks],
) -> None:
    """Rank 0 is undecided on this ask, rank 1 on the next, and so on: a decided
    rank's answer is kept until every rank has decided, so the lookup ends (the least
    of the two), instead of starting over at every step."""
    _, stubs, remote = two_ranks
    answers = [remote.lookup("r", [])]
    while answers[-1] is None and len(answers) < 10:
        answers.append(remote.lookup("r", []))
    assert answers == [None, 4]
    assert len(_ops(stubs[1], "lookup")) == 1  # its kept answer (and pin) stood
    # Decided: the next lookup of the request asks every rank again.
    remote.lookup("r", [])
    assert [len(_ops(s, "lookup")) for s in stubs] == [3, 2]


def test_a_kept_answer_is_released_on_every_rank(
    two_ranks: tuple[str, list[_Turns], RemoteBooks],
) -> None:
    """A rank's decided answer is kept (its claim pinned) while the other decides;
    the request ends meanwhile: its release reaches every rank, and a plan too."""
    _, stubs, remote = two_ranks
    assert remote.lookup("r", []) is None  # rank 1 decided, rank 0 not
    remote.release("r")
    assert [_ops(s, "release") for s in stubs] == [["r"], ["r"]]
    assert remote.lookup("r", []) is None  # started over: both ranks asked
    assert [len(_ops(s, "lookup")) for s in stubs] == [2, 2]
    remote.plan(3, "r", 0, 4)
    assert [_ops(s, "plan") for s in stubs] == [[(3, "r", 0, 4)]] * 2


def test_a_rank_that_misses_decides_the_lookup(
    two_ranks: tuple[str, list[_Turns], RemoteBooks],
) -> None:
    """A block is loadable only where every rank holds it: one rank's 0 is the
    answer, whatever the undecided ranks will say."""
    _, stubs, remote = two_ranks
    stubs[0].hit, stubs[1].hit = -1, 0  # rank 0 never decides, rank 1 misses
    assert remote.lookup("r", []) == 0
    remote.release("r")
    assert [_ops(s, "release") for s in stubs] == [["r"], ["r"]]


def test_deeply_nested_json_is_an_error_and_the_server_goes_on(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    """JSON nested past the interpreter's recursion limit (``RecursionError``, not a
    ``ValueError``), sent with the right key: answered with an error, and the same
    connection, then a new one, are still served."""
    engine_id, _, _ = served
    remote = RemoteBooks(engine_id, 1, timeout_s=10)
    try:
        (conn,) = remote.conns
        for nested in (b"[" * 100_000 + b"]" * 100_000, b'{"n":' * 100_000 + b"1" + b"}" * 100_000):
            conn.send_bytes(nested)
            assert conn.poll(10), "no answer: the books thread died"
            assert b'"error"' in conn.recv_bytes()
        assert remote.plan(1, "r", 0, 2) == 7
    finally:
        conn.close()
    again = RemoteBooks(engine_id, 1, timeout_s=10)
    try:
        assert again.sources("abc") == 3
    finally:
        again.conns[0].close()


def test_an_oversized_message_drops_only_its_connection(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    engine_id, _, _ = served
    remote = RemoteBooks(engine_id, 1, timeout_s=10)
    (conn,) = remote.conns
    with conn:
        conn._send(b"\x7f\xff\xff\xff")  # type: ignore[attr-defined]  # a 2 GiB length, no body
        assert conn.poll(10)
        with pytest.raises(EOFError):
            conn.recv_bytes()
    again = RemoteBooks(engine_id, 1, timeout_s=10)
    try:
        assert again.sources("ab") == 2
    finally:
        again.conns[0].close()


def test_a_silent_client_does_not_block_the_next(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    """A client that connects and never answers the key challenge is dropped after
    ``challenge_timeout_s`` (0.2 s here); the scheduler connecting after it is served
    (bound: 10 s)."""
    engine_id, _, server = served
    server.challenge_timeout_s = 0.2
    answers: list[int] = []

    def ask() -> None:
        remote = RemoteBooks(engine_id, 1, timeout_s=10)
        try:
            answers.append(remote.sources("abcd"))
        finally:
            remote.conns[0].close()

    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(socket_address(engine_id, 0))
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(10)
        assert answers == [4]


def test_a_second_server_with_the_same_engine_id_is_refused(
    served: tuple[str, _Stub, BooksServer],
) -> None:
    """Two engines given one engine id would share one socket path: the second is
    refused at start, naming the id, the path and the fix; the first keeps its socket
    and key. A socket file whose server is gone is replaced."""
    engine_id, _, first = served
    key = key_file(engine_id, 0).read_bytes()
    with pytest.raises(ConfigError, match=f"{engine_id}.*{first.address}.*unique `engine_id`"):
        BooksServer(SimpleNamespace(answer=_Stub().answer), engine_id, 0)  # type: ignore[arg-type]
    assert key_file(engine_id, 0).read_bytes() == key
    remote = RemoteBooks(engine_id, 1, timeout_s=10)
    try:
        assert remote.sources("abc") == 3
    finally:
        remote.conns[0].close()
    first.close()
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: a stale file
        dead.bind(first.address)
    assert Path(first.address).exists()
    again = BooksServer(SimpleNamespace(answer=_Stub().answer), engine_id, 0)  # type: ignore[arg-type]
    try:
        remote = RemoteBooks(engine_id, 1, timeout_s=10)
        assert remote.sources("ab") == 2
        remote.conns[0].close()
    finally:
        again.close()
