"""The actor contract: what every echo2 actor is, and what the runtime hands it.

An actor has three explicit phases:

* ``__init__(name, config, job)``: pure; no sockets, files or threads.
* ``await setup(ctx)``: open endpoints (``ctx.open(port)``), load models. When it returns
  the actor is ready: its bound sockets accept peers.
* ``await run()``: the actor's loop. Returning means it finished; raising means it failed
  (the runtime logs the cause and brings the process down). A finished actor whose kind
  sets ``completes_run`` (the Learner) stops the run; any other finished actor just leaves
  its peers running, and a process whose actors have all finished exits cleanly. It must watch
  ``ctx.stopping`` and return promptly once set (drain), and it may be cancelled outright
  (second signal or drain deadline), so it must re-raise ``CancelledError``.
* ``await aclose()``: always runs, releases what setup acquired (the runtime also closes
  every endpoint opened through ``ctx``).

Placement (process, host, threads) never appears here: the topology decides it, and
``ctx.open(port)`` receives addresses derived from it (inproc, ipc or tcp).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec

from echo2.config import convert_config
from echo2.errors import ConfigError
from echo2.job import JobConfig, JobObjects
from echo2.ledger import LedgerEvent, event_record
from echo2.messages import Message, Statistics
from echo2.rundir import JsonLinesWriter, RunDir
from echo2.transport import Endpoint, SocketOptions, Transport
from echo2.transport.endpoint import DEFAULT_HWM, DEFAULT_MAX_MESSAGE_BYTES, OnFull, SocketKind
from echo2.transport.recording import RecordingSettings


@dataclasses.dataclass(frozen=True)
class Port:
    """A named channel end an actor kind declares: socket kind and whether it binds.

    For each channel name the binders are found from the topology, and each connector gets
    one address per binder (so several Rewarders behind one ``rollouts`` channel just work).
    """

    socket: SocketKind
    bind: bool
    """True: this end binds and peers connect to it; False: it connects to every binder."""
    hwm: int = DEFAULT_HWM
    """ZeroMQ high-water mark, messages queued per peer."""
    on_full: OnFull = "block"
    """At the high-water mark a send blocks ("block") or the message is dropped ("drop")."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message accepted from a peer, bytes (a bigger one closes its connection):
    what the channel legitimately carries (``CONTROL_MAX_MESSAGE_BYTES`` for requests and
    leases), since a peer can park ``hwm`` of them in the socket. Not enforced on inproc."""
    channel: str = ""
    """Channel whose binders and connectors meet; "": the port's own name."""


class PortAddresses(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The addresses one port of one actor gets: derived from the topology, written in the
    resolved topology (``topology.resolved.json``) and handed to ``ctx.open``."""

    bind: tuple[str, ...] = ()
    """URLs this port binds (inproc, ipc or tcp, by where its peers are)."""
    connect: tuple[str, ...] = ()
    """URLs this port connects to, one per binder of its channel."""
    curve_server: bool = False
    """Bound for peers on other hosts with CURVE on: a CURVE server."""
    curve_servers: tuple[str, ...] = ()
    """Per connect URL: the host whose CURVE public key to pin ("" = plain)."""
    curve_clients: tuple[str, ...] = ()
    """A CURVE server's admitted clients: the hosts whose keys may connect; () admits every
    allowed key (a port that untrusted workers use, ``Actor.trusted``)."""
    stream_bind: str = ""
    """A chunk-stream listener the actor opens beside this port (``echo2.weights.stream``:
    a sampler's relay inbox, the weight publisher's dial-in listener): the tcp URL it
    binds, a fixed port of its host's range; "" none, or an ephemeral port."""
    stream_announce: str = ""
    """The tcp URL peers on other hosts reach ``stream_bind`` at (its host's ``address``)."""
    stream_dial: tuple[str, ...] = ()
    """Per connect URL, the binder's chunk-stream listener to dial: set when this actor's
    host accepts no inbound connection (``[hosts] inbound = false``), so its chunks come
    down connections it opens."""


class ActorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of each actor kind's ``Config``; an empty config is valid."""


class Actor:
    """Base class of actors. Subclasses set ``kind``, ``Config`` and ``ports``."""

    kind: ClassVar[str] = ""
    Config: ClassVar[type[ActorConfig]] = ActorConfig
    ports: ClassVar[Mapping[str, Port]] = {}
    completes_run: ClassVar[bool] = False
    """True if this actor returning from run() means the whole run is done (the Learner)."""
    restartable: ClassVar[bool] = True
    """False if a process the launcher restarts (``restart = "on-failure"``) would run this
    actor over from nothing while its peers carry on (the Learner: step 0); the setting is
    then refused at topology load for its process."""
    torchrun: ClassVar[bool] = False
    """True for an actor that trains across ranks (the ``distributed_learner``): the launcher
    starts its process under torchrun (``[processes.NAME] nproc_per_node``, ``nnodes``), rank 0
    running the process's actors (``echo2.launch.torchrun``)."""
    trusted: ClassVar[bool] = True
    """False for an actor the job's owner may not control (a Sampler on a rented or
    volunteered machine). With CURVE on, a port such an actor connects to admits every
    allowed key; any other port admits only the keys of the hosts whose actors connect to
    it, so a worker's key opens the worker channels and nothing else."""

    def __init__(self, name: str, config: ActorConfig | None = None, job: JobConfig | None = None):
        self.name = name
        self.config = config if config is not None else self.Config()
        self.job = job if job is not None else JobConfig()
        self.ctx: ActorContext  # set in setup()

    @classmethod
    def torch_weight(cls, config: ActorConfig) -> float:
        """Share of the host's cores this actor's torch work wants (0: no torch)."""
        return 0.0

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any], path: str) -> ActorConfig:
        """This kind's ``Config`` from its topology table; ``ConfigError`` naming the field."""
        config: ActorConfig = convert_config(raw, cls.Config, path)
        return config

    async def setup(self, ctx: ActorContext) -> None:
        self.ctx = ctx

    async def run(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release what setup acquired; endpoints opened via ctx are closed by the runtime."""

    def statistics(self) -> Statistics | None:
        """This actor's statistics record, carried in every heartbeat of its process
        (``Heartbeat.actor_stats[name]``); None: nothing to report.

        The built-in actors return their kind's record (``echo2.messages.LearnerStats``,
        ``SamplerStats``, ...). An actor of your own returns
        ``echo2.messages.CustomStats(values={"name": number, ...})``.
        """
        return None


class ActorContext:
    """What the runtime gives an actor: its endpoints, run directory and stop signal."""

    def __init__(
        self,
        *,
        actor_name: str,
        process: str,
        transport: Transport,
        ports: Mapping[str, PortAddresses],
        declared: Mapping[str, Port],
        run_dir: Path | None,
        stopping: asyncio.Event,
        telemetry: Any = None,
        started_at: float | None = None,
        curve: Any = None,
        resume: bool = False,
        on_record: Callable[[str, str, Mapping[str, Any]], None] | None = None,
        recording: RecordingSettings | None = None,
        job_objects: JobObjects | None = None,
    ) -> None:
        self.actor_name = actor_name
        self._on_record = on_record
        """Called with ``(actor, kind, values)`` for every ``record`` (the process's /metrics)."""
        self.process = process
        self.transport = transport
        self.stopping = stopping
        self.run_dir = run_dir
        self.log = logging.getLogger(f"echo2.{actor_name}")
        self.started_at = started_at if started_at is not None else time.time()
        self._ports = ports
        self._declared = declared
        self._telemetry = telemetry
        self._curve = curve  # echo2.transport.auth.CurveSettings, or None
        self.resume = resume
        """True when the run continues from checkpoints in ``run_dir`` (``--resume``)."""
        self._recording = recording
        self.job_objects = job_objects
        """The task and reward given as objects in this process (``echo2.Pipeline(task=...)``),
        which replace the job's import strings; None in a launched run."""
        layout = RunDir(run_dir) if run_dir is not None else None
        self._metrics = JsonLinesWriter(layout.metrics_path(actor_name)) if layout is not None else None
        self._ledger = JsonLinesWriter(layout.ledger_path(actor_name)) if layout is not None else None
        self._endpoints: list[Endpoint] = []

    @property
    def sealed_weights(self) -> bool:
        """Under ``[security]`` (CURVE on): weight versions are sealed and chunk streams
        admit only the plan's members (``echo2.weights.seal``, ``echo2.weights.stream``)."""
        return self._curve is not None

    def addresses(self, port: str) -> PortAddresses:
        """The resolved addresses of a declared port (empty ones where none were derived)."""
        return self._ports.get(port, PortAddresses())

    def has_peers(self, port: str) -> bool:
        addresses = self._ports.get(port)
        return bool(addresses and (addresses.bind or addresses.connect))

    def open(self, port: str, **overrides: Any) -> Any:
        """Open the endpoint for a declared port at its resolved addresses.

        ``overrides``: ``Transport.open``'s keywords, and ``max_message_bytes`` in place of
        the port's declared one (a bound that depends on the job)."""
        try:
            spec = self._declared[port]
        except KeyError:
            raise ConfigError(f"actor {self.actor_name!r} has no port {port!r}") from None
        addresses = self._ports.get(port, PortAddresses())
        # max_message_bytes: a bound the actor derives from its job (a group's size).
        max_message_bytes = overrides.pop("max_message_bytes", spec.max_message_bytes)
        options = overrides.pop(
            "options",
            SocketOptions(hwm=spec.hwm, max_message_bytes=max_message_bytes, count_disconnects=spec.bind),
        )
        if self._curve is not None and "curve" not in overrides:
            overrides["curve"] = self._curve.for_port(addresses)
        endpoint = self.transport.open(
            spec.socket,
            name=f"{self.actor_name}.{port}",
            bind=addresses.bind,
            connect=addresses.connect,
            options=options,
            on_full=overrides.pop("on_full", spec.on_full),
            **overrides,
        )
        self._endpoints.append(endpoint)
        if self._recording is not None and self.run_dir is not None and self._recording.records(self.actor_name, port):
            endpoint.record_to(
                RunDir(self.run_dir).recording_path(self.actor_name, port),
                actor=self.actor_name,
                port=port,
                socket=spec.socket,
                max_bytes=self._recording.max_bytes,
            )
        return endpoint

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    def close_endpoints(self, linger_ms: int = 0) -> None:
        for endpoint in self._endpoints:
            endpoint.close(linger_ms)

    async def publish_telemetry(self, topic: bytes, message: Message) -> None:
        """Best effort: telemetry is lossy by design and never on the data path."""
        if self._telemetry is not None:
            await self._telemetry.publish(topic, message)

    def record(self, kind: str, **values: Any) -> None:
        """Append one JSON line to ``run_dir/metrics/<actor>.jsonl`` (no-op without a run dir)."""
        if self._metrics is not None:
            self._metrics.write({"time_s": round(time.time() - self.started_at, 4), "kind": kind, **values})
        if self._on_record is not None:  # after the line is written: a scrape never runs ahead of the file
            self._on_record(self.actor_name, kind, values)

    def ledger(self, event: LedgerEvent) -> None:
        """Append one accounting event to ``run_dir/ledger/<actor>.jsonl``.

        ``event`` is one of ``echo2.ledger``'s records (the vocabulary the audit reads):
        every task leased, every group accepted, rejected, trained or dropped. Line-buffered,
        so a process killed with SIGKILL loses at most the line being written.
        """
        record = event_record(event, time.time())  # checks the event even without a run dir
        if self._ledger is not None:
            self._ledger.write(record)

    def close(self, linger_ms: int = 0) -> None:
        self.close_endpoints(linger_ms)
        for writer in (self._ledger, self._metrics):
            if writer is not None:
                writer.close()


def default_cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


async def run_until_stopped(stopping: asyncio.Event, *loops: Coroutine[Any, Any, None]) -> None:
    """Run an actor's concurrent loops until ``stopping`` is set, then cancel them.

    Returns as well once every loop has returned by itself: an actor that ends its own
    work (a watcher that has seen enough) returns from ``run()`` through this helper and
    the runtime counts it as finished, not failed. A loop that returns while others still
    run just ends; the others carry on. One loop raising cancels the others and the error
    propagates (the actor fails).
    """
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(loop) for loop in loops]
        stop = group.create_task(stopping.wait())
        running: set[asyncio.Future[Any]] = set(tasks)
        while running and not stop.done():
            _, pending = await asyncio.wait({*running, stop}, return_when=asyncio.FIRST_COMPLETED)
            running = pending - {stop}
        for task in (*tasks, stop):
            task.cancel()


STATS_RECORD_KIND = "stats"
"""``kind`` of the metrics lines ``record_statistics`` writes."""


async def record_statistics(actor: Actor, every_s: float) -> None:
    """Write ``actor.statistics()`` to its metrics file (``kind = "stats"``: the record's
    ``type`` and fields) every ``every_s`` seconds, and once more when cancelled, as the
    actor stops: counters that only heartbeats carried stay in the run directory. A loop
    for ``run_until_stopped``."""
    try:
        while True:
            await asyncio.sleep(every_s)  # a timer: the records are periodic
            _record_statistics(actor)
    finally:
        _record_statistics(actor)


def _record_statistics(actor: Actor) -> None:
    stats = actor.statistics()
    if isinstance(stats, Statistics):
        actor.ctx.record(STATS_RECORD_KIND, **msgspec.to_builtins(stats))


T = TypeVar("T")


async def until_stopping(stopping: asyncio.Event, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
    """Await ``awaitable`` unless ``stopping`` is set first.

    Returns ``(True, result)`` when it completed, ``(False, None)`` when the run is stopping
    (the awaitable is then cancelled; a cancelled pyzmq receive loses no message).
    """
    if stopping.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        return False, None
    work = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Both tasks end here, on every path (also when we are cancelled ourselves).
        for task in (work, stop):
            task.cancel()
        await asyncio.wait((work, stop))
    if work.cancelled():
        return False, None
    return True, work.result()
