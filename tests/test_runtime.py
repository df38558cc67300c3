"""ProcessRuntime with real (testing) actors in one process: completion, failure, shutdown.

Every test shares the ``transport`` fixture with the runtime, so a leaked endpoint fails
the test at teardown (on top of the explicit ``open_endpoints`` checks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import ClassVar

import pytest

from echo2.actor import Actor, ActorConfig, ActorContext, Port
from echo2.actors.testing import CounterSink, CounterSource, Failing, Idle
from echo2.errors import ActorFailed
from echo2.messages import HEARTBEAT_TOPIC, Heartbeat
from echo2.runtime import ProcessRuntime
from echo2.topology import DEFAULT_HOST, HostSpec, Placement, derive_addresses
from echo2.transport import Transport


def runtime_for(actors: Sequence[Actor], transport: Transport, **kwargs: object) -> ProcessRuntime:
    places = [Placement(a.name, "main", DEFAULT_HOST, a.ports) for a in actors]
    addresses = derive_addresses(places, {DEFAULT_HOST: HostSpec()}, "test")
    return ProcessRuntime(actors, addresses.ports, process="main", transport=transport, **kwargs)  # type: ignore[arg-type]


class Stubborn(Actor):
    """Ignores ``stopping``; only cancellation ends it. Holds an endpoint to check closing."""

    kind = "stubborn"
    ports: ClassVar[dict[str, Port]] = {"in": Port("pull", bind=True, channel="stubborn")}

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.cancelled = False
        self.closed = False

    async def setup(self, ctx: ActorContext) -> None:
        await super().setup(ctx)
        self.endpoint = ctx.open("in")

    async def run(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def aclose(self) -> None:
        self.closed = True


class Closing(CounterSink):
    """A sink that records whether it was cancelled and closed."""

    def __init__(self, name: str, config: ActorConfig | None = None) -> None:
        super().__init__(name, config)
        self.cancelled = False
        self.closed = False

    async def run(self) -> None:
        try:
            await super().run()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def aclose(self) -> None:
        self.closed = True


async def test_source_to_sink_completes(transport: Transport) -> None:
    sources = [CounterSource(f"src-{i}", CounterSource.Config(count=50, batch=7)) for i in range(2)]
    sink = CounterSink("sink", CounterSink.Config(expected_producers=2))
    runtime = runtime_for([*sources, sink], transport)
    await asyncio.wait_for(runtime.run(), 10)
    assert sink.complete and sink.received == 100
    assert [s.sent for s in sources] == [50, 50]
    assert transport.open_endpoints == []


async def test_failing_actor_raises_actor_failed_and_closes_the_rest(transport: Transport) -> None:
    sink = Closing("sink")
    runtime = runtime_for([sink, Failing("boom", Failing.Config(message="injected"))], transport)
    with pytest.raises(ActorFailed) as info:
        await asyncio.wait_for(runtime.run(), 10)
    assert info.value.actor == "boom"
    assert "boom" in str(info.value) and "injected" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert sink.cancelled and sink.closed
    assert transport.open_endpoints == []


async def test_first_stop_request_drains(transport: Transport) -> None:
    sink = Closing("sink")
    idle = Idle("idle")
    runtime = runtime_for([sink, idle], transport, drain_timeout_s=60.0)
    async with asyncio.TaskGroup() as group:
        task = group.create_task(runtime.run())
        await runtime.wait_ready()
        runtime.request_stop("test")
    assert task.result() is None
    assert not sink.cancelled and sink.closed and not sink.complete
    assert transport.open_endpoints == []


async def test_second_stop_request_cancels(transport: Transport) -> None:
    stubborn = Stubborn("stubborn")
    runtime = runtime_for([stubborn, Idle("idle")], transport, drain_timeout_s=60.0)
    async with asyncio.TaskGroup() as group:
        task = group.create_task(runtime.run())
        await runtime.wait_ready()
        runtime.request_stop("first")
        assert not task.done()
        runtime.request_stop("second")
    assert stubborn.cancelled and stubborn.closed
    assert transport.open_endpoints == []


async def test_drain_deadline_cancels_an_actor_that_ignores_stopping(transport: Transport) -> None:
    stubborn = Stubborn("stubborn")
    runtime = runtime_for([stubborn], transport, drain_timeout_s=0.1)
    async with asyncio.TaskGroup() as group:
        group.create_task(runtime.run())
        await runtime.wait_ready()
        loop = asyncio.get_running_loop()
        started = loop.time()
        runtime.request_stop("test")
    assert stubborn.cancelled and stubborn.closed
    assert loop.time() - started >= 0.09  # not before the deadline; the test's timeout bounds a hang
    assert transport.open_endpoints == []


async def test_heartbeats_reach_a_telemetry_subscriber(transport: Transport) -> None:
    sub = transport.sub(name="test.telemetry", bind=["inproc://test-telemetry"], subscribe=[HEARTBEAT_TOPIC])
    runtime = runtime_for([Idle("idle")], transport, heartbeat_s=0.02, telemetry_connect=["inproc://test-telemetry"])
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(runtime.run())
            beat = await asyncio.wait_for(sub.recv(), 10)
            runtime.request_stop("test")
    finally:
        sub.close()
    assert isinstance(beat, Heartbeat)
    assert beat.process == "main" and beat.actors == ["idle"]
    assert transport.open_endpoints == []


async def test_setup_failure_closes_what_was_opened(transport: Transport) -> None:
    class BrokenSetup(Actor):
        kind = "broken"

        async def setup(self, ctx: ActorContext) -> None:
            await super().setup(ctx)
            raise OSError("no model here")

    sink = Closing("sink")
    runtime = runtime_for([sink, BrokenSetup("broken")], transport)
    with pytest.raises(OSError, match="no model here"):
        await asyncio.wait_for(runtime.run(), 10)
    assert sink.closed
    assert transport.open_endpoints == []
