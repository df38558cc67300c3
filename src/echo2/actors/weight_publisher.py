"""WeightPublisher: turns the Learner's snapshots into verified chunks on the weights topic.

Role: dissemination. For each ``Snapshot`` it builds a ``WeightManifest`` (layout, a
BLAKE2b-256 digest per chunk and for the whole) and publishes the manifest, then the
chunks, on topic ``w|``. Chunks are views into the snapshot: no copy on the hot path.

Late joiners: the XPUB socket reports each new subscription, and the latest version is
published again at once, so a sampler that joins (or restarts) mid-run installs the
current policy without waiting for the next publication. Samplers ignore versions they
already have.

Input: ``snapshots`` (PULL, bound; the Learner connects, inproc when co-located).
Output: ``weights`` (XPUB, bound; samplers subscribe).

Backpressure: XPUB with NODROP and ``on_full="block"``: a chunk is never dropped at the
high-water mark; the publisher waits for the slowest subscriber's queue instead. Only the
newest snapshot matters: if several are queued, older ones are skipped (counted).

Shutdown: on ``stopping`` it returns.
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

from echo2.actor import Actor, ActorConfig, Port
from echo2.actors.common import run_until_stopped
from echo2.messages import Snapshot, WeightManifest
from echo2.transport.broadcast import DEFAULT_CHUNK_BYTES, WEIGHTS_TOPIC, iter_chunks, make_manifest


class WeightPublisherConfig(ActorConfig):
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    hwm_chunks: int = 1024
    """Per-subscriber queue, in messages; at least a whole snapshot's chunks."""


class WeightPublisher(Actor):
    kind: ClassVar[str] = "weight_publisher"
    Config = WeightPublisherConfig
    ports: ClassVar[dict[str, Port]] = {
        "snapshots": Port("pull", bind=True, hwm=4),
        "weights": Port("pub", bind=True),
    }
    config: WeightPublisherConfig

    async def setup(self, ctx) -> None:  # type: ignore[no-untyped-def]
        from echo2.transport import SocketOptions

        await super().setup(ctx)
        self._snapshots = ctx.open("snapshots")
        self._weights = ctx.open("weights", options=SocketOptions(hwm=self.config.hwm_chunks))
        self._latest: tuple[Snapshot, WeightManifest] | None = None
        self._new = asyncio.Event()
        self._resend = False
        self.counters = {"published": 0, "republished_for_joiners": 0, "skipped": 0, "chunks_sent": 0}
        self.last_publish_s = 0.0

    def statistics(self) -> dict[str, float]:
        version = self._latest[1].version if self._latest else -1
        return {**self.counters, "latest_version": version, "last_publish_s": self.last_publish_s}

    async def run(self) -> None:
        await run_until_stopped(
            self.ctx.stopping, self._receive_snapshots(), self._watch_subscribers(), self._publish_loop()
        )

    async def _receive_snapshots(self) -> None:
        while True:
            batch = [m for m in await self._snapshots.recv_many() if isinstance(m, Snapshot)]
            if not batch:
                continue
            newest = max(batch, key=lambda s: (s.incarnation, s.version))
            if self._new.is_set():
                self.counters["skipped"] += 1
            self.counters["skipped"] += len(batch) - 1
            self._latest = (newest, await asyncio.to_thread(make_manifest, newest, self.config.chunk_bytes))
            self._new.set()

    async def _watch_subscribers(self) -> None:
        while True:
            await self._weights.wait_subscriber(WEIGHTS_TOPIC)
            if self._latest is not None:
                self._resend = True
                self.counters["republished_for_joiners"] += 1
                self._new.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._new.wait()
            self._new.clear()
            self._resend = False
            if self._latest is None:
                continue
            snapshot, manifest = self._latest
            started = time.perf_counter()
            await self._weights.publish(WEIGHTS_TOPIC, manifest)
            for chunk in iter_chunks(snapshot, manifest):
                await self._weights.publish(WEIGHTS_TOPIC, chunk)
                self.counters["chunks_sent"] += 1
            self.counters["published"] += 1
            self.last_publish_s = time.perf_counter() - started
