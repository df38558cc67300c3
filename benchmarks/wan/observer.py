"""An actor the bed adds to the learner host: it records what only telemetry carries.

Sampler installs (``WeightsInstalled``) and the actors' statistics travel only on the
telemetry channel, which nothing writes to the run directory. This actor binds one more
telemetry SUB (every process's heartbeat publisher connects to every telemetry binder, so
adding it takes no change to echo2) and writes to ``metrics/<name>.jsonl``: every install
(``install``: sampler, version, incarnation, unix_s, and how long the version took from its
manifest to complete, ``received_s``, and when it was complete, ``complete_unix_s``) and, at most every ``stats_every_s`` per
actor, the statistics of each sampler and weight publisher (``stats``: actor, the record).
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from echo2.actor import Actor, ActorConfig, ActorContext, Port, until_stopping
from echo2.messages import (
    HEARTBEAT_TOPIC,
    INSTALLED_TOPIC,
    TELEMETRY_CHANNEL,
    Heartbeat,
    PublisherStats,
    SamplerStats,
    WeightsInstalled,
)


class WanObserver(Actor):
    kind: ClassVar[str] = "wan_observer"

    class Config(ActorConfig, frozen=True):
        stats_every_s: Annotated[float, Meta(gt=0)] = 2.0
        """Seconds between two ``stats`` records of one actor."""

    config: Config
    ports: ClassVar[dict[str, Port]] = {
        "telemetry": Port("sub", bind=True, channel=TELEMETRY_CHANNEL, on_full="drop"),
    }

    async def setup(self, ctx: ActorContext) -> None:
        await super().setup(ctx)
        self._in = ctx.open("telemetry", subscribe=[HEARTBEAT_TOPIC, INSTALLED_TOPIC])
        self._last_stats: dict[str, float] = {}

    async def run(self) -> None:
        while True:
            done, batch = await until_stopping(self.ctx.stopping, self._in.recv_many())
            if not done:
                return
            for message in batch or ():
                if isinstance(message, WeightsInstalled):
                    self.ctx.record(
                        "install",
                        sampler=message.sampler_id,
                        version=message.version,
                        incarnation=message.incarnation,
                        unix_s=message.time_s,
                        received_s=message.received_s,
                        complete_unix_s=message.complete_time_s,
                    )
                elif isinstance(message, Heartbeat):
                    self._record_stats(message)

    def _record_stats(self, beat: Heartbeat) -> None:
        now = time.monotonic()
        for actor, stats in beat.actor_stats.items():
            if not isinstance(stats, SamplerStats | PublisherStats):
                continue
            if now - self._last_stats.get(actor, -float("inf")) < self.config.stats_every_s:
                continue
            self._last_stats[actor] = now
            self.ctx.record("stats", actor=actor, host=beat.host, unix_s=beat.time_s, **msgspec.to_builtins(stats))
