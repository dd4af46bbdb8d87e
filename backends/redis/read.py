"""The read side of the ``redis`` tier: each value received straight into its row.

A tier read is one pipeline of ``GET``s. With redis-py's hiredis parser each value is
copied three times on its way from the socket to the caller's row: ``recv_into`` a
connection buffer, ``feed`` into hiredis's own buffer, a new ``bytes`` object for the
reply, and then into the row. :class:`DirectGetParser` parses the replies of a read
itself: the ``$<length>`` line and the 128-byte header come through a small buffer,
and the payload is received by the kernel directly into the row that the header's
key names, so the only copy is the socket's own. The payload is then checksummed
from the row, still in cache.

Everything else (every reply outside a read, and any reply of a read that is not a
bulk string or an error) goes through hiredis exactly as before: the bytes this
parser has buffered are fed to hiredis first, so the stream stays in order.
"""

from __future__ import annotations

import logging
import threading
import zlib
from typing import Any, Final

import numpy as np
from redis._parsers.hiredis import _HiredisParser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR
from redis.exceptions import ConnectionError, InvalidResponse
from redis.utils import SENTINEL

from kvoffload.codec import Packer
from kvoffload.keys import MAX_KEY_BYTES
from kvoffload.record import HEADER_BYTES, HEADER_DTYPE, payload_checksum

logger = logging.getLogger(__name__)

LINE_READ_BYTES: Final = 4096
"""Bytes asked of each ``recv`` while looking for a reply's first line: enough for
the line, the header and the previous value's ``\\r\\n`` in one call, small enough that
little of a payload (under 2% of a 256 KiB block) comes through the buffer instead of
straight into its row."""

_KEY_FIELD: Final = slice(
    HEADER_DTYPE.fields["key"][1],  # type: ignore[index]
    HEADER_DTYPE.fields["key"][1] + MAX_KEY_BYTES,  # type: ignore[index]
)
"""Where a value's header keeps its (NUL-padded) block key."""
_CHECKSUM_FIELD: Final = slice(
    HEADER_DTYPE.fields["checksum"][1],  # type: ignore[index]
    HEADER_DTYPE.fields["checksum"][1] + 8,  # type: ignore[index]
)
"""Where a value's header keeps the checksum of its payload as stored."""


class Sunk:
    """The reply a read gets for a value its sink took: the row the value went to."""

    __slots__ = ("row",)

    def __init__(self, row: int) -> None:
        self.row = row


class ReadSink:
    """The rows one read fills, and what it learned of each value on the way.

    A value goes to the row of the key its header names, among the rows the read asked
    for and has not filled yet (a cluster answers per node, not in the read's order).
    The row is only *claimed* here: it counts as valid only if the value came back
    for that very row's key and verifies (``RedisBackend._verify``); anything else is
    left as the reply it was, and a row its value did not fill is undefined, as
    :meth:`~kvoffload.backend.Backend.read` allows for a miss.

    Values that reach it as ``bytes`` (parsed by hiredis: see the module docs) are
    checksummed and copied as soon as they are parsed, then dropped, so the next value
    of the batch reuses their memory. Kept until the end, a batch of 32 values of 2 MiB
    is 64 MiB of fresh pages every batch, faulted in by the parser and then read twice
    from memory."""

    def __init__(
        self,
        rows: np.ndarray[Any, Any],
        keys: list[bytes],
        value_bytes: int,
        packer: Packer | None = None,
    ) -> None:
        n = len(keys)
        self.rows = rows
        self.value_bytes = value_bytes
        """A raw value's length (header plus payload); a compressed one is shorter."""
        self.packer = packer
        self.waiting: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            self.waiting.setdefault(key.ljust(MAX_KEY_BYTES, b"\0"), []).append(i)
        self.headers = np.zeros(n, dtype=HEADER_DTYPE)
        self._raw = self.headers.view(np.uint8).data  # flat: row i at i * 128
        self.crcs = [0] * n
        self.sums = [0] * n
        self.stored = [0] * n
        """Payload bytes each row's value held, as stored."""
        self.undecodable: set[int] = set()
        """Rows whose value verified but did not decompress (a foreign chunk)."""

    def takes(self, length: int) -> bool:
        """Whether a value of ``length`` bytes may be a record: a header and a payload
        no longer than a raw one."""
        return HEADER_BYTES < length <= self.value_bytes

    def claim(self, header: bytes | memoryview) -> int | None:
        """The row a value with this header goes to, taken off the waiting list."""
        rows = self.waiting.get(bytes(header[_KEY_FIELD]))
        return rows.pop(0) if rows else None

    def take(self, value: bytes) -> Sunk | bytes:
        """Claim the row ``value`` names; ``value`` itself where it names none."""
        row = self.claim(value)
        if row is None:
            return value
        try:
            self.fill(row, value)
        except Exception:  # never into the engine: the reply goes the slow way
            logger.debug("value for row %d not taken", row, exc_info=True)
            return value
        return Sunk(row)

    def fill(self, row: int, value: bytes) -> None:
        """Header, header CRC and payload checksum of ``value``, and its payload into
        ``row``: everything the read's verification needs of it afterwards. A
        compressed payload is decompressed into the row only once its header and
        checksum verify: damage never reaches the decompressor."""
        view = memoryview(value)
        target = self.rows[row]
        if len(value) != self.value_bytes:
            header, stored = view[:HEADER_BYTES], view[HEADER_BYTES:]
            self.note(row, header, stored)
            intact = self.crcs[row] == int.from_bytes(
                header[HEADER_BYTES - 4 :], "little"
            ) and self.sums[row] == int.from_bytes(header[_CHECKSUM_FIELD], "little")
            if not intact:
                return  # the verification afterwards finds it
            if self.packer is None or not self.packer.decompress_into(stored, target):
                self.undecodable.add(row)
            return
        if target.flags.c_contiguous:
            memoryview(target)[:] = view[HEADER_BYTES:]
        else:
            np.copyto(target, np.frombuffer(value, np.uint8, offset=HEADER_BYTES))
        self.note(row, view[:HEADER_BYTES], view[HEADER_BYTES:])

    def note(self, row: int, header: bytes | memoryview, payload: memoryview) -> None:
        """Record ``header`` of ``row``'s value, its CRC and the checksum of ``payload``
        (the value's payload, or the row it was received into)."""
        self._raw[row * HEADER_BYTES : (row + 1) * HEADER_BYTES] = header
        self.crcs[row] = zlib.crc32(header[: HEADER_BYTES - 4])
        self.sums[row] = payload_checksum(payload)
        self.stored[row] = len(payload)

    def direct_row(self, row: int) -> memoryview | None:
        """A writable view of ``row`` to receive a payload into; None if it is strided."""
        target = self.rows[row]
        return memoryview(target).cast("B") if target.flags.c_contiguous else None


class Sinks(threading.local):
    """The read each thread is running, if any: a connection reads replies on the
    thread that sent the pipeline, so the value it parses belongs to that read."""

    active: ReadSink | None = None


def direct_get_parser(sinks: Sinks) -> type[_HiredisParser]:
    """A parser class whose connections receive the values of ``sinks``' active read
    straight into their rows (module docs). A class per backend, like the connection
    class, because redis-py builds a parser from its class alone."""

    class DirectGetParser(_HiredisParser):
        """hiredis for everything but a read's bulk replies (module docs)."""

        def __init__(self, socket_read_size: int) -> None:
            super().__init__(socket_read_size)  # type: ignore[no-untyped-call]
            self._line_buf = bytearray(LINE_READ_BYTES)
            self._pending = bytearray()  # received, not yet parsed by this parser

        def on_disconnect(self) -> None:
            super().on_disconnect()  # type: ignore[no-untyped-call]
            self._pending = bytearray()

        def read_response(
            self,
            disable_decoding: bool = False,
            push_request: bool = False,
            timeout: Any = SENTINEL,
        ) -> Any:
            sink = sinks.active
            reader = self._reader
            if (
                sink is None
                or reader is None
                or self._sock is None
                or timeout is not SENTINEL
                or reader.has_data()
            ):
                self._hand_over()
                return super().read_response(
                    disable_decoding=disable_decoding, push_request=push_request, timeout=timeout
                )
            line = self._line()
            kind = line[:1]
            if kind == b"$":
                return self._bulk(sink, int(line[1:]))
            if kind == b"-":
                error = self.parse_error(line[1:].decode("utf-8", "replace"))  # type: ignore[no-untyped-call]
                if isinstance(error, ConnectionError):
                    raise error
                return error
            # Not what a GET answers: hiredis parses it, from this line on.
            self._pending[0:0] = line + b"\r\n"
            self._hand_over()
            return super().read_response(
                disable_decoding=disable_decoding, push_request=push_request, timeout=timeout
            )

        def _hand_over(self) -> None:
            """Give hiredis what this parser received and did not parse, in order."""
            if self._pending and self._reader is not None:
                self._reader.feed(bytes(self._pending))
                self._pending.clear()

        def _bulk(self, sink: ReadSink, length: int) -> Any:
            if length < 0:
                return None
            if length != sink.value_bytes:
                value = self._exact(length)
                self._crlf()
                # A compressed record (shorter than a raw one) goes to its row now,
                # decompressed while the next reply is still on the wire.
                return sink.take(value) if sink.takes(length) else value
            header = self._exact(HEADER_BYTES)
            row = sink.claim(header)
            view = None if row is None else sink.direct_row(row)
            if row is None or view is None:
                value = header + self._exact(length - HEADER_BYTES)
                self._crlf()
                if row is None:
                    return value
                sink.fill(row, value)
                return Sunk(row)
            self._into(view)
            self._crlf()
            sink.note(row, header, view)
            return Sunk(row)

        # -- the socket: what is pending first, then the kernel --------------------
        def _recv(self, into: memoryview) -> int:
            """One ``recv_into``; the peer closing is an error, as in redis-py."""
            sock = self._sock
            if sock is None:
                raise ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
            got: int = sock.recv_into(into)
            if got == 0:
                raise ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
            return got

        def _more(self) -> None:
            got = self._recv(memoryview(self._line_buf))
            self._pending += memoryview(self._line_buf)[:got]

        def _line(self) -> bytes:
            """The next reply's first line, without its ``\\r\\n``."""
            while True:
                end = self._pending.find(b"\r\n")
                if end >= 0:
                    line = bytes(self._pending[:end])
                    del self._pending[: end + 2]
                    return line
                if len(self._pending) > 1 << 20:
                    raise InvalidResponse("a reply line over 1 MiB")
                self._more()

        def _crlf(self) -> None:
            if self._exact(2) != b"\r\n":
                raise InvalidResponse("a bulk reply longer than its declared length")

        def _exact(self, n: int) -> bytes:
            """The next ``n`` bytes."""
            if len(self._pending) >= n:
                out = bytes(self._pending[:n])
                del self._pending[:n]
                return out
            out_buf = bytearray(n)
            self._into(memoryview(out_buf))
            return bytes(out_buf)

        def _into(self, view: memoryview) -> None:
            """Fill ``view``: from what is pending, then straight from the socket."""
            have = min(len(self._pending), len(view))
            if have:
                view[:have] = self._pending[:have]
                del self._pending[:have]
            while have < len(view):
                have += self._recv(view[have:])

    return DirectGetParser


__all__ = ["LINE_READ_BYTES", "ReadSink", "Sinks", "Sunk", "direct_get_parser"]
