"""Dialed chunk streams: weights for a worker that accepts no inbound connection.

A sampler behind NAT or a firewall with no forwarded port (its host's ``inbound = false``)
cannot take a relay inbox: nobody can connect to it. It dials the weight publisher's
dial-in listener instead (``PortAddresses.stream_dial``, a fixed port of the publisher's
host), announces ``dial://<its name>`` as its relay address, and the publisher sends that
member's chunks, streamed and repaired, down the connections it dialed: the frames of
``echo2.weights.stream``, the other way round. Such a member is fed by the publisher
directly, never by a predecessor in a chain (nobody can reach it).

Handshake (listener first, so that one flow serves open and sealed runs)::

    challenge (listener -> dialer, 40 bytes): the inbox challenge of echo2.weights.stream
              (magic b"E2SC", format 1, 3 pad bytes, 32 random bytes)
    answer    (dialer -> listener): magic b"E2DA", format u8 (=1), name length u8, 2 pad
              bytes, the dialer's name (UTF-8), then 32 bytes: under [security]
              HMAC-SHA256(stream_secret, challenge | len(dialer) u8 | dialer
                                         | len(listener) u8 | listener)
              with the secret of the current plan or the one before; else zeros

After it the listener sends frames and the dialer only reads. How many connections: one
at first; the publisher adapts its stream count to the path like any other hop
(``echo2.weights.lanes``) and, when it wants more than it has, sends a header with magic
``E2DN`` whose index is the number it wants (``stream.DIAL_MORE_MAGIC``). The dialer keeps
that many open (capped by its own ``max_streams``), dialing again any that close.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import struct
from collections.abc import Callable

from echo2.errors import TransportError
from echo2.weights.stream import (
    CHALLENGE,
    CHALLENGE_MAGIC,
    DIAL_MORE_MAGIC,
    FORMAT,
    HEADER,
    MAC_BYTES,
    ChunkStreamServer,
    parse_address,
    stream_mac,
)

log = logging.getLogger(__name__)

SCHEME = "dial"
ANSWER = struct.Struct("<4sBB2x")
ANSWER_MAGIC = b"E2DA"
REDIAL_S = 1.0
"""Seconds between two attempts to bring the dialed connections back to the number wanted."""

Admit = Callable[[bytes, str, bytes], bool]
"""(challenge, dialer's name, mac) -> may this dialer take chunks down its connection?"""


def dial_address(member: str) -> str:
    """The relay address a member that dials announces."""
    return f"{SCHEME}://{member}"


def is_dial_address(address: str) -> bool:
    return address.startswith(SCHEME + "://")


def dial_more_frame(wanted: int) -> bytes:
    return HEADER.pack(DIAL_MORE_MAGIC, FORMAT, 0, 0, wanted, 0)


def answer_frame(dialer: str, listener: str, challenge: bytes, secret: bytes) -> bytes:
    name = dialer.encode()
    mac = stream_mac(secret, challenge, dialer, listener) if secret else bytes(MAC_BYTES)
    return ANSWER.pack(ANSWER_MAGIC, FORMAT, len(name)) + name + mac


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    view, got = memoryview(data), 0
    while got < nbytes:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise TransportError("closed during the dial handshake")
        got += n
    return bytes(data)


class DialListener:
    """Publisher side: accepts dialed connections; ``on_dialed(name, sock)`` takes each
    admitted one (the socket is then the caller's)."""

    def __init__(
        self,
        admit: Admit,
        on_dialed: Callable[[str, socket.socket], None],
        *,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        self._admit = admit
        self._on_dialed = on_dialed
        self.handshake_timeout_s = handshake_timeout_s
        self.counters = dict.fromkeys(("dialed", "refused"), 0)
        self._refusals_logged: set[str] = set()

    async def serve(self, listener: socket.socket, group: asyncio.TaskGroup) -> None:
        """Accept on ``listener`` (bound and listening) until cancelled; it is closed then."""
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        try:
            while True:
                sock, _ = await loop.sock_accept(listener)
                group.create_task(self._greet(sock))
        finally:
            listener.close()

    async def _greet(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        name = ""
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                challenge = os.urandom(32)
                await loop.sock_sendall(sock, CHALLENGE.pack(CHALLENGE_MAGIC, FORMAT, challenge))
                magic, fmt, length = ANSWER.unpack(await _recv_exact(loop, sock, ANSWER.size))
                if magic != ANSWER_MAGIC or fmt != FORMAT or length == 0:
                    raise TransportError("not a dial answer")
                raw = await _recv_exact(loop, sock, length + MAC_BYTES)
                name = raw[:length].decode()
                if not self._admit(challenge, name, raw[length:]):
                    raise TransportError("not a member this publisher may stream to, or a wrong HMAC")
        except (OSError, TimeoutError, TransportError, UnicodeDecodeError) as exc:
            self.counters["refused"] += 1
            who = name or "a peer"
            if who not in self._refusals_logged:  # once per peer: a refused one may retry forever
                self._refusals_logged.add(who)
                log.warning("dial-in: refused %s: %s", who, exc)
            sock.close()
            return
        self.counters["dialed"] += 1
        self._on_dialed(name, sock)


class Dialer:
    """Member side: keeps ``wanted`` connections dialed to the publisher's listener and
    reads chunk frames from each into ``server`` (which needs no listener of its own)."""

    def __init__(
        self,
        server: ChunkStreamServer,
        address: str,
        name: str,
        *,
        credentials: Callable[[], tuple[str, bytes] | None],
        max_streams: int = 128,
        connect_timeout_s: float = 5.0,
    ) -> None:
        """``address``: the listener (``chunkstream://host:port``); ``credentials`` gives
        (listener's name, stream secret) of the current plan, or None while no plan is
        known (a sealed run dials only once one is)."""
        self.server = server
        self.address = address
        self._host, self._port = parse_address(address)
        self.name = name
        self._credentials = credentials
        self.max_streams = max_streams
        self.connect_timeout_s = connect_timeout_s
        self.wanted = 1
        self._transports: list[asyncio.Transport] = []
        self._changed = asyncio.Event()
        self.counters = dict.fromkeys(("dials", "dial_failures"), 0)
        server.on_dial_more = self._on_dial_more

    @property
    def connections(self) -> int:
        self._transports = [t for t in self._transports if not t.is_closing()]
        return len(self._transports)

    def _on_dial_more(self, wanted: int) -> None:
        self.wanted = max(1, min(self.max_streams, wanted))
        self._changed.set()

    async def run(self, sealed: bool) -> None:
        """Dial until cancelled: up to ``wanted`` connections, again every ``REDIAL_S``."""
        try:
            while True:
                credentials = self._credentials()
                if credentials is not None or not sealed:
                    missing = self.wanted - self.connections
                    if missing > 0:
                        results = await asyncio.gather(
                            *(self._dial(credentials) for _ in range(missing)), return_exceptions=True
                        )
                        for result in results:
                            if isinstance(result, asyncio.CancelledError):
                                raise result
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REDIAL_S):
                        await self._changed.wait()
        finally:
            for transport in self._transports:
                transport.close()

    async def _dial(self, credentials: tuple[str, bytes] | None) -> None:
        loop = asyncio.get_running_loop()
        self.counters["dials"] += 1
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
                family, kind, proto, _, addr = infos[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, addr)
                magic, fmt, challenge = CHALLENGE.unpack(await _recv_exact(loop, sock, CHALLENGE.size))
                if magic != CHALLENGE_MAGIC or fmt != FORMAT:
                    raise TransportError("not a dial-in listener")
                listener, secret = credentials if credentials is not None else ("", b"")
                await loop.sock_sendall(sock, answer_frame(self.name, listener, challenge, secret))
            self._transports.append(await self.server.serve_dialed(sock))
        except (OSError, TimeoutError, TransportError):
            self.counters["dial_failures"] += 1
            if sock is not None:
                sock.close()


def admits(secrets: Callable[[], list[bytes]], members: Callable[[], set[str]], listener: str) -> Admit:
    """The publisher's admission of a dialer: a member it may stream to, proving the stream
    secret of the current plan or the one before when there is one (``[security]``)."""

    def admit(challenge: bytes, dialer: str, mac: bytes) -> bool:
        if dialer not in members():
            return False
        known = [secret for secret in secrets() if secret]
        if not known:
            return True  # an open run: the chunks need no secrecy from the stream
        return any(hmac.compare_digest(mac, stream_mac(secret, challenge, dialer, listener)) for secret in known)

    return admit


__all__ = [
    "SCHEME",
    "DialListener",
    "Dialer",
    "admits",
    "dial_address",
    "dial_more_frame",
    "is_dial_address",
]
