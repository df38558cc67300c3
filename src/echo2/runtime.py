"""The per-process runtime: sets actors up, runs them in one TaskGroup, shuts them down.

Shutdown has two phases. The first stop request (SIGTERM, SIGINT, an actor that completes
the run) sets ``stopping``: actors drain and return. The second request, or the drain
deadline, cancels every actor task. Setup happens in order and teardown in reverse through
one ``AsyncExitStack``, so a failure anywhere still closes everything that was opened.

A failing actor fails the process: the TaskGroup cancels its siblings, the cause is logged
with the actor's name, and ``run_actors`` raises ``ActorFailed``.

Heartbeats go on the ``telemetry`` channel (when some actor binds it) every
``heartbeat_s``: ZMTP heartbeats detect a dead peer but not a stuck event loop. Each
carries every actor's ``statistics()`` record and what each endpoint discarded.

With ``metrics_port`` set (``[hosts.NAME] metrics_port`` in a topology) the process serves
``/metrics`` and ``/health`` on its own loop from the start of setup to the end of teardown
(``echo2.observe``). ``metric_writers`` (``[run] metric_writers``: TensorBoard, W&B) get
every record of the actor that completes the run (the learner), as it is written.

The program each launched process runs is ``echo2.launch.child``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from echo2.actor import Actor, ActorContext, PortAddresses
from echo2.errors import ActorFailed
from echo2.job import JobObjects
from echo2.messages import HEARTBEAT_TOPIC, ActorStats, CustomStats, EndpointHealth, Heartbeat
from echo2.observe.health import ActorState, ProcessHealth, health_routes, heartbeat_timeout_s
from echo2.observe.http import serve
from echo2.observe.metrics import ProcessSnapshot, RecordTracker, exposition, process_families
from echo2.observe.writers import RecordFanout
from echo2.transport import PublisherEndpoint, SocketOptions, Transport
from echo2.transport.auth import CurveSettings
from echo2.transport.recording import RecordingSettings

log = logging.getLogger("echo2.runtime")


class ProcessRuntime:
    """Runs a list of actors in this process until they finish, fail or are stopped."""

    def __init__(
        self,
        actors: Sequence[Actor],
        addresses: Mapping[str, Mapping[str, PortAddresses]],
        *,
        process: str = "main",
        run_dir: Path | None = None,
        drain_timeout_s: float = 10.0,
        heartbeat_s: float = 1.0,
        flush_timeout_s: float = 1.0,
        telemetry_connect: Sequence[str] = (),
        telemetry_curve_servers: Sequence[str] = (),
        transport: Transport | None = None,
        curve: CurveSettings | None = None,
        resume: bool = False,
        metrics_port: int = 0,
        recording: RecordingSettings | None = None,
        job_objects: JobObjects | None = None,
        metric_writers: RecordFanout | None = None,
    ) -> None:
        self.actors = list(actors)
        self._writers = metric_writers
        self.metrics_port = metrics_port
        """Port of this process's /metrics and /health (0: not served)."""
        self._records = RecordTracker()
        self._actor_states: dict[str, ActorState] = {a.name: "setting up" for a in self.actors}
        self._heartbeats_sent = 0
        self._last_beat_at: float | None = None
        self._last_lag_s = 0.0
        self.process = process
        self.run_dir = run_dir
        self.drain_timeout_s = drain_timeout_s
        self.heartbeat_s = heartbeat_s
        self.flush_timeout_s = flush_timeout_s
        self._failed = False
        self.stopping = asyncio.Event()
        self.stop_reason = ""
        self._addresses = addresses
        self._telemetry_connect = tuple(telemetry_connect)
        self._telemetry_curve_servers = tuple(telemetry_curve_servers)
        self._curve = curve
        self.resume = resume
        self._recording = recording
        self.job_objects = job_objects
        """A task and reward given as objects (the embedding API), handed to every actor."""
        self._transport = transport
        self._owns_transport = transport is None
        self._forced = False
        self._wake = asyncio.Event()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._unfinished = 0
        self._contexts: list[ActorContext] = []
        self._ready = asyncio.Event()
        self._drain_timer: asyncio.TimerHandle | None = None

    # -- control ---------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """First call: drain. Second call: cancel everything now."""
        if self.stopping.is_set():
            self.force_stop(f"second stop request ({reason})")
            return
        log.info("%s: stopping (%s); draining up to %.1f s", self.process, reason, self.drain_timeout_s)
        self.stop_reason = reason
        self.stopping.set()
        self._wake.set()

    def force_stop(self, reason: str) -> None:
        if not self._forced:
            log.warning("%s: cancelling actors (%s)", self.process, reason)
        self._forced = True
        self.stopping.set()
        self._wake.set()

    def _linger_ms(self) -> int:
        """A graceful exit flushes what actors queued last (bounded); an abort does not."""
        return 0 if self._forced or self._failed else int(self.flush_timeout_s * 1000)

    def _close_context(self, ctx: ActorContext) -> None:
        ctx.close(self._linger_ms())  # at exit: whether it is graceful is known only then

    async def wait_ready(self) -> None:
        """Returns once every actor's setup has completed."""
        await self._ready.wait()

    # -- main ------------------------------------------------------------------------

    async def run(self, *, install_signal_handlers: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self._transport is None:
                    self._transport = Transport()
                transport = self._transport
                if self._owns_transport:
                    stack.callback(lambda: transport.close(self._linger_ms()))
                if self._curve is not None and any(
                    a.curve_server for ports in self._addresses.values() for a in ports.values()
                ):
                    # Before any CURVE server binds: without a ZAP handler it would admit anyone.
                    transport.enable_curve(self._curve.allowed)
                if self._writers is not None:
                    stack.callback(self._writers.close)
                if self.metrics_port:
                    routes = {"/metrics": lambda: exposition(process_families(self.snapshot()))}
                    server = await serve(self.metrics_port, {**routes, **health_routes(self.health)})
                    stack.push_async_callback(_close_server, server)
                telemetry = self._open_telemetry(transport)
                if telemetry is not None:
                    stack.callback(telemetry.close)
                for actor in self.actors:
                    ctx = ActorContext(
                        actor_name=actor.name,
                        process=self.process,
                        transport=transport,
                        ports=self._addresses.get(actor.name, {}),
                        declared=actor.ports,
                        run_dir=self.run_dir,
                        stopping=self.stopping,
                        telemetry=telemetry,
                        curve=self._curve,
                        resume=self.resume,
                        on_record=self._on_record(actor),
                        recording=self._recording,
                        job_objects=self.job_objects,
                    )
                    stack.callback(self._close_context, ctx)
                    stack.push_async_callback(_aclose_actor, actor)
                    await actor.setup(ctx)
                    self._contexts.append(ctx)
                self._ready.set()
                await self._run_all(telemetry)
        finally:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            if install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                    # The work is done; a stop request racing with the exit (the launcher
                    # stopping everyone once the run completed) must not turn a clean exit
                    # into death by signal.
                    signal.signal(sig, signal.SIG_IGN)

    async def _run_all(self, telemetry: PublisherEndpoint | None) -> None:
        self._unfinished = len(self.actors)
        try:
            async with asyncio.TaskGroup() as group:
                for actor in self.actors:
                    self._running[actor.name] = group.create_task(self._run_actor(actor), name=f"actor:{actor.name}")
                heartbeat = None
                if telemetry is not None or self.metrics_port:  # /health reads the ticks too
                    heartbeat = group.create_task(self._heartbeats(telemetry), name="heartbeats")
                group.create_task(self._supervise(heartbeat), name="supervisor")
        except BaseExceptionGroup as group_exc:
            self._failed = True
            failures = group_exc.subgroup(ActorFailed)
            if failures is not None:
                failure = failures.exceptions[0]
                raise failure from failure.__cause__  # keep the actor's exception as cause
            raise

    async def _run_actor(self, actor: Actor) -> None:
        self._actor_states[actor.name] = "running"
        try:
            await actor.run()
        except asyncio.CancelledError:
            self._actor_states[actor.name] = "cancelled"
            log.info("%s: actor %s cancelled", self.process, actor.name)
            raise
        except Exception as exc:
            self._actor_states[actor.name] = "failed"
            log.error("%s: actor %s failed: %s: %s", self.process, actor.name, type(exc).__name__, exc, exc_info=exc)
            raise ActorFailed(actor.name, exc) from exc
        else:
            self._actor_states[actor.name] = "finished"
            log.info("%s: actor %s finished", self.process, actor.name)
            if actor.completes_run and not self.stopping.is_set():
                self.request_stop(f"actor {actor.name} completed the run")
        finally:
            self._unfinished -= 1
            self._wake.set()

    async def _supervise(self, heartbeat: asyncio.Task[None] | None) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._unfinished == 0:
                break
            if self._forced:
                for task in self._running.values():
                    task.cancel()
                break
            if self.stopping.is_set() and self._drain_timer is None:
                self._drain_timer = loop.call_later(self.drain_timeout_s, self.force_stop, "drain deadline passed")
        if heartbeat is not None:
            heartbeat.cancel()

    # -- health and metrics ----------------------------------------------------------

    def _on_record(self, actor: Actor) -> Callable[[str, str, Mapping[str, Any]], None] | None:
        """Where an actor's ``ctx.record`` lines also go: /metrics, and the metric writers
        for the actor that completes the run (the learner's metrics)."""
        sinks = [self._records.observe] if self.metrics_port else []
        if self._writers is not None and actor.completes_run and actor.trusted:
            sinks.append(self._writers.write)
        if len(sinks) < 2:
            return sinks[0] if sinks else None

        def both(name: str, kind: str, values: Mapping[str, Any]) -> None:
            for sink in sinks:
                sink(name, kind, values)

        return both

    def health(self) -> ProcessHealth:
        """Ready: every actor set up, none failed, not stopping, heartbeats on time."""
        age = None if self._last_beat_at is None else round(time.monotonic() - self._last_beat_at, 3)
        failed = [name for name, state in self._actor_states.items() if state == "failed"]
        if failed:
            reason = f"actor {failed[0]} failed"
        elif not self._ready.is_set():
            reason = "actors setting up"
        elif self.stopping.is_set():
            reason = f"stopping ({self.stop_reason or 'cancelled'})"
        elif age is None or age > heartbeat_timeout_s(self.heartbeat_s):
            reason = "no heartbeat within the heartbeat timeout" if age is not None else "no heartbeat yet"
        else:
            reason = ""
        return ProcessHealth(
            process=self.process,
            ready=not reason,
            reason=reason,
            actors=dict(self._actor_states),
            last_heartbeat_age_s=age,
        )

    def snapshot(self) -> ProcessSnapshot:
        """What ``/metrics`` shows (``echo2.observe.metrics``)."""
        return ProcessSnapshot(
            health=self.health(),
            records=self._records,
            stats={a.name: stats for a in self.actors if (stats := _statistics_of(a)) is not None},
            endpoints=self._endpoint_health(),
            heartbeats=self._heartbeats_sent,
            loop_lag_s=self._last_lag_s,
        )

    def _endpoint_health(self) -> dict[str, EndpointHealth]:
        return {
            s.name: EndpointHealth(
                decode_errors=s.decode_errors,
                dropped=s.dropped,
                disconnects=s.disconnects,
                inconsistent=s.inconsistent,
            )
            for ctx in self._contexts
            for s in (endpoint.statistics() for endpoint in ctx.endpoints)
        }

    # -- telemetry -------------------------------------------------------------------

    def _open_telemetry(self, transport: Transport) -> PublisherEndpoint | None:
        if not self._telemetry_connect:
            return None
        return transport.pub(
            name=f"{self.process}.telemetry",
            connect=self._telemetry_connect,
            options=SocketOptions(hwm=100),
            on_full="drop",
            curve=None
            if self._curve is None
            else self._curve.for_urls(False, self._telemetry_connect, self._telemetry_curve_servers),
        )

    async def _heartbeats(self, telemetry: PublisherEndpoint | None) -> None:
        host = socket.gethostname()
        names = [a.name for a in self.actors]
        seq = 0
        loop = asyncio.get_running_loop()
        expected = loop.time()
        while True:
            lag = max(0.0, loop.time() - expected)
            self._last_beat_at, self._last_lag_s = time.monotonic(), lag
            self._heartbeats_sent += 1
            if telemetry is None:  # ticks for /health only
                expected = loop.time() + self.heartbeat_s
                await asyncio.sleep(self.heartbeat_s)
                continue
            actor_stats = {a.name: stats for a in self.actors if (stats := _statistics_of(a)) is not None}
            endpoints = self._endpoint_health()
            beat = Heartbeat(
                process=self.process,
                actors=names,
                pid=os.getpid(),
                host=host,
                seq=seq,
                time_s=time.time(),
                loop_lag_s=lag,
                actor_stats=actor_stats,
                endpoints=endpoints,
            )
            await telemetry.publish(HEARTBEAT_TOPIC, beat)
            seq += 1
            expected = loop.time() + self.heartbeat_s
            await asyncio.sleep(self.heartbeat_s)


def _statistics_of(actor: Actor) -> ActorStats | None:
    stats: object = actor.statistics()
    if stats is None or isinstance(stats, ActorStats):
        return stats
    if isinstance(stats, Mapping):
        # An actor written before statistics were typed returns a flat dict: carry it as
        # the record for actors of one's own, as if it had returned CustomStats.
        return CustomStats(values={str(k): float(v) for k, v in stats.items()})
    raise TypeError(
        f"actor {actor.name}: statistics() must return an echo2.messages statistics record "
        f"(CustomStats for an actor of your own) or None, got {type(stats).__name__}"
    )


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


async def _aclose_actor(actor: Actor) -> None:
    try:
        await actor.aclose()
    except Exception:
        log.exception("actor %s: aclose failed", actor.name)
        raise
