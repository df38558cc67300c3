"""``Transport``: one per process; opens, tracks and closes every endpoint.

The URL alone picks the medium: ``inproc://`` within the process (all in-process actors
share this context, which inproc requires), ``ipc://`` within a host, ``tcp://`` across
hosts. Nothing above this module branches on the scheme.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from echo2.errors import TransportError
from echo2.messages import AnyMessage
from echo2.transport.auth import Authenticator, CurveClient, CurveServer, apply_client, apply_server
from echo2.transport.codec import Codec
from echo2.transport.endpoint import (
    ENDPOINT_CLASSES,
    DealerEndpoint,
    Endpoint,
    OnFull,
    PublisherEndpoint,
    PullEndpoint,
    PushEndpoint,
    RouterEndpoint,
    SocketOptions,
    SubscriberEndpoint,
)
from echo2.transport.urls import is_ipv6_url

E = TypeVar("E", bound=Endpoint)


class Transport:
    """Owns the process's ZeroMQ context and every endpoint opened through it."""

    def __init__(self, *, io_threads: int = 1, max_sockets: int = 16384) -> None:
        self._context = zmq.asyncio.Context(io_threads=io_threads)
        self._context.set(zmq.MAX_SOCKETS, max_sockets)
        self._open: set[Endpoint] = set()
        self._closed = False
        self._authenticator: Authenticator | None = None

    def enable_curve(self, allowed_public_keys: set[bytes]) -> Authenticator:
        """Start this process's ZAP handler; needed before opening a CURVE server socket.

        Must be called from the event loop that will serve it.
        """
        if self._authenticator is None:
            self._authenticator = Authenticator(self._context, allowed_public_keys)
            self._authenticator.start()
        return self._authenticator

    @property
    def open_endpoints(self) -> list[Endpoint]:
        return list(self._open)

    def open(
        self,
        kind: str,
        *,
        name: str,
        bind: Iterable[str] = (),
        connect: Iterable[str] = (),
        options: SocketOptions | None = None,
        on_full: OnFull = "block",
        producers: int = 0,
        identity: bytes | None = None,
        subscribe: Iterable[bytes] = (),
        message_types: Any = AnyMessage,
        codec: Codec | None = None,
        curve: CurveServer | CurveClient | None = None,
    ) -> Endpoint:
        """Open a socket of ``kind`` ("push", "pull", "dealer", "router", "pub", "sub").

        ``bind`` and ``connect`` may both be given; a ``tcp://host:0`` bind picks a free port,
        and ``endpoint.endpoints`` lists the addresses actually bound.
        """
        if self._closed:
            raise TransportError("transport is closed")
        try:
            cls = ENDPOINT_CLASSES[kind]
        except KeyError:
            raise TransportError(f"unknown socket kind {kind!r}") from None
        options = options or SocketOptions()
        bind, connect = tuple(bind), tuple(connect)
        socket = self._context.socket(cls.socket_type)
        try:
            _apply_options(socket, cls.socket_type, options, identity)
            if any(is_ipv6_url(url) for url in (*bind, *connect)):
                socket.setsockopt(zmq.IPV6, 1)  # an IPv6 literal: also binds [::] dual-stack
            endpoint = cls(
                socket,
                name=name,
                codec=codec or Codec(message_types),
                on_full=on_full,
                producers=producers,
                on_close=self._open.discard,
                coalesce=options.coalesce if kind == "push" else 1,
                recv_budget_bytes=options.recv_budget_bytes,
            )
            for topic in subscribe:
                socket.setsockopt(zmq.SUBSCRIBE, topic)
            if isinstance(curve, CurveServer):
                if self._authenticator is None:
                    raise TransportError(f"{name}: a CURVE server needs enable_curve() first")
                self._authenticator.serve(curve)
                apply_server(socket, curve)
                endpoint.track_user_ids()
            elif isinstance(curve, CurveClient):
                apply_client(socket, curve)
            for url in bind:
                endpoint.endpoints.append(_bind(socket, url))
            if options.count_disconnects and any(not url.startswith("inproc://") for url in bind):
                # Peers from other processes: count their disconnects (oversized frames
                # among them; inproc has no frames to refuse and no connection to drop).
                endpoint.monitor_disconnects()
            for url in connect:
                if isinstance(curve, CurveClient):
                    # Pin the server per address: set before each connect, used by it.
                    socket.setsockopt(zmq.CURVE_SERVERKEY, curve.server_keys[url])
                socket.connect(url)
                endpoint.endpoints.append(url)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"{name}: cannot open {kind} socket: {exc}") from exc
        self._open.add(endpoint)
        return endpoint

    # Typed conveniences, so call sites read as what they open.
    def push(self, **kw: Any) -> PushEndpoint:
        return _as(PushEndpoint, self.open("push", **kw))

    def pull(self, **kw: Any) -> PullEndpoint:
        return _as(PullEndpoint, self.open("pull", **kw))

    def dealer(self, **kw: Any) -> DealerEndpoint:
        return _as(DealerEndpoint, self.open("dealer", **kw))

    def router(self, **kw: Any) -> RouterEndpoint:
        return _as(RouterEndpoint, self.open("router", **kw))

    def pub(self, **kw: Any) -> PublisherEndpoint:
        return _as(PublisherEndpoint, self.open("pub", **kw))

    def sub(self, **kw: Any) -> SubscriberEndpoint:
        return _as(SubscriberEndpoint, self.open("sub", **kw))

    def close(self, linger_ms: int = 0) -> None:
        """Close every endpoint still open, then the context. Idempotent.

        ``linger_ms`` > 0 is a bounded flush: ``term()`` blocks until every queued message
        (including those of endpoints closed earlier with a linger) is handed to the peer,
        or the linger runs out. Use it on a graceful exit; 0 on an abort.
        """
        if self._closed:
            return
        self._closed = True
        for endpoint in list(self._open):
            endpoint.close(linger_ms)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def _apply_options(socket: zmq.Socket, socket_type: int, options: SocketOptions, identity: bytes | None) -> None:
    socket.setsockopt(zmq.LINGER, options.linger_ms)
    socket.setsockopt(zmq.SNDHWM, options.hwm)
    socket.setsockopt(zmq.RCVHWM, options.hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
    socket.setsockopt(zmq.HEARTBEAT_IVL, options.heartbeat_ivl_ms)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, options.heartbeat_timeout_ms)
    socket.setsockopt(zmq.RECONNECT_IVL, options.reconnect_ivl_ms)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, options.reconnect_ivl_max_ms)
    socket.setsockopt(zmq.CONNECT_TIMEOUT, options.connect_timeout_ms)
    if identity is not None:
        socket.setsockopt(zmq.ROUTING_ID, identity)
    if socket_type == zmq.ROUTER:
        # Unknown peers raise instead of vanishing. Never ROUTER_HANDOVER: it lets any client
        # evict a live connection by presenting its routing id, and libzmq can abort the
        # process doing so (echo2.transport.peers); a restarted peer connects with a new id.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    elif socket_type == zmq.XPUB:
        # A full subscriber makes send() raise Again instead of dropping silently.
        socket.setsockopt(zmq.XPUB_NODROP, 1)
        # Report every subscription, not only the first per topic: late joiners need it.
        socket.setsockopt(zmq.XPUB_VERBOSE, 1)
    elif socket_type in (zmq.PUSH, zmq.DEALER):
        # Queue only to peers whose connection is up, so work is not parked on a dead pipe.
        socket.setsockopt(zmq.IMMEDIATE, 1)


def _bind(socket: zmq.Socket, url: str) -> str:
    if url.startswith("ipc://"):
        directory = os.path.dirname(url[len("ipc://") :])
        if directory:
            os.makedirs(directory, exist_ok=True)
    socket.bind(url)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT) if url.startswith("tcp://") else url


def _as(cls: type[E], endpoint: Endpoint) -> E:
    assert isinstance(endpoint, cls)  # ENDPOINT_CLASSES maps the kind to this class
    return endpoint
