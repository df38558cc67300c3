"""Relay plans and addresses: who forwards which chunks to whom, and where inboxes live.

Pure decisions the broadcaster and receivers share: the plan of a version (star, relay
chain, striped chains), the install threshold that defines T_bcast, where a receiver binds
its relay inbox and the address it announces, and the sender that reaches an inbox by its
address's scheme (chunk stream or ZeroMQ PUSH).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import os
import socket
from collections.abc import Collection, Mapping, Sequence
from typing import Literal, get_args

import msgspec

from echo2.errors import ClosedError, TransportError
from echo2.messages import (
    RelayChain,
    RelayPlan,
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

MAX_DEPTH = 6
"""Default bound on how many members a chunk passes through from the publisher to the
farthest member: each hop adds its latency (a chunk's time on the link, its verification,
a one-way trip), so a chain of every member grows T_bcast linearly in N. Relay plans of
more members are trees whose fan-out grows with N instead (``relay_fanout``)."""


def tree_depth(n: int, fanout: int) -> int:
    """Members on the longest path of a complete ``fanout``-ary tree of ``n`` members (a
    chain of ``n`` when ``fanout`` is 1)."""
    if n <= 0:
        return 0
    if fanout <= 1:
        return n
    depth, level, total = 0, 1, 0
    while total < n:
        total += level
        level *= fanout
        depth += 1
    return depth


def relay_fanout(n: int, max_depth: int = MAX_DEPTH) -> int:
    """The smallest fan-out whose tree over ``n`` members is at most ``max_depth`` deep: 1
    (one chain) up to ``max_depth`` members, then 2, 3, ... as N grows (depth ~ log N)."""
    fanout = 1
    while tree_depth(n, fanout) > max(1, max_depth):
        fanout += 1
    return fanout


@dataclasses.dataclass(frozen=True)
class RelayTree:
    """One stripe's relay tree, a chain when ``fanout`` is 1: ``members`` breadth first,
    member ``i`` forwards every verified chunk of stripe ``stripe`` to members ``fanout * i
    + 1`` .. ``fanout * i + fanout``, and the publisher feeds ``members[0]``.

    The publisher's form of a plan; no member is sent it whole: each gets its own place in
    it as ``RelayChain``s (``member_view``)."""

    stripe: int
    members: list[str]
    fanout: int = 1

    def children(self, member: str) -> list[str]:
        """Whom ``member`` forwards this stripe to (none if it is not in the tree)."""
        try:
            at = self.members.index(member)
        except ValueError:
            return []
        return self.members[self.fanout * at + 1 : self.fanout * at + self.fanout + 1]

    def parent(self, member: str) -> str | None:
        """Who feeds ``member``: None for the root (the publisher feeds it) and for a member
        not in the tree."""
        try:
            at = self.members.index(member)
        except ValueError:
            return None
        return self.members[(at - 1) // self.fanout] if at > 0 else None


def relay_plan(
    members: Sequence[str],
    mode: str,
    stripes: int = 1,
    *,
    max_depth: int = MAX_DEPTH,
    leaves: Collection[str] = (),
) -> tuple[int, list[RelayTree]]:
    """``(stripes, trees)`` for one version. Pure.

    ``members`` in placement order, best first (``Placement.order``); ``leaves``: members
    that should forward to nobody (measured slow or far: ``Placement``), placed last in
    that order, so that they feed no one whenever the others can carry the plan. A chain
    keeps the placement order (the slowest at its tail); trees take the other members by
    name, so that their shape changes only with membership and leaves (members keep their
    connections to the ones they feed).

    star: one single-member tree per member (the publisher sends everything to all).
    relay: up to ``max_depth`` members one chain in that order; beyond, ``f =
    relay_fanout(N)`` stripes, each a tree of fan-out f whose inner members are a different
    f-th of the members (so each member forwards about one copy of the version, as in a
    chain, and a chunk passes at most ``max_depth`` members).
    striped: ``stripes`` chains of every member, chain ``s`` rotated by ``s * N / stripes``
    so that seeds differ; beyond ``max_depth`` members, trees of fan-out ``relay_fanout(N)``
    rotated the same way.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = list(members)
    if not names:
        return 1, []
    if mode == "star":
        return 1, [RelayTree(0, [m]) for m in names]
    fanout = relay_fanout(len(names), max_depth)
    count = fanout if mode == "relay" else max(1, stripes)
    tail = [m for m in names if m in leaves]
    forwarders = [m for m in names if m not in leaves]
    if fanout > 1:
        # By name: a tree's shape then changes only when its members or its leaves do, and
        # members keep the connections to the ones they feed (all of these keep up).
        forwarders.sort()
    n = len(forwarders)
    trees = []
    for s in range(count):
        rotated = forwarders[s * n // count :] + forwarders[: s * n // count]
        trees.append(RelayTree(s, rotated + tail, fanout))
    return count, trees


def reach_order(trees: Sequence[RelayTree]) -> list[str]:
    """The members of ``trees`` in the order a version reaches them: by their earliest
    place in any tree (breadth first), roots first. The publisher sends plans and
    manifests in this order, so that the first chunks need not wait for the last member's
    manifest."""
    first: dict[str, int] = {}
    for tree in trees:
        for at, member in enumerate(tree.members):
            first[member] = min(at, first.get(member, at))
    return sorted(first, key=lambda m: (first[m], m))


def member_view(plan: RelayPlan, trees: Sequence[RelayTree], member: str) -> RelayPlan:
    """What ``member`` is sent of a plan: ``plan`` (its stripes, publisher, secret) with,
    per tree, a two-member chain ``[parent, member]`` from whoever feeds it and
    ``[member, child]`` to each member it feeds (``[member]`` for a root that feeds
    nobody), and its children's addresses (``plan`` has everyone's). A member forwards
    each chunk of a stripe to the next member in every chain of that stripe it heads, and
    its inbox admits the member before it in each chain: the same as reading its place in
    the whole tree, in a message as large as its fan-out, where the whole plan is as large
    as N (N members decoding it would cost O(N^2) per version). A member in no tree gets
    the publisher and the stream secret (a late joiner's repair stream needs them)."""
    chains: list[RelayChain] = []
    addresses: dict[str, str] = {}
    for tree in trees:
        if member not in tree.members:
            continue
        parent, children = tree.parent(member), tree.children(member)
        if parent is not None:
            chains.append(RelayChain(tree.stripe, [parent, member]))
        elif not children:
            chains.append(RelayChain(tree.stripe, [member]))
        for child in children:
            chains.append(RelayChain(tree.stripe, [member, child]))
            if child in plan.addresses:
                addresses[child] = plan.addresses[child]
    return msgspec.structs.replace(plan, chains=chains, addresses=addresses)


@dataclasses.dataclass
class _Lag:
    received_s: float | None = None
    """Weighted lag behind the members that fed it (s)."""
    forwarded_s: float | None = None
    """Weighted least lag among the members it fed (s)."""
    forwarded_age: int = 0
    """Versions observed since ``forwarded_s`` last was."""
    tier: int = 0


TIER_HYSTERESIS = 0.5
"""How far (in log2 of the lag ratio) past a tier's rounding boundary a member's lag must
move before it changes tier: noise around a boundary must not reshuffle plans."""


class Placement:
    """Where members go in the next plans, from how long each took to hold past versions.

    After each version the publisher hands ``observe`` the plan it used and when each member
    reported the version complete and verified (``WeightsReceived``, seconds after
    publication). A member's *lag* in a version is how long after the members that fed it
    (its parent in each stripe; for a root the publisher, at 0) it held the version: its
    own path and work (downlink rate, latency, CPU), not its place in the plan. A member
    that had not reported when the next version came, although its feeders had, lagged at
    least that long: a lower bound, so a member that never keeps up is seen too. A member
    that fed two or more others is also charged the least lag among them (when even its
    best-served child lags, its uplink is the bottleneck; with one child, as in a single
    chain, there is no telling the two apart, and the child is charged); that charge is
    forgotten after
    ``forget_after`` versions without a child to measure it by, so a member sent to the
    leaves gets another chance. Both are weighted ``alpha`` to the newest version.

    ``order`` sorts members by tier, then name: tier ``round(log2(lag / reference))`` of
    the larger of its two lags (with hysteresis), the reference the lower quartile of the
    members' lags, lags under ``floor_s`` counted as ``floor_s`` (jitter of a few ms on a
    fast network moves nobody), unmeasured members at tier 0. ``leaves`` are the members at
    tier ``slow_tier`` or more (about 3x the reference), the slowest ``max_leaf_fraction``
    of all at most (the others then forward their share): they feed nobody and sit at the
    tail of chains. Tiers rather than raw lags keep plans stable from version to
    version (and with them the relay connections members keep open).
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        floor_s: float = 0.1,
        slow_tier: int = 2,
        max_leaf_fraction: float = 0.25,
        forget_after: int = 16,
    ) -> None:
        self.alpha = alpha
        self.max_leaf_fraction = max_leaf_fraction
        self.floor_s = floor_s
        self.slow_tier = slow_tier
        self.forget_after = forget_after
        self._lags: dict[str, _Lag] = {}

    def observe(self, trees: Sequence[RelayTree], received_s: Mapping[str, float], elapsed_s: float) -> None:
        """One version's measurements: its plan, ``received_s`` member -> seconds from
        publication to its ``WeightsReceived``, and how long the version ran before the
        next (``elapsed_s``)."""
        feeders: dict[str, set[str]] = {}
        for tree in trees:
            for at, member in enumerate(tree.members):
                parents = feeders.setdefault(member, set())
                if at > 0:
                    parents.add(tree.members[(at - 1) // tree.fanout])
        lags: dict[str, float] = {}
        for member, parents in feeders.items():
            if any(p not in received_s for p in parents):
                continue  # a feeder never held it: nothing to tell about this member
            fed_s = max((received_s[p] for p in parents), default=0.0)
            if member in received_s:
                lags[member] = max(0.0, received_s[member] - fed_s)
            else:
                lag = self._lags.get(member, _Lag()).received_s
                bound = max(0.0, elapsed_s - fed_s)
                if lag is None or bound > lag:
                    lags[member] = bound
        for member, lag in lags.items():
            entry = self._lags.setdefault(member, _Lag())
            entry.received_s = self._weigh(entry.received_s, lag)
        children: dict[str, list[float]] = {}
        for member, parents in feeders.items():
            if member in lags:
                for parent in parents:
                    children.setdefault(parent, []).append(lags[member])
        for member in feeders:
            entry = self._lags.setdefault(member, _Lag())
            if len(children.get(member, ())) >= 2:
                entry.forwarded_s = self._weigh(entry.forwarded_s, min(children[member]))
                entry.forwarded_age = 0
            else:
                entry.forwarded_age += 1
                if entry.forwarded_age >= self.forget_after:
                    entry.forwarded_s = None

    def _weigh(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def forget(self, member: str) -> None:
        """A member left: what was measured of it no longer says anything."""
        self._lags.pop(member, None)

    def lag_s(self, member: str) -> float | None:
        """The lag ``member`` is placed by (the larger of its two), None when unmeasured."""
        entry = self._lags.get(member)
        if entry is None:
            return None
        known = [v for v in (entry.received_s, entry.forwarded_s) if v is not None]
        return max(known) if known else None

    def tiers(self, members: Sequence[str]) -> dict[str, int]:
        """Each member's tier (see the class docstring); 0 when unmeasured. A member keeps its
        tier until its lag moves ``TIER_HYSTERESIS`` past the rounding boundary."""
        lags = {m: self.lag_s(m) for m in members}
        known = sorted(max(lag, self.floor_s) for lag in lags.values() if lag is not None)
        # The lower quartile: what a member that is not held up takes. A median would be
        # pulled up by the slow members themselves when there are few.
        reference = known[(len(known) - 1) // 4] if known else self.floor_s
        tiers = {}
        for member, lag in lags.items():
            entry = self._lags.get(member)
            if lag is None or entry is None:
                tiers[member] = 0
                continue
            raw = math.log2(max(lag, self.floor_s) / reference)
            if abs(raw - entry.tier) > 0.5 + TIER_HYSTERESIS:
                entry.tier = max(-2, min(8, round(raw)))
            tiers[member] = entry.tier
        return tiers

    def order(self, members: Sequence[str]) -> tuple[list[str], set[str]]:
        """(``members`` best first, the ones to keep at the leaves): ``relay_plan``'s inputs."""
        tiers = self.tiers(members)
        ordered = sorted(members, key=lambda m: (tiers[m], m))
        slow = [m for m in ordered if tiers[m] >= self.slow_tier]
        cap = math.floor(self.max_leaf_fraction * len(members))
        return ordered, set(slow[-cap:]) if cap else set()


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
