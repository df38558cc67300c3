"""The topology: typed TOML schema, one-line validation errors, address derivation.

A topology says where actors run; actor code never does. The file has five tables::

    [run]             name, run_dir, drain_timeout_s, heartbeat_s, deadline_s
    [job]             settings several actors share (echo2.actor.JobConfig)
    [hosts.NAME]      address, port_base, cores
    [processes.NAME]  host, torch_threads
    [actors.NAME]     kind, process, replicas, config = {...}

Three steps, each a pure function:

1. ``load_topology(path, overrides)`` reads TOML, applies ``--set path=value`` overrides to
   the raw tables, and validates into a ``Topology``. Every problem is a ``ConfigError``
   whose text is one line, ``<field path>: <problem>``.
2. ``derive_addresses(placements, hosts, run_id)`` gives every port its URLs from placement
   alone: ``inproc://`` when binder and connector share a process, ``ipc://`` when they
   share a host, ``tcp://`` across hosts (ports assigned deterministically from the host's
   ``port_base``, so every host computes the same ones from the same file).
3. ``resolve(topology, run_id, run_dir)`` fixes everything a process needs into a
   JSON-serialisable ``ResolvedTopology`` (the launcher writes it to the run directory), and
   ``build_process(resolved, name)`` turns one process of it into live actor objects.

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
* The runtime of every process publishes heartbeats to all binders of channel
  ``telemetry`` (``telemetry_connect``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from echo2.actor import (
    Actor,
    ActorConfig,
    JobConfig,
    Port,
    PortAddresses,
    convert_config,
    default_cpu_count,
)
from echo2.actors import load_actor_class
from echo2.errors import ConfigError
from echo2.messages import TELEMETRY_CHANNEL

log = logging.getLogger("echo2.topology")

IPC_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS
DEFAULT_HOST = "local"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_LOCAL_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})

# -- schema ------------------------------------------------------------------------------

_Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")]


class RunSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[run]``: how the launcher runs and stops this topology."""

    name: _Name = "echo2"
    """Prefix of the run directory's name: ``<run_dir>/<name>-<YYYYmmdd-HHMMSS>``."""
    run_dir: str = "runs"
    """Parent directory of run directories."""
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 10.0
    """After a stop request, actors get this long to return before they are cancelled."""
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    """Interval of each process's heartbeat on the telemetry channel."""
    deadline_s: Annotated[float, Meta(ge=0)] = 0.0
    """Stop the run gracefully after this many seconds (0: no deadline)."""


class HostSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[hosts.NAME]``: a machine. Processes on other hosts reach it at ``address``."""

    address: str = "127.0.0.1"
    port_base: Annotated[int, Meta(ge=1, le=65535)] = 47000
    """First tcp port for endpoints other hosts connect to (assigned by (actor, port))."""
    cores: Annotated[int, Meta(ge=0)] = 0
    """Cores torch may use on this host (0: the usable cores of the machine resolving the
    topology; each host's launcher resolves for itself, so 0 is right on every host)."""


class ProcessSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[processes.NAME]``: one OS process holding one or more actors."""

    host: str = DEFAULT_HOST
    torch_threads: Annotated[int, Meta(ge=0)] = 0
    """Torch intra-op threads (0: a share of the host's cores by the actors' torch weight)."""
    restart: Literal["never", "on-failure"] = "never"
    """"on-failure": the launcher restarts the process when it dies (crash, kill -9) instead
    of stopping the run. For samplers and rewarders, whose lost work is re-issued."""
    max_restarts: Annotated[int, Meta(ge=0)] = 10
    restart_backoff_s: Annotated[float, Meta(ge=0)] = 1.0
    """First restart delay; doubles per consecutive restart, capped at 30 s."""


class ActorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[actors.NAME]``: one actor (or ``replicas`` of it) and where it runs."""

    kind: str
    """Registry name (``echo2.actors.ACTOR_KINDS``) or ``"package.module:Class"``."""
    process: str = ""
    """Process to run in; default: a process named like the actor. ``{i}``: replica index."""
    replicas: Annotated[int, Meta(ge=1)] = 1
    config: dict[str, Any] = {}
    """The kind's ``Config``."""


class SecuritySpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``[security]``: CURVE encryption and authentication on links that leave a host.

    Every socket bound for peers on other hosts becomes a CURVE server with its host's key
    pair (``keys_dir/<host>.key_secret``) and admits only the public keys in ``allowed``;
    every connection to such a socket is a CURVE client with its own host's key pair, and
    pins the server's public key (``keys_dir/<server host>.key``). Make keys with
    ``python -m echo2.keys``.
    """

    curve: bool = False
    keys_dir: str = "keys"
    allowed: list[str] = []
    """Public key files or directories of them; default ``<keys_dir>/allowed``."""


_TABLES = ("run", "job", "hosts", "processes", "actors", "security")


@dataclasses.dataclass(frozen=True)
class PlacedActor:
    """One actor after replica expansion, with its class, typed config and process."""

    name: str
    kind: str
    cls: type[Actor]
    config: ActorConfig
    raw_config: Mapping[str, Any]
    process: str
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
        raise ConfigError(f"invalid TOML: {_one_line(str(exc))}") from None
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
    run = _convert(_table(raw, "run"), RunSpec, "run")
    job = _convert(_table(raw, "job"), JobConfig, "job")

    if "hosts" in raw:
        hosts = {
            name: _convert(table, HostSpec, f"hosts.{name}") for name, table in _named_tables(raw, "hosts").items()
        }
        if not hosts:
            raise ConfigError("hosts: declares no host (omit [hosts] for one local host)")
    else:
        hosts = {DEFAULT_HOST: HostSpec()}

    declared = {
        name: _convert(table, ProcessSpec, f"processes.{name}")
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
        spec = _convert(table, ActorSpec, where)
        try:
            cls = load_actor_class(spec.kind)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=f"{where}.kind") from exc
        config = _parse_actor_config(cls, spec.config, f"{where}.config")
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
    unused = sorted(set(declared) - set(processes) - {p for p in declared if "{i}" in p})
    if unused:
        log.warning("processes %s hold no actor and will not be started", ", ".join(unused))
    security = _convert(_table(raw, "security"), SecuritySpec, "security")
    topology = Topology(run=run, job=job, hosts=hosts, processes=processes, actors=actors, security=security)
    check_channels(placements(topology))
    return topology


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


_UNKNOWN_FIELD = re.compile(r"^(?P<path>.*): Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^(?P<path>.*): Object missing required field `(?P<field>[^`]*)`$")


def _convert(raw: Mapping[str, Any], config_type: type[Any], path: str) -> Any:
    try:
        return convert_config(raw, config_type, path)
    except ConfigError as exc:
        raise ConfigError(_polish(str(exc), config_type)) from None


def _parse_actor_config(cls: type[Actor], raw: Mapping[str, Any], path: str) -> ActorConfig:
    try:
        return cls.parse_config(raw, path)
    except ConfigError as exc:
        raise ConfigError(_polish(str(exc), getattr(cls, "Config", None))) from None


def _polish(message: str, config_type: Any) -> str:
    """Put the offending field into the path: ``x.foo: unknown field (allowed: ...)``."""
    message = _one_line(message)
    if match := _UNKNOWN_FIELD.match(message):
        fields = getattr(config_type, "__struct_fields__", ())
        allowed = f" (allowed: {', '.join(fields)})" if fields else ""
        return f"{match['path']}.{match['field']}: unknown field{allowed}"
    if match := _MISSING_FIELD.match(message):
        return f"{match['path']}.{match['field']}: missing required field"
    return message


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- address derivation --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """What address derivation needs to know about one actor."""

    actor: str
    process: str
    host: str
    ports: Mapping[str, Port]


@dataclasses.dataclass(frozen=True)
class Addresses:
    """Derived URLs: per actor and port, and per process the telemetry binders to reach."""

    ports: dict[str, dict[str, PortAddresses]]
    telemetry: dict[str, tuple[str, ...]]
    tcp_ports: dict[tuple[str, str], int]
    """(actor, port) -> tcp port, for binders that other hosts connect to."""
    ipc_dir: str
    curve_hosts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Connect URL -> host of the CURVE server behind it (CURVE on only)."""


def placements(topology: Topology) -> list[Placement]:
    return [
        Placement(
            actor=a.name,
            process=a.process,
            host=topology.processes[a.process].host,
            ports=a.cls.ports,
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


def ipc_dir_for(run_id: str) -> str:
    """Directory of this run's ipc sockets (short: socket paths must stay < 100 chars)."""
    directory = f"/tmp/echo2-{run_id}"
    if len(directory) > 48:
        directory = f"/tmp/echo2-{_short_hash(run_id)}"
    return directory


def derive_addresses(
    places: Sequence[Placement], hosts: Mapping[str, HostSpec], run_id: str, *, curve: bool = False
) -> Addresses:
    """Give every port of every placed actor its bind and connect URLs. Pure.

    A binder binds inproc when a connector shares its process, ipc when one shares its host
    from another process, tcp when one is on another host; with no connector it binds
    inproc. Each connector gets one URL per binder of its channel, by the same relation.
    """
    check_channels(places)
    ipc_dir = ipc_dir_for(run_id)
    binders: dict[str, list[tuple[Placement, str]]] = {}
    connectors: dict[str, list[Placement]] = {}
    for pl in places:
        for port_name, spec in pl.ports.items():
            channel = channel_of(port_name, spec)
            if spec.bind:
                binders.setdefault(channel, []).append((pl, port_name))
            else:
                connectors.setdefault(channel, []).append(pl)
    # The runtime's heartbeat publisher of every process is a connector of "telemetry".
    process_hosts = {pl.process: pl.host for pl in places}
    telemetry_peers = [Placement(actor="", process=proc, host=host, ports={}) for proc, host in process_hosts.items()]

    # Deterministic tcp ports: per host, binders reached from other hosts sorted by (actor, port).
    needs_tcp: dict[str, list[tuple[str, str]]] = {}
    for channel, owners in binders.items():
        peers = connectors.get(channel, []) + (telemetry_peers if channel == TELEMETRY_CHANNEL else [])
        for owner, port_name in owners:
            if any(peer.host != owner.host for peer in peers):
                needs_tcp.setdefault(owner.host, []).append((owner.actor, port_name))
    tcp_ports: dict[tuple[str, str], int] = {}
    for host, keys in needs_tcp.items():
        base = hosts[host].port_base
        for offset, key in enumerate(sorted(keys)):
            if base + offset > 65535:
                raise ConfigError(f"tcp ports from {base} run past 65535", path=f"hosts.{host}.port_base")
            tcp_ports[key] = base + offset

    def url(owner: Placement, port_name: str, peer: Placement, *, bind: bool) -> str:
        if peer.process == owner.process:
            return f"inproc://echo2-{run_id}/{owner.actor}/{port_name}"
        if peer.host == owner.host:
            return f"ipc://{_ipc_path(ipc_dir, owner.actor, port_name)}"
        port = tcp_ports[(owner.actor, port_name)]
        return f"tcp://*:{port}" if bind else f"tcp://{hosts[owner.host].address}:{port}"

    result: dict[str, dict[str, dict[str, list[str]]]] = {pl.actor: {} for pl in places}
    telemetry: dict[str, list[str]] = {proc: [] for proc in process_hosts}
    for channel, owners in binders.items():
        peers = connectors.get(channel, [])
        for owner, port_name in owners:
            extra = telemetry_peers if channel == TELEMETRY_CHANNEL else []
            binds: list[str] = []
            for peer in [*peers, *extra]:
                _add(binds, url(owner, port_name, peer, bind=True))
            if not binds:
                _add(binds, url(owner, port_name, owner, bind=True))
            result[owner.actor].setdefault(port_name, {"bind": [], "connect": []})["bind"] = binds
            for peer in peers:
                for peer_port, spec in peer.ports.items():
                    if not spec.bind and channel_of(peer_port, spec) == channel:
                        entry = result[peer.actor].setdefault(peer_port, {"bind": [], "connect": []})
                        _add(entry["connect"], url(owner, port_name, peer, bind=False))
            for peer in extra:
                _add(telemetry[peer.process], url(owner, port_name, peer, bind=False))
    # With CURVE on, a binder reachable from other hosts is a CURVE server on all its
    # endpoints, so every connection to it (same host too) must be a CURVE client.
    owner_of_url = {}
    for channel, owners in binders.items():
        for owner, port_name in owners:
            if curve and (owner.actor, port_name) in tcp_ports:
                for peer in [*connectors.get(channel, []), *telemetry_peers]:
                    owner_of_url[url(owner, port_name, peer, bind=False)] = owner.host
    ports = {
        actor: {
            port: PortAddresses(
                bind=tuple(urls["bind"]),
                connect=tuple(urls["connect"]),
                curve_server=curve and (actor, port) in tcp_ports,
                curve_servers=tuple(owner_of_url.get(u, "") for u in urls["connect"]) if curve else (),
            )
            for port, urls in by_port.items()
        }
        for actor, by_port in result.items()
    }
    return Addresses(
        ports=ports,
        telemetry={proc: tuple(urls) for proc, urls in telemetry.items()},
        tcp_ports=tcp_ports,
        ipc_dir=ipc_dir,
        curve_hosts=owner_of_url,
    )


def _add(urls: list[str], url: str) -> None:
    if url not in urls:
        urls.append(url)


def _ipc_path(ipc_dir: str, actor: str, port: str) -> str:
    name = f"{actor}.{port}"
    if len("ipc://") + len(ipc_dir) + 1 + len(name) >= IPC_PATH_MAX:
        name = _short_hash(name)
    return f"{ipc_dir}/{name}"


def _short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# -- torch threads -------------------------------------------------------------------------


def torch_threads(topology: Topology) -> dict[str, int]:
    """Torch threads per process: explicit values, or a share of the host's cores.

    A process with ``torch_threads = 0`` gets ``max(1, floor(cores * w / W))`` where ``w``
    is the sum of its actors' ``torch_weight`` and ``W`` the sum over the host's automatic
    processes; ``w == 0`` gives 0 (the runtime leaves torch alone).
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
                threads[p] = max(1, int(cores * weights[p] / total))
        used = sum(threads[p] for p in members)
        if used > cores:
            log.warning(
                "host %s: processes use %d torch threads on %d cores (%s)",
                host_name,
                used,
                cores,
                ", ".join(f"{p}={threads[p]}" for p in members if threads[p]),
            )
    return threads


# -- resolution ----------------------------------------------------------------------------


class ResolvedPort(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    bind: list[str] = []
    connect: list[str] = []
    curve_server: bool = False
    curve_servers: list[str] = []
    """Per connect URL: the host whose CURVE server key to pin, or "" for plain."""


class ResolvedActor(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    kind: str
    config: dict[str, Any]
    """The raw table from the topology (validated at resolution, parsed again per process)."""
    ports: dict[str, ResolvedPort] = {}
    spec: str = ""
    """The ``[actors.*]`` table this actor came from (for error paths)."""


class ResolvedProcess(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str
    torch_threads: int
    actors: list[ResolvedActor]
    telemetry_connect: list[str] = []
    telemetry_curve_servers: list[str] = []
    restart: str = "never"
    max_restarts: int = 0
    restart_backoff_s: float = 1.0


class ResolvedTopology(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything the processes of one run need; written as ``topology.resolved.json``."""

    run: RunSpec
    job: JobConfig
    run_id: str
    run_dir: str
    hosts: dict[str, HostSpec]
    processes: dict[str, ResolvedProcess]
    ipc_dir: str = ""
    resume: bool = False
    """Actors restore their state from the run directory's checkpoints (``--resume``)."""
    security: SecuritySpec = dataclasses.field(default_factory=SecuritySpec)
    tcp_ports: dict[str, int] = {}
    """``"actor.port"`` -> tcp port, for endpoints reached from other hosts."""

    @classmethod
    def load(cls, path: str | Path) -> ResolvedTopology:
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)

    def dump(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")

    def actors_of(self, process: str) -> list[str]:
        return [a.name for a in self.processes[process].actors]


def resolve(topology: Topology, run_id: str, run_dir: str) -> ResolvedTopology:
    """Fix addresses, threads and configs of a validated topology for one run."""
    addresses = derive_addresses(placements(topology), topology.hosts, run_id, curve=topology.security.curve)
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
                    ports={
                        port: ResolvedPort(
                            bind=list(a.bind),
                            connect=list(a.connect),
                            curve_server=a.curve_server,
                            curve_servers=list(a.curve_servers),
                        )
                        for port, a in addresses.ports[actor.name].items()
                    },
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
        config = _parse_actor_config(cls, entry.config, f"{where}.config")
        actors.append(cls(entry.name, config, resolved.job))
        addresses[entry.name] = {
            port: PortAddresses(
                bind=tuple(p.bind),
                connect=tuple(p.connect),
                curve_server=p.curve_server,
                curve_servers=tuple(p.curve_servers),
            )
            for port, p in entry.ports.items()
        }
    return actors, addresses, list(spec.telemetry_connect)


def is_local_address(address: str) -> bool:
    """True if ``address`` names this machine (loopback or this host's name)."""
    import socket

    if address in _LOCAL_ADDRESSES or address.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return address in names


__all__ = [
    "ActorSpec",
    "Addresses",
    "HostSpec",
    "PlacedActor",
    "Placement",
    "ProcessSpec",
    "ResolvedActor",
    "ResolvedPort",
    "ResolvedProcess",
    "ResolvedTopology",
    "RunSpec",
    "Topology",
    "apply_overrides",
    "build_process",
    "check_channels",
    "derive_addresses",
    "ipc_dir_for",
    "load_topology",
    "parse_override",
    "placements",
    "resolve",
    "torch_threads",
    "validate",
]
