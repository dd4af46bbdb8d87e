"""The redis tier's reply parser (``backends/redis/read.py``) over a real socket pair.

The server-side cases (foreign values, WRONGTYPE, timeouts, a server killed mid-read,
resharding) run against real servers in ``test_backend_redis.py``; here the byte
stream is crafted, so every reply boundary can be made to fall anywhere: replies are
sent in pieces of 1 to 7 bytes, and the parser must give the same answers as when
they arrive whole."""

from __future__ import annotations

import random
import socket
import threading
import zlib
from typing import Any

import numpy as np
import pytest
from kvoffload.backends.redis.read import ReadSink, Sinks, Sunk, direct_get_parser
from redis.exceptions import ConnectionError, ResponseError

from kvoffload.record import HEADER_BYTES, HEADER_DTYPE, payload_checksum

PAYLOAD = 3000
VALUE = HEADER_BYTES + PAYLOAD


class _Encoder:
    encoding_errors = "strict"
    decode_responses = False


class _Conn:
    """What ``on_connect`` reads of a redis-py connection: its socket and settings."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.socket_timeout = 5.0
        self.encoder = _Encoder()


def _value(key: bytes, seed: int) -> tuple[bytes, bytes]:
    """A value (header naming ``key``, then a payload) and its payload."""
    header = bytearray(HEADER_BYTES)
    offset = HEADER_DTYPE.fields["key"][1]  # type: ignore[index]
    header[offset : offset + len(key)] = key
    header[HEADER_BYTES - 4 :] = zlib.crc32(header[: HEADER_BYTES - 4]).to_bytes(4, "little")
    payload = random.Random(seed).randbytes(PAYLOAD)
    return bytes(header) + payload, payload


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


@pytest.fixture
def pair() -> Any:
    a, b = socket.socketpair()
    a.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def _parser(sock: socket.socket, sinks: Sinks) -> Any:
    parser = direct_get_parser(sinks)(socket_read_size=65536)
    parser.on_connect(_Conn(sock))
    return parser


def _dribble(sock: socket.socket, stream: bytes, seed: int) -> threading.Thread:
    """Send ``stream`` in pieces of 1 to 7 bytes (whole when ``seed`` is None)."""

    def run() -> None:
        rng = random.Random(seed)
        at = 0
        while at < len(stream):
            step = rng.randint(1, 7) if seed >= 0 else len(stream)
            sock.sendall(stream[at : at + step])
            at += step

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("seed", [-1, 0, 1, 2])
def test_replies_parse_the_same_however_they_are_cut(pair: Any, seed: int) -> None:
    """A read's replies in any order, with a miss, an error, a foreign-length value,
    a value naming a key nobody asked for, a value that comes twice for one key, then
    replies that are not a read's (an integer, an array, a status) parsed by hiredis
    from where this parser stopped."""
    ours, theirs = pair
    keys = [b"k%d" % i for i in range(4)]
    rows = np.zeros((4, PAYLOAD), dtype=np.uint8)
    sinks = Sinks()
    sink = ReadSink(rows, keys, VALUE)
    parser = _parser(ours, sinks)
    values = {k: _value(k, i) for i, k in enumerate(keys)}
    stray, _ = _value(b"nobody", 9)
    stream = b"".join(
        [
            _bulk(values[b"k2"][0]),
            b"$-1\r\n",
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
            _bulk(b"short"),
            _bulk(stray),
            _bulk(values[b"k0"][0]),
            _bulk(values[b"k0"][0]),  # k0 again: no row left for it
            b":42\r\n*2\r\n$1\r\na\r\n:7\r\n+OK\r\n",
        ]
    )
    sender = _dribble(theirs, stream, seed)
    sinks.active = sink
    got = [parser.read_response() for _ in range(7)]
    sinks.active = None
    tail = [parser.read_response() for _ in range(3)]
    sender.join()
    assert isinstance(got[0], Sunk)
    assert got[0].row == 2
    assert got[1] is None
    assert isinstance(got[2], ResponseError)
    assert "WRONGTYPE" in str(got[2])
    assert got[3] == b"short"
    assert got[4] == stray  # no row waits for it: handed back whole
    assert isinstance(got[5], Sunk)
    assert got[5].row == 0
    assert got[6] == values[b"k0"][0]
    assert tail == [42, [b"a", 7], b"OK"]
    for row, key in ((2, b"k2"), (0, b"k0")):
        payload = values[key][1]
        assert rows[row].tobytes() == payload
        assert sink.sums[row] == payload_checksum(payload)
        assert sink.headers[row : row + 1].tobytes() == values[key][0][:HEADER_BYTES]
        assert sink.crcs[row] == zlib.crc32(values[key][0][: HEADER_BYTES - 4])
    assert rows[1].tobytes() == bytes(PAYLOAD)  # never touched


def test_a_read_reply_in_the_middle_of_hiredis_replies(pair: Any) -> None:
    """Bytes this parser received ahead of a reply it gives to hiredis are not lost:
    a status reply arrives in the same segment as a value's bulk reply."""
    ours, theirs = pair
    rows = np.zeros((1, PAYLOAD), dtype=np.uint8)
    sinks = Sinks()
    parser = _parser(ours, sinks)
    value, payload = _value(b"k", 1)
    theirs.sendall(_bulk(value) + b"+OK\r\n" + _bulk(b"after"))
    sinks.active = ReadSink(rows, [b"k"], VALUE)
    assert isinstance(parser.read_response(), Sunk)
    assert parser.read_response() == b"OK"  # not a GET's reply: hiredis, in order
    sinks.active = None
    assert parser.read_response() == b"after"
    assert rows[0].tobytes() == payload


def test_a_peer_closing_mid_value_is_a_connection_error(pair: Any) -> None:
    ours, theirs = pair
    sinks = Sinks()
    parser = _parser(ours, sinks)
    value, _ = _value(b"k", 1)
    theirs.sendall(_bulk(value)[: VALUE // 2])
    theirs.shutdown(socket.SHUT_WR)
    sinks.active = ReadSink(np.zeros((1, PAYLOAD), dtype=np.uint8), [b"k"], VALUE)
    with pytest.raises(ConnectionError):
        parser.read_response()
    parser.on_disconnect()
    assert not parser._pending  # nothing left to be taken for the next connection's


def test_a_bulk_reply_longer_than_declared_is_refused(pair: Any) -> None:
    ours, theirs = pair
    sinks = Sinks()
    parser = _parser(ours, sinks)
    value, _ = _value(b"k", 1)
    theirs.sendall(b"$%d\r\n%sXX\r\n" % (VALUE, value))
    sinks.active = ReadSink(np.zeros((1, PAYLOAD), dtype=np.uint8), [b"k"], VALUE)
    with pytest.raises(Exception, match="longer than its declared length"):
        parser.read_response()
