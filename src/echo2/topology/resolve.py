"""Resolution: a validated topology fixed for one run, as the JSON every process reads.

``resolve(topology, run_id, run_dir)`` fixes addresses (``echo2.topology.addresses``), torch
threads and configs into a ``ResolvedTopology``, which the launcher writes to the run
directory as ``topology.resolved.json``; ``build_process(resolved, name)`` turns one process
of it into live actor objects and the ``PortAddresses`` their ``ctx.open`` uses.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from echo2.actor import Actor, PortAddresses, default_cpu_count
from echo2.actors import load_actor_class
from echo2.errors import ConfigError
from echo2.job import JobConfig
from echo2.topology.addresses import Addresses, topology_addresses
from echo2.topology.schema import (
    JOINED_SAMPLER,
    HostSpec,
    RestartPolicy,
    RunSpec,
    SecuritySpec,
    Topology,
    join_host,
)
from echo2.transport.recording import RecordingSettings

log = logging.getLogger("echo2.topology")


def torch_threads(topology: Topology) -> dict[str, int]:
    """Torch threads per process: explicit values, or a share of the host's cores.

    A process with ``torch_threads = 0`` gets ``max(1, floor(cores * w / W))`` where ``w``
    is the sum of its actors' ``torch_weight`` and ``W`` the sum over the host's automatic
    processes; ``w == 0`` gives 0 (the runtime leaves torch alone). Under torchrun the value
    is per rank: an automatic share is divided among the ``nproc_per_node`` ranks.
    """
    weights = {name: sum(a.cls.torch_weight(a.config) for a in topology.actors_in(name)) for name in topology.processes}
    threads: dict[str, int] = {}
    for host_name, host in topology.hosts.items():
        members = [p for p, spec in topology.processes.items() if spec.host == host_name]
        if not members:
            continue
        cores = host.cores or default_cpu_count()
        automatic = [p for p in members if topology.processes[p].torch_threads == 0]
        total = sum(weights[p] for p in automatic)
        for p in members:
            explicit = topology.processes[p].torch_threads
            if explicit:
                threads[p] = explicit
            elif weights[p] <= 0:
                threads[p] = 0
            else:
                threads[p] = max(1, int(cores * weights[p] / total / topology.processes[p].nproc_per_node))
        used = sum(threads[p] * topology.processes[p].nproc_per_node for p in members)
        if used > cores:
            log.warning(
                "host %s: processes use %d torch threads on %d cores (%s)",
                host_name,
                used,
                cores,
                ", ".join(f"{p}={threads[p]}" for p in members if threads[p]),
            )
    return threads


class ResolvedActor(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One actor of a process: what its child process builds it from."""

    name: str
    """Actor name (``NAME-i`` for replica ``i``)."""
    kind: str
    """``kind`` as written in the topology (a registry name or an import path)."""
    config: dict[str, Any]
    """The raw table from the topology (validated at resolution, parsed again per process)."""
    ports: dict[str, PortAddresses] = {}
    """Port name -> the addresses ``ctx.open(port)`` uses."""
    spec: str = ""
    """The ``[actors.*]`` table this actor came from (for error paths)."""


class ResolvedProcess(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One OS process of the run: where it runs, its actors and how it is supervised."""

    host: str
    """The ``[hosts.NAME]`` it runs on (its host's launcher starts it)."""
    torch_threads: int
    """Torch intra-op threads (0: torch is left alone)."""
    actors: list[ResolvedActor]
    telemetry_connect: list[str] = []
    """URLs of the telemetry binders this process's heartbeats go to."""
    telemetry_curve_servers: list[str] = []
    """Per telemetry URL: the host whose CURVE server key to pin ("" = plain)."""
    restart: RestartPolicy = "never"
    """``ProcessSpec.restart``."""
    max_restarts: int = 0
    """``ProcessSpec.max_restarts``."""
    restart_backoff_s: float = 1.0
    """``ProcessSpec.restart_backoff_s``: seconds before the first restart."""
    metrics_port: int = 0
    """Port of this process's ``/metrics`` and ``/health`` (0: off; ``HostSpec.metrics_port``)."""
    torchrun: bool = False
    """Started under torchrun (it holds a distributed actor; ``echo2.launch.torchrun``)."""
    nproc_per_node: int = 1
    """``ProcessSpec.nproc_per_node``: ranks per node under torchrun."""
    nnodes: int = 1
    """``ProcessSpec.nnodes``."""
    node_hosts: list[str] = []
    """``ProcessSpec.node_hosts``: the host of each node rank (empty: one node, ``host``)."""
    rdzv_endpoint: str = ""
    """``ProcessSpec.rdzv_endpoint`` (empty: a free local port, one node)."""
    gpus: list[int] = []
    """``ProcessSpec.gpus``: indices among the GPUs its host's launcher sees."""


class ResolvedTopology(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything the processes of one run need; written as ``topology.resolved.json``."""

    run: RunSpec
    job: JobConfig
    run_id: str
    """The run directory's name, ``<run.name>-<YYYYmmdd-HHMMSS>``."""
    run_dir: str
    """Absolute path of the run directory."""
    hosts: dict[str, HostSpec]
    processes: dict[str, ResolvedProcess]
    ipc_dir: str = ""
    """Directory of this run's ipc sockets (the launcher removes it at the end)."""
    resume: bool = False
    """Actors restore their state from the run directory's checkpoints (``--resume``)."""
    security: SecuritySpec = msgspec.field(default_factory=SecuritySpec)
    tcp_ports: dict[str, int] = {}
    """``"actor.port"`` -> tcp port, for endpoints reached from other hosts."""
    joined: ResolvedProcess | None = None
    """With a ``join_port``: what a sampler joining with ``python -m echo2.join`` gets (its
    ``host`` is the host that answers joins; its one actor, ``JOINED_SAMPLER``, carries the
    first declared sampler's config and the stand-in's addresses)."""

    @classmethod
    def load(cls, path: str | Path) -> ResolvedTopology:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

    def dump(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")

    @property
    def recording(self) -> RecordingSettings:
        """The ports this run records (``[run] record``) and the cap of each file."""
        return RecordingSettings(channels=frozenset(self.run.record), max_bytes=int(self.run.record_max_mb * 1e6))

    def actors_of(self, process: str) -> list[str]:
        return [a.name for a in self.processes[process].actors]


def resolve(topology: Topology, run_id: str, run_dir: str) -> ResolvedTopology:
    """Fix addresses, threads and configs of a validated topology for one run."""
    addresses = topology_addresses(topology, run_id, run_dir)
    threads = torch_threads(topology)
    processes: dict[str, ResolvedProcess] = {}
    for proc_name, spec in topology.processes.items():
        members = []
        for actor in topology.actors_in(proc_name):
            members.append(
                ResolvedActor(
                    name=actor.name,
                    kind=actor.kind,
                    config=dict(actor.raw_config),
                    ports=addresses.ports[actor.name],
                    spec=actor.spec,
                )
            )
        processes[proc_name] = ResolvedProcess(
            host=spec.host,
            torch_threads=threads[proc_name],
            actors=members,
            telemetry_connect=list(addresses.telemetry.get(proc_name, ())),
            telemetry_curve_servers=[addresses.curve_hosts.get(u, "") for u in addresses.telemetry.get(proc_name, ())],
            restart=spec.restart,
            max_restarts=spec.max_restarts,
            restart_backoff_s=spec.restart_backoff_s,
            metrics_port=addresses.metrics_ports.get(proc_name, 0),
            torchrun=any(a.cls.torchrun for a in topology.actors_in(proc_name)),
            nproc_per_node=spec.nproc_per_node,
            nnodes=spec.nnodes,
            node_hosts=list(spec.node_hosts),
            rdzv_endpoint=spec.rdzv_endpoint,
            gpus=list(spec.gpus),
        )
    return ResolvedTopology(
        run=topology.run,
        job=topology.job,
        run_id=run_id,
        run_dir=str(run_dir),
        hosts=dict(topology.hosts),
        processes=processes,
        ipc_dir=addresses.ipc_dir,
        security=topology.security,
        tcp_ports={f"{actor}.{port}": n for (actor, port), n in sorted(addresses.tcp_ports.items())},
        joined=_joined(topology, addresses),
    )


def _joined(topology: Topology, addresses: Addresses) -> ResolvedProcess | None:
    """What joined samplers get: the stand-in's addresses, and the portable part of the first
    declared sampler's config (by name; none declared: the defaults)."""
    serving = join_host(topology)
    if serving is None:
        return None
    sampler = load_actor_class("sampler")
    declared = sorted((a for a in topology.actors.values() if issubclass(a.cls, sampler)), key=lambda a: a.name)
    template = dict(declared[0].raw_config) if declared else {}
    local_fields: frozenset[str] = getattr(declared[0].cls if declared else sampler, "host_local_fields", frozenset())
    config = {key: value for key, value in template.items() if key not in local_fields}
    telemetry = addresses.telemetry.get(JOINED_SAMPLER, ())
    return ResolvedProcess(
        host=serving,
        torch_threads=0,
        actors=[
            ResolvedActor(name=JOINED_SAMPLER, kind="sampler", config=config, ports=addresses.ports[JOINED_SAMPLER])
        ],
        telemetry_connect=list(telemetry),
        telemetry_curve_servers=[addresses.curve_hosts.get(url, "") for url in telemetry],
    )


def build_process(
    resolved: ResolvedTopology, process_name: str
) -> tuple[list[Actor], dict[str, dict[str, PortAddresses]], list[str]]:
    """Instantiate one process's actors: ``(actors, addresses, telemetry_connect)``."""
    try:
        spec = resolved.processes[process_name]
    except KeyError:
        known = ", ".join(sorted(resolved.processes))
        raise ConfigError(f"unknown process {process_name!r} (known: {known})") from None
    actors: list[Actor] = []
    addresses: dict[str, dict[str, PortAddresses]] = {}
    for entry in spec.actors:
        where = f"actors.{entry.spec or entry.name}"
        try:
            cls = load_actor_class(entry.kind)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"{where}.kind") from exc
        config = cls.parse_config(entry.config, f"{where}.config")
        actors.append(cls(entry.name, config, resolved.job))
        addresses[entry.name] = entry.ports
    return actors, addresses, list(spec.telemetry_connect)


__all__ = ["ResolvedActor", "ResolvedProcess", "ResolvedTopology", "build_process", "resolve", "torch_threads"]
