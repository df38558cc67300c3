"""Chunk streams: weight chunks over a plain TCP connection, received straight into place.

The weight path is the one place where echo2 moves hundreds of megabytes per version, and
on it a ZeroMQ PULL costs a receiver two extra passes over every byte: its I/O thread
reads each message into a fresh allocation (page faults included), then the assembler
copies the verified chunk into the snapshot buffer. A chunk stream reads the bytes from
the kernel directly into the chunk's final place in the assembly buffer
(``asyncio.BufferedProtocol``), so verification is the only pass left; the sender hands
the kernel views of the snapshot (``sock_sendall``, no copy either).

Wire format, one frame per chunk, repeated on a connection::

    header  (40 bytes, little-endian): magic b"E2CK", format u8 (=1), 3 pad bytes,
            incarnation i64, version i64, index i64, nbytes u64
    body    nbytes raw bytes of the chunk

Only the weight data travels here; control, manifests and repair stay on ZeroMQ. Chunks
are verified against the publisher's manifest exactly as on the ZeroMQ path, so a stream
needs no trust in its peer. A frame that is not one (bad magic or format, or a body over
``max_chunk_bytes``) is counted and its connection closed; the receiver keeps running and
the chunks it lost are repaired like any others.

Addresses are ``chunkstream://host:port``; ``WeightReceiver`` announces one in place of a
ZeroMQ inbox and senders pick the transport by the scheme.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

import numpy as np

from echo2.errors import ClosedError, TransportError
from echo2.messages import PolicyVersion, WeightChunk

log = logging.getLogger(__name__)

SCHEME = "chunkstream"
MAGIC = b"E2CK"
FORMAT = 1
HEADER = struct.Struct("<4sB3xqqqQ")

Destination = Callable[[PolicyVersion, int, int], "np.ndarray | None"]
"""(version, index, nbytes) -> the uint8 memory to receive that chunk into, or None (the
receiver then reads it into a fresh buffer). Memory handed out is returned either as a
delivered chunk or through ``abandon`` (connection lost mid-body)."""


def is_stream_address(address: str) -> bool:
    return address.startswith(SCHEME + "://")


def parse_address(address: str) -> tuple[str, int]:
    if not is_stream_address(address):
        raise ValueError(f"not a chunk stream address: {address!r}")
    host, _, port = address[len(SCHEME) + 3 :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"chunk stream address needs host:port, got {address!r}")
    return host.strip("[]"), int(port)


class _Connection(asyncio.BufferedProtocol):
    """One inbound connection: header, then the body into its destination, repeat."""

    def __init__(self, server: ChunkStreamServer) -> None:
        self._server = server
        self._header = bytearray(HEADER.size)
        self._header_view = memoryview(self._header)
        self._body: memoryview | None = None
        self._chunk: WeightChunk | None = None
        self._got = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server._connections.add(self)
        if self._server._paused:
            transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
        if self._chunk is not None:
            # The peer went away mid-body: the destination it was writing is given back.
            self._server.counters["frames_truncated"] += 1
            chunk, self._chunk, self._body = self._chunk, None, None
            self._server._abandon(chunk)

    @property
    def mid_chunk(self) -> bool:
        return self._chunk is not None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is None:
            return self._header_view[self._got :]
        return self._body[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        self._server.counters["reads"] += 1
        self._got += nbytes
        if self._body is None:
            if self._got == HEADER.size:
                self._start_body()
        elif self._got == len(self._body):
            chunk, self._chunk, self._body, self._got = self._chunk, None, None, 0
            assert chunk is not None
            self._server._deliver(chunk)

    def _start_body(self) -> None:
        server = self._server
        magic, fmt, incarnation, version, index, nbytes = HEADER.unpack(self._header)
        if magic != MAGIC or fmt != FORMAT or nbytes > server.max_chunk_bytes or index < 0:
            server.counters["malformed"] += 1
            log.warning("chunk stream: malformed frame header from a peer; closing its connection")
            assert self.transport is not None
            self.transport.close()
            self._got = 0
            return
        target = server._destination(PolicyVersion(incarnation, version), index, nbytes)
        if target is None:
            target = np.empty(nbytes, dtype=np.uint8)
            server.counters["chunks_copied"] += 1
        else:
            server.counters["chunks_in_place"] += 1
        self._chunk = WeightChunk(incarnation=incarnation, version=version, index=index, data=target)
        self._body = target.data.cast("B")
        self._got = 0
        if nbytes == 0:
            chunk, self._chunk, self._body = self._chunk, None, None
            server._deliver(chunk)


class ChunkStreamServer:
    """Accepts chunk streams; ``on_chunk`` gets each complete chunk, in arrival order per
    connection. ``destination`` chooses where each body lands (see ``Destination``).

    Flow control: when more than ``max_pending`` delivered chunks wait to be taken
    (``taken()``), every connection stops reading until the backlog halves, so a slow
    consumer pushes back on its senders through TCP instead of growing memory.
    """

    def __init__(
        self,
        on_chunk: Callable[[WeightChunk], None],
        destination: Destination,
        abandon: Callable[[WeightChunk], None],
        *,
        max_chunk_bytes: int = 64 << 20,
        max_pending: int = 32,
    ) -> None:
        self._on_chunk = on_chunk
        self._destination = destination
        self._abandon = abandon
        self.max_chunk_bytes = max_chunk_bytes
        self.max_pending = max_pending
        self._pending = 0
        self._paused = False
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.counters = dict.fromkeys(
            ("chunks_in_place", "chunks_copied", "reads", "malformed", "frames_truncated", "pauses"), 0
        )

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port``; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def start_on(self, listener: socket.socket) -> None:
        """Serve on a socket already bound and listening (bound early, served later);
        the server owns it from now on."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=listener)

    def _deliver(self, chunk: WeightChunk) -> None:
        self._pending += 1
        if self._pending > self.max_pending and not self._paused:
            self._paused = True
            self.counters["pauses"] += 1
            for connection in self._connections:
                if connection.transport is not None:
                    connection.transport.pause_reading()
        self._on_chunk(chunk)

    def taken(self, count: int = 1) -> None:
        """The consumer is done with ``count`` delivered chunks."""
        self._pending -= count
        if self._paused and self._pending <= self.max_pending // 2:
            self._paused = False
            for connection in self._connections:
                if connection.transport is not None and not connection.transport.is_closing():
                    connection.transport.resume_reading()

    def drop_partial(self) -> int:
        """Close every connection that is in the middle of a chunk (its place goes back
        through ``abandon``); returns how many. For a consumer that saw no progress for a
        while: a peer that sent a header and went quiet must not hold a place forever."""
        stuck = [c for c in self._connections if c.mid_chunk and c.transport is not None]
        for connection in stuck:
            assert connection.transport is not None
            connection.transport.abort()
        return len(stuck)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()


class ChunkStreamSender:
    """One outbound chunk stream; ``send`` returns once the kernel holds the whole frame.

    Same contract as a ``PushEndpoint`` on the weight path: ``await send(chunk)`` is True on
    success and raises ``ClosedError``/``TransportError`` when the peer is gone; a caller
    that cancels a send (timeout) must ``close()`` it, as a half-written frame cannot be
    resumed.
    """

    def __init__(self, address: str, *, connect_timeout_s: float = 5.0) -> None:
        self.address = address
        self._host, self._port = parse_address(address)
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()
        self.closed = False

    async def send(self, chunk: WeightChunk) -> bool:
        if self.closed:
            raise ClosedError(f"chunk stream to {self.address} is closed")
        data = chunk.data.data.cast("B")  # the array's buffer, as bytes
        header = HEADER.pack(MAGIC, FORMAT, chunk.incarnation, chunk.version, chunk.index, len(data))
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                sock = self._sock or await self._connect(loop)
                try:
                    sent = sock.sendmsg([header, data])  # one syscall when the kernel has room
                except BlockingIOError:
                    sent = 0
                if sent < len(header):
                    await loop.sock_sendall(sock, header[sent:])
                    sent = len(header)
                if sent - len(header) < len(data):
                    await loop.sock_sendall(sock, data[sent - len(header) :])
            except OSError as exc:
                self.close()
                raise TransportError(f"chunk stream to {self.address}: {exc}") from exc
        return True

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def close(self) -> None:
        self.closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None


__all__ = [
    "HEADER",
    "SCHEME",
    "ChunkStreamSender",
    "ChunkStreamServer",
    "is_stream_address",
    "parse_address",
]
