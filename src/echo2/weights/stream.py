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

Under ``[security]`` the same frames travel inside mutual TLS (``tls`` on both ends,
``echo2.weights.secure``): the server admits a verified peer only if ``admit`` says its
identity may send to this inbox (the publisher, or a predecessor in the current plan); a
peer with no valid certificate fails the handshake, and both are counted
(``refused_handshake``, ``refused_identity``), logged once per peer, and closed.

Addresses are ``chunkstream://host:port``; ``WeightReceiver`` announces one in place of a
ZeroMQ inbox and senders pick the transport by the scheme.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable

import numpy as np

from echo2.errors import ClosedError, TransportError
from echo2.messages import PolicyVersion, WeightChunk
from echo2.weights.secure import peer_identity

log = logging.getLogger(__name__)

SCHEME = "chunkstream"
MAGIC = b"E2CK"
FORMAT = 1
HEADER = struct.Struct("<4sB3xqqqQ")

Destination = Callable[[PolicyVersion, int, int], "np.ndarray | None"]
"""(version, index, nbytes) -> the uint8 memory to receive that chunk into, or None (the
receiver then reads it into a fresh buffer). Memory handed out is returned either as a
delivered chunk or through ``abandon`` (connection lost mid-body)."""

Admit = Callable[[str], bool]
"""TLS only: may the peer with this verified identity deliver chunks now? False may turn
True later (the plan naming it is on its way): see ``ChunkStreamServer.readmit``."""


def _peer_address(transport: asyncio.BaseTransport) -> str:
    """The peer's host (no port: refusals are logged once per peer, not per connection)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


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

    def __init__(self, server: ChunkStreamServer, *, gated: bool = False) -> None:
        self._server = server
        # TLS: bytes decrypted before the peer is admitted are held, not parsed (asyncio may
        # deliver them before the handshake's waiter runs); admission replays them.
        self._held: bytearray | None = bytearray() if gated else None
        self._scratch = memoryview(bytearray(1 << 16)) if gated else memoryview(b"")
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

    def admitted(self, transport: asyncio.Transport) -> None:
        """TLS: the handshake is done and the peer admitted; frames may flow."""
        self.connection_made(transport)
        held, self._held = self._held or bytearray(), None
        view = memoryview(held)
        while view and not transport.is_closing():
            buffer = self.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
        if not self._server._paused and not transport.is_closing():
            transport.resume_reading()

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
        if self._held is not None:
            return self._scratch
        if self._body is None:
            return self._header_view[self._got :]
        return self._body[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._held is not None:
            self._held += self._scratch[:nbytes]
            return
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


class _TlsAccept(asyncio.Protocol):
    """A TCP connection to a TLS inbox before its handshake: not a byte is read here."""

    def __init__(self, server: ChunkStreamServer) -> None:
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the ClientHello is for start_tls, which resumes reading
        self._server._handshake_soon(transport)


@dataclasses.dataclass
class _Parked:
    """An authenticated connection waiting for the plan that names its peer."""

    connection: _Connection
    transport: asyncio.Transport
    identity: str
    deadline_s: float


class ChunkStreamServer:
    """Accepts chunk streams; ``on_chunk`` gets each complete chunk, in arrival order per
    connection. ``destination`` chooses where each body lands (see ``Destination``).

    Flow control: when more than ``max_pending`` delivered chunks wait to be taken
    (``taken()``), every connection stops reading until the backlog halves, so a slow
    consumer pushes back on its senders through TCP instead of growing memory.

    With ``tls`` (a server context that requires client certificates) every connection is
    handshaken in a task of the ``group`` given to ``start``/``start_on``, then ``admit``
    is asked about the peer's identity; a peer not admitted waits, not reading, up to
    ``admit_wait_s`` for a ``readmit()`` that admits it (a relay plan naming it may
    arrive after its stream), and is refused after that.
    """

    def __init__(
        self,
        on_chunk: Callable[[WeightChunk], None],
        destination: Destination,
        abandon: Callable[[WeightChunk], None],
        *,
        max_chunk_bytes: int = 64 << 20,
        max_pending: int = 32,
        tls: ssl.SSLContext | None = None,
        admit: Admit | None = None,
        admit_wait_s: float = 2.0,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        if tls is not None and tls.verify_mode != ssl.CERT_REQUIRED:
            raise ValueError("a chunk stream's TLS context must require peer certificates")
        self.tls = tls
        self._admit = admit if admit is not None else (lambda identity: True)
        self.admit_wait_s = admit_wait_s
        self.handshake_timeout_s = handshake_timeout_s
        self._group: asyncio.TaskGroup | None = None
        self._parked: list[_Parked] = []
        self._handshaking: set[asyncio.Transport] = set()
        self._refused_logged: set[str] = set()
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
            (
                "chunks_in_place",
                "chunks_copied",
                "reads",
                "malformed",
                "frames_truncated",
                "pauses",
                "tls_admitted",
                "refused_handshake",
                "refused_identity",
            ),
            0,
        )

    def _protocol(self) -> asyncio.BaseProtocol:
        return _Connection(self) if self.tls is None else _TlsAccept(self)

    def _use(self, group: asyncio.TaskGroup | None) -> None:
        if self.tls is not None and group is None:
            raise ValueError("a TLS chunk stream server needs a TaskGroup for its handshakes")
        self._group = group

    async def start(self, host: str, port: int = 0, group: asyncio.TaskGroup | None = None) -> int:
        """Listen on ``host:port``; returns the bound port."""
        self._use(group)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def start_on(self, listener: socket.socket, group: asyncio.TaskGroup | None = None) -> None:
        """Serve on a socket already bound and listening (bound early, served later);
        the server owns it from now on."""
        self._use(group)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, sock=listener)

    # -- TLS: handshake and admission --------------------------------------------------

    def _handshake_soon(self, transport: asyncio.Transport) -> None:
        if self._group is None or self._server is None:
            transport.abort()  # closed meanwhile
            return
        self._handshaking.add(transport)
        self._group.create_task(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        assert self.tls is not None
        peer = _peer_address(transport)
        connection = _Connection(self, gated=True)
        loop = asyncio.get_running_loop()
        try:
            secured = await loop.start_tls(
                transport, connection, self.tls, server_side=True, ssl_handshake_timeout=self.handshake_timeout_s
            )
        except (OSError, TimeoutError, ConnectionError) as exc:  # ssl.SSLError is an OSError
            self.counters["refused_handshake"] += 1
            self._log_refusal(f"address {peer}", f"no valid certificate ({exc})")
            transport.abort()
            return
        finally:
            self._handshaking.discard(transport)
        if secured is None:  # the peer closed during the handshake
            transport.abort()
            return
        assert isinstance(secured, asyncio.Transport)
        secured.pause_reading()  # until admitted
        identity = peer_identity(secured.get_extra_info("ssl_object"))
        if self._server is None:
            secured.abort()
        elif self._admit(identity):
            self._accept(connection, secured)
        else:
            self._parked.append(_Parked(connection, secured, identity, time.monotonic() + self.admit_wait_s))
            loop.call_later(self.admit_wait_s, self.readmit)

    def _accept(self, connection: _Connection, transport: asyncio.Transport) -> None:
        self.counters["tls_admitted"] += 1
        connection.admitted(transport)

    def readmit(self) -> None:
        """Ask ``admit`` again about every waiting peer (call it when the plan changes);
        refuse those whose wait is over."""
        now = time.monotonic()
        waiting, self._parked = self._parked, []
        for parked in waiting:
            if parked.transport.is_closing():
                continue
            if self._admit(parked.identity):
                self._accept(parked.connection, parked.transport)
            elif now >= parked.deadline_s - 1e-3:
                self.counters["refused_identity"] += 1
                self._log_refusal(f"{parked.identity!r}", "not the publisher or a predecessor in the plan")
                parked.transport.abort()
            else:
                self._parked.append(parked)

    def _log_refusal(self, who: str, why: str) -> None:
        if who not in self._refused_logged:  # once per peer: a refused peer may retry forever
            self._refused_logged.add(who)
            log.warning("chunk stream: refused %s: %s", who, why)

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
        for parked in self._parked:
            parked.transport.abort()
        self._parked.clear()
        for transport in list(self._handshaking):
            transport.abort()
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

    With ``tls`` (a client context holding this actor's certificate) the stream is TLS and
    ``peer``, when given, is the identity the inbox must prove (the member the plan names
    at this address); another identity is a ``TransportError`` before any chunk leaves.
    ``send`` then returns once the frame is encrypted and the transport's buffer is below
    ``tls_buffer_bytes``.
    """

    def __init__(
        self,
        address: str,
        *,
        connect_timeout_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
        peer: str = "",
        tls_buffer_bytes: int = 1 << 20,
    ) -> None:
        self.address = address
        self._host, self._port = parse_address(address)
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.peer = peer
        self.tls_buffer_bytes = tls_buffer_bytes
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
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
                if self.tls is not None:
                    writer = self._writer or await self._connect_tls()
                    writer.write(header)
                    writer.write(data)  # the snapshot's memory is never written again: no copy
                    await writer.drain()
                    return True
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
            except OSError as exc:  # ssl.SSLError and ConnectionError included
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

    async def _connect_tls(self) -> asyncio.StreamWriter:
        async with asyncio.timeout(self.connect_timeout_s):
            _, writer = await asyncio.open_connection(
                self._host, self._port, ssl=self.tls, ssl_handshake_timeout=self.connect_timeout_s
            )
        identity = peer_identity(writer.get_extra_info("ssl_object"))
        if self.peer and identity != self.peer:
            writer.transport.abort()
            self.close()
            raise TransportError(f"chunk stream to {self.address}: the inbox is {identity!r}, not {self.peer!r}")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.transport.set_write_buffer_limits(high=self.tls_buffer_bytes)
        self._writer = writer
        return writer

    def close(self) -> None:
        self.closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._writer is not None:
            self._writer.transport.abort()  # a half-written frame cannot be finished anyway
            self._writer = None


__all__ = [
    "HEADER",
    "SCHEME",
    "ChunkStreamSender",
    "ChunkStreamServer",
    "is_stream_address",
    "parse_address",
]
