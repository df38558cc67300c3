"""Pipeline: actors embedded in this process without a topology file."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import ClassVar

import pytest
from tests.polling import until

from echo2.actor import Actor, ActorContext, Port, run_until_stopped
from echo2.actors.testing import CounterSink, CounterSource, Failing, Idle
from echo2.errors import ActorFailed, ConfigError
from echo2.pipeline import Pipeline
from echo2.rundir import RunDir


def counters(count: int = 40) -> tuple[list[CounterSource], CounterSink]:
    sources = [CounterSource(f"src-{i}", CounterSource.Config(count=count)) for i in range(2)]
    return sources, CounterSink("sink", CounterSink.Config(expected_producers=2))


async def test_two_sources_one_sink_completes(tmp_path: Path) -> None:
    sources, sink = counters(40)
    async with Pipeline([*sources, sink], run_dir=tmp_path) as pipeline:
        await asyncio.wait_for(pipeline.wait(), 10)
    assert sink.complete and sink.received == 80
    assert RunDir(tmp_path).metrics("sink")[-1]["count"] == 80


async def test_failing_actor_surfaces_from_wait() -> None:
    sources, sink = counters(10**9)  # would run for ages: the failure must end it
    failing = Failing("boom", Failing.Config(message="injected"))
    async with Pipeline([*sources, sink, failing]) as pipeline:
        with pytest.raises(ActorFailed) as info:
            await asyncio.wait_for(pipeline.wait(), 10)
    assert info.value.actor == "boom"
    assert isinstance(info.value.__cause__, RuntimeError)


class FailsWhenStopped(Actor):
    kind = "fails_when_stopped"

    async def run(self) -> None:
        await self.ctx.stopping.wait()
        raise RuntimeError("failed while draining")


async def test_unobserved_failure_is_raised_on_exit() -> None:
    with pytest.raises(ActorFailed, match="failed while draining"):
        async with Pipeline([FailsWhenStopped("drainer"), Idle("idle")]):
            pass


async def test_exit_stops_running_actors() -> None:
    sources, sink = counters(10**9)
    async with Pipeline([*sources, sink, Idle("idle")], drain_timeout_s=5.0) as pipeline:
        assert not pipeline.runtime.stopping.is_set()
    assert not sink.complete
    assert pipeline.runtime.stopping.is_set()


async def test_request_stop_then_wait_returns() -> None:
    async with Pipeline([Idle("idle")]) as pipeline:
        pipeline.request_stop()
        await asyncio.wait_for(pipeline.wait(), 10)


async def test_setup_failure_propagates_from_enter() -> None:
    class BrokenSetup(Actor):
        kind = "broken"

        async def setup(self, ctx: ActorContext) -> None:
            await super().setup(ctx)
            raise OSError("no model here")

    idle = Idle("idle")
    with pytest.raises(OSError, match="no model here"):
        async with Pipeline([idle, BrokenSetup("broken")]):
            raise AssertionError("not reached")


def test_connector_without_binder_is_rejected_before_any_io() -> None:
    class Lonely(Actor):
        kind = "lonely"
        ports: ClassVar[dict[str, Port]] = {"out": Port("push", bind=False, channel="nowhere")}

    with pytest.raises(ConfigError, match=r"^actors\.lonely\.ports\.out: no actor binds channel 'nowhere'$"):
        Pipeline([Lonely("lonely")])
    with pytest.raises(ConfigError, match="duplicate actor names: a"):
        Pipeline([Idle("a"), Idle("a")])


class CountsThenReturns(Actor):
    """A custom actor whose one loop ends by itself, through the public helper."""

    kind = "counts_then_returns"

    def __init__(self, name: str, *, ticks: int, completes: bool = False) -> None:
        super().__init__(name)
        self.ticks = ticks
        self.done = asyncio.Event()
        self.completes_run = completes  # type: ignore[misc]  # per instance, for the test

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._count())
        self.done.set()

    async def _count(self) -> None:
        for _ in range(self.ticks):
            await asyncio.sleep(0)  # a yield, not a wait for something


async def test_actor_returning_through_run_until_stopped_finishes_and_peers_continue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="echo2.runtime")
    watcher = CountsThenReturns("watcher", ticks=3)
    async with Pipeline([watcher, Idle("idle")]) as pipeline:
        await asyncio.wait_for(watcher.done.wait(), 10)
        # Finished, not failed, and the run goes on: nobody asked it to stop.
        await until(lambda: "actor watcher finished" in caplog.text)
        assert not pipeline.runtime.stopping.is_set()
        pipeline.request_stop()
        await asyncio.wait_for(pipeline.wait(), 10)  # no ActorFailed
    assert "watcher failed" not in caplog.text


async def test_actor_that_completes_the_run_stops_it_by_returning() -> None:
    async with Pipeline([CountsThenReturns("watcher", ticks=3, completes=True), Idle("idle")]) as pipeline:
        await asyncio.wait_for(pipeline.wait(), 10)
    assert pipeline.runtime.stop_reason == "actor watcher completed the run"


async def test_run_until_stopped_still_stops_loops_that_never_return() -> None:
    stopping, forever, returned = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def short() -> None:
        returned.set()

    helper = asyncio.ensure_future(run_until_stopped(stopping, forever.wait(), short()))
    await asyncio.wait_for(returned.wait(), 5)
    for _ in range(5):  # let the helper see the short loop's end
        await asyncio.sleep(0)
    assert not helper.done()  # one loop returned, the other still runs
    stopping.set()
    await asyncio.wait_for(helper, 5)
