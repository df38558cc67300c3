"""Relay plans and addresses: who forwards which chunks to whom, and where inboxes live.

Pure decisions the broadcaster and receivers share: the plan of a version (star, relay
chain, striped chains), the install threshold that defines T_bcast, where a receiver binds
its relay inbox and the address it announces, and the sender that reaches an inbox by its
address's scheme (chunk stream or ZeroMQ PUSH).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import socket
from collections.abc import Sequence
from typing import Literal, get_args

from echo2.errors import ClosedError, TransportError
from echo2.messages import (
    RelayChain,
    WeightChunk,
)
from echo2.transport.context import Transport
from echo2.transport.endpoint import (
    PushEndpoint,
    SocketOptions,
)
from echo2.weights.link import LinkSpec
from echo2.weights.stream import (
    ChunkStreamSender,
    StreamCredentials,
    is_stream_address,
)

log = logging.getLogger(__name__)

RelayMode = Literal["star", "relay", "striped"]
"""Who the publisher streams to: every sampler, the head of one chain, or of several."""
MODES: tuple[RelayMode, ...] = get_args(RelayMode)
RELAY_HWM = 8
"""Chunks queued per relay hop: enough to keep a link busy, few enough that a dead peer
strands little and the sender is paced by its receiver."""
GAMMA = 1.1
NO_LINK = LinkSpec()
MAX_REPAIR_INDICES = 1024
DataPlane = Literal["stream", "zmq"]
"""A relay inbox over tcp: a chunk stream (``weights.stream``) or a ZeroMQ PULL."""
DATA_PLANES: tuple[DataPlane, ...] = get_args(DataPlane)
_IPC_PATH_MAX = 100


def max_message_bytes(chunk_bytes: int) -> int:
    return max(64 * 1024 * 1024, 2 * chunk_bytes + 65536)


ChunkSender = PushEndpoint | ChunkStreamSender
"""Where chunks go to a relay inbox: ``await send(chunk)``, ``close()``, ``closed``."""


def chunk_sender(
    transport: Transport,
    name: str,
    address: str,
    chunk_bytes: int,
    *,
    credentials: StreamCredentials | None = None,
    connect_timeout_s: float = 5.0,
    stall_timeout_s: float = 5.0,
) -> ChunkSender:
    """A sender to the relay inbox at ``address``, by its scheme (chunk stream or ZeroMQ);
    a chunk stream answers the inbox's challenge with ``credentials`` (``[security]``),
    gives up connecting after ``connect_timeout_s`` and fails a send that makes no
    progress for ``stall_timeout_s``."""
    if is_stream_address(address):
        return ChunkStreamSender(
            address, credentials=credentials, connect_timeout_s=connect_timeout_s, stall_timeout_s=stall_timeout_s
        )
    return transport.push(
        name=f"{name}->{address}",
        connect=[address],
        options=SocketOptions(hwm=RELAY_HWM, max_message_bytes=max_message_bytes(chunk_bytes)),
    )


async def send_chunk(sender: ChunkSender, chunk: WeightChunk, timeout_s: float) -> bool:
    """Send one chunk down the weight path; False when the peer is gone or stuck (the
    caller then closes ``sender`` and skips that peer for the version).

    A chunk stream is judged by progress (no byte taken for its stall timeout: see
    ``ChunkStreamSender``), since on a slow lossy path one chunk may take longer than any
    fixed bound; a ZeroMQ PUSH, which shows no progress, must finish in ``timeout_s``.
    """
    try:
        if isinstance(sender, ChunkStreamSender):
            return await sender.send(chunk)
        async with asyncio.timeout(timeout_s):  # no task per chunk, unlike wait_for
            return await sender.send(chunk)
    except (TimeoutError, ClosedError, TransportError):
        return False


# -- plans -------------------------------------------------------------------------------


def relay_plan(members: Sequence[str], mode: str, stripes: int = 1) -> tuple[int, list[RelayChain]]:
    """``(stripes, chains)`` for one version. Pure.

    star: one single-member chain per member (the publisher sends everything to all);
    relay: one chain through every member; striped: ``stripes`` chains through every
    member, chain ``s`` rotated by ``s * N / stripes`` so that each member receives every
    stripe and seeds differ.
    """
    names = list(members)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not names:
        return 1, []
    if mode == "star":
        return 1, [RelayChain(0, [m]) for m in names]
    if mode == "relay" or stripes <= 1:
        return 1, [RelayChain(0, names)]
    n = len(names)
    return stripes, [RelayChain(s, names[s * n // stripes :] + names[: s * n // stripes]) for s in range(stripes)]


def bcast_threshold(active: int, gamma: float = GAMMA) -> int:
    """Installs needed for T_bcast: a fraction 1/gamma of the active samplers."""
    return max(1, math.ceil(active / gamma - 1e-9)) if active > 0 else 0


# -- addresses ---------------------------------------------------------------------------


def relay_bind_url(control_url: str, name: str) -> str:
    """Where a receiver binds its inbox, by the medium that reaches its publisher."""
    token = f"{os.getpid()}-{os.urandom(3).hex()}"
    scheme = control_url.split("://", 1)[0]
    if scheme == "inproc":
        return f"inproc://echo2-relay/{name}-{token}"
    if scheme == "ipc":
        directory = os.path.dirname(control_url[len("ipc://") :]) or "/tmp"
        leaf = f"relay-{name}-{token}"
        if len("ipc://") + len(directory) + 1 + len(leaf) >= _IPC_PATH_MAX:
            leaf = "relay-" + hashlib.blake2b(leaf.encode(), digest_size=8).hexdigest()
        return f"ipc://{directory}/{leaf}"
    return "tcp://*:0"


def announce_url(bound: str, control_url: str, relay_host: str = "") -> str:
    """The address peers use to reach an inbox bound at ``bound``."""
    if not bound.startswith("tcp://"):
        return bound
    port = bound.rsplit(":", 1)[1]
    host = relay_host or _local_ip_towards(control_url)
    return f"tcp://{host}:{port}"


def _local_ip_towards(control_url: str) -> str:
    """This host's address on the route to the publisher (no packet is sent)."""
    hostport = control_url.split("://", 1)[1]
    host = hostport.rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "localhost") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
