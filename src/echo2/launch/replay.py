"""Replay a recorded port into one actor, offline, and compare what it records.

    python -m echo2.replay RUN_DIR ACTOR [--port PORT] [--steps N] [--out DIR]

Builds ``ACTOR`` as the run's process did (its config and the job from
``RUN_DIR/topology.resolved.json``, its process's torch thread count; the seeds are the
job's), alone in this process, and runs it with every port on an inproc socket of its own:

* the replayed port (``RUN_DIR/recordings/ACTOR.PORT.rec``, ``[run] record``) gets the
  recorded frames, unchanged, in order. What the actor received is released once the actor
  has sent as many messages on that port as it had when the message arrived in the run, so
  on a request/reply port (the learner's ``batch``) each request is answered by the reply
  recorded for it, and a stream (``pull``, ``sub``) is fed at once;
* every other port is a sink: what the actor sends is received and counted, nothing is sent
  to it.

It stops when the actor returns by itself (the learner at ``max_steps``) or, once the
recorded messages (or the first ``--steps`` of them) are delivered, when the actor asks for
more on a request/reply port, or after ``--idle-s`` without output on a stream port. Its
metrics, ledger and summary go to ``--out`` (default ``RUN_DIR/replays/ACTOR.PORT-<time>``),
and each metrics record is compared with the run's, field by field, timings (``*_s``) left
out. Exit 0: every compared record is equal; 1: a difference (printed); 2: bad arguments.
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
from echo2.transport import Endpoint, SocketOptions, Transport
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
    port: str
    delivered: int
    """Recorded messages handed to the actor."""
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


def recorded_port(run: RunDir, actor: str, port: str | None) -> str:
    """``port``, or the one port of ``actor`` that has a recording; ``ConfigError`` if none."""
    if port is not None:
        return port
    found = sorted(p.name.removeprefix(f"{actor}.").removesuffix(RECORDING_SUFFIX) for p in _recordings_of(run, actor))
    if len(found) != 1:
        listed = ", ".join(found) or "none"
        raise ConfigError(f"--port: {actor!r} has {len(found)} recordings in {run.recordings_dir} ({listed}); name one")
    return found[0]


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


async def replay(
    run_dir: Path,
    actor_name: str,
    *,
    port: str | None = None,
    steps: int = 0,
    out_dir: Path | None = None,
    idle_s: float = 2.0,
) -> ReplayResult:
    """Replay ``run_dir``'s recording of ``actor_name.port`` into a fresh actor (see the module)."""
    run = RunDir(run_dir)
    if not run.is_run_dir():
        raise ConfigError(f"RUN_DIR: {run.root} has no {run.topology_path.name}")
    resolved = ResolvedTopology.load(run.topology_path)
    actor, threads = build_actor(resolved, actor_name)
    port = recorded_port(run, actor_name, port)
    if port not in actor.ports:
        raise ConfigError(
            f"--port: actor {actor_name!r} has no port {port!r} (ports: {', '.join(sorted(actor.ports))})"
        )
    path = run.recording_path(actor_name, port)
    if not path.is_file():
        raise ConfigError(f'--port: no recording {path} (record it with run.record = ["{actor_name}.{port}"])')
    recording = Recording.read(path)
    if recording.header.protocol_version != PROTOCOL_VERSION:
        raise DecodeError(
            f"{path}: recorded in protocol {recording.header.protocol_version}, this is {PROTOCOL_VERSION}"
        )
    if recording.cut_tail:
        log.warning("%s: the last record was cut mid-write and is left out", path)
    recorded, sent_total = deliveries(recording.messages)
    todo = recorded[:steps] if steps else recorded
    # On a request/reply port the actor asking for what comes next (the first message not
    # delivered, or past the recording's end) is the end of the replay.
    asks_for_more = recorded[len(todo)].sent_before if len(todo) < len(recorded) else sent_total
    out = out_dir or run.replays_dir / f"{actor_name}.{port}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=False)
    set_torch_threads(threads)

    kind = actor.ports[port].socket
    addresses = {name: _addresses(actor_name, name, spec.bind) for name, spec in actor.ports.items()}
    async with contextlib.AsyncExitStack() as stack:
        transport = Transport()
        stack.callback(transport.close)
        peers = {
            name: _open_peer(transport, actor_name, name, _PEER_KIND[spec.socket], addresses[name])
            for name, spec in actor.ports.items()
        }
        feeder = Feeder(peers[port], kind, todo, asks_for_more)
        runtime = ProcessRuntime(
            [actor],
            {actor_name: addresses},
            process="replay",
            run_dir=out,
            transport=transport,
            drain_timeout_s=_DRAIN_TIMEOUT_S,
        )
        async with asyncio.TaskGroup() as group:
            runner = group.create_task(runtime.run(), name="replay:runtime")
            await runtime.wait_ready()
            sinks = [group.create_task(feeder.drain(peer), name=f"replay:sink:{n}") for n, peer in peers.items()]
            feeding = group.create_task(feeder.feed(), name="replay:feed")
            ended = group.create_task(feeder.wait_end(idle_s if kind in _STREAM_KINDS else None))
            await asyncio.wait((runner, ended), return_when=asyncio.FIRST_COMPLETED)
            if not runner.done():
                runtime.request_stop("replay: the recording is delivered")
                await runner
            for task in (*sinks, feeding, ended):
                task.cancel()
    compared, differences = compare_metrics(run.metrics(actor_name), RunDir(out).metrics(actor_name))
    return ReplayResult(actor_name, port, feeder.delivered, out, compared, differences)


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


class Feeder:
    """Hands the recorded messages to the actor in their turn; counts what it sends."""

    def __init__(self, peer: Endpoint, actor_kind: SocketKind, todo: list[Delivery], asks_for_more: int) -> None:
        self.peer = peer
        self.delivered = 0
        self.sent_by_actor = 0
        self._kind = actor_kind
        self._todo = todo
        self._asks_for_more = asks_for_more
        self._progress = asyncio.Event()  # the actor sent something (on any port)
        self._routing_id = b""  # the actor's DEALER, seen with its first request

    async def feed(self) -> None:
        if self._kind == "sub":
            assert hasattr(self.peer, "wait_subscriber")
            await self.peer.wait_subscriber()  # the slow-joiner handshake, never a sleep
        for delivery in self._todo:
            while self.sent_by_actor < delivery.sent_before:
                await self._wait_progress()
            frames = delivery.frames
            if self._kind == "dealer":
                frames = [self._routing_id, *frames]  # the replay's ROUTER answers the actor
            elif self._kind == "router":
                frames = frames[1:]  # the peer's routing id: the replay is the one peer
            await self.peer.send_encoded(frames)
            self.delivered += 1

    async def drain(self, peer: Endpoint) -> None:
        """Receive what the actor sends on one port (the replayed port's count paces ``feed``)."""
        if not hasattr(peer, "recv_many"):
            return  # the replay only sends on this one
        while True:
            try:
                received = await peer.recv_many()
            except EndOfStream:
                return
            if peer is self.peer:
                if self._kind == "dealer" and received:
                    self._routing_id = received[-1][0]
                self.sent_by_actor += len(received)
            self._progress.set()

    async def wait_end(self, idle_s: float | None) -> None:
        """Return once everything is delivered and the actor asked for more (request/reply)
        or, on a stream port (``idle_s``), fell quiet for ``idle_s``."""
        while self.delivered < len(self._todo) or self.sent_by_actor < self._asks_for_more:
            await self._wait_progress()
        if idle_s is None:
            return
        while True:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), idle_s)
            except TimeoutError:
                return

    async def _wait_progress(self) -> None:
        self._progress.clear()
        await self._progress.wait()


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
    parser.add_argument("--port", help="the recorded port (default: the actor's one recording)")
    parser.add_argument("--steps", type=int, default=0, help="deliver only the first N recorded messages")
    parser.add_argument("--out", type=Path, help="output directory (default RUN_DIR/replays/ACTOR.PORT-<time>)")
    parser.add_argument("--idle-s", type=float, default=2.0, help="stream ports: stop after this quiet spell")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level="INFO", format="%(asctime)s replay %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        result = asyncio.run(
            replay(args.run_dir, args.actor, port=args.port, steps=args.steps, out_dir=args.out, idle_s=args.idle_s)
        )
    except (ConfigError, DecodeError, FileExistsError) as exc:
        print(f"echo2.replay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report(result), indent=2))
    return 0 if result.matches else 1


def report(result: ReplayResult) -> dict[str, Any]:
    """What a replay prints: where its output is, and how it compares with the run."""
    return {
        "actor": result.actor,
        "port": result.port,
        "delivered": result.delivered,
        "out_dir": str(result.out_dir),
        "records_compared": result.compared,
        "matches": result.matches,
        "differences": [dataclasses.asdict(d) for d in result.differences[:50]],
    }


__all__ = ["ReplayResult", "compare_metrics", "deliveries", "main", "replay"]
