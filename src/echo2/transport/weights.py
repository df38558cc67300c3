"""Weight dissemination: verified chunks, peer-assisted pipelined relay, repair.

Two components on top of the pure chunk layer (``echo2.transport.broadcast``):

* ``WeightBroadcaster`` (publisher side, owns the ``weights`` ROUTER). Samplers lease
  membership with ``WeightSubscribe`` (repeated every ``announce_s``, naming the address of
  their relay inbox). Per version it computes a ``RelayPlan`` from the live members
  (``relay_plan``: star, relay chain or striped chains), sends each member the plan and
  then the ``WeightManifest`` over the ROUTER (ordered, never dropped: ROUTER_MANDATORY
  counts a gone peer as unroutable), and streams each chunk to the seed of its stripe
  through a PUSH connected to the seed's inbox. It answers ``ChunkRequest`` (repair) with
  chunks over the ROUTER, sends the latest manifest to a member that joins late, and
  measures T_bcast from the members' ``WeightsInstalled`` (sent on the same reliable
  channel, not on lossy telemetry).
* ``WeightReceiver`` (sampler side). It binds a relay inbox (over tcp a chunk stream,
  ``echo2.transport.chunkstream``, whose bytes land straight in the assembly buffer; else,
  or with ``data_plane="zmq"``, a ZeroMQ PULL), assembles a version into memory
  allocated once (``SnapshotAssembler``), verifies every chunk against the manifest (in a
  worker thread: hashing releases the GIL), forwards every verified chunk of the stripes
  it relays to its successor the moment it lands (a PUSH per successor), and hands a
  complete, verified version to ``on_complete``. Gap detection: when a version makes no
  progress for ``gap_timeout_s`` the missing chunks are requested from the publisher
  (dropped, corrupt, or a dead predecessor in the chain: all end the same way). Repaired
  chunks are forwarded too, so a chain heals behind a dead relay.

Nothing is lost silently: PUSH and ROUTER sends block at the high-water mark instead of
dropping, a send that cannot complete within ``send_timeout_s`` (dead peer) is counted and
that peer skipped for the version, and every gap ends in a repair.

Shared memory (optional, ``shm_dir`` on both sides): members on the publisher's host map
each version from a file the publisher writes once (``echo2.transport.shm``) and verify it
in place; they take no part in relay chains.

Link emulation (``LinkSpec``): the publisher's uplink, and each receiver's uplink and
downlink, pace every byte on the weight path (chunks streamed, forwarded and repaired);
``latency_ms`` delays each chunk a receiver takes in, pipelined.

Buffers: chunks are views into the snapshot (publisher), into received ZeroMQ frames, or
into verified regions of the assembly buffer (relays); none is ever written again, so a
buffer ZeroMQ or the kernel still holds is never mutated.
Deviation: repair is served by the publisher only, not by peers (the publisher holds
every chunk of the latest version; peers would spread the repair load).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from echo2.errors import ClosedError, TransportError
from echo2.messages import (
    ChunkRequest,
    RelayChain,
    RelayPlan,
    Snapshot,
    WeightChunk,
    WeightManifest,
    WeightShm,
    WeightsInstalled,
    WeightSubscribe,
)
from echo2.transport.broadcast import (
    DEFAULT_CHUNK_BYTES,
    ManifestRejected,
    SnapshotAssembler,
    iter_chunks,
    make_manifest,
    prefaulted_buffer,
)
from echo2.transport.chunkstream import SCHEME as STREAM_SCHEME
from echo2.transport.chunkstream import (
    ChunkStreamSender,
    ChunkStreamServer,
    is_stream_address,
)
from echo2.transport.context import Transport
from echo2.transport.endpoint import (
    DealerEndpoint,
    PullEndpoint,
    PushEndpoint,
    RouterEndpoint,
    SocketOptions,
)
from echo2.transport.link import DelayLine, LinkSpec
from echo2.transport.shm import map_snapshot, shm_identity, write_snapshot

log = logging.getLogger(__name__)

Key = tuple[int, int]
MODES = ("star", "relay", "striped")
RELAY_HWM = 8
"""Chunks queued per relay hop: enough to keep a link busy, few enough that a dead peer
strands little and the sender is paced by its receiver."""
GAMMA = 1.1
NO_LINK = LinkSpec()
MAX_REPAIR_INDICES = 1024
DATA_PLANES = ("stream", "zmq")
_IPC_PATH_MAX = 100


def _max_message_bytes(chunk_bytes: int) -> int:
    return max(64 * 1024 * 1024, 2 * chunk_bytes + 65536)


ChunkSender = PushEndpoint | ChunkStreamSender
"""Where chunks go to a relay inbox: ``await send(chunk)``, ``close()``, ``closed``."""


def chunk_sender(transport: Transport, name: str, address: str, chunk_bytes: int) -> ChunkSender:
    """A sender to the relay inbox at ``address``, by its scheme (chunk stream or ZeroMQ)."""
    if is_stream_address(address):
        return ChunkStreamSender(address)
    return transport.push(
        name=f"{name}->{address}",
        connect=[address],
        options=SocketOptions(hwm=RELAY_HWM, max_message_bytes=_max_message_bytes(chunk_bytes)),
    )


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


# -- receiver ----------------------------------------------------------------------------


def _offer_all(assembler: SnapshotAssembler, chunks: list[WeightChunk]) -> list[str]:
    return [assembler.offer(chunk) for chunk in chunks]


@dataclasses.dataclass
class _Progress:
    last_s: float
    requested_s: float = 0.0


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
        chunk_bytes_hint: int = DEFAULT_CHUNK_BYTES,
        on_complete: Callable[[SnapshotAssembler], None] | None = None,
        verify_manifest: Callable[[WeightManifest], None] | None = None,
        max_early_chunks: int = 4096,
        verify_threads: int = 2,
        prefault_next: bool = True,
        data_plane: str = "stream",
        shm_dir: str | None = None,
    ) -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {DATA_PLANES}, got {data_plane!r}")
        self.data_plane = data_plane
        self.shm_id = shm_identity(shm_dir)
        self._shm_offer: WeightShm | None = None
        self._shm_key: Key | None = None  # the last version taken from shared memory
        self._verify_manifest = verify_manifest
        self.prefault_next = prefault_next
        self._spare: np.ndarray | None = None
        self.name = name
        self._transport = transport
        self._control = control
        self.link = link
        self._relay_host = relay_host
        self.gap_timeout_s = gap_timeout_s
        self.announce_s = announce_s
        self.send_timeout_s = send_timeout_s
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
        self._progress = _Progress(time.monotonic())
        self._complete_key: Key | None = None
        self._installed_key: Key | None = None
        self._plan: RelayPlan | None = None
        self._successors: dict[int, str] = {}
        self._dead_successors: set[str] = set()
        self._early: dict[Key, list[WeightChunk]] = {}
        self._forward: asyncio.Queue[tuple[Key, str, WeightChunk]] = asyncio.Queue()
        self._pushes: dict[str, ChunkSender] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(verify_threads, thread_name_prefix=f"verify-{name}")
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
            ),
            0,
        )

    # -- lifecycle -------------------------------------------------------------------

    def open(self) -> str:
        """Bind the relay inbox; returns the address announced to the publisher.

        Over tcp the inbox is a chunk stream (``data_plane="stream"``, the default: bytes
        land in place, see ``echo2.transport.chunkstream``) or a ZeroMQ PULL
        (``data_plane="zmq"``); over ipc and inproc it is always a PULL.
        """
        control_url = self._control.endpoints[0] if self._control.endpoints else "inproc://x"
        bind = relay_bind_url(control_url, self.name)
        if self.data_plane == "stream" and bind.startswith("tcp://"):
            listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=64)
            listener.setblocking(False)
            self._stream_socket = listener
            self._stream = ChunkStreamServer(
                self._on_landed,
                self._stream_destination,
                self._stream_abandon,
                max_chunk_bytes=_max_message_bytes(64 << 20),
            )
            port = listener.getsockname()[1]
            tcp = announce_url(f"tcp://*:{port}", control_url, self._relay_host)
            self.relay_address = STREAM_SCHEME + tcp[len("tcp") :]
            return self.relay_address
        self._inbox = self._transport.pull(
            name=f"{self.name}.relay",
            bind=[bind],
            options=SocketOptions(hwm=RELAY_HWM, max_message_bytes=_max_message_bytes(64 << 20)),
        )
        self.relay_address = announce_url(self._inbox.endpoints[0], control_url, self._relay_host)
        return self.relay_address

    def close(self) -> None:
        for push in self._pushes.values():
            push.close()
        self._pushes.clear()
        if self._inbox is not None:
            self._inbox.close()
        if self._stream is not None:
            self._stream.close()
        if self._stream_socket is not None:
            self._stream_socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> None:
        if self._inbox is None and self._stream is None:
            self.open()
        if self._stream is not None and self._stream_socket is not None:
            await self._stream.start_on(self._stream_socket)
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._control_loop())
            group.create_task(self._relay_loop())
            group.create_task(self._announce_loop())
            group.create_task(self._watchdog_loop())
            group.create_task(self._forward_loop())
            if self._delay is not None:
                group.create_task(self._delayed_loop())

    def _stream_destination(self, key: Key, index: int, nbytes: int) -> np.ndarray | None:
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
    def assembling(self) -> Key | None:
        return self._assembler.key if self._assembler is not None else None

    @property
    def complete_key(self) -> Key | None:
        return self._complete_key

    def newest(self) -> Key | None:
        keys = [k for k in (self._complete_key, self.assembling, self._installed_key) if k is not None]
        return max(keys) if keys else None

    def statistics(self) -> dict[str, float]:
        stream = self._stream.counters if self._stream is not None else {}
        return {
            **self.counters,
            **{f"stream_{k}": v for k, v in stream.items()},
            "uplink_bytes": self._uplink.bytes,
            "downlink_bytes": self._downlink.bytes,
        }

    async def report_installed(self, key: Key, install_s: float) -> None:
        """Tell the publisher this version is installed (T_bcast counts it)."""
        self._installed_key = key if self._installed_key is None else max(key, self._installed_key)
        await self._control.send(
            WeightsInstalled(
                sampler_id=self.name,
                incarnation=key[0],
                version=key[1],
                install_s=install_s,
                time_s=time.time(),
            )
        )

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
        return [m for m in await self._inbox.recv_many(limit) if isinstance(m, WeightChunk)]

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
        key = (plan.incarnation, plan.version)
        newest = self.newest()
        if newest is not None and key < newest:
            return
        self._plan = plan
        if self.assembling == key:
            self._apply_plan()

    def _apply_plan(self) -> None:
        """Set successors for the assembling version and forward what is already held."""
        plan, assembler = self._plan, self._assembler
        self._successors = {}
        self._dead_successors = set()
        if plan is None or assembler is None or (plan.incarnation, plan.version) != assembler.key:
            return
        for chain in plan.chains:
            if self.name in chain.members:
                at = chain.members.index(self.name)
                if at + 1 < len(chain.members):
                    successor = plan.addresses.get(chain.members[at + 1], "")
                    if successor and successor != self.relay_address:
                        self._successors[chain.stripe] = successor
        # Chunks that landed before the plan still go down the chain.
        # (Their bytes are in the assembler's buffer, which is never written again.)
        for index in assembler.held():
            self._queue_forward(assembler, index, None)

    def _in_plan(self, key: Key) -> bool:
        plan = self._plan
        return (
            plan is not None
            and (plan.incarnation, plan.version) == key
            and any(self.name in chain.members for chain in plan.chains)
        )

    async def _on_manifest(self, manifest: WeightManifest) -> None:
        key = (manifest.incarnation, manifest.version)
        newest = self.newest()
        if newest is not None and key <= newest:
            self.counters["manifests_stale"] += 1
            return
        try:
            if self._verify_manifest is not None:
                self._verify_manifest(manifest)  # before any memory is committed to it
            mapped = self._map_offered(manifest)
            buffer = mapped if mapped is not None else self._take_spare(manifest.total_bytes)
            assembler = SnapshotAssembler(manifest, buffer)
        except ManifestRejected as exc:
            self.counters["manifests_rejected"] += 1
            log.warning("%s: rejected manifest v%d: %s", self.name, manifest.version, exc)
            return
        self._assembler = assembler
        self._progress = _Progress(time.monotonic())
        self._apply_plan()
        early = self._early.pop(key, [])
        self._early = {k: v for k, v in self._early.items() if k > key}
        if early:
            await self._on_chunks(early)
        if mapped is not None:
            self._shm_key = key
            self.counters["shm_versions"] += 1
            await self._verify_mapped(assembler)
        if self._assembler is assembler and not self._in_plan(key):
            # A late joiner, or a member the plan left out (shared memory: what failed to
            # verify): no stream is coming; repair what is missing.
            await self._request_missing(assembler)

    def _map_offered(self, manifest: WeightManifest) -> np.ndarray | None:
        """The version's bytes mapped from shared memory, if the publisher offered them."""
        offer, self._shm_offer = self._shm_offer, None
        if offer is None or (offer.incarnation, offer.version) != (manifest.incarnation, manifest.version):
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
            key = (chunk.incarnation, chunk.version)
            if assembler is not None and key == assembler.key:
                mine.append(chunk)
                continue
            newest = self.newest()
            if (newest is None or key > newest) and sum(map(len, self._early.values())) < self._max_early:
                self._early.setdefault(key, []).append(chunk)  # the manifest is on its way
            else:
                self.counters["chunks_stale"] += 1
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
        if assembler is not self._assembler:
            return  # completed by a parallel verification, or superseded
        self._progress.last_s = time.monotonic()
        if assembler.complete:
            self._assembler = None
            self._complete_key = assembler.key
            self.counters["versions_complete"] += 1
            if assembler.key != self._shm_key:  # shared-memory members need no spare
                self._prepare_spare(assembler.manifest.total_bytes)
            if self._on_complete is not None:
                self._on_complete(assembler)

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
            or (chunk.incarnation, chunk.version) != assembler.key
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
        spare, self._spare = self._spare, None
        if spare is not None and spare.nbytes == nbytes:
            self.counters["spare_buffers_used"] += 1
            return spare
        return None

    def _prepare_spare(self, nbytes: int) -> None:
        """Map the next version's memory now, between versions, so that its page faults
        do not slow the next transfer (snapshots keep their size from version to version).
        Costs one snapshot of memory while idle; ``prefault_next=False`` turns it off."""
        if not self.prefault_next or self._group is None:
            return
        self._spare = None

        async def prepare() -> None:
            loop = asyncio.get_running_loop()
            spare = await loop.run_in_executor(self._pool, prefaulted_buffer, nbytes)
            if self._assembler is None:  # not already assembling the next version
                self._spare = spare

        self._group.create_task(prepare())

    def _queue_forward(self, assembler: SnapshotAssembler, index: int, chunk: WeightChunk | None) -> None:
        plan = self._plan
        if not self._successors or plan is None:
            return
        successor = self._successors.get(index % max(1, plan.stripes))
        if successor is None:
            return
        if chunk is None:
            chunk = assembler.chunk(index)
        self._forward.put_nowait((assembler.key, successor, chunk))

    # -- outputs ---------------------------------------------------------------------

    def _push(self, address: str) -> ChunkSender:
        push = self._pushes.get(address)
        if push is None or push.closed:
            push = chunk_sender(self._transport, f"{self.name}.relay", address, 64 << 20)
            self._pushes[address] = push
        return push

    async def _forward_loop(self) -> None:
        while True:
            key, address, chunk = await self._forward.get()
            newest = self.newest()
            if (newest is not None and key < newest) or address in self._dead_successors:
                continue
            await self._uplink.acquire(chunk.data.nbytes)
            try:
                # asyncio.timeout, not wait_for: no task per chunk (3.11 wraps each in one)
                async with asyncio.timeout(self.send_timeout_s):
                    sent = await self._push(address).send(chunk)
            except (TimeoutError, ClosedError, TransportError):
                sent = False
            if sent:
                self.counters["chunks_forwarded"] += 1
            else:
                # The successor is gone or stuck: skip it for this version; it (or the
                # next in the chain) repairs from the publisher.
                self.counters["forward_failures"] += 1
                self._dead_successors.add(address)
                stale = self._pushes.pop(address, None)
                if stale is not None:
                    stale.close()

    async def _announce_loop(self) -> None:
        while True:
            installed = self._installed_key or (-1, -1)
            await self._control.send(
                WeightSubscribe(
                    sampler_id=self.name,
                    relay_address=self.relay_address,
                    incarnation=installed[0],
                    installed_version=installed[1],
                    shm_id=self.shm_id,
                )
            )
            await asyncio.sleep(self.announce_s)

    async def _watchdog_loop(self) -> None:
        period = max(0.01, self.gap_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            assembler = self._assembler
            if assembler is None:
                continue
            now = time.monotonic()
            if now - max(self._progress.last_s, self._progress.requested_s) >= self.gap_timeout_s:
                if self._stream is not None:
                    # A stream stuck mid-chunk holds that chunk's place in the buffer, so
                    # its repair could never land; a stalled version frees them all.
                    self.counters["stalled_streams_dropped"] += self._stream.drop_partial()
                await self._request_missing(assembler)

    async def _request_missing(self, assembler: SnapshotAssembler) -> None:
        missing = assembler.missing()[:MAX_REPAIR_INDICES]
        if not missing:
            return
        self._progress.requested_s = time.monotonic()
        self.counters["repair_requests"] += 1
        self.counters["repair_chunks_requested"] += len(missing)
        incarnation, version = assembler.key
        await self._control.send(
            ChunkRequest(
                sampler_id=self.name,
                incarnation=incarnation,
                version=version,
                indices=missing,
            )
        )


# -- broadcaster -------------------------------------------------------------------------


@dataclasses.dataclass
class _Member:
    peer: bytes
    address: str
    last_seen_s: float
    manifest_sent_s: float = 0.0
    installed: Key = (-1, -1)
    shm_id: str = ""


@dataclasses.dataclass
class _Version:
    snapshot: Snapshot
    manifest: WeightManifest
    published_s: float = 0.0
    active: frozenset[str] = frozenset()
    installed: set[str] = dataclasses.field(default_factory=set)
    t_bcast_s: float | None = None
    shm_path: str | None = None

    @property
    def key(self) -> Key:
        return (self.manifest.incarnation, self.manifest.version)


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
        gamma: float = GAMMA,
        fault: Fault | None = None,
        on_bcast: Callable[[dict[str, Any]], None] | None = None,
        shm_dir: str | None = None,
    ) -> None:
        """``shm_dir``: where versions for members sharing this host are written (None:
        never; every member then gets chunks)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.name = name
        self.mode = mode
        self.stripes = stripes
        self.chunk_bytes = chunk_bytes
        self.link = link
        self.member_ttl_s = member_ttl_s
        self.send_timeout_s = send_timeout_s
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
        self._pushes: dict[str, ChunkSender] = {}
        self.shm_dir = shm_dir
        self.shm_id = shm_identity(shm_dir)
        self._shm_files: list[str] = []
        self.t_bcast: dict[Key, float] = {}
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
                "late_joiner_manifests",
                "unroutable",
                "members_expired",
                "installs",
                "shm_versions_written",
                "shm_failures",
            ),
            0,
        )

    # -- API -------------------------------------------------------------------------

    def publish_nowait(self, snapshot: Snapshot, manifest: WeightManifest | None = None) -> None:
        """Make ``snapshot`` the latest version and start streaming it (the previous
        stream, if still running, stops: only the newest version matters)."""
        if manifest is None:
            manifest = make_manifest(snapshot, self.chunk_bytes)
        self._pending = _Version(snapshot, manifest)
        self._new.set()

    def members(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, m in self._members.items() if now - m.last_seen_s > self.member_ttl_s]:
            del self._members[name]
            self.counters["members_expired"] += 1
        return list(self._members)

    async def wait_members(self, count: int) -> list[str]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._members) >= count)
        return self.members()

    async def wait_bcast(self, key: Key) -> float:
        async with self._changed:
            await self._changed.wait_for(lambda: key in self.t_bcast)
        return self.t_bcast[key]

    async def wait_installed(self, key: Key, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: sum(1 for m in self._members.values() if m.installed >= key) >= count)

    @property
    def latest_key(self) -> Key | None:
        return self._latest.key if self._latest is not None else None

    def statistics(self) -> dict[str, float]:
        return {
            **self.counters,
            "members": len(self._members),
            "t_bcast_s": self.last_t_bcast_s,
            "uplink_bytes": self._uplink.bytes,
        }

    def close(self) -> None:
        for push in self._pushes.values():
            push.close()
        self._pushes.clear()
        self._drop_shm_files(keep=0)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
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
                    await self._on_subscribe(peer, message)
                elif isinstance(message, ChunkRequest):
                    self.counters["repair_requests"] += 1
                    self._repairs.put_nowait((peer, message))
                elif isinstance(message, WeightsInstalled):
                    self._on_installed(message)
            await self._notify()

    async def _on_subscribe(self, peer: bytes, message: WeightSubscribe) -> None:
        now = time.monotonic()
        member = self._members.get(message.sampler_id)
        joined = member is None
        restarted = member is not None and (member.address != message.relay_address or member.peer != peer)
        if member is None or restarted:
            member = _Member(peer, message.relay_address, now)
            self._members[message.sampler_id] = member
        member.last_seen_s = now
        member.shm_id = message.shm_id
        member.installed = max(member.installed, (message.incarnation, message.installed_version))
        latest = self._latest
        if latest is None or member.installed >= latest.key:
            return
        in_stream = message.sampler_id in latest.active
        overdue = now - max(latest.published_s, member.manifest_sent_s) > self.member_ttl_s
        if (joined and not in_stream) or restarted or overdue:
            # Late joiner (or a member that lost track): the latest version at once.
            member.manifest_sent_s = now
            self.counters["late_joiner_manifests"] += 1
            if self._is_local(member):
                await self._send_local(member, latest)
            else:
                await self._send(peer, latest.manifest)

    def _on_installed(self, message: WeightsInstalled) -> None:
        key = (message.incarnation, message.version)
        self.counters["installs"] += 1
        member = self._members.get(message.sampler_id)
        if member is not None:
            member.installed = max(member.installed, key)
        version = self._latest
        if version is None or version.key != key:
            return
        version.installed.add(message.sampler_id)
        done = len(version.installed & version.active)
        need = bcast_threshold(len(version.active), self.gamma)
        if version.t_bcast_s is None and version.active and done >= need:
            version.t_bcast_s = time.monotonic() - version.published_s
            self.t_bcast[key] = version.t_bcast_s
            self.last_t_bcast_s = version.t_bcast_s
            if self._on_bcast is not None:
                self._on_bcast(
                    {
                        "incarnation": key[0],
                        "version": key[1],
                        "t_bcast_s": version.t_bcast_s,
                        "installed": done,
                        "active": len(version.active),
                        "mode": self.mode,
                        "bytes": version.manifest.total_bytes,
                    }
                )

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
            name = f"echo2-weights-{os.getpid()}-{os.urandom(4).hex()}-{version.key[0]}-{version.key[1]}"
            # Listed before it exists, so that it is removed even if this stream is
            # superseded (cancelled) while the write goes on in its thread.
            self._shm_files.append(os.path.join(self.shm_dir, name))
            try:
                path = await asyncio.to_thread(write_snapshot, self.shm_dir, name, version.snapshot.data)
            except OSError as exc:
                self.counters["shm_failures"] += 1
                log.warning(
                    "%s: cannot write v%d to %s (%s); repairing instead", self.name, version.key[1], self.shm_dir, exc
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
        version.active = frozenset(names)
        version.published_s = time.monotonic()
        self._latest = version
        self.counters["published"] += 1
        # Members sharing this host map the version from shared memory (written while the
        # others' stream starts); the plan covers the others.
        local = [n for n in names if self._is_local(self._members[n])]
        remote = [n for n in names if n not in local]
        stripes, chains = relay_plan(remote, self.mode, self.stripes)
        addresses = {n: self._members[n].address for n in remote}
        plan = RelayPlan(
            incarnation=version.key[0],
            version=version.key[1],
            stripes=stripes,
            chains=chains,
            addresses=addresses,
        )
        for name in remote:
            member = self._members[name]
            member.manifest_sent_s = version.published_s
            if await self._send(member.peer, plan):
                await self._send(member.peer, version.manifest)
        if local:
            await asyncio.gather(
                self._offer_shm(version, local), self._stream_chunks(version, stripes, chains, addresses)
            )
        else:
            await self._stream_chunks(version, stripes, chains, addresses)

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
        offer = WeightShm(incarnation=version.key[0], version=version.key[1], path=path) if path else None
        if offer is None or await self._send(member.peer, offer):
            await self._send(member.peer, version.manifest)

    async def _stream_chunks(
        self, version: _Version, stripes: int, chains: list[RelayChain], addresses: dict[str, str]
    ) -> None:
        seeds: dict[int, list[str]] = {}
        for chain in chains:
            seeds.setdefault(chain.stripe, []).append(chain.members[0])
        dead: set[str] = set()
        for chunk in iter_chunks(version.snapshot, version.manifest):
            for seed in seeds.get(chunk.index % stripes, ()):
                if seed in dead:
                    continue
                out: WeightChunk | None = chunk
                if self._fault is not None:
                    out = self._fault(seed, chunk)
                    if out is None:
                        continue
                if not await self._push_chunk(addresses[seed], out):
                    dead.add(seed)

    async def _push_chunk(self, address: str, chunk: WeightChunk) -> bool:
        await self._uplink.acquire(chunk.data.nbytes)
        push = self._pushes.get(address)
        if push is None or push.closed:
            push = chunk_sender(self._transport, f"{self.name}.seed", address, self.chunk_bytes)
            self._pushes[address] = push
        try:
            async with asyncio.timeout(self.send_timeout_s):  # no task per chunk, unlike wait_for
                sent = await push.send(chunk)
        except (TimeoutError, ClosedError, TransportError):
            sent = False
        if sent:
            self.counters["chunks_sent"] += 1
            self.counters["stream_bytes"] += chunk.data.nbytes
            return True
        self.counters["send_failures"] += 1
        self._pushes.pop(address, None)
        push.close()
        return False

    # -- repair ----------------------------------------------------------------------

    async def _repair_loop(self) -> None:
        while True:
            peer, request = await self._repairs.get()
            version = self._latest
            if version is None:
                continue
            if (request.incarnation, request.version) != version.key:
                if (request.incarnation, request.version) < version.key:
                    await self._send(peer, version.manifest)  # move on to the latest
                continue
            data = version.snapshot.data
            n = len(version.manifest.chunk_digests)
            size = version.manifest.chunk_bytes
            for index in request.indices:
                if not 0 <= index < n:
                    continue
                if self._latest is not version:
                    break
                chunk = WeightChunk(
                    incarnation=version.key[0],
                    version=version.key[1],
                    index=index,
                    data=data[index * size : (index + 1) * size],
                )
                await self._uplink.acquire(chunk.data.nbytes)
                if not await self._send(peer, chunk):
                    break
                self.counters["repair_chunks_sent"] += 1


__all__ = [
    "DATA_PLANES",
    "GAMMA",
    "MODES",
    "WeightBroadcaster",
    "WeightReceiver",
    "announce_url",
    "bcast_threshold",
    "relay_bind_url",
    "relay_plan",
]
