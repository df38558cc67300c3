"""The topology's schema: the TOML tables as typed Structs, and their validation.

A topology says where actors run; actor code never does. The file has six tables::

    [run]             name, run_dir, drain_timeout_s, heartbeat_s, deadline_s, record, record_max_mb
    [job]             settings several actors share (echo2.job.JobConfig)
    [hosts.NAME]      address, port_base, metrics_port, cores
    [processes.NAME]  host, torch_threads, restart, max_restarts, restart_backoff_s
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
from echo2.errors import ConfigError, one_line
from echo2.job import JobConfig
from echo2.tasks.base import check_job_task

log = logging.getLogger("echo2.topology")

DEFAULT_HOST = "local"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")

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


class HostSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[hosts.NAME]``: a machine. Processes on other hosts reach it at ``address``."""

    address: str = "127.0.0.1"
    """Hostname or IP address (IPv4 or IPv6) at which processes on other hosts reach this
    one: the address it advertises, which behind NAT is the router's public one."""
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

    if "hosts" in raw:
        hosts = {
            name: convert_config(table, HostSpec, f"hosts.{name}")
            for name, table in _named_tables(raw, "hosts").items()
        }
        if not hosts:
            raise ConfigError("hosts: declares no host (omit [hosts] for one local host)")
    else:
        hosts = {DEFAULT_HOST: HostSpec()}

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
    unused = sorted(set(declared) - set(processes) - {p for p in declared if "{i}" in p})
    if unused:
        log.warning("processes %s hold no actor and will not be started", ", ".join(unused))
    check_recorded_ports(run.record, actors)
    security = convert_config(_table(raw, "security"), SecuritySpec, "security")
    topology = Topology(run=run, job=job, hosts=hosts, processes=processes, actors=actors, security=security)
    check_channels(placements(topology))
    return topology


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
    "load_topology",
    "parse_override",
    "placements",
    "validate",
]
