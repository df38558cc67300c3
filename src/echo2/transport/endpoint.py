"""Async endpoints over ZeroMQ sockets, with the fast path and per-endpoint statistics.

Why not plain ``zmq.asyncio``: ``await sock.recv()`` costs ~25 us per message even when one
is waiting, capping a socket near 40k msg/s. Endpoints await one message, then drain what
else is queued with non-blocking receives on a synchronous shadow of the same socket, and
hand out lists. Sends try a non-blocking send first and await only under back-pressure
(the high-water mark is reached). A cancelled receive loses nothing: the await is the only
suspension point and pyzmq keeps a message that was not delivered.

Each endpoint owns one socket and one ``Codec``. Outcomes at the high-water mark are explicit
per endpoint: ``on_full="block"`` waits (PUSH, DEALER, ROUTER, weights), ``on_full="drop"``
drops and counts (telemetry). ROUTER sends to an unknown peer are counted as ``unroutable``.
Malformed input is counted in ``decode_errors`` and dropped; the endpoint keeps running.
So is a well-formed message whose fields contradict each other (``consistency.check``, run
on every message received: the codec stays a plain pair of functions). An endpoint given a
recording file (``record_to``) appends the frames of every message it receives, before
decoding, and of every message it is asked to send (``recording.py``).

Memory is bounded per socket, not per process: ``SocketOptions.max_message_bytes``
(ZMQ_MAXMSGSIZE) makes libzmq close the connection of a peer whose frame is larger, while
reading its size and before buffering any of it, and each peer's pipe holds at most ``hwm``
messages; so one peer can park at most ``hwm * max_message_bytes`` bytes in a receiving
socket. A receive drains at most ``recv_budget_bytes`` past the first message, so a
batch handed out is bounded in bytes as well as in messages. Bound sockets with
``count_disconnects`` (every actor's) count their peers' disconnects (``EndpointStats.disconnects``: the oversized-frame closes among them,
libzmq does not tell those apart).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import zmq
import zmq.asyncio

from echo2.errors import ClosedError, DecodeError, EndOfStream, TransportError
from echo2.messages import AnyMessage, EndOfStreamMsg, Message
from echo2.transport import consistency
from echo2.transport.codec import Codec
from echo2.transport.consistency import InconsistentMessage
from echo2.transport.recording import Recorder, recording_header

log = logging.getLogger(__name__)

OnFull = Literal["block", "drop"]
SocketKind = Literal["push", "pull", "dealer", "router", "pub", "sub"]
DEFAULT_HWM = 1000
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CONTROL_MAX_MESSAGE_BYTES = 256 * 1024
"""Channels of requests, leases and acknowledgements: the largest legitimate one (a
``TaskLease`` with its prompt text, a ``LeaseRecords`` reply) is a few KiB."""
TELEMETRY_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Heartbeats: a process's actors' statistics records (~100 KiB with 256 samplers)."""
DEFAULT_RECV_BUDGET_BYTES = 64 * 1024 * 1024
"""Bytes one receive drains past its first message (the first is always taken)."""
_PEER_COUNTS_MAX = 64  # peers named in per-peer counters; later ones share one entry
# Messages drained and decoded per receive. Larger batches barely cut the per-await cost
# further but keep more objects alive at once, which the garbage collector pays for: at
# 1024, 64-record messages decoded ~30% slower than at 128 (benchmarks/transport.py).
DEFAULT_RECV_BATCH = 128
_DECODE_LOG_INTERVAL_S = 5.0
# Bundles: a small message costs a receiver ~3 us of which ~2 are per ZeroMQ message (the
# receive call, a frame object, a decode call), so a stream of small records moves several
# times faster in bundles. Only messages under 4 KiB join one (above that the per-message
# cost is a small share and joining would copy for nothing); 64 messages or 64 KiB bound a
# bundle, so that one HWM slot stays small.
DEFAULT_COALESCE = 64
COALESCE_MESSAGE_MAX_BYTES = 4 * 1024
COALESCE_MAX_BYTES = 64 * 1024
# A frame's metadata property naming its authenticated peer. As bytes: pyzmq types
# Frame.get(bytes) as the str a property is, Frame.get(str) as int | str.
USER_ID = b"User-Id"


def _user_id(frame: zmq.Frame) -> str | None:
    """The CURVE key (z85) a message's connection authenticated with; None for one without
    a handshake: an ``inproc`` peer, in this process (libzmq then has no such property and
    ``get`` raises EINVAL, which crashed a CURVE server with a co-located peer)."""
    try:
        return frame.get(USER_ID)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EINVAL:
            raise
        return None


@dataclasses.dataclass(frozen=True)
class EndpointStats:
    """A snapshot of one endpoint's counters."""

    name: str
    sent: int
    received: int
    dropped: int
    unroutable: int
    decode_errors: int
    queued: int
    bytes_sent: int
    bytes_received: int
    eos_received: int
    disconnects: int = 0
    """Peer connections closed (bound tcp/ipc sockets only): by the peer, by a heartbeat
    timeout, or by libzmq for a frame over ``max_message_bytes``."""
    inconsistent: dict[str, int] = dataclasses.field(default_factory=dict)
    """Well-formed messages whose fields contradict each other, dropped, by reason
    (``echo2.transport.consistency``); also counted in ``decode_errors``."""
    decode_errors_by_peer: dict[str, int] = dataclasses.field(default_factory=dict)
    """ROUTER only: ``decode_errors`` by the peer's routing id (hex; the first 64 peers,
    later ones under "other")."""


@dataclasses.dataclass(frozen=True)
class SocketOptions:
    """Options every echo2 socket gets explicitly instead of libzmq's defaults.

    ``hwm`` counts messages, not bytes: size it from the message size (e.g. weight chunks).
    """

    hwm: int = DEFAULT_HWM
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    linger_ms: int = 0
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 1000
    """Back-off cap between reconnects: a link that returns is used again within it."""
    connect_timeout_ms: int = 3000
    """A tcp connect not answered in this long is abandoned and tried afresh. The kernel
    backs a lost SYN off exponentially (1, 3, 7, 15 s ...): after a 12 s outage a connect
    begun during it would otherwise wait for its next retransmission, seconds past the
    link's return."""
    coalesce: int = DEFAULT_COALESCE
    """PUSH with ``on_full="block"``: up to this many small messages sent back to back (in
    one turn of the event loop) leave as one bundle (``codec.py``); 1 turns it off."""
    recv_budget_bytes: int = DEFAULT_RECV_BUDGET_BYTES
    """Bytes one receive drains from the socket past its first message."""
    count_disconnects: bool = False
    """Bound on tcp/ipc: count peers' disconnects (``EndpointStats.disconnects``) with a
    socket monitor. A socket has one monitor: leave it off to monitor the socket yourself
    (the actors' bound ports turn it on, ``ActorContext.open``)."""


class Endpoint:
    """One socket, its codec and counters. Created by ``Transport``; use as a context manager."""

    socket_type: int = -1
    _envelope_frames = 0  # leading routing frames on receive (ROUTER: peer id, SUB: topic)

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        *,
        name: str,
        codec: Codec,
        on_full: OnFull = "block",
        producers: int = 0,
        on_close: Any = None,
        coalesce: int = 1,
        recv_budget_bytes: int = DEFAULT_RECV_BUDGET_BYTES,
    ) -> None:
        self.name = name
        self._socket = socket
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._codec = codec
        self._on_full = on_full
        self._producers = producers
        self._on_close = on_close
        self._pending: collections.deque[Any] = collections.deque()  # frames, not decoded
        self._ready: collections.deque[tuple[bytes, Message]] = collections.deque()  # decoded
        self._closed = False
        self._ended = False
        self._eos_from: set[str] = set()
        self._sent = self._received = self._dropped = self._unroutable = 0
        self._decode_errors = self._bytes_sent = self._bytes_received = 0
        self._last_decode_log = 0.0
        self._recv_budget_bytes = recv_budget_bytes
        self._inconsistent: dict[str, int] = {}
        self._decode_errors_by_peer: dict[str, int] = {}
        self._monitor: zmq.Socket[bytes] | None = None  # sync shadow of _monitor_pair
        self._monitor_pair: Any = None
        self._disconnects = 0
        self.endpoints: list[str] = []
        self._user_ids: dict[bytes, str | None] | None = None
        self._recorder: Recorder | None = None
        # Private pyzmq hook (zmq/_future.py), the one its own sync paths use; should a
        # future pyzmq drop it, re-arming becomes a no-op and the contract tests catch it.
        self._schedule_events = getattr(socket, "_schedule_remaining_events", _no_events)
        # Bundling (PUSH, blocking): frame 0s of small messages not yet handed to ZeroMQ.
        self._coalesce = coalesce if on_full == "block" and codec.bundles else 1
        self._bundle: list[bytes] = []
        self._bundle_bytes = 0
        self._flush_scheduled = False
        self._bundle_idle = asyncio.Event()  # cleared while a bundle is being awaited out
        self._bundle_idle.set()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket. With ``linger_ms`` > 0, messages still queued get that long to
        reach their peers (the context's ``term()`` waits for them); 0 discards them."""
        if self._closed:
            return
        if self._bundle:
            self._flush_at_close(linger_ms)
        self._closed = True
        if self._recorder is not None:
            self._recorder.close()
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor_pair.close(linger=0)
        self._socket.close(linger=linger_ms)
        if self._on_close is not None:
            self._on_close(self)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def record_to(self, path: Path, *, actor: str, port: str, socket: str, max_bytes: int) -> Recorder:
        """Append this endpoint's traffic, both ways, to the recording file ``path`` from
        now on (until it is closed or the file reaches ``max_bytes``)."""
        header = recording_header(actor, port, socket, self._envelope_frames, self._codec.types)
        self._recorder = Recorder(path, header, max_bytes=max_bytes)
        return self._recorder

    def monitor_disconnects(self) -> None:
        """Count peers' disconnects (``EndpointStats.disconnects``). The events queue in an
        inproc PAIR that ``statistics()`` drains: no task, and an event queue bounded by its
        HWM (a burst of more disconnects than that between two reads is undercounted)."""
        if self._monitor is None:
            # On the async socket: the sync shadow has no context to make the PAIR in.
            pair = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitor_pair = pair
            self._monitor = zmq.Socket.shadow(pair.underlying)

    def _drain_monitor(self) -> None:
        if self._monitor is None or self._closed:
            return
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._disconnects += 1

    def statistics(self) -> EndpointStats:
        self._drain_monitor()
        return EndpointStats(
            name=self.name,
            sent=self._sent,
            received=self._received,
            dropped=self._dropped,
            unroutable=self._unroutable,
            decode_errors=self._decode_errors,
            queued=len(self._pending) + len(self._ready) + len(self._bundle),
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            eos_received=len(self._eos_from),
            disconnects=self._disconnects,
            inconsistent=dict(self._inconsistent),
            decode_errors_by_peer=dict(self._decode_errors_by_peer),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"endpoint {self.name!r} is closed")

    def _woken_by_close(self) -> bool:
        """True when an await was cancelled by ``close()`` (pyzmq cancels pending futures),
        not because our own task is being cancelled."""
        task = asyncio.current_task()
        return self._closed and (task is None or not task.cancelling())

    # -- frames out ------------------------------------------------------------------

    async def _send_frames(self, frames: Sequence[Any]) -> bool:
        """Send one multipart message; returns False when dropped or unroutable."""
        self._check_open()
        try:
            if len(frames) == 1 and len(frames[0]) < zmq.COPY_THRESHOLD:
                # A small header alone: a plain copying send skips send_multipart's checks
                # and zmq.Frame objects (~1 us of a ~3 us message).
                self._sync.send(frames[0], zmq.NOBLOCK)
            else:
                self._sync.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self._rearm()
        except zmq.Again:
            if self._on_full == "drop":
                self._dropped += 1
                return False
            if not await self._send_when_room(frames):
                return False
        except zmq.ZMQError as exc:
            return self._send_failed(exc)
        self._sent += 1
        self._bytes_sent += _frames_nbytes(frames)
        return True

    async def send_encoded(self, frames: Sequence[Any]) -> bool:
        """Send one message's frames as they are, not encoded here (a recording's frames,
        envelope included: a ROUTER's peer, a topic). False if dropped or unroutable."""
        return await self._send_frames(frames)

    async def _send_when_room(self, frames: Sequence[Any]) -> bool:
        """Back-pressure: wait until the message fits under the HWM, then send it.

        XPUB with XPUB_NODROP and ROUTER with ROUTER_MANDATORY report POLLOUT while the
        peer's pipe is still full, so pyzmq's awaited send fails with ``Again`` instead of
        waiting; retry after a short pause that grows to 1 ms.
        """
        pause_s = 0.0
        while True:
            self._check_open()
            try:
                await self._socket.send_multipart(frames, copy=False)
                return True
            except zmq.Again:
                pause_s = min(max(2 * pause_s, 50e-6), 1e-3)
            except zmq.ZMQError as exc:
                return self._send_failed(exc)
            except asyncio.CancelledError:
                if self._woken_by_close():
                    raise ClosedError(f"endpoint {self.name!r} closed during send") from None
                raise
            await asyncio.sleep(pause_s)

    def _send_failed(self, exc: zmq.ZMQError) -> bool:
        if exc.errno == zmq.EHOSTUNREACH:
            self._unroutable += 1
            return False
        if self._closed:
            raise ClosedError(f"endpoint {self.name!r} closed during send") from exc
        raise TransportError(f"{self.name}: send failed: {exc}") from exc

    # -- frames in -------------------------------------------------------------------

    async def _fill(self, max_messages: int) -> None:
        """Wait for at least one multipart message, then drain up to ``max_messages`` or
        ``recv_budget_bytes``, whichever comes first (what stays queued stays in libzmq,
        under its per-peer HWM)."""
        self._check_open()
        if not self._pending:
            first = await self._await_first()
            if self._user_ids is not None:
                self._user_ids[first[0].bytes] = _user_id(first[-1])
            self._pending.append(first)
        budget = self._recv_budget_bytes
        while len(self._pending) < max_messages and budget > 0:
            try:
                frames = self._recv_nowait()
            except zmq.Again:
                break
            self._pending.append(frames)
            budget -= _frames_nbytes(frames)
        self._rearm()

    async def _await_first(self) -> list[Any]:
        while True:
            try:
                return await self._socket.recv_multipart(copy=False)
            except asyncio.CancelledError:
                if self._woken_by_close():
                    raise ClosedError(f"endpoint {self.name!r} closed during recv") from None
                raise
            except zmq.Again:
                # The socket signalled readable but held no message: seen once on a CURVE
                # server across hosts while its ZAP handler refused a client of unknown
                # key; it crashed the Rewarder. Nothing was lost: wait again.
                self._check_open()
            except zmq.ZMQError as exc:
                if self._closed:
                    raise ClosedError(f"endpoint {self.name!r} closed during recv") from exc
                raise TransportError(f"{self.name}: recv failed: {exc}") from exc

    def _rearm(self) -> None:
        """Let pending awaits on the async socket see events the shadow socket consumed.

        The ZeroMQ FD is edge-triggered: a send or receive on the sync shadow can swallow the
        edge that a concurrent ``await recv()`` (or a blocked send) on the same socket waits
        for, which then never wakes (seen as a whole pipeline stalling at random). pyzmq's
        own calls re-check pending events after each operation; this does the same for ours.
        """
        self._schedule_events()

    def _recv_nowait(self) -> list[Any]:
        """One queued multipart message, or ``zmq.Again``.

        Envelope and header frames come back as ``bytes``: for small frames a copy is
        cheaper than a ``zmq.Frame`` (and decodes faster); data frames (large arrays) stay
        zero-copy ``zmq.Frame``s. ``Frame.more`` avoids a ``getsockopt(RCVMORE)`` per frame.
        """
        recv = self._sync.recv
        frame = recv(zmq.NOBLOCK, copy=False)
        frames: list[Any] = [frame.bytes]
        copied = 1 + self._envelope_frames
        while frame.more:
            frame = recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.bytes if len(frames) < copied else frame)
        if self._user_ids is not None:
            self._user_ids[frames[0]] = _user_id(frame)
        return frames

    def track_user_ids(self) -> None:
        """Remember each peer's authenticated ``User-Id`` (its CURVE public key, z85)."""
        self._user_ids = {}

    def user_id(self, peer: bytes) -> str | None:
        """The authenticated identity of a ROUTER peer, or None without CURVE."""
        return None if self._user_ids is None else self._user_ids.get(peer)

    def _decode(self, frames: Sequence[Any], peer: bytes | None = None) -> Message | list[Message] | None:
        """Decode or count-and-drop: a message, a bundle's messages, or None. End-of-stream
        markers are consumed here. ``peer``: a ROUTER's sender, for per-peer counts."""
        self._bytes_received += _frames_nbytes(frames)
        try:
            message = self._codec.decode_any(frames)
            if isinstance(message, list):
                for one in message:
                    consistency.check(one)
            else:
                consistency.check(message)
        except DecodeError as exc:
            self._received += 1
            self._decode_errors += 1
            if isinstance(exc, InconsistentMessage):
                self._inconsistent[exc.reason] = self._inconsistent.get(exc.reason, 0) + 1
            if peer is not None:
                self._count_peer_error(peer)
            now = time.monotonic()
            if now - self._last_decode_log >= _DECODE_LOG_INTERVAL_S:
                self._last_decode_log = now
                log.warning(
                    "%s: dropped a malformed message (%d so far): %s",
                    self.name,
                    self._decode_errors,
                    exc,
                )
            return None
        if isinstance(message, list):  # a bundle
            self._received += len(message)
            kept = [m for m in message if not self._is_eos(m)]
            return kept or None
        self._received += 1
        return None if self._is_eos(message) else message

    def _count_peer_error(self, peer: bytes) -> None:
        counts = self._decode_errors_by_peer
        key = peer.hex()
        if key not in counts and len(counts) >= _PEER_COUNTS_MAX:
            key = "other"
        counts[key] = counts.get(key, 0) + 1

    def _flush_at_close(self, linger_ms: int) -> None:
        """Closing with bundled messages pending (only sending endpoints have any)."""

    def _is_eos(self, message: Message) -> bool:
        if type(message) is not EndOfStreamMsg:
            return False
        self._eos_from.add(message.producer_id)
        if self._producers and len(self._eos_from) >= self._producers:
            self._ended = True
        return True


def _frames_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a message's frames (a loop: this runs once per message)."""
    total = 0
    for frame in frames:
        total += frame.nbytes if type(frame) is memoryview else len(frame)
    return total


Received = TypeVar("Received")


class _Receiving(Endpoint, Generic[Received]):
    """Receive logic shared by every endpoint kind. ``Received`` is what a receive hands
    out: a message, or for a ROUTER ``(peer_id, message)``.

    ``_envelope_frames`` is how many leading frames are routing data (a ROUTER's peer id, a
    SUB's topic) rather than message; those come back alongside the message.
    """

    _envelope_frames = 0

    async def _wait_ready(self, max_messages: int) -> None:
        """Receive and decode until at least one message is ready (bad input is dropped).

        Decoded messages wait in ``_ready`` until handed out, so a caller that stops early
        (``break`` out of ``async for``, cancellation between messages) loses none of them.
        """
        self._check_open()
        skip = self._envelope_frames
        while not self._ready:
            if self._ended and not self._pending:
                raise EndOfStream(self.name)
            await self._fill(max_messages)
            while self._pending:
                frames = self._pending.popleft()
                if self._recorder is not None:
                    self._recorder.received(frames)
                if len(frames) <= skip:
                    self._received += 1
                    self._decode_errors += 1
                    continue
                peer = bytes(frames[0]) if self.socket_type == zmq.ROUTER else None
                message = self._decode(frames[skip:] if skip else frames, peer)
                if message is None:
                    continue
                envelope = bytes(frames[0]) if skip else b""
                if isinstance(message, list):  # a bundle
                    self._ready.extend([(envelope, m) for m in message])
                else:
                    self._ready.append((envelope, message))

    async def _recv_enveloped(self, max_messages: int) -> list[tuple[bytes, Message]]:
        await self._wait_ready(max_messages)
        ready = self._ready
        if len(ready) <= max_messages:
            out = list(ready)
            ready.clear()
            return out
        return [ready.popleft() for _ in range(max_messages)]

    def _item(self, enveloped: tuple[bytes, Message]) -> Received:
        """What a receive hands out for one enveloped message."""
        raise NotImplementedError

    async def recv_many(self, max_messages: int = DEFAULT_RECV_BATCH) -> list[Received]:
        """Return 1..max_messages messages; raise ``EndOfStream`` once the channel ended."""
        raise NotImplementedError  # each kind builds its list without a call per message

    async def recv(self) -> Received:
        """Return one message (later ones stay queued locally for the next call)."""
        return self._item((await self._recv_enveloped(1))[0])

    async def __aiter__(self) -> AsyncIterator[Received]:
        """Messages until end of stream; leaving the loop early loses nothing."""
        while True:
            try:
                await self._wait_ready(DEFAULT_RECV_BATCH)
            except EndOfStream:
                return
            yield self._item(self._ready.popleft())


class _MessageReceiving(_Receiving[Message]):
    """PULL, DEALER and SUB: a receive hands out the message alone."""

    def _item(self, enveloped: tuple[bytes, Message]) -> Message:
        return enveloped[1]

    async def recv_many(self, max_messages: int = DEFAULT_RECV_BATCH) -> list[Message]:
        return [message for _, message in await self._recv_enveloped(max_messages)]


class _Sending(Endpoint):
    async def send(self, message: Message) -> bool:
        """Send one message. Returns False if it was dropped at the HWM (``on_full="drop"``).

        With bundling (PUSH), a small message may wait in the endpoint until the current
        turn of the event loop ends (or the bundle is full) and then leaves with the ones
        sent after it; order is kept. ``flush()`` hands everything to ZeroMQ now.
        """
        frames = self._codec.encode(message)
        if self._recorder is not None:
            self._recorder.sent(frames)
        if self._coalesce > 1 and len(frames) == 1 and len(frames[0]) < COALESCE_MESSAGE_MAX_BYTES:
            return await self._send_coalesced(frames[0])
        if self._bundle or self._bundle_in_flight:
            await self.flush()
        return await self._send_frames(frames)

    async def send_many(self, messages: Iterable[Message]) -> int:
        """Send messages in order; returns how many were sent (not dropped)."""
        sent = 0
        for message in messages:
            sent += await self.send(message)
        return sent

    async def send_eos(self, producer_id: str) -> None:
        """Tell the consumer this producer is done."""
        await self.send(EndOfStreamMsg(producer_id=producer_id))

    async def flush(self) -> None:
        """Wait until every message sent so far is in ZeroMQ's queue (bundles included)."""
        while self._bundle or self._bundle_in_flight:
            if self._bundle_in_flight:
                await self._bundle_idle.wait()  # another task is sending the previous bundle
                continue
            await self._send_bundle()

    # -- bundling --------------------------------------------------------------------

    async def _send_coalesced(self, header: bytes) -> bool:
        self._check_open()
        self._bundle.append(header)
        self._bundle_bytes += len(header)
        if len(self._bundle) >= self._coalesce or self._bundle_bytes >= COALESCE_MAX_BYTES:
            if not self._bundle_in_flight and self._flush_nowait():
                return True
            await self.flush()  # back-pressure: the producer waits for room
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_soon)
        return True

    @property
    def _bundle_in_flight(self) -> bool:
        return not self._bundle_idle.is_set()

    def _bundle_wire(self) -> bytes:
        """Frame 0 for what is pending: a lone message as itself, several as a bundle."""
        return self._bundle[0] if len(self._bundle) == 1 else self._codec.bundle(self._bundle)

    def _take_bundle(self) -> tuple[bytes, int]:
        wire, count = self._bundle_wire(), len(self._bundle)
        self._bundle, self._bundle_bytes = [], 0
        return wire, count

    def _flush_nowait(self) -> bool:
        """Hand the bundle to ZeroMQ without waiting; False if the HWM is full."""
        if not self._bundle:
            return True
        wire = self._bundle_wire()
        try:
            self._sync.send(wire, zmq.NOBLOCK)
            self._rearm()
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self._dropped += len(self._bundle)  # counted here: _send_failed may raise
            self._bundle, self._bundle_bytes = [], 0
            return self._send_failed(exc)
        count = len(self._bundle)
        self._bundle, self._bundle_bytes = [], 0
        self._sent += count
        self._bytes_sent += len(wire)
        return True

    def _flush_soon(self, _ready: Any = None) -> None:
        """End of an event-loop turn: send what accumulated. Under back-pressure, try again
        when the socket can take it (a producer that keeps sending waits in ``flush``)."""
        if isinstance(_ready, asyncio.Future) and not _ready.cancelled():
            _ready.exception()  # retrieved: a failed poll just means try again below
        self._flush_scheduled = False
        if self._closed or self._bundle_in_flight or not self._bundle:
            return
        try:
            if self._flush_nowait():
                return
        except TransportError as exc:  # no caller to raise to: the messages are lost
            log.error("%s: a bundle could not be sent: %s", self.name, exc)
            return
        self._flush_scheduled = True
        # pyzmq's _future.pyi gives the async socket's poll the Poller's signature; at
        # runtime it takes flags and returns a Future.
        self._socket.poll(flags=zmq.POLLOUT).add_done_callback(self._flush_soon)  # type: ignore[call-arg, attr-defined]

    async def _send_bundle(self) -> None:
        wire, count = self._take_bundle()
        self._bundle_idle.clear()
        try:
            if await self._send_frames([wire]):
                self._sent += count - 1  # _send_frames counted one message
        finally:
            self._bundle_idle.set()
            if self._bundle and not self._flush_scheduled and not self._closed:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._flush_soon)

    def _flush_at_close(self, linger_ms: int) -> None:
        """Closing: the bundle joins ZeroMQ's queue if there is room (or, with a linger,
        once there is, within it); otherwise its messages count as dropped."""
        try:
            if self._flush_nowait():
                return
        except TransportError as exc:  # the bundle is counted as dropped already
            log.warning("%s: messages dropped at close: %s", self.name, exc)
            return
        wire, count = self._take_bundle()
        if linger_ms > 0:
            self._sync.setsockopt(zmq.SNDTIMEO, linger_ms)
            try:
                self._sync.send(wire)
            except zmq.ZMQError as exc:
                log.warning("%s: %d messages dropped at close: %s", self.name, count, exc)
            else:
                self._sent += count
                self._bytes_sent += len(wire)
                return
        self._dropped += count


class PushEndpoint(_Sending):
    socket_type = zmq.PUSH


class PullEndpoint(_MessageReceiving):
    socket_type = zmq.PULL


class DealerEndpoint(_Sending, _MessageReceiving):
    """Client side of a request/reply channel; its routing id is its peer id."""

    socket_type = zmq.DEALER


class RouterEndpoint(_Receiving[tuple[bytes, Message]]):
    """Server side of a request/reply channel; messages are ``(peer_id, message)``."""

    socket_type = zmq.ROUTER
    _envelope_frames = 1

    def _item(self, enveloped: tuple[bytes, Message]) -> tuple[bytes, Message]:
        return enveloped

    async def recv_many(self, max_messages: int = DEFAULT_RECV_BATCH) -> list[tuple[bytes, Message]]:
        return await self._recv_enveloped(max_messages)

    async def send(self, peer: bytes, message: Message) -> bool:
        """Send to one peer; False if the peer is unknown (gone) or dropped at the HWM."""
        frames = [peer, *self._codec.encode(message)]
        if self._recorder is not None:
            self._recorder.sent(frames)
        return await self._send_frames(frames)


class PublisherEndpoint(Endpoint):
    """XPUB: topic-prefixed broadcast. Drops at the HWM are counted, never silent."""

    socket_type = zmq.XPUB

    async def publish(self, topic: bytes, message: Message) -> bool:
        frames = [topic, *self._codec.encode(message)]
        if self._recorder is not None:
            self._recorder.sent(frames)
        return await self._send_frames(frames)

    def subscriptions_nowait(self) -> list[tuple[bool, bytes]]:
        """Subscription changes seen since the last call: ``(subscribed, topic)``."""
        self._check_open()
        out: list[tuple[bool, bytes]] = []
        while True:
            try:
                event = self._sync.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if event:
                out.append((event[0] == 1, event[1:]))

    async def wait_subscriber(self, topic_prefix: bytes = b"") -> bytes:
        """Wait until a peer subscribes to a topic starting with ``topic_prefix``.

        This is the handshake against the slow-joiner problem: publish after it, never after
        a sleep.
        """
        while True:
            self._check_open()
            try:
                event = await self._socket.recv()
            except asyncio.CancelledError:
                if self._woken_by_close():
                    raise ClosedError(f"endpoint {self.name!r} closed during wait") from None
                raise
            if event and event[0] == 1 and event[1:].startswith(topic_prefix):
                return bytes(event[1:])


class SubscriberEndpoint(_MessageReceiving):
    """SUB: ``recv``/``recv_many`` give messages; ``recv_many_with_topic`` keeps the topic."""

    socket_type = zmq.SUB
    _envelope_frames = 1

    def subscribe(self, topic: bytes) -> None:
        """Subscribe to a topic prefix; end topics with ``|`` since SUB matches prefixes."""
        self._check_open()
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)

    async def recv_many_with_topic(self, max_messages: int = DEFAULT_RECV_BATCH) -> list[tuple[bytes, Message]]:
        return await self._recv_enveloped(max_messages)


ENDPOINT_CLASSES: dict[str, type[Endpoint]] = {
    "push": PushEndpoint,
    "pull": PullEndpoint,
    "dealer": DealerEndpoint,
    "router": RouterEndpoint,
    "pub": PublisherEndpoint,
    "sub": SubscriberEndpoint,
}

__all__ = [
    "AnyMessage",
    "DealerEndpoint",
    "Endpoint",
    "EndpointStats",
    "OnFull",
    "PublisherEndpoint",
    "PullEndpoint",
    "PushEndpoint",
    "RouterEndpoint",
    "SocketOptions",
    "SubscriberEndpoint",
]


def _no_events() -> None:
    return None
