"""The topology's schema: the TOML tables as typed Structs, and their validation.

A topology says where actors run; actor code never does. The file has six tables::

    [run]             name, run_dir, drain_timeout_s, heartbeat_s, deadline_s, record, record_max_mb,
                      metric_writers, wandb_project, wandb_mode
    [job]             settings several actors share (echo2.job.JobConfig)
    [hosts.NAME]      address, port_base, metrics_port, join_port, cores
    [processes.NAME]  host, torch_threads, restart, max_restarts, restart_backoff_s,
                      gpus, nproc_per_node, nnodes, node_hosts, rdzv_endpoint
    [actors.NAME]     kind, process, replicas, config = {...}
    [security]        curve, keys_dir, allowed

``load_topology(path, overrides)`` reads TOML, applies ``--set path=value`` overrides to the
raw tables, and validates into a ``Topology``. Every problem is a ``ConfigError`` whose text
is one line, ``<field path>: <problem>``. Validation decodes every table and every actor's
``Config`` (enumerated values are ``Literal``, bounds are ``Meta``), and resolves every name
that stands for code: each actor ``kind``, ``job.task`` (and its ``task_kwargs`` against the
factory's signature) and ``job.reward`` are imported and checked to be the right kind of
object, so a typo fails here, at ``--dry-run``, and not later inside a child. What needs
the whole topology or this machine (relations, addresses, engines, models, key files) is
checked next, by ``echo2.topology.preflight``, before the launcher starts anything.

Placement rules worth knowing:

* ``replicas = n > 1`` expands ``NAME`` into ``NAME-0 .. NAME-{n-1}``. ``"{i}"`` in
  ``process`` is replaced by the replica index (``process = "sampler-{i}"``: one process
  each); without it all replicas share the process. Without ``process`` every actor (and
  every replica) gets its own process, named like it.
* Processes need no table unless they need settings. When a ``[processes]`` table exists,
  a process named explicitly without ``"{i}"`` must be declared there (a typo is an error,
  not a new process). ``[processes."sampler-{i}"]`` gives settings to templated processes.
* A host ``local`` (127.0.0.1) exists when there is no ``[hosts]`` table.
* ``address = "env:VAR"`` is read from the environment of each launcher as it starts
  (``resolve_env_addresses``): a scheduler's node names (Slurm, Kubernetes) rather than
  fixed IPs. A DNS name is used as written (resolved when connecting).
* ``join_port`` on one host lets samplers outside the topology join the running job
  (``python -m echo2.join``). Addresses are then derived as if a sampler sat on a host of
  its own (``JOIN_HOST``): every channel a sampler uses is reachable over tcp.
* A process holding a distributed actor (``Actor.torchrun``: the ``distributed_learner``)
  runs under torchrun, ``nproc_per_node`` ranks on each of ``nnodes`` nodes (one, its
  ``host``, unless ``node_hosts`` names them); ``gpus`` then lists one GPU per local rank.
  Ranks are refused for any other process: it has nothing to run on them.
* Channels are matched by ``Port.channel`` or else the port name. A connector whose channel
  has no binder is an error; a binder without connectors still binds (inproc).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from echo2.actor import Actor, ActorConfig, Port
from echo2.actors import load_actor_class
from echo2.config import Name, convert_config
from echo2.envs.base import check_job_environment
from echo2.errors import ConfigError, one_line
from echo2.job import JobConfig
from echo2.observe.writers import MetricWriterKind, WandbMode
from echo2.tasks.base import check_job_task

log = logging.getLogger("echo2.topology")

DEFAULT_HOST = "local"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
ENV_ADDRESS_PREFIX = "env:"
"""``address = "env:VAR"``: the address is the value of ``VAR`` in each launcher's environment."""
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JOINED_SAMPLER = "joined-sampler"
"""The stand-in actor for samplers that join with ``python -m echo2.join`` (its addresses)."""
JOIN_HOST = "(join)"
"""The host the stand-in sits on: not a topology host (no valid host name has parentheses)."""

RestartPolicy = Literal["never", "on-failure"]
"""What the launcher does when a process dies: stop the run, or restart the process."""

# -- the tables ----------------------------------------------------------------------------


class RunSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[run]``: how the launcher runs and stops this topology."""

    name: Name = "echo2"
    """Prefix of the run directory's name: ``<run_dir>/<name>-<YYYYmmdd-HHMMSS>``."""
    run_dir: str = "runs"
    """Parent directory of run directories."""
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 10.0
    """Seconds actors get to return after a stop request before they are cancelled."""
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    """Seconds between two heartbeats of each process on the telemetry channel."""
    deadline_s: Annotated[float, Meta(ge=0)] = 0.0
    """Stop the run gracefully after this many seconds (0: no deadline)."""
    record: list[str] = []
    """Ports whose traffic is recorded to ``recordings/<actor>.<port>.rec``, as
    ``"actor.port"`` (``"learner.batch"``); replay one with ``python -m echo2.replay``."""
    record_max_mb: Annotated[float, Meta(gt=0)] = 256.0
    """Cap of each recording file, MB; past it that port stops recording (with a log line)."""
    metric_writers: list[MetricWriterKind] = []
    """Where the learner's metrics also go, live (off by default): "tensorboard" (event files
    in ``RUN_DIR/tensorboard/``) and "wandb" (Weights & Biases); ``echo2.observe.writers``."""
    wandb_project: Name = "echo2"
    """The W&B project of the run (with "wandb")."""
    wandb_mode: WandbMode = "offline"
    """"offline": W&B files in ``RUN_DIR/wandb/`` only, no account needed (``wandb sync``
    uploads them later); "online": streamed (``wandb login`` or ``WANDB_API_KEY`` first)."""


class HostSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[hosts.NAME]``: a machine. Processes on other hosts reach it at ``address``."""

    address: str = "127.0.0.1"
    """Hostname, DNS name or IP address (IPv4 or IPv6) at which processes on other hosts reach
    this one: the address it advertises, which behind NAT is the router's public one. Or
    ``"env:VAR"``: the value of the environment variable ``VAR`` where each launcher starts."""
    bind: str = ""
    """IP address of this host's own interface its tcp endpoints listen on ("": every
    interface); behind NAT with forwarded ports, the private address ``address`` maps to."""
    inbound: bool = True
    """False: this host accepts no connection from other hosts (NAT or a firewall with no
    forwarded ports). Its samplers then receive weights over connections they open to the
    weight publisher; an actor that other hosts connect to cannot run here."""
    port_base: Annotated[int, Meta(ge=1024, le=65535)] = 28100
    """First tcp port for endpoints other hosts connect to (assigned by (actor, port));
    ports below 1024 are for services run as root. The default lies below Linux's ephemeral
    range (32768-60999), from which outgoing connections take their local ports."""
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """Port of this host's launcher's ``/metrics`` and ``/health`` (0: off); the host's
    processes, in name order, serve theirs at the ports after it (``docs/metrics.md``)."""
    join_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """Port on which this host's launcher answers ``python -m echo2.join`` (0: off): samplers
    outside the topology then join the running job. One host at most."""
    cores: Annotated[int, Meta(ge=0)] = 0
    """Cores torch may use on this host (0: the usable cores of the machine resolving the
    topology; each host's launcher resolves for itself, so 0 is right on every host)."""


class ProcessSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[processes.NAME]``: one OS process holding one or more actors."""

    host: str = DEFAULT_HOST
    """The ``[hosts.NAME]`` this process runs on."""
    torch_threads: Annotated[int, Meta(ge=0)] = 0
    """Torch intra-op threads (0: a share of the host's cores by the actors' torch weight)."""
    restart: RestartPolicy = "never"
    """"never" or "on-failure": the launcher restarts the process when it dies (crash,
    kill -9) instead of stopping the run. For samplers and rewarders, whose lost work is
    re-issued; refused for a process holding a learner (continue that with ``--resume``)."""
    max_restarts: Annotated[int, Meta(ge=0)] = 10
    """Restarts allowed before a death of this process stops the run ("on-failure" only)."""
    restart_backoff_s: Annotated[float, Meta(ge=0)] = 1.0
    """Seconds before the first restart; doubles per consecutive restart, capped at 30 s."""
    gpus: list[Annotated[int, Meta(ge=0)]] = []
    """GPUs this process sees (its ``CUDA_VISIBLE_DEVICES``), as indices among those its
    host's launcher sees (``echo2.topology.devices``); under torchrun one per local rank.
    Empty: the launcher's own, unchanged."""
    nproc_per_node: Annotated[int, Meta(ge=1, le=1024)] = 1
    """Ranks per node of a process holding a distributed actor (``distributed_learner``),
    which the launcher starts under torchrun; other processes run one."""
    nnodes: Annotated[int, Meta(ge=1, le=1024)] = 1
    """Nodes (machines) such a process spans; more than 1 needs ``node_hosts`` and ``rdzv_endpoint``."""
    node_hosts: list[str] = []
    """With ``nnodes`` > 1: the host of each node rank; ``node_hosts[0]`` is ``host`` (global
    rank 0 runs the actors and binds their ports). Each host's launcher starts its node."""
    rdzv_endpoint: str = ""
    """``"address:port"`` where node 0's torchrun serves the rendezvous (static); reachable from
    every node. Required with ``nnodes`` > 1; otherwise default: a free port on this machine."""


class ActorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[actors.NAME]``: one actor (or ``replicas`` of it) and where it runs."""

    kind: str
    """Registry name (``echo2.registry.ACTORS``) or ``"package.module:Class"``."""
    process: str = ""
    """Process to run in; default: a process named like the actor. ``{i}``: replica index."""
    replicas: Annotated[int, Meta(ge=1)] = 1
    """Copies of this actor, named ``NAME-0 .. NAME-{n-1}`` when more than one."""
    config: dict[str, Any] = {}
    """The kind's ``Config`` table, decoded and checked by that class."""


class SecuritySpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[security]``: CURVE encryption and authentication on links that leave a host.

    Every socket bound for peers on other hosts becomes a CURVE server with its host's key
    pair (``keys_dir/<host>.key_secret``) and admits only the public keys in ``allowed``;
    every connection to such a socket is a CURVE client with its own host's key pair, and
    pins the server's public key (``keys_dir/<server host>.key``). Make keys with
    ``python -m echo2.keys``.
    """

    curve: bool = False
    """CURVE on every socket that peers on other hosts reach (off: plain tcp)."""
    keys_dir: str = "keys"
    """Directory of the hosts' key pairs (``<host>.key``, ``<host>.key_secret``)."""
    allowed: list[str] = []
    """Public key files or directories of them; default ``<keys_dir>/allowed``."""


_TABLES = ("run", "job", "hosts", "processes", "actors", "security")


@dataclasses.dataclass(frozen=True)
class PlacedActor:
    """One actor after replica expansion, with its class, typed config and process."""

    name: str
    """Actor name: the ``[actors.NAME]`` table's name, ``NAME-i`` for replica ``i``."""
    kind: str
    """``kind`` as written (a registry name or an import path)."""
    cls: type[Actor]
    """The class ``kind`` resolved to."""
    config: ActorConfig
    """The table's ``config``, decoded into ``cls.Config``."""
    raw_config: Mapping[str, Any]
    """The same ``config`` as written, which the resolved topology carries to the child."""
    process: str
    """Process it runs in, after ``{i}`` and default-name substitution."""
    spec: str
    """Name of the ``[actors.*]`` table it came from (differs from ``name`` for replicas)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A validated topology: every name resolves, every config is typed."""

    run: RunSpec
    job: JobConfig
    hosts: Mapping[str, HostSpec]
    processes: Mapping[str, ProcessSpec]
    actors: Mapping[str, PlacedActor]
    security: SecuritySpec = dataclasses.field(default_factory=SecuritySpec)

    def actors_in(self, process: str) -> list[PlacedActor]:
        return [a for a in self.actors.values() if a.process == process]


# -- placement and channels ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one actor runs and which ports it declares: what address derivation reads."""

    actor: str
    process: str
    host: str
    ports: Mapping[str, Port]
    trusted: bool = True
    """``Actor.trusted`` of its class: False for workers the job's owner may not control."""


def placements(topology: Topology) -> list[Placement]:
    return [
        Placement(
            actor=a.name,
            process=a.process,
            host=topology.processes[a.process].host,
            ports=a.cls.ports,
            trusted=a.cls.trusted,
        )
        for a in topology.actors.values()
    ]


def channel_of(port_name: str, port: Port) -> str:
    return port.channel or port_name


def check_channels(places: Sequence[Placement]) -> None:
    """Every connector's channel needs a binder; raises ``ConfigError`` naming the port."""
    bound = {channel_of(p, spec) for pl in places for p, spec in pl.ports.items() if spec.bind}
    for pl in places:
        for port_name, spec in pl.ports.items():
            channel = channel_of(port_name, spec)
            if not spec.bind and channel not in bound:
                raise ConfigError(
                    f"no actor binds channel {channel!r}",
                    path=f"actors.{pl.actor}.ports.{port_name}",
                )


# -- loading and validation ----------------------------------------------------------------


def load_topology(path: str | Path, overrides: Sequence[str] = ()) -> Topology:
    """Read a topology file, apply ``--set path=value`` overrides, validate.

    Raises ``ConfigError`` with a one-line message (``<field path>: <problem>``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {one_line(exc)}") from None
    apply_overrides(raw, overrides)
    return validate(raw)


def parse_override(override: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], value parsed as TOML, else the raw string)."""
    key, sep, text = override.partition("=")
    keys = [part.strip() for part in key.strip().split(".")]
    if not sep or not all(keys):
        raise ConfigError(f"--set {override!r}: expected path=value, e.g. job.staleness=0")
    text = text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: take it as a string
    return keys, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``--set`` overrides to a raw TOML dict in place, before validation.

    Missing intermediate tables are created; a key the schema does not know is then
    rejected by validation, with its path.
    """
    for override in overrides:
        keys, value = parse_override(override)
        table = raw
        for depth, key in enumerate(keys[:-1]):
            child = table.setdefault(key, {})
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise ConfigError(f"--set {override!r}: {where} is not a table")
            table = child
        table[keys[-1]] = value


def validate(raw: Mapping[str, Any]) -> Topology:
    """Validate a raw topology dict (as read from TOML) into a ``Topology``."""
    for key in raw:
        if key not in _TABLES:
            raise ConfigError(f"{key}: unknown table (allowed: {', '.join(_TABLES)})")
    run = convert_config(_table(raw, "run"), RunSpec, "run")
    job = convert_config(_table(raw, "job"), JobConfig, "job")
    check_job_task(job)
    if job.multi_turn:
        check_job_environment(job.episode.environment, job.episode.environment_kwargs)

    if "hosts" in raw:
        hosts = {
            name: convert_config(table, HostSpec, f"hosts.{name}")
            for name, table in _named_tables(raw, "hosts").items()
        }
        if not hosts:
            raise ConfigError("hosts: declares no host (omit [hosts] for one local host)")
    else:
        hosts = {DEFAULT_HOST: HostSpec()}
    _check_hosts(hosts)

    declared = {
        name: convert_config(table, ProcessSpec, f"processes.{name}")
        for name, table in _named_tables(raw, "processes").items()
    }
    for name, spec in declared.items():
        if spec.host not in hosts:
            raise ConfigError(f"unknown host {spec.host!r}", path=f"processes.{name}.host")
    strict_processes = "processes" in raw

    actors: dict[str, PlacedActor] = {}
    processes: dict[str, ProcessSpec] = {}
    for spec_name, table in _named_tables(raw, "actors").items():
        where = f"actors.{spec_name}"
        spec = convert_config(table, ActorSpec, where)
        try:
            cls = load_actor_class(spec.kind)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"{where}.kind") from exc
        config = cls.parse_config(spec.config, f"{where}.config")
        template = spec.process or "{name}"
        for index in range(spec.replicas):
            name = spec_name if spec.replicas == 1 else f"{spec_name}-{index}"
            if name in actors:
                raise ConfigError(
                    f"duplicate actor name {name!r} (from actors.{actors[name].spec} and actors.{spec_name})",
                    path=where,
                )
            process = template.replace("{name}", name).replace("{i}", str(index))
            if not _NAME_RE.fullmatch(process):
                raise ConfigError(f"process name {process!r} must match {_NAME_RE.pattern}", path=f"{where}.process")
            if process in declared:
                processes[process] = declared[process]
            elif spec.process and "{i}" in spec.process and spec.process in declared:
                processes[process] = declared[spec.process]
            elif strict_processes and spec.process and "{i}" not in spec.process:
                known = ", ".join(sorted(declared)) or "none"
                raise ConfigError(f"unknown process {process!r} (declared: {known})", path=f"{where}.process")
            else:
                processes.setdefault(process, ProcessSpec())
            if processes[process].host not in hosts:
                raise ConfigError(
                    f"process {process!r} is on unknown host {processes[process].host!r} "
                    f"(declare [processes.{process}] with a host)",
                    path=f"{where}.process",
                )
            actors[name] = PlacedActor(
                name=name,
                kind=spec.kind,
                cls=cls,
                config=config,
                raw_config=spec.config,
                process=process,
                spec=spec_name,
            )
    if not actors:
        raise ConfigError("actors: the topology has no actors")
    for actor in actors.values():
        if processes[actor.process].restart != "never" and not actor.cls.restartable:
            raise ConfigError(
                f"{actor.name!r} ({actor.kind}) cannot be restarted within a run, it would start over from "
                'step 0; use restart = "never" and continue a stopped run with --resume RUN_DIR',
                path=f"processes.{actor.process}.restart",
            )
    for name, spec in processes.items():
        check_ranks(name, spec, topology_hosts=hosts, actors=[a for a in actors.values() if a.process == name])
    unused = sorted(set(declared) - set(processes) - {p for p in declared if "{i}" in p})
    if unused:
        log.warning("processes %s hold no actor and will not be started", ", ".join(unused))
    check_recorded_ports(run.record, actors)
    security = convert_config(_table(raw, "security"), SecuritySpec, "security")
    topology = Topology(run=run, job=job, hosts=hosts, processes=processes, actors=actors, security=security)
    check_channels(placements(topology))
    return topology


def _check_hosts(hosts: Mapping[str, HostSpec]) -> None:
    """Address syntax and the join port: ``ConfigError`` naming the host's field."""
    serving = []
    for name, host in hosts.items():
        if not host.address:
            raise ConfigError("empty address", path=f"hosts.{name}.address")
        if host.address.startswith(ENV_ADDRESS_PREFIX):
            var = host.address.removeprefix(ENV_ADDRESS_PREFIX)
            if not _ENV_NAME_RE.fullmatch(var):
                raise ConfigError(
                    f"{host.address!r}: expected env:VARIABLE, a name matching {_ENV_NAME_RE.pattern}",
                    path=f"hosts.{name}.address",
                )
        if host.join_port:
            if host.join_port < 1024:
                raise ConfigError(
                    f"{host.join_port}: ports below 1024 are for services run as root", path=f"hosts.{name}.join_port"
                )
            serving.append(name)
    if len(serving) > 1:
        raise ConfigError(
            f"only one host answers joins; hosts.{serving[0]}.join_port is set too",
            path=f"hosts.{serving[1]}.join_port",
        )


def join_host(topology: Topology) -> str | None:
    """The host whose launcher answers ``python -m echo2.join`` (``join_port``), if any."""
    return next((name for name, host in topology.hosts.items() if host.join_port), None)


def joined_placement(topology: Topology) -> tuple[Placement, HostSpec] | None:
    """The stand-in for joined samplers, on ``JOIN_HOST`` (at the join host's address), when
    a host serves joins: deriving addresses with it makes every channel a sampler uses
    reachable over tcp, and gives a joined sampler its URLs."""
    serving = join_host(topology)
    if serving is None:
        return None
    sampler = load_actor_class("sampler")
    place = Placement(
        actor=JOINED_SAMPLER, process=JOINED_SAMPLER, host=JOIN_HOST, ports=sampler.ports, trusted=sampler.trusted
    )
    # A joined sampler's machine is unknown here and often behind NAT: like a host that
    # accepts no inbound connection, it dials the publisher for its weights.
    return place, HostSpec(address=topology.hosts[serving].address, inbound=False)


def resolve_env_addresses(topology: Topology, environ: Mapping[str, str]) -> Topology:
    """``address = "env:VAR"`` replaced by ``environ[VAR]`` (what a launcher does as it
    starts); ``ConfigError`` naming the host when the variable is unset or empty."""
    hosts = dict(topology.hosts)
    for name, host in topology.hosts.items():
        if host.address.startswith(ENV_ADDRESS_PREFIX):
            var = host.address.removeprefix(ENV_ADDRESS_PREFIX)
            value = environ.get(var, "").strip()
            if not value:
                raise ConfigError(
                    f"{host.address!r}: the environment variable {var} is not set where this launcher runs",
                    path=f"hosts.{name}.address",
                )
            hosts[name] = msgspec.structs.replace(host, address=value)
    return dataclasses.replace(topology, hosts=hosts)


def check_ranks(
    name: str, spec: ProcessSpec, *, topology_hosts: Mapping[str, HostSpec], actors: Sequence[PlacedActor]
) -> None:
    """A process's ranks, nodes and GPUs fit together; ``ConfigError`` naming the field."""
    where = f"processes.{name}"
    if len(set(spec.gpus)) != len(spec.gpus):
        raise ConfigError(f"{spec.gpus} lists a GPU twice", path=f"{where}.gpus")
    distributed = [a for a in actors if a.cls.torchrun]
    if len(distributed) > 1:
        names = ", ".join(a.name for a in distributed)
        raise ConfigError(f"holds {len(distributed)} distributed actors ({names}); one per process", path=where)
    if not distributed:
        for field, value in (("nproc_per_node", spec.nproc_per_node), ("nnodes", spec.nnodes)):
            if value > 1:
                held = ", ".join(f"{a.name} ({a.kind})" for a in actors)
                raise ConfigError(
                    f'{value} needs an actor that trains across ranks (kind = "distributed_learner"); '
                    f"process {name!r} holds {held}",
                    path=f"{where}.{field}",
                )
        for field, text in (("node_hosts", spec.node_hosts), ("rdzv_endpoint", spec.rdzv_endpoint)):
            if text:
                raise ConfigError(
                    f"only for a process under torchrun (nnodes > 1); {name!r} is not", path=f"{where}.{field}"
                )
        return
    if spec.gpus and len(spec.gpus) != spec.nproc_per_node:
        raise ConfigError(
            f"{len(spec.gpus)} GPU(s) {spec.gpus} for nproc_per_node = {spec.nproc_per_node} ranks: list one per rank",
            path=f"{where}.gpus",
        )
    if spec.rdzv_endpoint:
        parse_endpoint(spec.rdzv_endpoint, f"{where}.rdzv_endpoint")
    if spec.nnodes == 1:
        if spec.node_hosts not in ([], [spec.host]):
            raise ConfigError(
                f"{spec.node_hosts} for nnodes = 1: omit it (the node is host {spec.host!r})",
                path=f"{where}.node_hosts",
            )
        return
    if len(spec.node_hosts) != spec.nnodes:
        raise ConfigError(
            f"{len(spec.node_hosts)} host(s) for nnodes = {spec.nnodes}: list the host of each node rank",
            path=f"{where}.node_hosts",
        )
    if spec.node_hosts[0] != spec.host:
        raise ConfigError(
            f"node rank 0 runs on {spec.node_hosts[0]!r} but the process's host is {spec.host!r}; they must be the same",
            path=f"{where}.node_hosts",
        )
    for index, host in enumerate(spec.node_hosts):
        if host not in topology_hosts:
            raise ConfigError(f"unknown host {host!r}", path=f"{where}.node_hosts[{index}]")
        if host in spec.node_hosts[:index]:
            raise ConfigError(f"host {host!r} is listed twice: one node per host", path=f"{where}.node_hosts[{index}]")
    if not spec.rdzv_endpoint:
        address = topology_hosts[spec.host].address
        raise ConfigError(
            f"required with nnodes = {spec.nnodes}: node 0's rendezvous address:port that every node reaches, "
            f'e.g. "{address}:29500"',
            path=f"{where}.rdzv_endpoint",
        )


def parse_endpoint(endpoint: str, path: str) -> tuple[str, int]:
    """``"address:port"`` (``"[v6]:port"``) -> (address, port); ``ConfigError`` at ``path``."""
    address, colon, port = endpoint.rpartition(":")
    address = address.removeprefix("[").removesuffix("]")
    if not colon or not address or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f'{endpoint!r}: expected address:port with a port in 1-65535, e.g. "10.0.0.1:29500"', path=path
        )
    return address, int(port)


def check_recorded_ports(record: Sequence[str], actors: Mapping[str, PlacedActor]) -> None:
    """Each ``run.record`` entry names a port of an actor; ``ConfigError`` naming the entry."""
    for index, entry in enumerate(record):
        where = f"run.record[{index}]"
        actor, dot, port = entry.rpartition(".")
        if not dot or not actor or not port:
            raise ConfigError(f'{entry!r}: expected "actor.port", e.g. "learner.batch"', path=where)
        if actor not in actors:
            raise ConfigError(f"{entry!r}: unknown actor {actor!r} (actors: {', '.join(sorted(actors))})", path=where)
        ports = actors[actor].cls.ports
        if port not in ports:
            known = ", ".join(sorted(ports)) or "none"
            raise ConfigError(f"{entry!r}: actor {actor!r} has no port {port!r} (ports: {known})", path=where)


def _table(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a table, got {type(value).__name__}", path=key)
    return value


def _named_tables(raw: Mapping[str, Any], key: str) -> dict[str, Mapping[str, Any]]:
    out = {}
    for name, value in _table(raw, key).items():
        where = f"{key}.{name}"
        if not _NAME_RE.fullmatch(name) and not (key == "processes" and "{i}" in name):
            raise ConfigError(f"name must match {_NAME_RE.pattern}", path=where)
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a table, got {type(value).__name__}", path=where)
        out[name] = value
    return out


__all__ = [
    "DEFAULT_HOST",
    "ENV_ADDRESS_PREFIX",
    "JOINED_SAMPLER",
    "JOIN_HOST",
    "ActorSpec",
    "HostSpec",
    "PlacedActor",
    "Placement",
    "ProcessSpec",
    "RestartPolicy",
    "RunSpec",
    "SecuritySpec",
    "Topology",
    "apply_overrides",
    "channel_of",
    "check_channels",
    "check_ranks",
    "join_host",
    "joined_placement",
    "load_topology",
    "parse_endpoint",
    "parse_override",
    "placements",
    "resolve_env_addresses",
    "validate",
]
