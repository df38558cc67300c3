"""Small real actors for tests, examples/smoke.toml and failure injection.

They use the same contract, sockets and runtime as the RL actors, so a topology made of
them exercises placement, address derivation, supervision and shutdown without a model.
Their statistics are ``CustomStats``, the record an actor of one's own reports.

* ``CounterSource`` (``counter_source``): sends ``count`` numbered ``MetricsRecord`` on
  channel ``numbers`` (PUSH, connects), then an end-of-stream marker, and returns (the
  runtime's graceful close flushes what is still queued). Back-pressure: blocks
  at the high-water mark. Shutdown: returns at the next batch once ``stopping`` is set,
  without the end-of-stream marker (the consumer is stopping too).
* ``CounterSink`` (``counter_sink``): PULL, binds ``numbers``; counts messages until every
  expected producer has sent end-of-stream, records ``received`` in the run's metrics and
  completes the run. Shutdown: returns as soon as ``stopping`` is set.
* ``Failing`` (``failing``): raises ``RuntimeError(message)`` after ``after_s`` seconds,
  unless the run stops first.
* ``Idle`` (``idle``): logs that it runs, then does nothing until the run stops;
  ``torch_weight`` is configurable so tests can exercise thread allocation without torch,
  and ``ignore_stop`` makes it ignore stop requests (only cancellation or SIGKILL end it).
* ``HeartbeatSink`` (``heartbeat_sink``): SUB, binds channel ``telemetry``; records the
  first heartbeat of every process (``pid`` included) until the run stops.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, ClassVar

from msgspec import Meta

from echo2.actor import Actor, ActorConfig, ActorContext, Port, until_stopping
from echo2.errors import EndOfStream
from echo2.job import JobConfig
from echo2.messages import HEARTBEAT_TOPIC, TELEMETRY_CHANNEL, CustomStats, Heartbeat, MetricsRecord


class CounterSource(Actor):
    kind = "counter_source"

    class Config(ActorConfig, frozen=True):
        count: Annotated[int, Meta(ge=0)] = 100
        """Messages to send in total."""
        batch: Annotated[int, Meta(ge=1)] = 1
        """Messages sent between two checks of ``stopping`` (and two yields to the loop)."""

    ports: ClassVar[dict[str, Port]] = {"out": Port("push", bind=False, channel="numbers")}
    config: Config

    def __init__(self, name: str, config: Config | None = None, job: JobConfig | None = None) -> None:
        super().__init__(name, config, job)
        self.sent = 0

    async def setup(self, ctx: ActorContext) -> None:
        await super().setup(ctx)
        self._out = ctx.open("out")

    async def run(self) -> None:
        count, batch = self.config.count, self.config.batch
        while self.sent < count:
            if self.ctx.stopping.is_set():
                return
            n = min(batch, count - self.sent)
            now = time.time()
            await self._out.send_many(
                MetricsRecord(source=self.name, kind="n", time_s=now, values={"i": self.sent + k}) for k in range(n)
            )
            self.sent += n
            await asyncio.sleep(0)  # a send that never blocks never yields: let others run
        await self._out.send_eos(self.name)

    def statistics(self) -> CustomStats:
        return CustomStats(values={"sent": self.sent})


class CounterSink(Actor):
    kind = "counter_sink"
    completes_run = True

    class Config(ActorConfig, frozen=True):
        expected_producers: Annotated[int, Meta(ge=1)] = 1
        """End-of-stream markers to wait for before the run is complete."""

    ports: ClassVar[dict[str, Port]] = {"in": Port("pull", bind=True, channel="numbers")}
    config: Config

    def __init__(self, name: str, config: Config | None = None, job: JobConfig | None = None) -> None:
        super().__init__(name, config, job)
        self.received = 0
        self.complete = False

    async def setup(self, ctx: ActorContext) -> None:
        await super().setup(ctx)
        self._in = ctx.open("in", producers=self.config.expected_producers)

    async def run(self) -> None:
        try:
            while True:
                done, batch = await until_stopping(self.ctx.stopping, self._in.recv_many())
                if not done:
                    return
                self.received += len(batch or ())
        except EndOfStream:
            self.complete = True
        finally:
            self.ctx.record("received", count=self.received, complete=self.complete)

    def statistics(self) -> CustomStats:
        return CustomStats(values={"received": self.received})


class Failing(Actor):
    kind = "failing"

    class Config(ActorConfig, frozen=True):
        after_s: Annotated[float, Meta(ge=0)] = 0.0
        """Seconds after run() starts at which the actor raises."""
        message: str = "boom"
        """Text of the ``RuntimeError`` it raises."""

    config: Config

    async def run(self) -> None:
        try:
            async with asyncio.timeout(self.config.after_s):
                await self.ctx.stopping.wait()
        except TimeoutError:
            raise RuntimeError(self.config.message) from None


class Idle(Actor):
    kind = "idle"

    class Config(ActorConfig, frozen=True):
        torch_weight: Annotated[float, Meta(ge=0)] = 0.0
        """Pretend share of the host's cores for torch (thread allocation tests)."""
        ignore_stop: bool = False
        """Misbehave: ignore ``stopping``, so only cancellation ends the actor."""

    config: Config

    @classmethod
    def torch_weight(cls, config: ActorConfig) -> float:
        assert isinstance(config, cls.Config)
        return config.torch_weight

    async def run(self) -> None:
        if self.config.ignore_stop:
            self.ctx.log.info("%s: running, ignoring stop requests", self.name)
            await asyncio.Event().wait()
        self.ctx.log.info("%s: running until stopped", self.name)
        await self.ctx.stopping.wait()


class HeartbeatSink(Actor):
    kind = "heartbeat_sink"
    ports: ClassVar[dict[str, Port]] = {"heartbeats": Port("sub", bind=True, channel=TELEMETRY_CHANNEL, on_full="drop")}

    def __init__(self, name: str, config: ActorConfig | None = None, job: JobConfig | None = None) -> None:
        super().__init__(name, config, job)
        self.seen: dict[str, Heartbeat] = {}

    async def setup(self, ctx: ActorContext) -> None:
        await super().setup(ctx)
        self._in = ctx.open("heartbeats", subscribe=[HEARTBEAT_TOPIC])

    async def run(self) -> None:
        while True:
            done, batch = await until_stopping(self.ctx.stopping, self._in.recv_many())
            if not done:
                return
            for beat in batch or ():
                if isinstance(beat, Heartbeat) and beat.process not in self.seen:
                    self.seen[beat.process] = beat
                    self.ctx.record("heartbeat", process=beat.process, pid=beat.pid, actors=beat.actors)

    def statistics(self) -> CustomStats:
        return CustomStats(values={"processes_seen": len(self.seen)})


__all__ = ["CounterSink", "CounterSource", "Failing", "HeartbeatSink", "Idle", "until_stopping"]
