"""Publisher side of weight dissemination: membership, relay plans, streaming, repair, T_bcast.

See ``echo2.weights`` for the whole path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from echo2.errors import ClosedError, TransportError
from echo2.messages import (
    NO_VERSION,
    ChunkRequest,
    PolicyVersion,
    RelayPlan,
    Snapshot,
    WeightChunk,
    WeightManifest,
    WeightShm,
    WeightsInstalled,
    WeightsReceived,
    WeightSubscribe,
)
from echo2.transport.context import Transport
from echo2.transport.endpoint import (
    RouterEndpoint,
)
from echo2.transport.peers import PeerTable, Refusal
from echo2.weights.chunks import (
    DEFAULT_CHUNK_BYTES,
    make_manifest,
    prefaulted_buffer,
)
from echo2.weights.delta import DeltaStats, delta_manifest, encode, payload_manifest
from echo2.weights.dial import DialListener, admits, dial_address, dial_more_frame, is_dial_address
from echo2.weights.lanes import Lanes, Outcome, open_lanes
from echo2.weights.link import LinkSpec
from echo2.weights.pacing import OutstandingRepairs, StreamCount, chunk_bytes_for
from echo2.weights.plan import (
    GAMMA,
    MAX_DEPTH,
    MODES,
    NO_LINK,
    Placement,
    RelayTree,
    bcast_threshold,
    member_view,
    reach_order,
    relay_plan,
)
from echo2.weights.seal import seal_version
from echo2.weights.shm import shm_identity, write_snapshot
from echo2.weights.stream import ChunkStreamSender, StreamCredentials, is_stream_address, listen

log = logging.getLogger(__name__)

# -- broadcaster -------------------------------------------------------------------------


@dataclasses.dataclass
class _Member:
    peer: bytes
    address: str
    last_seen_s: float
    manifest_sent_s: float = 0.0
    installed: PolicyVersion = NO_VERSION
    shm_id: str = ""


@dataclasses.dataclass
class _Bcast:
    """One published version's broadcast: who it went to, who installed it, T_bcast. Kept
    for the last ``TRACKED_VERSIONS`` versions (without their snapshots)."""

    key: PolicyVersion
    total_bytes: int
    published_s: float = 0.0
    active: frozenset[str] = frozenset()
    installed: set[str] = dataclasses.field(default_factory=set)
    t_bcast_s: float | None = None
    reported: bool = False
    wire_bytes: int = 0
    """Bytes of the form streamed: the delta payload's for a delta version, else ``total_bytes``."""
    changed_fraction: float | None = None
    encode_s: float | None = None
    delta_members: int = 0
    received_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Member -> seconds from publication to its ``WeightsReceived`` (placement)."""


TRACKED_VERSIONS = 8
"""Versions whose installs still count toward their T_bcast after newer ones were published."""
RETAINED_VERSIONS = 2
"""Versions whose bytes stay here for repair: the latest, and the one before it for members
still finishing it (``WeightReceiver``: a member that holds most of a version when the next
one is published finishes it first). Each costs one snapshot of memory."""
UNKNOWN_PATH_CHUNK_BYTES = 256 << 10
"""Largest chunk while a member's path is unknown (no connection measured yet): a chunk
stays on its stream until done, and a 1 MB one takes 13 s on a stream at 0.6 Mbit/s."""
MAX_STREAMS = 128
"""Parallel chunk streams per member, at most (``echo2.weights.lanes``): at 200 ms and 1%
loss, 128 reno streams carried ~71 Mbit/s of a 100 Mbit/s link in the WAN test bed."""


def _chunk_of(key: PolicyVersion, data: np.ndarray, size: int, index: int) -> WeightChunk:
    """Chunk ``index`` of a version's bytes cut in ``size``: a view, never a copy."""
    return WeightChunk(
        incarnation=key.incarnation, version=key.version, index=index, data=data[index * size : (index + 1) * size]
    )


class _Pending:
    """Chunks put on lanes and not yet settled (sent, failed or discarded)."""

    def __init__(self) -> None:
        self.count = 0
        self._settled = asyncio.Event()
        self._settled.set()

    def add(self) -> None:
        self.count += 1
        self._settled.clear()

    def settle(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._settled.set()

    async def wait(self) -> None:
        await self._settled.wait()


@dataclasses.dataclass(frozen=True)
class DeltaForm:
    """A version's delta form (``echo2.weights.delta``): the payload its chunks carry for
    members holding the base, its manifest (sign it like the dense one), what encoding
    found and how long it took."""

    payload: np.ndarray
    manifest: WeightManifest
    stats: DeltaStats
    encode_s: float

    def signed(self, sign: Callable[[WeightManifest], WeightManifest]) -> DeltaForm:
        return dataclasses.replace(self, manifest=sign(self.manifest))


DELTA_MAX_RATIO = 0.8
"""A delta form is kept only below this payload / state size: above it, encoding and
rebuilding cost more than the bytes save, and every member takes the dense form."""
DELTA_MAX_CHANGED = 0.25
"""Nor when at least this fraction of elements changed: rebuilding then scatters a
quarter of the state or more (~0.3 s of CPU per 128 MiB at 30%, ten times a dense
version's verification), which on a busy or fast-linked member costs more time than the
bytes save (4 members on 2 shared cores: 22 s against 14 s dense at 31%). Real updates sit
far below it (bf16 RL steps: 1-3%) or far above it (fp32 under Adam: ~100%)."""


@dataclasses.dataclass
class _Version:
    snapshot: Snapshot
    manifest: WeightManifest
    delta: DeltaForm | None = None
    shm_path: str | None = None
    bcast: _Bcast = dataclasses.field(init=False)
    delta_members: set[str] = dataclasses.field(default_factory=set)
    """Members sent the delta form (in its plan; repaired from the payload)."""

    def __post_init__(self) -> None:
        self.bcast = _Bcast(key=self.key, total_bytes=self.manifest.total_bytes, wire_bytes=self.manifest.total_bytes)
        self._payload_manifest: WeightManifest | None = None
        if self.delta is not None:
            self.bcast.changed_fraction = self.delta.stats.changed_fraction
            self.bcast.encode_s = self.delta.encode_s
            self._payload_manifest = payload_manifest(self.delta.manifest)

    def form(self, member: str | None = None) -> tuple[np.ndarray, WeightManifest]:
        """(bytes, manifest chunking them) of the form ``member`` was sent (None: the form
        the plan carries): the delta payload, or the dense state."""
        delta = self.delta is not None and (member in self.delta_members if member else bool(self.delta_members))
        if delta and self.delta is not None and self._payload_manifest is not None:
            return self.delta.payload, self._payload_manifest
        return self.snapshot.data, self.manifest

    @property
    def key(self) -> PolicyVersion:
        return self.manifest.policy_version

    @property
    def active(self) -> frozenset[str]:
        return self.bcast.active

    @property
    def published_s(self) -> float:
        return self.bcast.published_s


Fault = Callable[[str, WeightChunk], WeightChunk | None]
"""Test hook on the stream: (destination, chunk) -> chunk to send (maybe altered) or None."""


class WeightBroadcaster:
    """Publisher side: membership, relay plans, streaming to seeds, repair, T_bcast."""

    def __init__(
        self,
        transport: Transport,
        control: RouterEndpoint,
        *,
        name: str = "weight_publisher",
        mode: str = "relay",
        stripes: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        link: LinkSpec = NO_LINK,
        member_ttl_s: float = 5.0,
        send_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        gamma: float = GAMMA,
        fault: Fault | None = None,
        on_bcast: Callable[[dict[str, Any]], None] | None = None,
        shm_dir: str | None = None,
        sealed: bool = False,
        delta_anchor_every: int = 0,
        delta_threads: int = 2,
        max_depth: int = MAX_DEPTH,
        max_streams: int = MAX_STREAMS,
        dial_in: str = "",
    ) -> None:
        """``chunk_bytes``: the largest chunk; a version is cut smaller when its members
        are reached over several parallel streams (``echo2.weights.pacing.chunk_bytes_for``),
        at most ``max_streams`` per member, their number adapted to each path
        (``echo2.weights.lanes``: 1 on a clean path). ``dial_in``: a tcp URL to listen on
        for members that accept no inbound connection (``echo2.weights.dial``; "": none).

        ``shm_dir``: where versions for members sharing this host are written (None:
        never; every member then gets chunks). ``sealed`` (``[security]``): every version
        is published sealed (``echo2.weights.seal``: ciphertext on every stream, in repair
        and in shared memory) and each plan carries a fresh stream secret that chunk
        streams prove to inboxes (``echo2.weights.stream``).

        ``delta_anchor_every`` K > 1: versions are also delta-coded against the version
        published before them (``prepare_delta``), and every K-th is a dense anchor; members
        that hold that base get the delta form, the others the dense one. 0 or 1: every
        version dense. Not with ``sealed`` (sealed versions stay dense).

        ``max_depth``: relay plans of more members than this are trees whose fan-out grows
        with N (``echo2.weights.plan.relay_plan``); members are placed in them by what was
        measured of past versions (``Placement``)."""
        self.sealed = sealed
        self.delta_anchor_every = delta_anchor_every
        self.delta_threads = delta_threads
        self._delta_base: Snapshot | None = None  # the last version prepared, in the clear
        self._since_anchor = 0
        self._spare: np.ndarray | None = None  # sealed: prefaulted memory for the next ciphertext
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.name = name
        self.mode = mode
        self.stripes = stripes
        self.max_depth = max_depth
        self.placement = Placement()
        self.chunk_bytes = chunk_bytes
        self.link = link
        self.member_ttl_s = member_ttl_s
        self.send_timeout_s = send_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.gamma = gamma
        self._transport = transport
        self._control = control
        self._fault = fault
        self._on_bcast = on_bcast
        self._uplink = link.uplink(chunk_bytes)
        self._members: dict[str, _Member] = {}
        self._latest: _Version | None = None
        self._pending: _Version | None = None
        self._new = asyncio.Event()
        self._changed = asyncio.Condition()
        self._repairs: asyncio.Queue[tuple[bytes, ChunkRequest]] = asyncio.Queue()
        self._queued_repairs = OutstandingRepairs()  # a request repeated before it is served adds nothing
        self._stream_secret = b""  # the latest plan's: repair streams prove it too
        self._latest_plan: RelayPlan | None = None  # sent to late joiners with the manifest
        self._latest_trees: list[RelayTree] = []  # the latest plan's: who feeds whom
        self.max_streams = max_streams
        self._lanes: dict[str, Lanes] = {}  # member address -> its lanes
        self._counts: dict[str, StreamCount] = {}  # member address -> its stream count (outlives lanes)
        self._group: asyncio.TaskGroup | None = None
        self.dial_in = dial_in
        self._previous_secret = b""  # the plan's before the latest: dialers may prove either
        self._dial_asked: dict[str, int] = {}  # dial address -> connections last asked for
        self.dial_listener = DialListener(
            admits(lambda: [self._stream_secret, self._previous_secret], lambda: set(self._members), name),
            self._on_dialed,
        )
        self._retained: collections.OrderedDict[PolicyVersion, _Version] = collections.OrderedDict()
        # Who holds each sampler name on the control channel; a contested name is retried
        # by the subscription lease itself, so the retry hint is unused here.
        self._peers = PeerTable(control, server_id=name, retry_after_s=member_ttl_s)
        self.unbound_dropped: dict[str, int] = {}
        self.shm_dir = shm_dir
        self.shm_id = shm_identity(shm_dir)
        self._shm_files: list[str] = []
        self.t_bcast: dict[PolicyVersion, float] = {}
        self._recent: collections.OrderedDict[PolicyVersion, _Bcast] = collections.OrderedDict()
        self.last_t_bcast_s = float("nan")
        self.counters = dict.fromkeys(
            (
                "published",
                "superseded",
                "chunks_sent",
                "stream_bytes",
                "send_failures",
                "repair_requests",
                "repair_chunks_sent",
                "repair_duplicates_dropped",
                "repair_bytes_sent",
                "late_joiner_manifests",
                "unroutable",
                "members_expired",
                "installs",
                "shm_versions_written",
                "shm_failures",
                "delta_versions",
                "delta_fallbacks",
                "delta_dense_members",
                "delta_dense_requests",
            ),
            0,
        )

    # -- API -------------------------------------------------------------------------

    def prepare(self, snapshot: Snapshot) -> tuple[Snapshot, WeightManifest]:
        """The snapshot as it will travel and its manifest: sealed under a fresh content key
        when ``sealed``, else as is. CPU-bound (one pass, or two when sealed): callers that
        must not block the loop run it in a thread, and may sign the manifest after."""
        chunk_bytes = self.chunk_bytes_for(snapshot.data.nbytes)
        if self.sealed:
            spare, self._spare = self._spare, None
            if spare is not None and spare.nbytes != snapshot.data.nbytes:
                spare = None
            return seal_version(snapshot, chunk_bytes, out=spare)
        manifest = make_manifest(snapshot, chunk_bytes)
        if self.delta_anchor_every > 1:  # members keep each version: the next may be coded against it
            manifest = msgspec.structs.replace(manifest, delta_base=True)
        return snapshot, manifest

    def chunk_bytes_for(self, total_bytes: int) -> int:
        """The chunk size of a version of ``total_bytes`` (``echo2.weights.pacing
        .chunk_bytes_for``): a few chunks per parallel stream of the member reached over
        the most, none longer than half a second on the slowest member's streams."""
        streams = max((count.n for count in list(self._counts.values())), default=1)
        rates = []
        for member in list(self._members.values()):
            if not (is_stream_address(member.address) or is_dial_address(member.address)):
                continue
            lanes = self._lanes.get(member.address)
            rates.append(lanes.per_stream_bps() if lanes is not None else None)
        largest = self.chunk_bytes
        if None in rates:  # a member whose path nothing is known of yet: no chunk may take it long
            largest = min(largest, UNKNOWN_PATH_CHUNK_BYTES)
        known = [rate for rate in rates if rate is not None]
        return chunk_bytes_for(total_bytes, streams, largest, per_stream_bps=min(known, default=None))

    def prepare_delta(self, snapshot: Snapshot, manifest: WeightManifest) -> DeltaForm | None:
        """The delta form of ``snapshot`` (in the clear; ``manifest`` its prepared one)
        against the version prepared before it, or None: delta off or sealed, an anchor
        (every ``delta_anchor_every``-th), no base of the same layout, or a payload of at
        least ``DELTA_MAX_RATIO`` of the state or at least ``DELTA_MAX_CHANGED`` of its
        elements changed (counted in ``delta_fallbacks``). Call it for
        every version, in order, off the event loop (CPU-bound, like ``prepare``)."""
        base, self._delta_base = self._delta_base, snapshot
        if self.delta_anchor_every <= 1 or self.sealed:
            return None
        if base is None or base.tensors != snapshot.tensors or self._since_anchor >= self.delta_anchor_every - 1:
            self._since_anchor = 0
            return None
        started = time.perf_counter()
        payload, stats = encode(snapshot.data, base.data, snapshot.tensors, threads=self.delta_threads)
        if stats.ratio >= DELTA_MAX_RATIO or stats.changed_fraction >= DELTA_MAX_CHANGED:
            self.counters["delta_fallbacks"] += 1
            self._since_anchor = 0
            return None
        delta = delta_manifest(manifest, base.policy_version, payload, stats)
        self._since_anchor += 1
        return DeltaForm(payload, delta, stats, time.perf_counter() - started)

    def publish_nowait(
        self, snapshot: Snapshot, manifest: WeightManifest | None = None, delta: DeltaForm | None = None
    ) -> None:
        """Make ``snapshot`` the latest version and start streaming it (the previous
        stream, if still running, stops: only the newest version matters). With a
        ``manifest``, ``snapshot`` is as ``prepare`` returned it (sealed when ``sealed``);
        with a ``delta`` (``prepare_delta``), members holding its base get that form."""
        if manifest is None:
            snapshot, manifest = self.prepare(snapshot)
        elif self.sealed and not manifest.seal_key:
            raise ValueError("a sealed broadcaster publishes only sealed versions (see prepare)")
        self._pending = _Version(snapshot, manifest, delta)
        self._new.set()

    def members(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, m in self._members.items() if now - m.last_seen_s > self.member_ttl_s]:
            self._close_lanes(self._members.pop(name).address)
            self.placement.forget(name)
            self.counters["members_expired"] += 1
        return list(self._members)

    async def wait_members(self, count: int) -> list[str]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._members) >= count)
        return self.members()

    async def wait_bcast(self, key: PolicyVersion) -> float:
        async with self._changed:
            await self._changed.wait_for(lambda: key in self.t_bcast)
        return self.t_bcast[key]

    async def wait_installed(self, key: PolicyVersion, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: sum(1 for m in self._members.values() if m.installed >= key) >= count)

    def installed_by(self, key: PolicyVersion) -> list[str]:
        """Members that reported ``key`` (or a later version) installed."""
        return sorted(name for name, m in self._members.items() if m.installed >= key)

    @property
    def relay_trees(self) -> list[RelayTree]:
        """The latest version's plan: who feeds whom, per stripe."""
        return list(self._latest_trees)

    @property
    def latest_key(self) -> PolicyVersion | None:
        return self._latest.key if self._latest is not None else None

    def statistics(self) -> dict[str, float]:
        return {
            **self.counters,
            "members": len(self._members),
            "dialed_streams": self.dial_listener.counters["dialed"],
            "max_streams": max((lanes.streams for lanes in self._lanes.values()), default=0),
            "t_bcast_s": self.last_t_bcast_s,
            "uplink_bytes": self._uplink.bytes,
        }

    def streams_to(self, member: str) -> int:
        """Parallel chunk streams the publisher uses to ``member`` now (0: none open)."""
        found = self._members.get(member)
        lanes = self._lanes.get(found.address) if found is not None else None
        return lanes.streams if lanes is not None else 0

    def _close_lanes(self, address: str) -> None:
        lanes = self._lanes.pop(address, None)
        if lanes is not None:
            lanes.close()

    def close(self) -> None:
        for lanes in self._lanes.values():
            lanes.close()
        self._lanes.clear()
        self._drop_shm_files(keep=0)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            if self.dial_in:
                group.create_task(self.dial_listener.serve(listen(self.dial_in), group))
            group.create_task(self._control_loop())
            group.create_task(self._repair_loop())
            group.create_task(self._stream_driver(group))

    # -- control ---------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _control_loop(self) -> None:
        while True:
            for peer, message in await self._control.recv_many():
                if isinstance(message, WeightSubscribe):
                    outcome = await self._peers.claim(peer, message.sampler_id)
                    if isinstance(outcome, Refusal):
                        # No answer: the subscription repeats, and once the connection
                        # holding the name is gone (a restart's old one) the claim succeeds.
                        log.warning("%s: subscription refused: %s", self.name, outcome.message)
                        continue
                    await self._on_subscribe(peer, message)
                elif isinstance(message, ChunkRequest | WeightsInstalled | WeightsReceived):
                    # Served only on the connection that holds the name the message carries:
                    # repairs are sent to members, and installs measure T_bcast.
                    if not self._peers.holds(peer, message.sampler_id):
                        kind = type(message).__name__
                        self.unbound_dropped[kind] = self.unbound_dropped.get(kind, 0) + 1
                    elif isinstance(message, ChunkRequest):
                        self._on_repair_request(peer, message)
                    elif isinstance(message, WeightsReceived):
                        self._on_received(message)
                    else:
                        self._on_installed(message)
            await self._notify()

    @property
    def refused_subscribers(self) -> dict[str, int]:
        """Subscriptions refused, by ``RefusalReason`` (``echo2.transport.peers``)."""
        return dict(self._peers.refused)

    async def _on_subscribe(self, peer: bytes, message: WeightSubscribe) -> None:
        now = time.monotonic()
        member = self._members.get(message.sampler_id)
        joined = member is None
        restarted = member is not None and (member.address != message.relay_address or member.peer != peer)
        if member is not None and restarted and member.address != message.relay_address:
            self._close_lanes(member.address)
        if member is None or restarted:
            member = _Member(peer, message.relay_address, now)
            self._members[message.sampler_id] = member
            if is_stream_address(member.address) and not self.sealed and self._group is not None:
                # Connect now: the path's round trip is known when the next version is cut.
                # (A sealed inbox admits a stream only once the member holds a plan.)
                self._lanes_to(message.sampler_id, member.address, b"").warm()
        member.last_seen_s = now
        member.shm_id = message.shm_id
        member.installed = max(member.installed, message.installed)
        latest = self._latest
        if latest is None or member.installed >= latest.key:
            return
        in_stream = message.sampler_id in latest.active
        overdue = now - max(latest.published_s, member.manifest_sent_s) > self.member_ttl_s
        if (joined and not in_stream) or restarted or overdue:
            # Late joiner (or a member that lost track): the latest version at once, dense.
            latest.delta_members.discard(message.sampler_id)
            member.manifest_sent_s = now
            self.counters["late_joiner_manifests"] += 1
            if self._is_local(member):
                await self._send_local(member, latest)
            else:
                # The plan first: it names the publisher and carries the stream secret, without
                # which a sealed member's inbox refuses the repair stream that will fill it.
                plan = self._latest_plan
                if plan is not None and plan.policy_version == latest.key:
                    await self._send(peer, member_view(plan, self._latest_trees, message.sampler_id))
                await self._send(peer, latest.manifest)

    def _on_received(self, message: WeightsReceived) -> None:
        version = self._recent.get(message.policy_version)
        if version is not None and message.sampler_id in version.active:
            version.received_s.setdefault(message.sampler_id, time.monotonic() - version.published_s)

    def _on_installed(self, message: WeightsInstalled) -> None:
        key = message.policy_version
        self.counters["installs"] += 1
        member = self._members.get(message.sampler_id)
        if member is not None:
            member.installed = max(member.installed, key)
        # Superseded versions count too: when broadcast is the bottleneck, most are.
        version = self._recent.get(key)
        if version is None:
            return
        version.installed.add(message.sampler_id)
        done = len(version.installed & version.active)
        need = bcast_threshold(len(version.active), self.gamma)
        if version.t_bcast_s is None and version.active and done >= need:
            version.t_bcast_s = time.monotonic() - version.published_s
            self.t_bcast[key] = version.t_bcast_s
            self.last_t_bcast_s = version.t_bcast_s
            self._report(version)

    def _report(self, version: _Bcast) -> None:
        """The ``broadcast`` record of a version, once: at its T_bcast, or when it leaves the
        window of tracked versions without reaching it (``t_bcast_s`` None)."""
        if version.reported or self._on_bcast is None:
            return
        version.reported = True
        self._on_bcast(
            {
                "incarnation": version.key.incarnation,
                "version": version.key.version,
                "t_bcast_s": version.t_bcast_s,
                "installed": len(version.installed & version.active),
                "active": len(version.active),
                "superseded": self._latest is not None and self._latest.key != version.key,
                "mode": self.mode,
                "sealed": self.sealed,
                "bytes": version.total_bytes,
                "dense_bytes": version.total_bytes,
                "wire_bytes": version.wire_bytes,
                "delta": version.delta_members > 0,
                "delta_members": version.delta_members,
                "changed_fraction": version.changed_fraction,
                "encode_s": version.encode_s,
            }
        )

    def _track(self, version: _Bcast) -> None:
        """Follow ``version``'s installs; the oldest tracked one past the window is reported as it stands."""
        self._recent[version.key] = version
        while len(self._recent) > TRACKED_VERSIONS:
            _, oldest = self._recent.popitem(last=False)
            self._report(oldest)

    async def _send(self, peer: bytes, message: Any) -> bool:
        try:
            # asyncio.timeout, never wait_for: on 3.11 wait_for can return the send's result
            # and drop a cancellation that arrived at the same moment, leaving a loop that
            # was told to stop running forever (seen as a hung shutdown).
            async with asyncio.timeout(self.send_timeout_s):
                ok = await self._control.send(peer, message)
        except TimeoutError:
            ok = False
        if not ok:
            self.counters["unroutable"] += 1
        return ok

    # -- streaming -------------------------------------------------------------------

    async def _stream_driver(self, group: asyncio.TaskGroup) -> None:
        current: asyncio.Task[None] | None = None
        while True:
            await self._new.wait()
            self._new.clear()
            version, self._pending = self._pending, None
            if version is None:
                continue
            if current is not None and not current.done():
                current.cancel()
                self.counters["superseded"] += 1
                await asyncio.wait([current])  # our own cancellation still propagates
            current = group.create_task(self._stream(version))

    def _is_local(self, member: _Member) -> bool:
        return bool(self.shm_id) and member.shm_id == self.shm_id

    async def _shm_path(self, version: _Version) -> str | None:
        """The file holding ``version`` in shared memory, written on first need; None if
        it cannot be written (members then get chunks instead)."""
        if version.shm_path is None and self.shm_dir is not None:
            name = f"echo2-weights-{os.getpid()}-{os.urandom(4).hex()}-{version.key.incarnation}-{version.key.version}"
            # Listed before it exists, so that it is removed even if this stream is
            # superseded (cancelled) while the write goes on in its thread.
            self._shm_files.append(os.path.join(self.shm_dir, name))
            try:
                path = await asyncio.to_thread(write_snapshot, self.shm_dir, name, version.snapshot.data)
            except OSError as exc:
                self.counters["shm_failures"] += 1
                log.warning(
                    "%s: cannot write v%d to %s (%s); repairing instead",
                    self.name,
                    version.key.version,
                    self.shm_dir,
                    exc,
                )
                return None
            version.shm_path = path
            self.counters["shm_versions_written"] += 1
            self._drop_shm_files(keep=1)
        return version.shm_path

    def _drop_shm_files(self, keep: int) -> None:
        """Unlink all but the newest ``keep`` files (members that mapped one keep it)."""
        while len(self._shm_files) > keep:
            path = self._shm_files.pop(0)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # removed from outside; nothing left to free

    async def _stream(self, version: _Version) -> None:
        names = sorted(self.members())
        version.bcast.active = frozenset(names)
        version.bcast.published_s = time.monotonic()
        previous, plan = self._latest, self._latest_plan
        if previous is not None and plan is not None and plan.policy_version == previous.key:
            # What the last version's plan showed of each member places it in this one.
            elapsed_s = version.published_s - previous.published_s
            self.placement.observe(self._latest_trees, previous.bcast.received_s, elapsed_s)
        self._latest = version
        self._retained[version.key] = version
        while len(self._retained) > RETAINED_VERSIONS:
            self._retained.popitem(last=False)
        self._track(version.bcast)
        self.counters["published"] += 1
        # Members sharing this host map the version from shared memory (written while the
        # others' stream starts); the plan covers the others.
        local = [n for n in names if self._is_local(self._members[n])]
        remote = [n for n in names if n not in local]
        dense_only: list[str] = []
        if version.delta is not None:
            base = version.delta.manifest.delta
            assert base is not None
            holders = [n for n in remote if self._members[n].installed == (base.base_incarnation, base.base_version)]
            if 2 * len(holders) >= len(remote) > 0:
                # The plan carries the delta form; the others (base not held: late,
                # restarted, behind) repair the dense form from here, like late joiners.
                version.delta_members = set(holders)
                dense_only = [n for n in remote if n not in version.delta_members]
                remote = holders
                version.bcast.wire_bytes = int(version.delta.payload.nbytes)
                version.bcast.delta_members = len(holders)
                self.counters["delta_versions"] += 1
                self.counters["delta_dense_members"] += len(dense_only)
        # Members that dial in are fed by the publisher alone: nobody can reach them.
        dialers = [n for n in remote if is_dial_address(self._members[n].address)]
        order, leaves = self.placement.order([n for n in remote if n not in dialers])
        stripes, trees = relay_plan(order, self.mode, self.stripes, max_depth=self.max_depth, leaves=leaves)
        trees += [RelayTree(stripe, [d]) for d in dialers for stripe in range(stripes)]
        addresses = {n: self._members[n].address for n in remote}
        plan = RelayPlan(
            incarnation=version.key.incarnation,
            version=version.key.version,
            stripes=stripes,
            chains=[],  # each member is sent its own place in the trees (member_view)
            addresses=addresses,
            publisher=self.name,
            stream_secret=os.urandom(32) if self.sealed else b"",
        )
        self._previous_secret, self._stream_secret = self._stream_secret, plan.stream_secret
        self._latest_plan, self._latest_trees = plan, trees
        # The seeds' plans first; the others' go out while the chunks already flow (in the
        # order chunks reach them: with hundreds of members, chunks waiting for every
        # manifest to be sent would add that to every member's time).
        reached = reach_order(trees)
        seeds: dict[int, list[str]] = {}
        for tree in trees:
            seeds.setdefault(tree.stripe, []).append(tree.members[0])
        first = len({tree.members[0] for tree in trees})
        await self._send_plans(version, plan, reached[:first])
        await asyncio.gather(
            self._send_plans(version, plan, reached[first:]),
            self._send_dense(version, dense_only),
            self._offer_shm(version, local),
            self._stream_chunks(version, plan, seeds),
        )
        if self.sealed and self._spare is None:
            # Between versions, so that the next one's page faults are not paid while it
            # is sealed (versions keep their size); never a buffer that was streamed.
            self._spare = await asyncio.to_thread(prefaulted_buffer, version.manifest.total_bytes)

    async def _send_plans(self, version: _Version, plan: RelayPlan, names: list[str]) -> None:
        """Each member's view of the plan (``member_view``), then its manifest."""
        for name in names:
            member = self._members.get(name)
            if member is None:
                continue  # gone since the plan was made
            member.manifest_sent_s = version.published_s
            if await self._send(member.peer, member_view(plan, self._latest_trees, name)):
                await self._send(member.peer, self._manifest_for(version, name))

    async def _send_dense(self, version: _Version, names: list[str]) -> None:
        for name in names:
            member = self._members.get(name)
            if member is not None:
                member.manifest_sent_s = version.published_s
                await self._send(member.peer, version.manifest)

    @staticmethod
    def _manifest_for(version: _Version, member: str) -> WeightManifest:
        """The manifest ``member`` is sent: the delta one if it takes the delta form."""
        if version.delta is not None and member in version.delta_members:
            return version.delta.manifest
        return version.manifest

    async def _offer_shm(self, version: _Version, names: list[str]) -> None:
        for name in names:
            member = self._members.get(name)
            if member is not None:
                member.manifest_sent_s = version.published_s
                await self._send_local(member, version)

    async def _send_local(self, member: _Member, version: _Version) -> None:
        """``WeightShm``, then the manifest, to a member on this host. If the version
        cannot be put in shared memory the manifest goes alone: the member, in no chain,
        then repairs the version from the publisher."""
        path = await self._shm_path(version)
        offer = WeightShm(incarnation=version.key.incarnation, version=version.key.version, path=path) if path else None
        if offer is None or await self._send(member.peer, offer):
            await self._send(member.peer, version.manifest)

    async def _stream_chunks(self, version: _Version, plan: RelayPlan, seeds: dict[int, list[str]]) -> None:
        """Put every chunk of the plan's form on the lanes of its stripe's seeds (the roots of
        the plan's trees), and wait until all have left (superseded: the chunks not yet gone
        are discarded)."""
        stripes, addresses = plan.stripes, plan.addresses
        dead: set[str] = set()
        pending = _Pending()
        tag = ("stream", version.key)

        def done_for(seed: str, nbytes: int) -> Callable[[Outcome], None]:
            def done(outcome: Outcome) -> None:
                pending.settle()
                if outcome == "sent":
                    self.counters["chunks_sent"] += 1
                    self.counters["stream_bytes"] += nbytes
                elif outcome == "failed" and seed not in dead:
                    dead.add(seed)  # skipped for this version; its chain repairs
                    self.counters["send_failures"] += 1

            return done

        # One form per plan: the delta payload when the plan's members took it.
        data, manifest = version.form()
        size = manifest.chunk_bytes

        async def feed(seed: str, stripe_set: set[int]) -> None:
            """Put the seed's stripes on its lanes, at its own pace: one slow member never
            holds back the others' streams."""
            for index in range(len(manifest.chunk_digests)):
                if index % stripes not in stripe_set:
                    continue
                if seed in dead:
                    return
                chunk = _chunk_of(manifest.policy_version, data, size, index)
                out = chunk if self._fault is None else self._fault(seed, chunk)
                if out is None:
                    continue
                pending.add()
                put = self._put_chunk(
                    seed, addresses[seed], out, plan.stream_secret, tag, done_for(seed, out.data.nbytes)
                )
                if not await put:
                    pending.settle()
                    if seed not in dead:
                        dead.add(seed)
                        self.counters["send_failures"] += 1

        stripes_of: dict[str, set[int]] = {}
        for stripe, members in seeds.items():
            for seed in members:
                stripes_of.setdefault(seed, set()).add(stripe)
        try:
            async with asyncio.TaskGroup() as feeders:
                for seed, stripe_set in stripes_of.items():
                    feeders.create_task(feed(seed, stripe_set))
            await pending.wait()
        except asyncio.CancelledError:
            for seed in stripes_of:
                lanes = self._lanes.get(addresses[seed])
                if lanes is not None:
                    lanes.discard(lambda queued: queued != tag)
            raise

    def _lanes_to(self, member: str, address: str, secret: bytes) -> Lanes:
        """The lanes to ``member``'s inbox, opened on first use (again after a failure,
        with the stream count learned before)."""
        lanes = self._lanes.get(address)
        if lanes is None or lanes.failed or lanes.closed:
            assert self._group is not None, "the broadcaster is not running"
            self._dial_asked.pop(address, None)
            lanes = self._lanes[address] = open_lanes(
                self._transport,
                address,
                name=f"{self.name}->{member}",
                group=self._group,
                counts=self._counts,
                max_streams=self.max_streams,
                credentials=StreamCredentials(self.name, member, secret) if secret else None,
                max_message_bytes=self.chunk_bytes,
                connect_timeout_s=self.connect_timeout_s,
                send_timeout_s=self.send_timeout_s,
            )
        return lanes

    async def _put_chunk(
        self, member: str, address: str, chunk: WeightChunk, secret: bytes, tag: object, done: Callable[[Outcome], None]
    ) -> bool:
        """Pace ``chunk`` through the uplink and put it on ``member``'s lanes; False when
        the member's inbox is gone (``done`` is then not called)."""
        await self._uplink.acquire(chunk.data.nbytes)
        lanes = self._lanes_to(member, address, secret)
        self._ask_to_dial(lanes, address)
        return await lanes.put(chunk, done, tag)

    def _on_dialed(self, member: str, sock: socket.socket) -> None:
        """A member that accepts no inbound connection dialed in: its chunks go down it."""
        address = dial_address(member)
        sender = ChunkStreamSender.adopted(sock, address, stall_timeout_s=self.send_timeout_s)
        self._lanes_to(member, address, self._stream_secret).adopt(sender)

    def _ask_to_dial(self, lanes: Lanes, address: str) -> None:
        """Dialed lanes whose stream count grew past the connections dialed: ask for more
        (once per new count), down one of those connections."""
        wanted = lanes.dial_wanted()
        sender = lanes.any_sender()
        if not wanted or self._dial_asked.get(address) == wanted or sender is None or self._group is None:
            return
        self._dial_asked[address] = wanted

        async def ask() -> None:
            with contextlib.suppress(ClosedError, TransportError, TimeoutError):
                await sender.send_frame(dial_more_frame(wanted))

        self._group.create_task(ask())

    # -- repair ----------------------------------------------------------------------

    def _on_repair_request(self, peer: bytes, request: ChunkRequest) -> None:
        """Queue what the request asks for that is not queued for that member already: a
        receiver whose deadline passed while its chunks waited here asks again, and those
        chunks must go once."""
        self.counters["repair_requests"] += 1
        member = self._members.get(request.sampler_id)
        if member is not None:  # it is at work on a version (maybe finishing an older one): not overdue
            member.manifest_sent_s = max(member.manifest_sent_s, time.monotonic())
        fresh = self._queued_repairs.admit(request.sampler_id, request.policy_version, request.indices)
        self.counters["repair_duplicates_dropped"] += len(request.indices) - len(fresh)
        if fresh or not request.indices:
            self._repairs.put_nowait((peer, msgspec.structs.replace(request, indices=fresh)))

    async def _repair_loop(self) -> None:
        """One repair worker per member: a member behind a slow path is served at its pace
        while the others are served at theirs."""
        queues: dict[str, asyncio.Queue[tuple[bytes, ChunkRequest]]] = {}
        async with asyncio.TaskGroup() as workers:
            while True:
                peer, request = await self._repairs.get()
                queue = queues.get(request.sampler_id)
                if queue is None:
                    queue = queues[request.sampler_id] = asyncio.Queue()
                    workers.create_task(self._repair_worker(queue))
                queue.put_nowait((peer, request))

    async def _repair_worker(self, queue: asyncio.Queue[tuple[bytes, ChunkRequest]]) -> None:
        while True:
            peer, request = await queue.get()
            handed: set[int] = set()
            try:
                await self._serve_repair(peer, request, handed)
            finally:
                for index in request.indices:  # given up on: may be asked for again
                    if index not in handed:
                        self._queued_repairs.sent(request.sampler_id, request.policy_version, index)

    async def _serve_repair(self, peer: bytes, request: ChunkRequest, handed: set[int]) -> None:
        """The chunks asked for, of the latest version or one still retained (a member
        finishing the version before it), on the member's chunk stream lanes when it has
        an inbox (its progress is visible in bytes there, and a chunk counts as served
        only when the kernel took it), else on the control channel. Indices put on lanes
        go in ``handed``: they leave the queue when their lane is done with them."""
        latest = self._latest
        if latest is None:
            return
        key = request.policy_version
        if request.dense and key == latest.key:
            # The member cannot use the delta form (its base differs, or what it rebuilt
            # failed verification): the dense form from now on.
            self.counters["delta_dense_requests"] += 1
            latest.delta_members.discard(request.sampler_id)
            await self._send(peer, latest.manifest)
            return
        version = self._retained.get(key)
        if version is None:
            if key < latest.key:
                await self._send(peer, latest.manifest)  # gone from here: move on to the latest
            return
        member = self._members.get(request.sampler_id)
        reached = member is not None and (is_stream_address(member.address) or is_dial_address(member.address))
        stream = member.address if member is not None and reached else ""
        data, manifest = version.form(request.sampler_id)
        n = len(manifest.chunk_digests)
        size = manifest.chunk_bytes
        for index in request.indices:
            if not 0 <= index < n:
                continue
            if key not in self._retained:
                break
            chunk = _chunk_of(key, data, size, index)
            if stream:
                done = self._repair_done(request.sampler_id, key, index, chunk.data.nbytes)
                if not await self._put_chunk(
                    request.sampler_id, stream, chunk, self._stream_secret, ("repair", key), done
                ):
                    break
                handed.add(index)
            else:
                await self._uplink.acquire(chunk.data.nbytes)
                if not await self._send(peer, chunk):
                    break
                self.counters["repair_chunks_sent"] += 1
                self.counters["repair_bytes_sent"] += chunk.data.nbytes
                self._queued_repairs.sent(request.sampler_id, key, index)
                handed.add(index)

    def _repair_done(self, member: str, key: PolicyVersion, index: int, nbytes: int) -> Callable[[Outcome], None]:
        def done(outcome: Outcome) -> None:
            if outcome == "sent":
                self.counters["repair_chunks_sent"] += 1
                self.counters["repair_bytes_sent"] += nbytes
            self._queued_repairs.sent(member, key, index)  # sent or given up on: may be asked again

        return done
