"""Replay a recorded port into one actor, offline, and compare what it records.

    python -m echo2.replay RUN_DIR ACTOR [--port PORT ...] [--steps N] [--out DIR]

Builds ``ACTOR`` as the run's process did (its config and the job from
``RUN_DIR/topology.resolved.json``, its process's torch thread count; the seeds are the
job's), alone in this process, and runs it with every port on an inproc socket of its own:

* each replayed port (``RUN_DIR/recordings/ACTOR.PORT.rec``, ``[run] record``; default:
  every port of the actor that has a recording) gets the recorded frames, unchanged, in
  order. What the actor received is released once the actor has sent as many messages on
  that port as it had when the message arrived in the run, so on a request/reply port (the
  learner's ``batch``) each request is answered by the reply recorded for it, and a stream
  (``pull``, ``sub``) is fed at once;
* every other port is a sink: what the actor sends there is received and dropped, nothing
  is sent to it.

Several ports replay together, each paced by its own: a Buffer needs its ``scored`` stream
to answer the ``batch`` requests. It stops when the actor returns by itself (the learner at
``max_steps``) or, once the recorded messages (or the first ``--steps`` of each port) are
delivered, when the actor asks for more on a request/reply port, then, with a stream port,
after ``--idle-s`` without output. Its metrics, ledger and summary go to ``--out`` (default
``RUN_DIR/replays/ACTOR.PORTS-<time>``), and each metrics record is compared with the
run's, field by field, timings (``*_s``) left out. Exit 0: every compared record is equal;
1: a difference (printed); 2: bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from echo2.actor import Actor, PortAddresses
from echo2.actors import load_actor_class
from echo2.errors import ConfigError, DecodeError, EndOfStream
from echo2.launch.child import set_torch_threads
from echo2.messages import PROTOCOL_VERSION
from echo2.rundir import RECORDING_SUFFIX, RunDir
from echo2.runtime import ProcessRuntime
from echo2.topology import ResolvedTopology
from echo2.transport import Endpoint, PublisherEndpoint, SocketOptions, Transport
from echo2.transport.endpoint import SocketKind
from echo2.transport.recording import RecordedMessage, Recording

log = logging.getLogger("echo2.replay")

_PEER_KIND: dict[SocketKind, SocketKind] = {
    "push": "pull",
    "pull": "push",
    "dealer": "router",
    "router": "dealer",
    "pub": "sub",
    "sub": "pub",
}
"""The socket the replay puts at the other end of an actor's port."""
_STREAM_KINDS = frozenset({"pull", "sub"})
"""Ports where the actor never answers on the same port: the end is a quiet spell."""
_DRAIN_TIMEOUT_S = 600.0  # a replayed step may be slow; the actor drains once it is done


@dataclasses.dataclass(frozen=True)
class Delivery:
    """A recorded message for the actor, and how many messages the actor had sent on the
    port when it arrived in the run (its turn comes once it has sent as many again)."""

    frames: list[bytes]
    sent_before: int


@dataclasses.dataclass(frozen=True)
class FieldDifference:
    kind: str
    index: int
    field: str
    recorded: Any
    replayed: Any


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    actor: str
    ports: list[str]
    """The replayed ports."""
    delivered: dict[str, int]
    """Per replayed port: recorded messages handed to the actor."""
    sent_by_actor: dict[str, int]
    """Per replayed port: messages the actor sent on it in the replay."""
    out_dir: Path
    compared: int
    """Metrics records compared with the run's (the shorter of the two, per kind)."""
    differences: list[FieldDifference]

    @property
    def matches(self) -> bool:
        return not self.differences


def deliveries(messages: Sequence[RecordedMessage]) -> tuple[list[Delivery], int]:
    """What the actor received, each with the sends that preceded it; and all sends."""
    out: list[Delivery] = []
    sent = 0
    for message in messages:
        if message.direction == "sent":
            sent += 1
        else:
            out.append(Delivery(message.frames, sent))
    return out, sent


def recorded_ports(run: RunDir, actor: str, ports: Sequence[str]) -> list[str]:
    """``ports``, or every port of ``actor`` that has a recording; ``ConfigError`` if none."""
    if ports:
        return list(ports)
    found = sorted(p.name.removeprefix(f"{actor}.").removesuffix(RECORDING_SUFFIX) for p in _recordings_of(run, actor))
    if not found:
        raise ConfigError(f"ACTOR: {actor!r} has no recording in {run.recordings_dir} (record one with [run] record)")
    return found


def _recordings_of(run: RunDir, actor: str) -> list[Path]:
    if not run.recordings_dir.is_dir():
        return []
    return list(run.recordings_dir.glob(f"{actor}.*{RECORDING_SUFFIX}"))


def build_actor(resolved: ResolvedTopology, name: str) -> tuple[Actor, int]:
    """The actor as its process built it, and that process's torch thread count."""
    for process in resolved.processes.values():
        for entry in process.actors:
            if entry.name == name:
                where = f"actors.{entry.spec or entry.name}"
                cls = load_actor_class(entry.kind)
                config = cls.parse_config(entry.config, f"{where}.config")
                return cls(entry.name, config, resolved.job), process.torch_threads
    known = ", ".join(sorted(a.name for p in resolved.processes.values() for a in p.actors))
    raise ConfigError(f"ACTOR: no actor {name!r} in this run (actors: {known})")


def read_port_recording(run: RunDir, actor: Actor, port: str) -> Recording:
    """The recording of ``actor.port`` (its first incarnation's); ``ConfigError`` if none."""
    if port not in actor.ports:
        raise ConfigError(
            f"--port: actor {actor.name!r} has no port {port!r} (ports: {', '.join(sorted(actor.ports))})"
        )
    path = run.recording_path(actor.name, port)
    if not path.is_file():
        raise ConfigError(f'--port: no recording {path} (record it with run.record = ["{actor.name}.{port}"])')
    recording = Recording.read(path)
    if recording.header.protocol_version != PROTOCOL_VERSION:
        raise DecodeError(
            f"{path}: recorded in protocol {recording.header.protocol_version}, this is {PROTOCOL_VERSION}"
        )
    if recording.cut_tail:
        log.warning("%s: the last record was cut mid-write and is left out", path)
    return recording


async def replay(
    run_dir: Path,
    actor_name: str,
    *,
    ports: Sequence[str] = (),
    steps: int = 0,
    out_dir: Path | None = None,
    idle_s: float = 2.0,
) -> ReplayResult:
    """Replay ``run_dir``'s recordings of ``actor_name``'s ``ports`` (default: every one it
    has) into a fresh actor; ``steps``: only the first that many messages of each."""
    run = RunDir(run_dir)
    if not run.is_run_dir():
        raise ConfigError(f"RUN_DIR: {run.root} has no {run.topology_path.name}")
    resolved = ResolvedTopology.load(run.topology_path)
    actor, threads = build_actor(resolved, actor_name)
    replayed = recorded_ports(run, actor_name, ports)
    recordings = {port: read_port_recording(run, actor, port) for port in replayed}
    out = out_dir or run.replays_dir / f"{actor_name}.{'+'.join(replayed)}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=False)
    set_torch_threads(threads)

    activity = Activity()
    addresses = {name: _addresses(actor_name, name, spec.bind) for name, spec in actor.ports.items()}
    async with contextlib.AsyncExitStack() as stack:
        transport = Transport()
        stack.callback(transport.close)
        peers = {
            name: _open_peer(transport, actor_name, name, _PEER_KIND[spec.socket], addresses[name])
            for name, spec in actor.ports.items()
        }
        feeders = {
            port: Feeder(peers[port], actor.ports[port].socket, recording.messages, steps, activity)
            for port, recording in recordings.items()
        }
        runtime = ProcessRuntime(
            [actor],
            {actor_name: addresses},
            process="replay",
            run_dir=out,
            transport=transport,
            drain_timeout_s=_DRAIN_TIMEOUT_S,
        )
        streams = any(actor.ports[port].socket in _STREAM_KINDS for port in feeders)
        async with asyncio.TaskGroup() as group:
            runner = group.create_task(runtime.run(), name="replay:runtime")
            await runtime.wait_ready()
            helpers = [
                group.create_task(feeders[n].drain() if n in feeders else sink(peer, activity), name=f"replay:{n}")
                for n, peer in peers.items()
            ]
            helpers += [group.create_task(f.feed(), name=f"replay:feed:{n}") for n, f in feeders.items()]
            ended = group.create_task(wait_end(list(feeders.values()), activity, idle_s if streams else None))
            await asyncio.wait((runner, ended), return_when=asyncio.FIRST_COMPLETED)
            if not runner.done():
                runtime.request_stop("replay: the recording is delivered")
                await runner
            for task in (*helpers, ended):
                task.cancel()
    compared, differences = compare_metrics(run.metrics(actor_name), RunDir(out).metrics(actor_name))
    return ReplayResult(
        actor=actor_name,
        ports=replayed,
        delivered={port: f.delivered for port, f in feeders.items()},
        sent_by_actor={port: f.sent_by_actor for port, f in feeders.items()},
        out_dir=out,
        compared=compared,
        differences=differences,
    )


def _addresses(actor: str, port: str, actor_binds: bool) -> PortAddresses:
    url = f"inproc://replay-{actor}-{port}"
    return PortAddresses(bind=(url,)) if actor_binds else PortAddresses(connect=(url,))


def _open_peer(transport: Transport, actor: str, port: str, kind: SocketKind, actor_side: PortAddresses) -> Endpoint:
    """The replay's end of one port: it connects where the actor binds, binds otherwise."""
    url = (actor_side.bind or actor_side.connect)[0]
    return transport.open(
        kind,
        name=f"replay.{actor}.{port}",
        bind=() if actor_side.bind else (url,),
        connect=actor_side.bind,
        options=SocketOptions(coalesce=1),
        subscribe=(b"",) if kind == "sub" else (),
    )


class Activity:
    """Set whenever the actor sends something, on any port: what the feeders wait on."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def note(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Until the actor's next send (or the one that happened since the last wait)."""
        self._event.clear()
        await self._event.wait()


class Feeder:
    """One replayed port: hands the recorded messages to the actor in their turn, counts
    what the actor sends on the port."""

    def __init__(
        self,
        peer: Endpoint,
        actor_kind: SocketKind,
        messages: Sequence[RecordedMessage],
        steps: int,
        activity: Activity,
    ) -> None:
        recorded, sent_total = deliveries(messages)
        self.todo = recorded[:steps] if steps else recorded
        self.asks_for_more = recorded[len(self.todo)].sent_before if len(self.todo) < len(recorded) else sent_total
        """On a request/reply port, the actor's send that asks for what is not delivered
        (the first message left out, or past the recording's end): the end of the replay."""
        self.peer = peer
        self.delivered = 0
        self.sent_by_actor = 0
        self._kind = actor_kind
        self._activity = activity
        self._routing_id = b""  # the actor's DEALER, seen with its first request

    @property
    def done(self) -> bool:
        return self.delivered == len(self.todo) and self.sent_by_actor >= self.asks_for_more

    async def feed(self) -> None:
        if self._kind == "sub":
            assert isinstance(self.peer, PublisherEndpoint)
            await self.peer.wait_subscriber()  # the slow-joiner handshake, never a sleep
        for delivery in self.todo:
            while self.sent_by_actor < delivery.sent_before:
                await self._activity.wait()
            frames = delivery.frames
            if self._kind == "dealer":
                frames = [self._routing_id, *frames]  # the replay's ROUTER answers the actor
            elif self._kind == "router":
                frames = frames[1:]  # the peer's routing id: the replay is the one peer
            await self.peer.send_encoded(frames)
            self.delivered += 1
            self._activity.note()

    async def drain(self) -> None:
        """Receive what the actor sends on this port; the count paces ``feed``."""
        if not hasattr(self.peer, "recv_many"):
            return  # the actor only receives on this port
        while True:
            try:
                received = await self.peer.recv_many()
            except EndOfStream:
                return
            if self._kind == "dealer" and received:
                self._routing_id = received[-1][0]
            self.sent_by_actor += len(received)
            self._activity.note()


async def sink(peer: Endpoint, activity: Activity) -> None:
    """A port not replayed: what the actor sends there is received and dropped."""
    if not hasattr(peer, "recv_many"):
        return  # the actor receives on it: nothing is sent to it
    while True:
        try:
            await peer.recv_many()
        except EndOfStream:
            return
        activity.note()


async def wait_end(feeders: Sequence[Feeder], activity: Activity, idle_s: float | None) -> None:
    """Return once every feeder is done and, with a stream port among them (``idle_s``),
    the actor has then been quiet for ``idle_s``."""
    while not all(f.done for f in feeders):
        await activity.wait()
    if idle_s is None:
        return
    while True:
        try:
            await asyncio.wait_for(activity.wait(), idle_s)
        except TimeoutError:
            return


def compare_metrics(
    recorded: Sequence[Mapping[str, Any]], replayed: Sequence[Mapping[str, Any]]
) -> tuple[int, list[FieldDifference]]:
    """Compare metrics records of each kind in order, field by field with ``==`` (floats
    as written); timings (``*_s``) are left out. Returns (records compared, differences)."""
    by_kind_recorded = _by_kind(recorded)
    by_kind_replayed = _by_kind(replayed)
    compared = 0
    differences: list[FieldDifference] = []
    for kind, replay_records in by_kind_replayed.items():
        for index, (before, after) in enumerate(zip(by_kind_recorded.get(kind, []), replay_records, strict=False)):
            compared += 1
            for field in sorted(set(before) | set(after)):
                if _is_timing(field):
                    continue
                if before.get(field) != after.get(field):
                    differences.append(FieldDifference(kind, index, field, before.get(field), after.get(field)))
    return compared, differences


def _by_kind(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        out.setdefault(str(record.get("kind")), []).append(record)
    return out


def _is_timing(field: str) -> bool:
    return field.endswith("_s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m echo2.replay",
        description="Replay a recorded port into one actor and compare its metrics with the run's.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("actor", metavar="ACTOR")
    parser.add_argument(
        "--port", action="append", default=[], help="a recorded port to replay (repeatable; default: every one)"
    )
    parser.add_argument("--steps", type=int, default=0, help="deliver only the first N recorded messages of each port")
    parser.add_argument("--out", type=Path, help="output directory (default RUN_DIR/replays/ACTOR.PORT-<time>)")
    parser.add_argument("--idle-s", type=float, default=2.0, help="stream ports: stop after this quiet spell")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level="INFO", format="%(asctime)s replay %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        result = asyncio.run(
            replay(args.run_dir, args.actor, ports=args.port, steps=args.steps, out_dir=args.out, idle_s=args.idle_s)
        )
    except (ConfigError, DecodeError, FileExistsError) as exc:
        print(f"echo2.replay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # an actor that waits for input no replayed port gives
        print("echo2.replay: interrupted (is a port the actor needs left out of the replay?)", file=sys.stderr)
        return 130
    print(json.dumps(report(result), indent=2))
    return 0 if result.matches else 1


def report(result: ReplayResult) -> dict[str, Any]:
    """What a replay prints: where its output is, and how it compares with the run."""
    return {
        "actor": result.actor,
        "ports": result.ports,
        "delivered": result.delivered,
        "sent_by_actor": result.sent_by_actor,
        "out_dir": str(result.out_dir),
        "records_compared": result.compared,
        "matches": result.matches,
        "differences": [dataclasses.asdict(d) for d in result.differences[:50]],
    }


__all__ = ["ReplayResult", "compare_metrics", "deliveries", "main", "replay"]
