"""WeightPublisher: disseminates the Learner's snapshots as verified chunks, relayed by peers.

Role: dissemination (``echo2.weights.WeightBroadcaster`` does the work). For each
``Snapshot`` it builds a ``WeightManifest`` (layout, a BLAKE3 digest per chunk and for
the whole) in a worker thread, computes a relay plan from the live samplers (those whose
``WeightSubscribe`` lease is fresh), sends each its place in the plan and the manifest,
and streams the chunks to the seeds: every sampler in ``star`` mode; in ``relay`` mode the
head of one chain up to ``relay_depth`` samplers, beyond that the roots of ``f`` stripes'
trees of fan-out ``f`` (the smallest that keeps every sampler within ``relay_depth`` hops);
in ``striped`` mode the heads of ``stripes`` rotated chains (or trees). Samplers forward
each verified chunk to the ones they feed as it lands. Samplers that lag the ones feeding
them (measured from their ``WeightsReceived``) are placed where they feed nobody
(``echo2.weights.plan.Placement``). Chunks are views into the snapshot: no copy,
and the snapshot is never written (the Learner hands over a fresh buffer each time).

Repair and late joiners: a sampler missing chunks (lost, corrupt, dead predecessor) asks
for them with ``ChunkRequest``; a sampler that joins late gets the latest manifest at once
and repairs the whole version from here, without waiting for a publication.

T_bcast: from publication until ``ceil(active / gamma)`` of the samplers active at
publication have reported ``WeightsInstalled`` (on the reliable ``weights`` channel);
every version gets one ``broadcast`` record (T_bcast, or none when it never reached the
threshold, and how many members installed it); ``statistics()`` exposes the estimate.

Publication that adapts (``publication = "adaptive"``, ``echo2.capacity.publication``):
while T_bcast <= kappa x T_train every snapshot is published at once. When broadcast is
slower, a newer snapshot waits while the version in flight can still land within the
staleness budget S (only the newest waiting one is kept: the others are skipped), so that
versions finish instead of cancelling each other mid-stream; and a log line (at most every
``BOTTLENECK_LOG_S``, also recorded as ``publication`` metrics) says what S or what bytes
per version would restore overlap.

Input: ``snapshots`` (PULL, bound; the Learner connects, inproc when co-located).
Control: ``weights`` (ROUTER, bound; samplers connect a DEALER).
Data: one PUSH per seed, connected to the seed's relay inbox (announced address).

Backpressure: PUSH and ROUTER block at the high-water mark, never drop; a seed whose chunk
stream takes no byte for ``send_timeout_s`` (a ZeroMQ PUSH: that cannot finish in it) is
skipped for the version (its chain repairs). Only the
newest snapshot matters: a newer one stops the stream of the older (counted).

Under ``[security]`` every version is sealed before its manifest is made (AES-256-CTR
under a fresh key per version, digests over the ciphertext: ``echo2.weights.seal``) and
chunk streams prove the plan's stream secret to each inbox.

Shutdown: on ``stopping`` it returns.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Annotated, ClassVar, Literal

from msgspec import Meta

from echo2.actor import Actor, ActorConfig, Port, record_statistics, run_until_stopped
from echo2.capacity.publication import Bottleneck, PublicationPolicy
from echo2.messages import PublisherStats, Snapshot
from echo2.weights import GAMMA, WeightBroadcaster
from echo2.weights.chunks import DEFAULT_CHUNK_BYTES
from echo2.weights.link import LinkSpec
from echo2.weights.plan import MAX_DEPTH, RelayMode


class WeightPublisherConfig(ActorConfig, frozen=True):
    chunk_bytes: Annotated[int, Meta(ge=1024, le=32 * 1024 * 1024)] = DEFAULT_CHUNK_BYTES
    """Chunk size in bytes (1-4 MB is right for WAN links; smaller pipelines deeper)."""
    mode: RelayMode = "relay"
    """"star" (send to every sampler), "relay" (samplers forward to each other: one chain up
    to ``relay_depth`` samplers, beyond that trees whose fan-out grows with their number) or
    "striped" (``stripes`` rotated chains or trees)."""
    stripes: Annotated[int, Meta(ge=1)] = 2
    """Chains (or trees) in striped mode."""
    relay_depth: Annotated[int, Meta(ge=1, le=4096)] = MAX_DEPTH
    """Most samplers a chunk passes through on its way to the farthest one (each adds a
    hop's latency): relay plans of more samplers are trees of growing fan-out."""
    uplink_mbps: Annotated[float, Meta(ge=0)] = 0.0
    """Emulated uplink cap on the weight path, Mbit/s (0: uncapped)."""
    member_ttl_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds after which a sampler not heard from (``WeightSubscribe``) leaves the plan."""
    send_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    """Seconds a seed's chunk stream may take no byte (a ZeroMQ PUSH: a send may take) before
    the seed is skipped for the version."""
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds to open a chunk stream to a seed."""
    max_streams: Annotated[int, Meta(ge=1, le=1024)] = 128
    """Parallel TCP streams to each sampler, at most; the number used adapts to each path
    (1 on a clean one; at 200 ms and 1% loss a reno stream carries ~0.6 Mbit/s)."""
    gamma: Annotated[float, Meta(ge=1)] = GAMMA
    """T_bcast counts until ceil(active / gamma) samplers installed the version."""
    shm_dir: str = ""
    """Shared-memory directory (e.g. "/dev/shm") for samplers on this host that set the
    same ``shm_dir``: they map each version from it instead of receiving chunks. "": off."""
    delta_anchor_every: Annotated[int, Meta(ge=0)] = 0
    """Delta-coded versions (``echo2.weights.delta``): K > 1 sends each version as its
    changes from the one before to samplers holding that one, with a dense anchor every
    K versions (and dense for any sampler that lacks the base). 0 or 1: all dense."""
    signing_key: str = ""
    """Ed25519 private key (PEM) to sign every manifest; samplers with the public key
    install nothing else. Make one with ``python -m echo2.keys --sign``."""
    publication: Literal["adaptive", "every"] = "adaptive"
    """"adaptive": a newer snapshot waits while the version in flight can still land within
    S (``echo2.capacity.publication``); "every": each snapshot at once, superseding it."""


STATS_RECORD_S = 5.0
"""Seconds between two ``stats`` records (the weight path's counters: repairs, forward and
send failures, supersessions, expiries, bytes) in the publisher's metrics file."""
BOTTLENECK_LOG_S = 30.0
"""Seconds between two log lines saying that broadcast is the bottleneck."""


class WeightPublisher(Actor):
    kind: ClassVar[str] = "weight_publisher"
    Config = WeightPublisherConfig
    ports: ClassVar[dict[str, Port]] = {
        "snapshots": Port("pull", bind=True, hwm=4),
        "weights": Port("router", bind=True),
    }
    config: WeightPublisherConfig

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        self._signer = None
        if self.config.signing_key:
            from echo2.weights.signing import ManifestSigner

            self._signer = ManifestSigner(self.config.signing_key)
        self._snapshots = ctx.open("snapshots")
        self._weights = ctx.open("weights")
        self.broadcaster = WeightBroadcaster(
            ctx.transport,
            self._weights,
            name=self.name,
            mode=self.config.mode,
            stripes=self.config.stripes,
            chunk_bytes=self.config.chunk_bytes,
            link=LinkSpec(uplink_mbps=self.config.uplink_mbps),
            member_ttl_s=self.config.member_ttl_s,
            send_timeout_s=self.config.send_timeout_s,
            connect_timeout_s=self.config.connect_timeout_s,
            gamma=self.config.gamma,
            on_bcast=self._on_bcast,
            shm_dir=self.config.shm_dir or None,
            sealed=ctx.sealed_weights,
            delta_anchor_every=self.config.delta_anchor_every,
            max_depth=self.config.relay_depth,
            max_streams=self.config.max_streams,
            dial_in=ctx.addresses("weights").stream_bind,
        )
        self.counters = {"snapshots": 0, "skipped": 0}
        self._policy = PublicationPolicy(self.job.staleness)
        self._incarnation: int | None = None
        self._waiting: Snapshot | None = None  # the newest snapshot not yet published
        self._decide = asyncio.Event()
        self._recheck: asyncio.TimerHandle | None = None
        self._t_train_s = 0.0
        self._wire_bytes = 0  # of the last published version
        self._bottleneck: Bottleneck | None = None
        self._bottleneck_said_s = -math.inf

    def _on_bcast(self, values: dict) -> None:
        self.ctx.record("broadcast", **values)
        t_bcast_s = values["t_bcast_s"]
        if t_bcast_s is None:
            self.ctx.log.debug(
                "v%d: installed by %d of %d, no T_bcast", values["version"], values["installed"], values["active"]
            )
            return
        self.ctx.log.debug("T_bcast v%d: %.3f s", values["version"], t_bcast_s)
        if values["incarnation"] == self._incarnation:
            self._policy.reached(values["version"], t_bcast_s)
            self._decide.set()  # a snapshot may be waiting for this version to land

    def statistics(self) -> PublisherStats:
        b = self.broadcaster.statistics()
        latest = self.broadcaster.latest_key
        t_bcast_s, lower_bound = b["t_bcast_s"], False
        estimate = self._policy.t_bcast_s(time.monotonic())
        if estimate is not None:
            t_bcast_s, lower_bound = estimate
        return PublisherStats(
            snapshots=self.counters["snapshots"],
            skipped=self.counters["skipped"],
            published=int(b["published"]),
            superseded=int(b["superseded"]),
            chunks_sent=int(b["chunks_sent"]),
            stream_bytes=int(b["stream_bytes"]),
            send_failures=int(b["send_failures"]),
            repair_requests=int(b["repair_requests"]),
            repair_chunks_sent=int(b["repair_chunks_sent"]),
            repair_bytes_sent=int(b["repair_bytes_sent"]),
            repair_duplicates_dropped=int(b["repair_duplicates_dropped"]),
            late_joiner_manifests=int(b["late_joiner_manifests"]),
            unroutable=int(b["unroutable"]),
            members_expired=int(b["members_expired"]),
            installs=int(b["installs"]),
            shm_versions_written=int(b["shm_versions_written"]),
            shm_failures=int(b["shm_failures"]),
            delta_versions=int(b["delta_versions"]),
            delta_fallbacks=int(b["delta_fallbacks"]),
            delta_dense_requests=int(b["delta_dense_requests"]),
            members=int(b["members"]),
            dialed_streams=int(b["dialed_streams"]),
            max_streams=int(b["max_streams"]),
            uplink_bytes=int(b["uplink_bytes"]),
            latest_version=latest.version if latest is not None else -1,
            t_bcast_s=t_bcast_s if not math.isnan(t_bcast_s) else -1.0,
            t_bcast_lower_bound=lower_bound,
            held=self._policy.held,
            broadcast_bound=self._bottleneck is not None,
            refused_subscribers=self.broadcaster.refused_subscribers,
            unbound_dropped=dict(self.broadcaster.unbound_dropped),
        )

    async def aclose(self) -> None:
        recheck: asyncio.TimerHandle | None = getattr(self, "_recheck", None)
        if recheck is not None:
            recheck.cancel()
        broadcaster = getattr(self, "broadcaster", None)
        if broadcaster is not None:
            broadcaster.close()

    async def run(self) -> None:
        await run_until_stopped(
            self.ctx.stopping,
            self._receive_snapshots(),
            self._publish_snapshots(),
            self.broadcaster.run(),
            record_statistics(self, STATS_RECORD_S),
        )

    async def _receive_snapshots(self) -> None:
        while True:
            batch = [m for m in await self._snapshots.recv_many() if isinstance(m, Snapshot)]
            if not batch:
                continue
            newest = max(batch, key=lambda s: s.policy_version)
            self.counters["snapshots"] += len(batch)
            self.counters["skipped"] += len(batch) - 1 + (self._waiting is not None)
            if newest.incarnation != self._incarnation:  # a resumed learner counts versions anew
                self._incarnation = newest.incarnation
                self._policy = PublicationPolicy(self.job.staleness)
            self._policy.snapshot_arrived(newest.version, time.monotonic())
            if newest.train_s > 0:
                self._t_train_s = newest.train_s
            self._waiting = newest
            self._decide.set()

    async def _publish_snapshots(self) -> None:
        """Publish the newest snapshot now, or once the version in flight lands (or would
        land too stale to be worth it): ``echo2.capacity.publication``."""
        loop = asyncio.get_running_loop()
        while True:
            await self._decide.wait()
            self._decide.clear()
            snapshot = self._waiting
            if snapshot is None:
                continue
            now = time.monotonic()
            self._say_bottleneck(now)
            hold_s = self._policy.hold_s(snapshot.version, now) if self.config.publication == "adaptive" else 0.0
            if self._recheck is not None:
                self._recheck.cancel()
                self._recheck = None
            if hold_s > 0:
                self._recheck = loop.call_later(hold_s, self._decide.set)
                continue
            self._waiting = None
            await self._publish(snapshot)

    async def _publish(self, newest: Snapshot) -> None:
        snapshot, manifest = await asyncio.to_thread(self.broadcaster.prepare, newest)
        # Off the loop and off the learner's path, like prepare (measured: encode_s).
        delta = await asyncio.to_thread(self.broadcaster.prepare_delta, newest, manifest)
        if self._signer is not None:
            manifest = self._signer.sign(manifest)
            delta = delta.signed(self._signer.sign) if delta is not None else None
        self.broadcaster.publish_nowait(snapshot, manifest, delta)
        self._wire_bytes = int(delta.payload.nbytes) if delta is not None else manifest.total_bytes
        self._policy.published(newest.version, len(self.broadcaster.members()), time.monotonic())

    def _say_bottleneck(self, now: float) -> None:
        """Whether broadcast is slower than training; if so, say (at most every
        ``BOTTLENECK_LOG_S``) what would restore overlap, and record it."""
        self._bottleneck = self._policy.bottleneck(self._t_train_s, self._wire_bytes, now)
        if self._bottleneck is None or now - self._bottleneck_said_s < BOTTLENECK_LOG_S:
            return
        self._bottleneck_said_s = now
        b = self._bottleneck
        self.ctx.log.warning("%s", b.describe(self.job.staleness, self._wire_bytes))
        self.ctx.record(
            "publication",
            t_bcast_s=round(b.t_bcast_s, 4),
            t_bcast_lower_bound=b.lower_bound,
            kappa=b.kappa,
            t_train_s=round(b.t_train_s, 5),
            bytes_per_version=self._wire_bytes,
            kappa_needed=b.remedy.kappa,
            staleness_needed=b.remedy.staleness,
            bytes_per_version_needed=b.remedy.bytes_per_version,
            held=self._policy.held,
            skipped=self.counters["skipped"],
        )
