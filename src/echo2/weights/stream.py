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

Admission under ``[security]`` (``authenticate`` on the server, ``credentials`` on the
sender). Before any frame, the inbox sends a challenge and the sender answers with its
name and an HMAC proving it holds the current plan's ``stream_secret`` (which travels
only in the ``RelayPlan``, on the CURVE-encrypted control channel)::

    challenge (inbox -> sender, 40 bytes): magic b"E2SC", format u8 (=1), 3 pad bytes,
              32 random bytes
    answer    (sender -> inbox): magic b"E2SA", format u8 (=1), name length u8, 2 pad
              bytes, the sender's name (UTF-8), then 32 bytes of
              HMAC-SHA256(stream_secret, challenge | len(sender) u8 | sender
                                              | len(receiver) u8 | receiver)

The inbox reads nothing past the answer until ``authenticate`` admits the sender (the
plan's publisher or the inbox's predecessor, checked by ``WeightReceiver``); a sender it
cannot admit yet waits, not read, up to ``admit_wait_s`` for the plan naming it
(``readmit``) and is then refused. Refusals (``refused``: wrong HMAC or not a sender of
this inbox; ``refused_handshake``: no well-formed answer in time) are counted, logged
once per peer, and closed. The frames themselves need no secrecy from the stream: under
``[security]`` their bodies are ciphertext (``echo2.weights.seal``).

Addresses are ``chunkstream://host:port``; ``WeightReceiver`` announces one in place of a
ZeroMQ inbox and senders pick the transport by the scheme.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable

import numpy as np

from echo2.errors import ClosedError, TransportError
from echo2.messages import PolicyVersion, WeightChunk

log = logging.getLogger(__name__)

SCHEME = "chunkstream"
MAGIC = b"E2CK"
DIAL_MORE_MAGIC = b"E2DN"
"""On a dialed stream (``echo2.weights.dial``), publisher -> member: a header whose index
is how many connections the publisher wants the member to keep dialed."""
FORMAT = 1
HEADER = struct.Struct("<4sB3xqqqQ")
CHALLENGE = struct.Struct("<4sB3x32s")
CHALLENGE_MAGIC = b"E2SC"
ANSWER = struct.Struct("<4sBB2x")
ANSWER_MAGIC = b"E2SA"
MAC_BYTES = 32

Destination = Callable[[PolicyVersion, int, int], "np.ndarray | None"]
"""(version, index, nbytes) -> the uint8 memory to receive that chunk into, or None (the
receiver then reads it into a fresh buffer). Memory handed out is returned either as a
delivered chunk or through ``abandon`` (connection lost mid-body)."""


Authenticate = Callable[[bytes, str, bytes], bool]
"""(challenge, sender name, mac) -> may this sender deliver to the inbox now? False may
turn True later (the plan naming it is on its way): see ``ChunkStreamServer.readmit``."""


@dataclasses.dataclass(frozen=True)
class StreamCredentials:
    """What a sender proves to an inbox: its name, to whom, and the plan's stream secret."""

    sender: str
    receiver: str
    secret: bytes


def _name_field(name: str) -> bytes:
    raw = name.encode()
    if not 0 < len(raw) < 256:
        raise ValueError(f"a chunk stream name must be 1-255 bytes, got {name!r}")
    return bytes([len(raw)]) + raw


def stream_mac(secret: bytes, challenge: bytes, sender: str, receiver: str) -> bytes:
    """HMAC-SHA256(secret, challenge | len sender | sender | len receiver | receiver)."""
    message = challenge + _name_field(sender) + _name_field(receiver)
    return hmac.new(secret, message, hashlib.sha256).digest()


def answer_frame(credentials: StreamCredentials, challenge: bytes) -> bytes:
    name = credentials.sender.encode()
    mac = stream_mac(credentials.secret, challenge, credentials.sender, credentials.receiver)
    return ANSWER.pack(ANSWER_MAGIC, FORMAT, len(name)) + name + mac


def _peer_address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


# struct tcp_info (linux/tcp.h) up to tcpi_bytes_retrans: 8 bytes of u8 fields, then u32s
# (rto at 8, snd_mss 16, rtt 68, snd_cwnd 80, total_retrans 100), u64s from 104
# (bytes_acked 120), u32 min_rtt at 148, u64 bytes_sent 200 and bytes_retrans 208.
_TCP_INFO = struct.Struct("<8xI4xI48xI8xI16xI16xQ20xI48xQQ")


@dataclasses.dataclass(frozen=True)
class TcpInfo:
    """What the kernel measured on one TCP connection (zeros where it cannot say)."""

    rto_s: float = 0.0
    rtt_s: float = 0.0
    min_rtt_s: float = 0.0
    mss: int = 0
    cwnd: int = 0
    """Congestion window, in segments."""
    bytes_acked: int = 0
    bytes_sent: int = 0
    """Data bytes put on the wire, retransmissions included."""
    bytes_retrans: int = 0


def tcp_info(sock: socket.socket | None) -> TcpInfo:
    """The kernel's view of ``sock`` (Linux); ``TcpInfo()`` where it cannot say (another
    system, not TCP, closed, or a kernel older than 4.19's tcp_info)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return TcpInfo()
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except OSError:
        return TcpInfo()
    if len(raw) < _TCP_INFO.size:
        return TcpInfo()
    rto, mss, rtt, cwnd, _retrans, acked, min_rtt, sent, retrans = _TCP_INFO.unpack(raw)
    return TcpInfo(rto / 1e6, rtt / 1e6, min_rtt / 1e6, mss, cwnd, acked, sent, retrans)


_TCP_THIN_LINEAR_TIMEOUTS = 16  # linux/tcp.h; not in Python's socket module
_SO_MAX_PACING_RATE = 47  # asm-generic/socket.h
_PACING_CEILING = (1 << 31) - 1  # bytes/s: no real cap; setting any value turns the kernel's pacing on


def tune_sender(sock: socket.socket) -> None:
    """A chunk stream's sending socket: no Nagle delay; retransmission timeouts that do not
    back off exponentially while few segments are in flight (the tail of a chunk on a lossy
    path, where a doubled timeout is what makes a version late); and the kernel's pacing,
    which spreads each window over the round trip: dozens of streams of one hop starting
    together would otherwise burst into the bottleneck's queue at once and lose together."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_THIN_LINEAR_TIMEOUTS, 1)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, _PACING_CEILING)


def tcp_rtt_s(transport: asyncio.BaseTransport) -> float:
    return tcp_info(transport.get_extra_info("socket")).rtt_s


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def is_stream_address(address: str) -> bool:
    return address.startswith(SCHEME + "://")


def parse_address(address: str) -> tuple[str, int]:
    if not is_stream_address(address):
        raise ValueError(f"not a chunk stream address: {address!r}")
    host, _, port = address[len(SCHEME) + 3 :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"chunk stream address needs host:port, got {address!r}")
    return host.strip("[]"), int(port)


def listen(url: str, backlog: int = 256) -> socket.socket:
    """A listening socket for ``tcp://HOST:PORT`` (``*``: every IPv4 interface; ``[::]``:
    every interface, IPv6 and IPv4; port 0: any free one), non-blocking."""
    if not url.startswith("tcp://"):
        raise ValueError(f"a chunk stream listens on a tcp URL, got {url!r}")
    host, _, port = url[len("tcp://") :].rpartition(":")
    if not port.isdigit():
        raise ValueError(f"a chunk stream listener needs host:port, got {url!r}")
    host = "" if host == "*" else host.strip("[]")
    if ":" in host:
        dual = host == "::" and socket.has_dualstack_ipv6()
        sock = socket.create_server((host, int(port)), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=dual)
    else:
        sock = socket.create_server((host, int(port)), family=socket.AF_INET, backlog=backlog)
    sock.setblocking(False)
    return sock


class _Connection(asyncio.BufferedProtocol):
    """One inbound connection: header, then the body into its destination, repeat."""

    def __init__(self, server: ChunkStreamServer) -> None:
        self._server = server
        # Admission (server.authenticate set): "answer-head", "answer-body", "parked", then
        # "frames"; an open inbox starts at "frames".
        self.phase = "frames" if server.authenticate is None else "answer-head"
        self.challenge = b""
        self._answer = bytearray(ANSWER.size)
        self.sender = ""
        self.mac = b""
        self._expiry: asyncio.TimerHandle | None = None
        self._header = bytearray(HEADER.size)
        self._header_view = memoryview(self._header)
        self._body: memoryview | None = None
        self._chunk: WeightChunk | None = None
        self._in_place = False  # the body being read lands in its destination
        self._got = 0
        self.transport: asyncio.Transport | None = None
        self.last_read_s = time.monotonic()
        self.chunk_started_s = 0.0  # when the body being read began

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server._connections.add(self)
        if self._server._paused:
            transport.pause_reading()
        if self.phase != "frames":
            self.challenge = os.urandom(32)
            transport.write(CHALLENGE.pack(CHALLENGE_MAGIC, FORMAT, self.challenge))
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(self._server.handshake_timeout_s, self._handshake_expired)

    def _handshake_expired(self) -> None:
        if self.phase.startswith("answer"):
            self._server._refuse_handshake(self, "no answer to its challenge in time")

    def admit(self) -> None:
        self.phase = "frames"
        self._got = 0
        if self.transport is not None and not self._server._paused and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._server._connections.discard(self)
        if self._chunk is not None:
            # The peer went away mid-body: the destination it was writing is given back.
            self._server.counters["frames_truncated"] += 1
            chunk, self._chunk, self._body = self._chunk, None, None
            self._server._abandon(chunk)

    @property
    def mid_chunk(self) -> bool:
        return self._chunk is not None

    @property
    def chunk(self) -> WeightChunk | None:
        """The chunk whose body is being read (None between chunks)."""
        return self._chunk

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.phase != "frames":
            # Exactly the answer's remaining bytes: nothing after it is read before admission.
            return memoryview(self._answer)[self._got :]
        if self._body is None:
            return self._header_view[self._got :]
        return self._body[self._got :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.phase != "frames":
            self._got += nbytes
            if self._got == len(self._answer):
                self._answer_read()
            return
        self._server.counters["reads"] += 1
        self._server.counters["bytes_received"] += nbytes
        self.last_read_s = time.monotonic()
        if self._in_place:
            self._server.counters["bytes_in_place"] += nbytes  # progress is judged in these
        self._got += nbytes
        if self._body is None:
            if self._got == HEADER.size:
                self._start_body()
        elif self._got == len(self._body):
            chunk, self._chunk, self._body, self._got = self._chunk, None, None, 0
            assert chunk is not None
            self._server._deliver(chunk)

    def _answer_read(self) -> None:
        server = self._server
        if self.phase == "answer-head":
            magic, fmt, name_len = ANSWER.unpack(self._answer)
            if magic != ANSWER_MAGIC or fmt != FORMAT or name_len == 0:
                server._refuse_handshake(self, "a malformed answer to its challenge")
                return
            self.phase, self._answer, self._got = "answer-body", bytearray(name_len + MAC_BYTES), 0
            return
        try:
            self.sender = bytes(self._answer[:-MAC_BYTES]).decode()
        except UnicodeDecodeError:
            server._refuse_handshake(self, "a sender name that is not UTF-8")
            return
        self.mac = bytes(self._answer[-MAC_BYTES:])
        if self._expiry is not None:
            self._expiry.cancel()
        self.phase, self._got = "parked", 0
        assert self.transport is not None
        self.transport.pause_reading()  # until admitted
        server._authenticate_connection(self)

    def _start_body(self) -> None:
        server = self._server
        magic, fmt, incarnation, version, index, nbytes = HEADER.unpack(self._header)
        if magic == DIAL_MORE_MAGIC and fmt == FORMAT and nbytes == 0 and server.on_dial_more is not None:
            self._got = 0
            server.on_dial_more(index)
            return
        if magic != MAGIC or fmt != FORMAT or nbytes > server.max_chunk_bytes or index < 0:
            server.counters["malformed"] += 1
            log.warning("chunk stream: malformed frame header from a peer; closing its connection")
            assert self.transport is not None
            self.transport.close()
            self._got = 0
            return
        target = server._destination(PolicyVersion(incarnation, version), index, nbytes)
        self._in_place = target is not None
        if target is None:
            target = np.empty(nbytes, dtype=np.uint8)
            server.counters["chunks_copied"] += 1
        else:
            server.counters["chunks_in_place"] += 1
        self._chunk = WeightChunk(incarnation=incarnation, version=version, index=index, data=target)
        self.chunk_started_s = time.monotonic()
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
        authenticate: Authenticate | None = None,
        admit_wait_s: float = 2.0,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self.authenticate = authenticate
        self.on_dial_more: Callable[[int], None] | None = None
        """Set by a member that dials (``echo2.weights.dial``): the publisher asked for
        this many dialed connections."""
        self.admit_wait_s = admit_wait_s
        self.handshake_timeout_s = handshake_timeout_s
        self._parked: dict[_Connection, float] = {}  # -> deadline (monotonic s)
        self._refusals_logged: set[str] = set()
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
                "admitted",
                "refused",
                "refused_handshake",
                "bytes_received",
                "bytes_in_place",
            ),
            0,
        )

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port``; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_dialed(self, sock: socket.socket) -> asyncio.Transport:
        """Read frames from a connection this side opened (a dialed stream: the peer
        sends down it what it would have sent to a relay inbox)."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(lambda: _Connection(self), sock)
        return transport

    async def start_on(self, listener: socket.socket) -> None:
        """Serve on a socket already bound and listening (bound early, served later);
        the server owns it from now on."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=listener)

    # -- admission (authenticate set) ---------------------------------------------------

    def _authenticate_connection(self, connection: _Connection) -> None:
        assert self.authenticate is not None
        if self.authenticate(connection.challenge, connection.sender, connection.mac):
            self.counters["admitted"] += 1
            connection.admit()
            return
        self._parked[connection] = time.monotonic() + self.admit_wait_s
        asyncio.get_running_loop().call_later(self.admit_wait_s, self.readmit)

    def readmit(self) -> None:
        """Ask ``authenticate`` again about every waiting sender (call it when the plan
        changes); refuse those whose wait is over."""
        assert self.authenticate is not None or not self._parked
        now = time.monotonic()
        for connection, deadline_s in list(self._parked.items()):
            transport = connection.transport
            if transport is None or transport.is_closing():
                del self._parked[connection]
            elif self.authenticate is not None and self.authenticate(
                connection.challenge, connection.sender, connection.mac
            ):
                del self._parked[connection]
                self.counters["admitted"] += 1
                connection.admit()
            elif now >= deadline_s - 1e-3:
                del self._parked[connection]
                self.counters["refused"] += 1
                self._log_refusal(
                    f"{connection.sender!r} from {_peer_address(transport)}",
                    "not the publisher or a predecessor in the plan, or a wrong HMAC",
                )
                transport.abort()

    def _refuse_handshake(self, connection: _Connection, why: str) -> None:
        self.counters["refused_handshake"] += 1
        if connection.transport is not None:
            self._log_refusal(f"a peer at {_peer_address(connection.transport)}", why)
            connection.transport.abort()

    def _log_refusal(self, who: str, why: str) -> None:
        if who not in self._refusals_logged:  # once per peer: a refused peer may retry forever
            self._refusals_logged.add(who)
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
                transport = connection.transport
                if transport is not None and not transport.is_closing() and connection.phase != "parked":
                    transport.resume_reading()

    def path_rtt_s(self) -> float:
        """The largest round trip the kernel measured on the connections open now (0: none
        or unknown): what deadlines on this inbox's paths are scaled by."""
        return max((tcp_rtt_s(c.transport) for c in self._connections if c.transport is not None), default=0.0)

    def drop_partial(self, quiet_s: float = 0.0) -> int:
        """Close every connection in the middle of a chunk that took no byte for
        ``quiet_s`` (its place goes back through ``abandon``); returns how many. For a
        consumer that saw no progress for a while: a peer that sent a header and went quiet
        must not hold a place forever, while one still moving bytes (of this version or a
        newer one) is left alone."""
        now = time.monotonic()
        stuck = [
            c for c in self._connections if c.mid_chunk and c.transport is not None and now - c.last_read_s >= quiet_s
        ]
        for connection in stuck:
            assert connection.transport is not None
            connection.transport.abort()
        return len(stuck)

    def drop_stuck(self, key: PolicyVersion, quiet_s: float, age_s: float | None = None) -> list[int]:
        """Close the connections in the middle of a chunk of version ``key`` that took no
        byte for ``quiet_s``, or (``age_s``) have been on that chunk that long (their places
        go back through ``abandon``); returns those chunks' indices."""
        now = time.monotonic()
        stuck = [
            c
            for c in self._connections
            if c.transport is not None
            and c.chunk is not None
            and c.chunk.policy_version == key
            and (now - c.last_read_s >= quiet_s or (age_s is not None and now - c.chunk_started_s >= age_s))
        ]
        indices = []
        for connection in stuck:
            assert connection.transport is not None and connection.chunk is not None
            indices.append(connection.chunk.index)
            connection.transport.abort()
        return indices

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._parked.clear()
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()


class ChunkStreamSender:
    """One outbound chunk stream; ``send`` returns once the kernel holds the whole frame.

    Same contract as a ``PushEndpoint`` on the weight path: ``await send(chunk)`` is True on
    success and raises ``ClosedError``/``TransportError`` when the peer is gone.

    A send is judged by progress, not completion: it fails (``TimeoutError``, and the
    stream is closed, as a half-written frame cannot be resumed) only when the kernel takes
    no byte of the frame for ``stall_timeout_s``, or three retransmission timeouts as the
    kernel measures them if that is longer. A 1 MB chunk on a loss-bound path at 100 KB/s
    takes 10 s and is no failure; a peer that stopped reading is one. Callers must not
    wrap ``send`` in a timeout of their own (``echo2.weights.plan.send_chunk``).
    """

    def __init__(
        self,
        address: str,
        *,
        connect_timeout_s: float = 5.0,
        stall_timeout_s: float = 5.0,
        credentials: StreamCredentials | None = None,
    ) -> None:
        """``credentials``: answer the inbox's challenge with them (``[security]``)."""
        self.credentials = credentials
        self.address = address
        self._host, self._port = parse_address(address)
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()
        self.closed = False
        self.stalls = 0
        """Sends that failed for want of progress."""
        self.bytes_written = 0
        """Bytes the kernel took on the current connection (frames whole): compared with
        ``TcpInfo.bytes_acked``, which chunks the peer has received."""
        self.on_lost: Callable[[], None] | None = None
        """Called once if the peer closes the connection (it never sends on it): the chunks
        in the kernel not yet acknowledged are lost with it (``echo2.weights.lanes``)."""
        self._watched: tuple[asyncio.AbstractEventLoop, int] | None = None

    @classmethod
    def adopted(cls, sock: socket.socket, address: str, *, stall_timeout_s: float = 5.0) -> ChunkStreamSender:
        """A sender on a connection the peer opened (``echo2.weights.dial``); ``address``
        names it (``dial://member``) and it is never re-opened from here."""
        sender = cls.__new__(cls)
        sender.credentials = None
        sender.address = address
        sender._host, sender._port = "", 0
        sender.connect_timeout_s = 0.0
        sender.stall_timeout_s = stall_timeout_s
        sock.setblocking(False)
        tune_sender(sock)
        sender._sock = sock
        sender._lock = asyncio.Lock()
        sender.closed = False
        sender.stalls = 0
        sender.bytes_written = 0
        sender.on_lost = None
        sender._watched = None
        sender._watch(asyncio.get_running_loop(), sock)
        return sender

    def _watch(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """Notice the peer closing (readable: it sends nothing else) even while idle."""
        loop.add_reader(sock.fileno(), self._readable)
        self._watched = (loop, sock.fileno())

    def _unwatch(self) -> None:
        if self._watched is not None:
            loop, fd = self._watched
            self._watched = None
            with contextlib.suppress(RuntimeError):  # the loop closed first
                loop.remove_reader(fd)

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            self._unwatch()
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # a peer has nothing to say on a chunk stream: dropped, only its close counts
        self._unwatch()
        if self.on_lost is not None:
            self.on_lost()

    async def send_frame(self, frame: bytes) -> None:
        """Write a control frame (whole, between chunks) on this stream."""
        async with self._lock:
            if self._sock is None or self.closed:
                raise ClosedError(f"chunk stream to {self.address} is closed")
            try:
                await self._send_progressing(asyncio.get_running_loop(), self._sock, memoryview(frame))
            except OSError as exc:
                self.close()
                raise TransportError(f"chunk stream to {self.address}: {exc}") from exc

    def stall_deadline_s(self) -> float:
        """Seconds without a byte taken before a send fails (see the class docstring)."""
        return max(self.stall_timeout_s, 3 * tcp_info(self._sock).rto_s)

    async def connect(self) -> None:
        """Open the connection now rather than at the first send (the kernel then knows the
        path's round trip before any chunk is cut for it)."""
        async with self._lock:
            if self._sock is None and not self.closed:
                try:
                    await self._connect(asyncio.get_running_loop())
                except OSError as exc:
                    raise TransportError(f"chunk stream to {self.address}: {exc}") from exc

    def info(self) -> TcpInfo:
        """The kernel's measurements of this stream (``TcpInfo()`` before it connects)."""
        return tcp_info(self._sock)

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
                    await self._send_progressing(loop, sock, memoryview(header)[sent:])
                    sent = len(header)
                if sent - len(header) < len(data):
                    await self._send_progressing(loop, sock, data[sent - len(header) :])
                self.bytes_written += len(header) + len(data)
            except TimeoutError:
                self.stalls += 1
                self.close()
                raise
            except OSError as exc:
                self.close()
                raise TransportError(f"chunk stream to {self.address}: {exc}") from exc
        return True

    async def _send_progressing(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, data: memoryview) -> None:
        """Hand ``data`` to the kernel as it makes room; TimeoutError once it took no byte
        for the stall deadline, judged again at the deadline (the kernel's retransmission
        timeout may have backed off meanwhile: a path losing packets, not a dead peer)."""
        fd = sock.fileno()
        progress_s = loop.time()
        while data:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent:
                data, progress_s = data[sent:], loop.time()
                continue
            writable = loop.create_future()
            loop.add_writer(fd, _resolve, writable)
            try:
                async with asyncio.timeout_at(progress_s + self.stall_deadline_s()):
                    await writable
            except TimeoutError:
                if loop.time() >= progress_s + self.stall_deadline_s():
                    raise
            finally:
                loop.remove_writer(fd)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        if not self._host:
            raise ClosedError(f"chunk stream {self.address} was dialed by its peer and is gone")
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            tune_sender(sock)
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.sock_connect(sock, addr)
                if self.credentials is not None:
                    await self._answer_challenge(loop, sock, self.credentials)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.bytes_written = 0
        self._watch(loop, sock)
        return sock

    async def _answer_challenge(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, credentials: StreamCredentials
    ) -> None:
        challenge = bytearray(CHALLENGE.size)
        view, got = memoryview(challenge), 0
        while got < len(challenge):
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise TransportError(f"chunk stream to {self.address}: closed before its challenge")
            got += n
        magic, fmt, nonce = CHALLENGE.unpack(challenge)
        if magic != CHALLENGE_MAGIC or fmt != FORMAT:
            raise TransportError(f"chunk stream to {self.address}: not an inbox that authenticates senders")
        await loop.sock_sendall(sock, answer_frame(credentials, nonce))

    def close(self) -> None:
        self.closed = True
        self._unwatch()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


__all__ = [
    "DIAL_MORE_MAGIC",
    "HEADER",
    "SCHEME",
    "Authenticate",
    "ChunkStreamSender",
    "ChunkStreamServer",
    "StreamCredentials",
    "TcpInfo",
    "is_stream_address",
    "listen",
    "parse_address",
    "stream_mac",
    "tcp_info",
    "tcp_rtt_s",
]
