"""Sampler side of weight dissemination: the relay inbox, assembly, verification, repair.

See ``echo2.weights`` for the whole path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from echo2.messages import (
    NO_VERSION,
    ChunkRequest,
    PolicyVersion,
    RelayPlan,
    WeightChunk,
    WeightManifest,
    WeightShm,
    WeightsInstalled,
    WeightsReceived,
    WeightSubscribe,
)
from echo2.transport.context import Transport
from echo2.transport.endpoint import (
    DealerEndpoint,
    PullEndpoint,
    SocketOptions,
)
from echo2.transport.urls import url_host, url_host_of
from echo2.weights.chunks import (
    DEFAULT_CHUNK_BYTES,
    ManifestRejected,
    SnapshotAssembler,
    prefaulted_buffer,
    rebuild_pool,
    verify_pool,
)
from echo2.weights.delta import DeltaRebuild, base_of
from echo2.weights.dial import Dialer, dial_address
from echo2.weights.lanes import Lanes, Outcome, open_lanes
from echo2.weights.link import DelayLine, LinkSpec
from echo2.weights.pacing import (
    DEFAULT_MAX_OUTSTANDING_BYTES,
    K,
    RateMeter,
    RepairPacer,
    RepairTally,
    StreamCount,
    transfer_deadline_s,
)
from echo2.weights.plan import (
    DATA_PLANES,
    MAX_REPAIR_INDICES,
    NO_LINK,
    RELAY_HWM,
    announce_url,
    max_message_bytes,
    relay_bind_url,
)
from echo2.weights.seal import opener_for
from echo2.weights.shm import map_snapshot, shm_identity
from echo2.weights.stream import SCHEME as STREAM_SCHEME
from echo2.weights.stream import (
    ChunkStreamServer,
    StreamCredentials,
    listen,
    stream_mac,
)

log = logging.getLogger(__name__)

KEPT_LANES = 16
"""Lanes to members this one fed kept open while later plans feed others: a plan that
returns to an earlier shape reuses them; beyond this many, unused ones are closed."""
TAIL_CHUNKS = 2
"""A version lacking at most this many chunks (or 2% of them) is in its tail: a chunk still
on its stream after ``straggler_deadline_s`` is repaired on another."""


# -- receiver ----------------------------------------------------------------------------


def _senders_to(plan: RelayPlan, member: str) -> set[str]:
    """Who may stream to ``member``'s inbox under ``plan``: its publisher and the member's
    predecessor in each chain."""
    senders = {plan.publisher} if plan.publisher else set()
    for chain in plan.chains:
        if member in chain.members[1:]:
            senders.add(chain.members[chain.members.index(member) - 1])
    return senders


def _offer_all(assembler: SnapshotAssembler, chunks: list[WeightChunk]) -> list[str]:
    return [assembler.offer(chunk) for chunk in chunks]


def _chunk_sizes(manifest: WeightManifest) -> list[int]:
    size, total = manifest.chunk_bytes, manifest.total_bytes
    return [min(size, total - i * size) for i in range(len(manifest.chunk_digests))]


class WeightReceiver:
    """Sampler side: assemble, verify, relay, repair; ``on_complete`` gets a full version.

    ``control`` is the sampler's DEALER on channel ``weights`` (routing id = ``name``).
    ``open()`` binds the relay inbox (call it in setup); ``run()`` is the loop.
    """

    def __init__(
        self,
        transport: Transport,
        control: DealerEndpoint,
        *,
        name: str,
        link: LinkSpec = NO_LINK,
        relay_host: str = "",
        gap_timeout_s: float = 2.0,
        announce_s: float = 1.0,
        send_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        max_repair_bytes: int = DEFAULT_MAX_OUTSTANDING_BYTES,
        chunk_bytes_hint: int = DEFAULT_CHUNK_BYTES,
        on_complete: Callable[[SnapshotAssembler], None] | None = None,
        verify_manifest: Callable[[WeightManifest], None] | None = None,
        max_early_chunks: int = 4096,
        verify_threads: int = 2,
        prefault_next: bool = True,
        data_plane: str = "stream",
        shm_dir: str | None = None,
        sealed: bool = False,
        finish_within: int = 0,
        max_streams: int = 128,
        relay_bind: str = "",
        relay_announce: str = "",
        dial: str = "",
    ) -> None:
        """``finish_within`` (versions; the job's staleness ``S``): a newer version that
        arrives while this one is half held or more waits until this one is complete and
        handed over, as long as this one is fewer than ``finish_within`` versions older
        (rollouts made with it are then still admissible); 0: the newer one always takes
        over at once. ``max_streams``: parallel chunk streams to each successor, at most
        (``echo2.weights.lanes``).

        Where the inbox is (``PortAddresses`` from the topology): ``relay_bind`` the tcp URL
        it listens on (a fixed port of the host's range; "": an ephemeral port), announced
        as ``relay_announce`` (``relay_host`` overrides its host; "": this host's address
        on the route to the publisher). ``dial``: this host accepts no inbound connection;
        the chunks come down connections dialed to the publisher's listener at this URL
        (``echo2.weights.dial``) and no inbox is opened.

        ``sealed`` (``[security]``): the relay inbox admits only senders that prove the
        plan's stream secret and are the publisher or this member's predecessor
        (``echo2.weights.stream``). Sealed versions (``echo2.weights.seal``) are opened
        whenever their manifest carries a key, sealed or not.

        Timeouts (``echo2.weights.pacing``): a version is stalled when no byte of it
        arrived for max(``gap_timeout_s``, K x RTT); a forward fails when the successor's
        stream takes no byte for ``send_timeout_s`` (or 3 retransmission timeouts) and a
        connection that is not up in ``connect_timeout_s``; at most ``max_repair_bytes`` of
        repair are outstanding, each chunk until its own deadline."""
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        if sealed and data_plane != "stream":
            raise ValueError("under [security] the relay inbox must be a chunk stream (data_plane='stream')")
        self.sealed = sealed
        self._previous_plan: RelayPlan | None = None
        self.data_plane = data_plane
        self.shm_id = shm_identity(shm_dir)
        self._shm_offer: WeightShm | None = None
        self._shm_key: PolicyVersion | None = None  # the last version taken from shared memory
        self._verify_manifest = verify_manifest
        self.prefault_next = prefault_next
        self._spares: list[np.ndarray] = []  # prefaulted for the next version (two if sealed)
        self.name = name
        self._transport = transport
        self._control = control
        self.link = link
        self._relay_host = relay_host
        self.gap_timeout_s = gap_timeout_s
        self.announce_s = announce_s
        self.send_timeout_s = send_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_repair_bytes = max_repair_bytes
        self._on_complete = on_complete
        self._max_early = max_early_chunks
        self._uplink = link.uplink(chunk_bytes_hint)
        self._downlink = link.downlink(chunk_bytes_hint)
        self._delay: DelayLine[WeightChunk] | None = (
            DelayLine(link.latency_ms / 1000.0) if link.latency_ms > 0 else None
        )
        self._inbox: PullEndpoint | None = None
        self._stream: ChunkStreamServer | None = None
        self._stream_socket: socket.socket | None = None
        self._landed: asyncio.Queue[WeightChunk] = asyncio.Queue()
        self.relay_address = ""
        self._assembler: SnapshotAssembler | None = None
        self._meter = RateMeter()  # bytes in on every path: the progress a stall is judged by
        self._bytes_in = 0  # bytes of the assembling version taken in off the chunk streams
        self._pacer: RepairPacer | None = None  # of the version being assembled, once it repairs
        self._pacer_key: PolicyVersion | None = None
        self._refilling = False
        self._repairing: PolicyVersion | None = None  # the version whose every missing chunk is repaired
        self._repair_totals = RepairTally()
        self._complete_key: PolicyVersion | None = None
        # When each recent version's manifest came (monotonic), and then how long it took
        # to arrive and when it was complete (unix): WeightsInstalled carries them.
        self._manifest_s: dict[PolicyVersion, float] = {}
        self._arrivals: dict[PolicyVersion, tuple[float, float]] = {}
        # Delta versions (``echo2.weights.delta``): the last complete version's state (the
        # base a delta rebuilds from; read only), the rebuild of the delta version whose
        # payload is being assembled, and the version being rebuilt.
        self._base: tuple[PolicyVersion, np.ndarray] | None = None
        self._delta: DeltaRebuild | None = None
        self._rebuilding: PolicyVersion | None = None
        self._installed_key: PolicyVersion | None = None
        self._plan: RelayPlan | None = None
        self._successors: dict[int, list[str]] = {}
        self._successor_names: dict[str, str] = {}  # address -> member (whom a stream proves itself to)
        self._dead_successors: set[str] = set()
        self._early: dict[PolicyVersion, list[WeightChunk]] = {}
        # One queue and one forwarding task per successor: a slow one never holds back another.
        self._forward: dict[str, asyncio.Queue[tuple[PolicyVersion, WeightChunk] | None]] = {}
        self._lanes: dict[str, Lanes] = {}  # successor address -> its lanes
        self._counts: dict[str, StreamCount] = {}  # successor address -> stream count (outlives lanes)
        self.max_streams = max_streams
        self.finish_within = finish_within
        self.relay_bind = relay_bind
        self.relay_announce = relay_announce
        self.dial = dial
        self._dialer: Dialer | None = None
        self._parked: WeightManifest | None = None  # a newer version waiting for this one to finish
        self._pool = verify_pool()  # the process's: many receivers share one process's cores
        self._rebuild_pool = rebuild_pool()
        self._slots = asyncio.Semaphore(verify_threads)
        self._verify_threads = verify_threads
        self._group: asyncio.TaskGroup | None = None
        self.counters = dict.fromkeys(
            (
                "manifests_rejected",
                "manifests_stale",
                "corrupt_chunks",
                "chunks_received",
                "chunks_duplicate",
                "chunks_stale",
                "chunks_forwarded",
                "forward_failures",
                "repair_requests",
                "repair_chunks_requested",
                "versions_complete",
                "spare_buffers_used",
                "stalled_streams_dropped",
                "shm_versions",
                "shm_failures",
                "seal_rejected",
                "delta_versions",
                "delta_base_missing",
                "delta_rejected",
                "dense_requests",
                "versions_finished",
                "versions_abandoned",
            ),
            0,
        )

    # -- lifecycle -------------------------------------------------------------------

    def open(self) -> str:
        """Bind the relay inbox; returns the address announced to the publisher.

        Over tcp the inbox is a chunk stream (``data_plane="stream"``, the default: bytes
        land in place, see ``echo2.weights.stream``) or a ZeroMQ PULL
        (``data_plane="zmq"``); over ipc and inproc it is always a PULL.
        """
        control_url = self._control.endpoints[0] if self._control.endpoints else "inproc://x"
        bind = relay_bind_url(control_url, self.name)
        if self.dial:
            self._stream = self._stream_server(authenticate=False)
            self._dialer = Dialer(
                self._stream,
                STREAM_SCHEME + self.dial[len("tcp") :],
                self.name,
                credentials=self._dial_credentials,
                max_streams=self.max_streams,
                connect_timeout_s=self.connect_timeout_s,
            )
            self.relay_address = dial_address(self.name)
            return self.relay_address
        if bind.startswith("tcp://") and self.relay_bind:
            bind = self.relay_bind
        if self.data_plane == "stream" and bind.startswith("tcp://"):
            listener = listen(bind, backlog=512)
            self._stream_socket = listener
            self._stream = self._stream_server(authenticate=self.sealed)
            tcp = self._announced(f"tcp://*:{listener.getsockname()[1]}", control_url)
            self.relay_address = STREAM_SCHEME + tcp[len("tcp") :]
            return self.relay_address
        self._inbox = self._transport.pull(
            name=f"{self.name}.relay",
            bind=[bind],
            options=SocketOptions(hwm=RELAY_HWM, max_message_bytes=max_message_bytes(64 << 20)),
        )
        self.relay_address = self._announced(self._inbox.endpoints[0], control_url)
        return self.relay_address

    def _stream_server(self, *, authenticate: bool) -> ChunkStreamServer:
        return ChunkStreamServer(
            self._on_landed,
            self._stream_destination,
            self._stream_abandon,
            max_chunk_bytes=max_message_bytes(64 << 20),
            authenticate=self._authenticates if authenticate else None,
            admit_wait_s=self.gap_timeout_s,
        )

    def _announced(self, bound: str, control_url: str) -> str:
        """The tcp URL peers reach an inbox bound at ``bound`` by: the topology's, with
        ``relay_host`` in place of its host when set; else found on the route."""
        if not bound.startswith("tcp://"):
            return bound
        port = bound.rpartition(":")[2]
        if self._relay_host:
            return f"tcp://{url_host(self._relay_host)}:{port}"
        if self.relay_announce:
            return f"tcp://{url_host_of(self.relay_announce)}:{port}"
        return announce_url(bound, control_url)

    def _dial_credentials(self) -> tuple[str, bytes] | None:
        """(publisher, stream secret) of the newest plan, for a dialed stream's answer."""
        plan = self._plan
        return (plan.publisher, plan.stream_secret) if plan is not None else None

    def close(self) -> None:
        for lanes in self._lanes.values():
            lanes.close()
        self._lanes.clear()
        if self._inbox is not None:
            self._inbox.close()
        if self._stream is not None:
            self._stream.close()
        if self._stream_socket is not None:
            self._stream_socket.close()

    async def run(self) -> None:
        if self._inbox is None and self._stream is None:
            self.open()
        if self._stream is not None and self._stream_socket is not None:
            await self._stream.start_on(self._stream_socket)
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                if self._dialer is not None:
                    group.create_task(self._dialer.run(self.sealed))
                group.create_task(self._control_loop())
                group.create_task(self._relay_loop())
                group.create_task(self._announce_loop())
                group.create_task(self._watchdog_loop())
                if self._delay is not None:
                    group.create_task(self._delayed_loop())
        finally:
            self._group = None

    def _spawn(self, work: Coroutine[Any, Any, object]) -> bool:
        """Run ``work`` as a task of the receiver's group. False (and ``work`` closed, never
        run) once the group is stopping: verify threads and chunk streams may still call
        back into a receiver that is closing, and what they would start is moot then."""
        group = self._group
        if group is None:
            work.close()
            return False
        try:
            group.create_task(work)
        except RuntimeError:  # "TaskGroup is shutting down" / "is finished"
            work.close()
            return False
        return True

    def _authenticates(self, challenge: bytes, sender: str, mac: bytes) -> bool:
        """May ``sender`` stream to our inbox? It must prove the stream secret of the
        current plan or the one before (a stream opened for the previous version may be
        the first to carry the next) and be that plan's publisher or our predecessor."""
        for plan in (self._plan, self._previous_plan):
            if plan is None or not plan.stream_secret or sender not in _senders_to(plan, self.name):
                continue
            if hmac.compare_digest(mac, stream_mac(plan.stream_secret, challenge, sender, self.name)):
                return True
        return False

    def _stream_destination(self, key: PolicyVersion, index: int, nbytes: int) -> np.ndarray | None:
        assembler = self._assembler
        if assembler is None or assembler.key != key:
            return None  # early, stale or foreign: read into its own buffer
        return assembler.destination(index, nbytes)

    def _stream_abandon(self, chunk: WeightChunk) -> None:
        assembler = self._assembler
        if assembler is not None:
            assembler.release(chunk)

    # -- queries ---------------------------------------------------------------------

    @property
    def assembling(self) -> PolicyVersion | None:
        return self._assembler.key if self._assembler is not None else None

    @property
    def complete_key(self) -> PolicyVersion | None:
        return self._complete_key

    def newest(self) -> PolicyVersion | None:
        """The newest version this receiver knows of: installed, complete, being
        assembled or rebuilt, or waiting for the one being assembled to finish."""
        parked = self._parked.policy_version if self._parked is not None else None
        keys = [
            k
            for k in (self._complete_key, self.assembling, self._installed_key, self._rebuilding, parked)
            if k is not None
        ]
        return max(keys) if keys else None

    def statistics(self) -> dict[str, float]:
        stream = self._stream.counters if self._stream is not None else {}
        totals = self._repair_totals
        return {
            **self.counters,
            **{f"stream_{k}": v for k, v in stream.items()},
            "repair_missing_bytes": totals.missing_bytes,
            "repair_bytes_requested": totals.requested_bytes,
            "requested_bytes_received": totals.received_bytes,
            "uplink_bytes": self._uplink.bytes,
            "downlink_bytes": self._downlink.bytes,
        }

    async def report_installed(self, key: PolicyVersion, install_s: float) -> WeightsInstalled:
        """Tell the publisher this version is installed (T_bcast counts it); returns what
        was sent (with how long the version took to arrive, and when it was complete)."""
        self._installed_key = key if self._installed_key is None else max(key, self._installed_key)
        received_s, complete_time_s = self._arrivals.get(key, (0.0, 0.0))
        message = WeightsInstalled(
            sampler_id=self.name,
            incarnation=key.incarnation,
            version=key.version,
            install_s=install_s,
            time_s=time.time(),
            received_s=received_s,
            complete_time_s=complete_time_s,
        )
        await self._control.send(message)
        return message

    # -- inputs ----------------------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            for message in await self._control.recv_many():
                if isinstance(message, RelayPlan):
                    self._on_plan(message)
                elif isinstance(message, WeightShm):
                    self._shm_offer = message  # its manifest comes next
                elif isinstance(message, WeightManifest):
                    await self._on_manifest(message)
                elif isinstance(message, WeightChunk):
                    self._count_progress([message])  # a repair (no chunk stream here)
                    await self._take(message)

    async def _inbound(self, limit: int = 16) -> list[WeightChunk]:
        """The next chunks from the relay inbox, as many as arrived together (<= limit)."""
        if self._stream is not None:
            chunks = [await self._landed.get()]
            while len(chunks) < limit and not self._landed.empty():
                chunks.append(self._landed.get_nowait())
            self._stream.taken(len(chunks))
            return chunks
        assert self._inbox is not None
        chunks = [m for m in await self._inbox.recv_many(limit) if isinstance(m, WeightChunk)]
        self._count_progress(chunks)
        return chunks

    async def _relay_loop(self) -> None:
        while True:
            chunks = await self._inbound()
            if self._delay is not None or self._downlink.capped:
                for chunk in chunks:
                    await self._take(chunk)
            elif chunks:
                # Uncapped: what arrived together is verified together, split over the
                # verify threads, one hand-off per thread rather than one per chunk.
                self._downlink.delay_for(sum(c.data.nbytes for c in chunks))  # counts bytes
                threads = self._verify_threads
                for part in range(min(threads, len(chunks))):
                    await self._verify_soon(chunks[part::threads])

    async def _take(self, chunk: WeightChunk) -> None:
        """Downlink pacing, then (after the emulated latency) processing."""
        await self._downlink.acquire(chunk.data.nbytes)
        if self._delay is not None:
            self._delay.put_nowait(chunk)
        else:
            await self._verify_soon([chunk])

    async def _delayed_loop(self) -> None:
        assert self._delay is not None
        while True:
            await self._verify_soon([await self._delay.get()])

    async def _verify_soon(self, chunks: list[WeightChunk]) -> None:
        """Verify up to ``verify_threads`` batches at once while the next ones arrive."""
        await self._slots.acquire()
        assert self._group is not None
        self._group.create_task(self._verify_then_release(chunks))

    async def _verify_then_release(self, chunks: list[WeightChunk]) -> None:
        try:
            await self._on_chunks(chunks)
        finally:
            self._slots.release()

    def _on_plan(self, plan: RelayPlan) -> None:
        key = plan.policy_version
        newest = self.newest()
        if newest is not None and key < newest:
            return
        if plan == self._plan:
            return  # sent again (to a member the publisher found overdue): nothing to redo
        if self._plan is not None and self._plan.policy_version != key:
            self._previous_plan = self._plan
        self._plan = plan
        if self._stream is not None and self.sealed:
            self._stream.readmit()  # senders waiting for the plan that names them
        if self.assembling == key:
            self._apply_plan()

    def _apply_plan(self) -> None:
        """Set successors for the assembling version and forward what is already held."""
        plan, assembler = self._plan, self._assembler
        self._successors = {}
        self._successor_names = {}
        self._dead_successors = set()
        if assembler is not None:
            for lanes in self._lanes.values():  # chunks of older versions not yet gone
                lanes.discard(lambda key: isinstance(key, PolicyVersion) and key >= assembler.key)
        if plan is None or assembler is None or plan.policy_version != assembler.key:
            return
        for chain in plan.chains:  # several chains of a stripe may start here: a relay tree
            if self.name in chain.members:
                at = chain.members.index(self.name)
                if at + 1 < len(chain.members):
                    successor = plan.addresses.get(chain.members[at + 1], "")
                    if successor and successor != self.relay_address:
                        self._successors.setdefault(chain.stripe, []).append(successor)
                        self._successor_names[successor] = chain.members[at + 1]
        if len(self._lanes) > KEPT_LANES:  # plans change with members: close who we no longer feed
            for address in [a for a in self._lanes if a not in self._successor_names]:
                self._lanes.pop(address).close()
                stale_queue = self._forward.pop(address, None)
                if stale_queue is not None:
                    stale_queue.put_nowait(None)  # its forwarding task ends
        # Chunks that landed before the plan still go down the chain.
        # (Their bytes are in the assembler's buffer, which is never written again.)
        for index in assembler.held():
            self._queue_forward(assembler, index, None)

    def _in_plan(self, key: PolicyVersion) -> bool:
        plan = self._plan
        return (
            plan is not None and plan.policy_version == key and any(self.name in chain.members for chain in plan.chains)
        )

    async def _on_manifest(self, manifest: WeightManifest) -> None:
        key = manifest.policy_version
        self._manifest_s.setdefault(key, time.monotonic())
        while len(self._manifest_s) > 8:
            del self._manifest_s[next(iter(self._manifest_s))]
        if self._parked is not None and key == self._parked.policy_version:
            # The publisher sent the waiting version again: it no longer holds the one being
            # finished (the answer to its repair), or finds this member overdue. Over,
            # unless bytes of it still arrive.
            if self._meter.idle_s >= self.stall_deadline_s():
                await self._abandon_for_parked()
            return
        newest = self.newest()
        # The dense form of the version being assembled as a delta (the publisher moved us
        # to it) replaces the delta assembly.
        to_dense = manifest.delta is None and self._delta is not None and key == self.assembling
        if newest is not None and key <= newest and not to_dense:
            self.counters["manifests_stale"] += 1
            return
        try:
            if self._verify_manifest is not None:
                self._verify_manifest(manifest)  # before any memory is committed to it
        except ManifestRejected as exc:
            self.counters["manifests_rejected"] += 1
            log.warning("%s: rejected manifest v%d: %s", self.name, manifest.version, exc)
            return
        try:
            opener = opener_for(manifest)
        except ManifestRejected as exc:
            # Not installed, and said why; the next version (or a corrected manifest) may open.
            self.counters["manifests_rejected"] += 1
            self.counters["seal_rejected"] += 1
            log.warning("%s: cannot open v%d: %s", self.name, manifest.version, exc)
            return
        if self._finishes_first(manifest):
            return
        if manifest.delta is not None:
            await self._on_delta_manifest(manifest)
            return
        self._delta = None
        try:
            mapped = self._map_offered(manifest)
            buffer = mapped if mapped is not None else self._take_spare(manifest.total_bytes)
            plaintext = self._take_spare(manifest.total_bytes) if opener is not None else None
            assembler = SnapshotAssembler(manifest, buffer, opener=opener, plaintext=plaintext)
        except ManifestRejected as exc:
            self.counters["manifests_rejected"] += 1
            log.warning("%s: rejected manifest v%d: %s", self.name, manifest.version, exc)
            return
        await self._start_assembly(assembler)
        if mapped is not None:
            self._shm_key = key
            self.counters["shm_versions"] += 1
            await self._verify_mapped(assembler)
        if self._assembler is assembler and not self._in_plan(key):
            # A late joiner, or a member the plan left out (shared memory: what failed to
            # verify): no stream is coming; repair what is missing.
            await self._request_missing(assembler)

    def _finishes_first(self, manifest: WeightManifest) -> bool:
        """Whether ``manifest`` (newer, verified) waits for the version being assembled:
        finishing that one is quicker than starting over and it is still useful (see
        ``finish_within``). True: it is parked (a newer one parked before is dropped)."""
        assembler = self._assembler
        if assembler is None or self._delta is not None or self.finish_within <= 0:
            return False
        key, current = manifest.policy_version, assembler.key
        if key.incarnation != current.incarnation or key.version - current.version >= self.finish_within:
            return False
        if self._parked is None:
            held = sum(_chunk_sizes(assembler.manifest)[i] for i in assembler.held())
            if 2 * held < assembler.manifest.total_bytes:
                return False
            self.counters["versions_finished"] += 1
            log.debug("%s: finishing v%d before v%d", self.name, current.version, key.version)
        self._parked = manifest
        return True

    async def _abandon_for_parked(self) -> None:
        """Stop finishing the version being assembled; assemble the parked one."""
        if self._assembler is not None:
            self.counters["versions_abandoned"] += 1
            self._assembler = None
        await self._start_parked()

    async def _start_parked(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None:
            await self._on_manifest(parked)

    async def _start_assembly(self, assembler: SnapshotAssembler) -> None:
        key = assembler.key
        if self._parked is not None and self._parked.policy_version <= key:
            self._parked = None
        self._assembler = assembler
        self._meter.progressed()
        self._apply_plan()
        early = self._early.pop(key, [])
        self._early = {k: v for k, v in self._early.items() if k > key}
        if early:
            await self._on_chunks(early)

    async def _on_delta_manifest(self, manifest: WeightManifest) -> None:
        """Assemble a delta version's payload (relayed and repaired like any version's
        chunks) if we hold its base; else ask for the dense form."""
        base = base_of(manifest)
        if manifest.seal_key:
            # echo2 publishes sealed versions dense only; a sealed delta is not one of ours.
            self.counters["manifests_rejected"] += 1
            log.warning("%s: rejected manifest v%d: a sealed delta version", self.name, manifest.version)
            return
        if self._base is None or self._base[0] != base:
            self.counters["delta_base_missing"] += 1
            await self._ask_dense(manifest.policy_version)
            return
        try:
            # Rebuilt as its payload's chunks verify, in the rebuild threads.
            rebuild = DeltaRebuild(
                manifest, self._base[1], self._rebuild_pool.submit, out=self._take_spare(manifest.total_bytes)
            )
        except (ManifestRejected, ValueError) as exc:
            self.counters["manifests_rejected"] += 1
            log.warning("%s: rejected delta manifest v%d: %s", self.name, manifest.version, exc)
            return
        self._delta = rebuild
        assembler = rebuild.payload
        await self._start_assembly(assembler)
        if self._assembler is assembler and not self._in_plan(assembler.key):
            await self._request_missing(assembler)

    async def _ask_dense(self, key: PolicyVersion) -> None:
        self.counters["dense_requests"] += 1
        await self._control.send(
            ChunkRequest(sampler_id=self.name, incarnation=key.incarnation, version=key.version, indices=[], dense=True)
        )

    async def _rebuild(self, rebuild: DeltaRebuild) -> None:
        """Complete a delta version once its rebuild (which ran while the payload arrived)
        verified every chunk of the full state against the (signed) manifest. On any
        failure the previous version stays installed and the dense form is asked for."""
        key = rebuild.key
        try:
            verified = await asyncio.wrap_future(rebuild.result)
        finally:
            self._rebuilding = None
        newest = self.newest()
        if newest is not None and newest > key:
            return  # superseded while rebuilding
        if not verified:
            self.counters["delta_rejected"] += 1
            log.warning(
                "%s: delta v%d failed verification (%s); keeping v%s, asking for dense",
                self.name,
                key.version,
                rebuild.error,
                newest,
            )
            await self._ask_dense(key)
            return
        self.counters["delta_versions"] += 1
        self._finish(rebuild.state)

    def _map_offered(self, manifest: WeightManifest) -> np.ndarray | None:
        """The version's bytes mapped from shared memory, if the publisher offered them."""
        offer, self._shm_offer = self._shm_offer, None
        if offer is None or offer.policy_version != manifest.policy_version:
            return None
        try:
            return map_snapshot(offer.path, manifest.total_bytes)
        except OSError as exc:
            self.counters["shm_failures"] += 1
            log.warning(
                "%s: cannot map v%d from %s (%s); repairing instead", self.name, manifest.version, offer.path, exc
            )
            return None

    async def _verify_mapped(self, assembler: SnapshotAssembler) -> None:
        """Verify every chunk where it lies in the mapped file, split over the verify threads."""
        m = assembler.manifest
        chunks = []
        for index in range(len(m.chunk_digests)):
            size = min(m.chunk_bytes, m.total_bytes - index * m.chunk_bytes)
            region = assembler.destination(index, size)
            if region is not None:  # None: already held (an early chunk)
                chunks.append(WeightChunk(incarnation=m.incarnation, version=m.version, index=index, data=region))
        threads = self._verify_threads
        await asyncio.gather(*(self._on_chunks(chunks[part::threads]) for part in range(min(threads, len(chunks)))))

    async def _on_chunks(self, chunks: list[WeightChunk]) -> None:
        assembler = self._assembler
        mine = []
        for chunk in chunks:
            key = chunk.policy_version
            if assembler is not None and key == assembler.key:
                mine.append(chunk)
                continue
            newest = self.newest()
            parked = self._parked is not None and key == self._parked.policy_version
            if (newest is None or key > newest or parked) and sum(map(len, self._early.values())) < self._max_early:
                self._early.setdefault(key, []).append(chunk)  # the manifest is on its way
            else:
                self.counters["chunks_stale"] += 1
                if self._pacer is not None and key == self._pacer_key:  # after completion
                    self._repair_totals.received_bytes += self._pacer.landed(chunk.index, chunk.data.nbytes)
        if not mine or assembler is None:
            return
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._pool, _offer_all, assembler, mine)
        self._after_offers(assembler, mine, outcomes)

    def _after_offers(self, assembler: SnapshotAssembler, chunks: list[WeightChunk], outcomes: list[str]) -> None:
        """Count what verification said, forward what was stored, finish a version."""
        for chunk, outcome in zip(chunks, outcomes, strict=True):
            if outcome == "corrupt":
                self.counters["corrupt_chunks"] += 1
            elif outcome == "duplicate":
                self.counters["chunks_duplicate"] += 1
            if outcome != "stored":
                continue
            self.counters["chunks_received"] += 1
            # Forward even if the version completed meanwhile (another chunk verified in
            # parallel finished it): the successor still needs this chunk.
            self._queue_forward(assembler, chunk.index, chunk)
        if self._pacer is not None and self._pacer_key == assembler.key:
            for chunk, outcome in zip(chunks, outcomes, strict=True):
                if outcome in ("stored", "duplicate"):
                    self._repair_totals.received_bytes += self._pacer.landed(chunk.index, chunk.data.nbytes)
            self._refill_repairs(assembler)
        if assembler is not self._assembler:
            return  # completed by a parallel verification, or superseded
        self._meter.progressed()
        if assembler.complete:
            self._assembler = None
            delta, self._delta = self._delta, None
            if delta is not None:
                if self._spawn(self._rebuild(delta)):
                    self._rebuilding = assembler.key
                return
            self._finish(assembler)

    def _finish(self, assembler: SnapshotAssembler) -> None:
        """A version complete and verified: the base of the next delta, and ``on_complete``."""
        self._complete_key = assembler.key
        key = assembler.key
        arrived_s = self._manifest_s.get(key, assembler.started_at)
        self._arrivals[key] = (time.monotonic() - arrived_s, time.time())
        while len(self._arrivals) > 8:
            del self._arrivals[next(iter(self._arrivals))]
        # Kept only while the publisher sends delta versions: on a large model the copy is
        # a whole state more per member.
        keep = assembler.manifest.delta_base or assembler.manifest.delta is not None
        self._base = (assembler.key, assembler.plaintext) if keep else None
        self.counters["versions_complete"] += 1
        # Shared-memory members need no spare for the bytes received, only for those opened.
        spares = int(assembler.key != self._shm_key) + int(bool(assembler.manifest.seal_key))
        self._prepare_spares(assembler.manifest.total_bytes, spares)
        # Now, not at install: the publisher places members by it.
        received = WeightsReceived(sampler_id=self.name, incarnation=key.incarnation, version=key.version)
        self._spawn(self._control.send(received))
        if self._on_complete is not None:
            self._on_complete(assembler)
        if self._parked is not None:
            self._spawn(self._start_parked())

    def _on_landed(self, chunk: WeightChunk) -> None:
        """A chunk stream delivered ``chunk`` (event loop thread, from the protocol).

        The common case, a chunk of the version being assembled on an unpaced link, goes
        straight to a verify thread and back: no queue, task or executor future per chunk,
        which at ~1 MB per chunk and GB/s is a tenth of a receiver's time. Everything else
        (paced links, early or stale chunks) takes the general path through ``_inbound``.
        """
        assembler = self._assembler
        if (
            self._delay is not None
            or self._downlink.capped
            or assembler is None
            or chunk.policy_version != assembler.key
        ):
            self._landed.put_nowait(chunk)
            return
        self._downlink.delay_for(chunk.data.nbytes)  # counts bytes
        loop = asyncio.get_running_loop()

        def verified(future: concurrent.futures.Future[str]) -> None:  # a verify thread
            try:
                loop.call_soon_threadsafe(self._on_verified, assembler, chunk, future)
            except RuntimeError:
                pass  # the loop closed while the receiver shut down: nothing to finish

        self._pool.submit(assembler.offer, chunk).add_done_callback(verified)

    def _on_verified(
        self, assembler: SnapshotAssembler, chunk: WeightChunk, future: concurrent.futures.Future[str]
    ) -> None:
        assert self._stream is not None
        self._stream.taken()  # counted from delivery to verdict: verification is the backlog
        self._after_offers(assembler, [chunk], [future.result()])

    def _take_spare(self, nbytes: int) -> np.ndarray | None:
        if self._spares and self._spares[-1].nbytes == nbytes:
            self.counters["spare_buffers_used"] += 1
            return self._spares.pop()
        self._spares.clear()
        return None

    def _prepare_spares(self, nbytes: int, count: int) -> None:
        """Map the next version's memory now, between versions, so that its page faults
        do not slow the next transfer (snapshots keep their size from version to version).
        Costs ``count`` snapshots of memory while idle (a sealed version needs two: the
        ciphertext received and the plaintext opened); ``prefault_next=False`` turns it off."""
        if not self.prefault_next or self._group is None or count == 0:
            return
        self._spares = []

        async def prepare() -> None:
            loop = asyncio.get_running_loop()
            spares = [await loop.run_in_executor(self._pool, prefaulted_buffer, nbytes) for _ in range(count)]
            if self._assembler is None:  # not already assembling the next version
                self._spares = spares

        self._spawn(prepare())

    def _queue_forward(self, assembler: SnapshotAssembler, index: int, chunk: WeightChunk | None) -> None:
        plan = self._plan
        if not self._successors or plan is None:
            return
        successors = self._successors.get(index % max(1, plan.stripes))
        if not successors:
            return
        if chunk is None:
            chunk = assembler.chunk(index)
        for successor in successors:
            queue = self._forward.get(successor)
            if queue is None:
                queue = asyncio.Queue()
                if not self._spawn(self._forward_loop(successor, queue)):
                    return  # stopping: nothing forwards any more
                self._forward[successor] = queue
            queue.put_nowait((assembler.key, chunk))

    # -- outputs ---------------------------------------------------------------------

    def _lanes_to(self, address: str) -> Lanes:
        """The lanes to a successor's inbox, opened on first use (again after a failure,
        with the stream count learned before)."""
        lanes = self._lanes.get(address)
        if lanes is None or lanes.failed or lanes.closed:
            assert self._group is not None, "the receiver is not running"
            plan, successor = self._plan, self._successor_names.get(address, "")
            credentials = (
                StreamCredentials(self.name, successor, plan.stream_secret)
                if plan is not None and plan.stream_secret and successor
                else None
            )
            lanes = self._lanes[address] = open_lanes(
                self._transport,
                address,
                name=f"{self.name}->{successor or address}",
                group=self._group,
                counts=self._counts,
                max_streams=self.max_streams,
                credentials=credentials,
                max_message_bytes=64 << 20,
                connect_timeout_s=self.connect_timeout_s,
                send_timeout_s=self.send_timeout_s,
            )
        return lanes

    async def _forward_loop(self, address: str, queue: asyncio.Queue[tuple[PolicyVersion, WeightChunk] | None]) -> None:
        while True:
            item = await queue.get()
            if item is None:  # no longer fed by this member
                return
            key, chunk = item
            newest = self.newest()
            if (newest is not None and key < newest) or address in self._dead_successors:
                continue
            await self._uplink.acquire(chunk.data.nbytes)
            if not await self._lanes_to(address).put(chunk, self._forwarded(address), key):
                self._successor_failed(address)

    def _forwarded(self, address: str) -> Callable[[Outcome], None]:
        def done(outcome: Outcome) -> None:
            if outcome == "sent":
                self.counters["chunks_forwarded"] += 1
            elif outcome == "failed":
                self._successor_failed(address)

        return done

    def _successor_failed(self, address: str) -> None:
        """The successor is gone or stuck: skip it for this version; it (or the next in
        the chain) repairs from the publisher."""
        if address in self._dead_successors:
            return
        self.counters["forward_failures"] += 1
        self._dead_successors.add(address)
        stale = self._lanes.pop(address, None)
        if stale is not None:
            stale.close()

    async def _announce_loop(self) -> None:
        while True:
            installed = self._installed_key or NO_VERSION
            await self._control.send(
                WeightSubscribe(
                    sampler_id=self.name,
                    relay_address=self.relay_address,
                    incarnation=installed.incarnation,
                    installed_version=installed.version,
                    shm_id=self.shm_id,
                )
            )
            await asyncio.sleep(self.announce_s)

    def _count_progress(self, chunks: list[WeightChunk]) -> None:
        key = self.assembling
        self._bytes_in += sum(c.data.nbytes for c in chunks if c.policy_version == key)

    def _bytes_received(self) -> int:
        """Bytes received for the version being assembled, on every path (chunk streams,
        repair, ZeroMQ inbox). Chunks of older versions still draining from a slow
        predecessor are no progress: they must not hold off the repair of this one."""
        stream = self._stream.counters["bytes_in_place"] if self._stream is not None else 0
        return stream + self._bytes_in

    def _rtt_s(self) -> float:
        return self._stream.path_rtt_s() if self._stream is not None else 0.0

    def stall_deadline_s(self) -> float:
        """Seconds without a byte before the version being assembled counts as stalled.
        While it is finished before a newer one, K round trips (at least a quarter of
        ``gap_timeout_s``): its stream has moved on to the newer version, and what it lacks
        comes by repair."""
        rtt = self._rtt_s()
        floor = self.gap_timeout_s
        if self._parked is not None:
            floor = min(floor, max(K * rtt, floor / 4))
        return transfer_deadline_s(0, self._meter.rate_bps, rtt, floor)

    def stuck_deadline_s(self) -> float:
        """Seconds a chunk stream may sit mid-chunk without a byte before that chunk is
        repaired on another stream (while the version's other streams still move): a
        stream backing off after repeated losses, whose chunk would be the version's last."""
        return max(K * self._rtt_s(), self.gap_timeout_s / 2)

    def straggler_deadline_s(self) -> float:
        """Seconds one of a version's last chunks (``TAIL_CHUNKS``) may take on its stream
        before it is repaired on another: a stream that lost its window recovers at a
        segment a round trip, and the version waits for it alone."""
        return max(K * self._rtt_s(), 2 * self.gap_timeout_s)

    async def _watchdog_loop(self) -> None:
        period = max(0.01, self.gap_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            await self.check_progress()

    async def check_progress(self) -> None:
        """One watchdog tick: measure, then repair a stalled version (or keep repairing)."""
        self._meter.observe(self._bytes_received())
        assembler = self._assembler
        if assembler is None:
            return
        deadline = self.stall_deadline_s()
        stalled = self._meter.idle_s >= deadline
        if stalled and self._stream is not None:
            # A stream stuck mid-chunk holds that chunk's place in the buffer, so its
            # repair could never land; a stalled version frees those as quiet as it.
            self.counters["stalled_streams_dropped"] += self._stream.drop_partial(deadline)
        if stalled or self._repairing == assembler.key:
            await self._request_missing(assembler)  # once repairing: the next window, what expired
        elif self._stream is not None:
            await self._repair_stuck(assembler)

    async def _repair_stuck(self, assembler: SnapshotAssembler) -> None:
        """Chunks of the version stuck mid-stream (``stuck_deadline_s``) while others move:
        their streams are dropped (freeing their places) and they are repaired, on the
        publisher's other streams."""
        assert self._stream is not None
        missing = len(assembler.missing())
        tail = missing <= max(TAIL_CHUNKS, len(assembler.manifest.chunk_digests) // 50)
        age = self.straggler_deadline_s() if tail else None
        stuck = self._stream.drop_stuck(assembler.key, self.stuck_deadline_s(), age)
        if stuck:
            self.counters["stalled_streams_dropped"] += len(stuck)
            await self._request_missing(assembler, only=stuck)

    def _refill_repairs(self, assembler: SnapshotAssembler) -> None:
        """Once half the repair window has landed, ask for the next chunks now rather than
        at the next watchdog tick: on a long path a tick is several round trips."""
        pacer = self._pacer
        if self._refilling or pacer is None or self._repairing != assembler.key or self._group is None:
            return
        if assembler is not self._assembler or assembler.complete:
            return
        if 2 * pacer.outstanding_bytes > self.max_repair_bytes:
            return
        self._refilling = True

        async def refill() -> None:
            try:
                if assembler is self._assembler:
                    await self._request_missing(assembler)
            finally:
                self._refilling = False

        if not self._spawn(refill()):
            self._refilling = False

    async def _request_missing(self, assembler: SnapshotAssembler, only: list[int] | None = None) -> None:
        """Request the missing chunks (or those of ``only``) that are due (``RepairPacer``:
        not outstanding, within the member's repair window). Without ``only`` the version
        is repaired whole from now on (each tick and as repairs land: ``_repairing``)."""
        if only is None:
            self._repairing = assembler.key
        if self._pacer is None or self._pacer_key != assembler.key:
            self._pacer_key = assembler.key
            self._pacer = RepairPacer(
                _chunk_sizes(assembler.manifest),
                floor_s=self.gap_timeout_s,
                max_outstanding_bytes=self.max_repair_bytes,
            )
        pacer = self._pacer
        before = dataclasses.replace(pacer.tally)
        due = pacer.due(
            assembler.missing() if only is None else sorted(set(only) & set(assembler.missing())),
            self._meter.rate_bps,
            self._rtt_s(),
            progressing=self._meter.idle_s < self.stall_deadline_s(),
            limit=MAX_REPAIR_INDICES,
        )
        if not due:
            return
        self._repair_totals.missing_bytes += pacer.tally.missing_bytes - before.missing_bytes
        self._repair_totals.requested_bytes += pacer.tally.requested_bytes - before.requested_bytes
        self.counters["repair_requests"] += 1
        self.counters["repair_chunks_requested"] += len(due)
        await self._control.send(
            ChunkRequest(
                sampler_id=self.name,
                incarnation=assembler.key.incarnation,
                version=assembler.key.version,
                indices=due,
            )
        )
