"""Address derivation: every port's URLs from placement alone, the same on every host.

``derive_addresses(placements, hosts, run_id)`` is pure. A binder binds ``inproc://`` when a
connector shares its process, ``ipc://`` when one shares its host from another process, and
``tcp://`` when one is on another host, with ports assigned deterministically from the
host's ``port_base`` (sorted by (actor, port)), so every host computes the same ones from
the same file. Each connector gets one URL per binder of its channel, by the same relation.

The runtime of every process publishes heartbeats to all binders of channel ``telemetry``
(``Addresses.telemetry``), so those binders are reachable from every process.

Binders listen on their host's ``bind`` address (every interface by default) and are
reached at its ``address`` (IPv6 literals in brackets): behind NAT the two differ.

Weight inboxes (``PortAddresses.stream_bind``): each weight receiver (a connector of channel
``weights``) whose publisher or chain peers are on other hosts gets a fixed tcp port for its
chunk-stream relay inbox, after its host's binders (so a firewall opens ``port_base`` and
the few ports after it, never an ephemeral one). On a host with ``inbound = false`` it gets
none: it dials the publisher's chunk-stream listener instead (``stream_dial``), which then
gets the next port of the publisher's host.

Derivation refuses (``ConfigError`` naming the host's field) what could not connect: a tcp
port past 65535; a binder that other hosts reach on a host whose ``address`` is a loopback
one (or omitted: 127.0.0.1) while other hosts of the topology have real addresses (all
loopback is one machine, which works), or on a host with ``inbound = false``; a ``bind``
that is not an IP address; and two hosts at one address (one machine: binders bind every
interface) whose tcp port ranges overlap.

``topology_addresses(topology, run_id)`` derives a topology's, with the stand-in for joined
samplers (``schema.joined_placement``) when a host serves joins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import socket
from collections.abc import Mapping, Sequence

from echo2.actor import PortAddresses
from echo2.errors import ConfigError
from echo2.messages import TELEMETRY_CHANNEL, WEIGHTS_CHANNEL
from echo2.topology.schema import (
    HostSpec,
    Placement,
    Topology,
    channel_of,
    check_channels,
    joined_placement,
    placements,
)
from echo2.transport.urls import is_ipv6_literal, url_host

IPC_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS
INBOX = "inbox"
"""The ``tcp_ports`` key, beside an actor's name, of its chunk-stream listener."""
_LOCAL_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclasses.dataclass(frozen=True)
class Addresses:
    """Derived URLs: per actor and port, and per process the telemetry binders to reach."""

    ports: dict[str, dict[str, PortAddresses]]
    telemetry: dict[str, tuple[str, ...]]
    tcp_ports: dict[tuple[str, str], int]
    """(actor, port) -> tcp port, for binders that other hosts connect to, and (actor,
    ``INBOX``) for chunk-stream listeners (weight inboxes, the publisher's dial-in)."""
    ipc_dir: str
    curve_hosts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Connect URL -> host of the CURVE server behind it (CURVE on only)."""
    metrics_ports: dict[str, int] = dataclasses.field(default_factory=dict)
    """Process -> port of its ``/metrics`` and ``/health`` (absent: off; ``HostSpec.metrics_port``)."""


def ipc_dir_for(run_id: str, run_dir: str = "") -> str:
    """Directory of this run's ipc sockets (short: socket paths must stay < 100 chars).

    ``run_dir`` (the run directory's path) tells apart runs of the same name started in the
    same second from different parent directories: their run ids are equal, their
    directories are not, and sharing one ipc directory would make each talk to the other."""
    directory = f"/tmp/echo2-{run_id}" + (f"-{_short_hash(run_dir)[:8]}" if run_dir else "")
    if len(directory) > 48:
        directory = f"/tmp/echo2-{_short_hash(run_id + run_dir)}"
    return directory


def derive_addresses(
    places: Sequence[Placement],
    hosts: Mapping[str, HostSpec],
    run_id: str,
    *,
    curve: bool = False,
    run_dir: str = "",
) -> Addresses:
    """Give every port of every placed actor its bind and connect URLs. Pure.

    A binder binds inproc when a connector shares its process, ipc when one shares its host
    from another process, tcp when one is on another host; with no connector it binds
    inproc. Each connector gets one URL per binder of its channel, by the same relation.
    """
    check_channels(places)
    _check_binds(hosts)
    ipc_dir = ipc_dir_for(run_id, run_dir)
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
    inboxes, dialers = _weight_inboxes(binders, connectors, hosts)
    tcp_ports: dict[tuple[str, str], int] = {}
    for host in sorted({*needs_tcp, *(pl.host for pl in inboxes)}):
        base = hosts[host].port_base
        # Binders first, in (actor, port) order, then this host's chunk-stream listeners.
        keys = sorted(needs_tcp.get(host, [])) + sorted((pl.actor, INBOX) for pl in inboxes if pl.host == host)
        for offset, key in enumerate(keys):
            if base + offset > 65535:
                raise ConfigError(f"tcp ports from {base} run past 65535", path=f"hosts.{host}.port_base")
            tcp_ports[key] = base + offset
        if any(key[1] == INBOX for key in keys):
            needs_tcp.setdefault(host, []).extend(key for key in keys if key[1] == INBOX)
    _check_reachable(binders, connectors, telemetry_peers, hosts)
    _check_inbound(binders, connectors, telemetry_peers, hosts)
    metrics_ports = _metrics_ports(process_hosts, hosts)
    _check_port_ranges(needs_tcp, hosts, process_hosts)

    def url(owner: Placement, port_name: str, peer: Placement, *, bind: bool) -> str:
        if peer.process == owner.process:
            return f"inproc://echo2-{run_id}/{owner.actor}/{port_name}"
        if peer.host == owner.host:
            return f"ipc://{_ipc_path(ipc_dir, owner.actor, port_name)}"
        port = tcp_ports[(owner.actor, port_name)]
        return _tcp_url(hosts[owner.host], port, bind=bind)

    def dial(owner: Placement, peer: Placement) -> str:
        """The chunk-stream listener ``peer`` dials on ``owner`` (a publisher), if it must."""
        if peer.actor not in dialers or (owner.actor, INBOX) not in tcp_ports:
            return ""
        return _tcp_url(hosts[owner.host], tcp_ports[(owner.actor, INBOX)], bind=False)

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
            result[owner.actor].setdefault(port_name, {"bind": [], "connect": [], "dial": []})["bind"] = binds
            for peer in peers:
                for peer_port, spec in peer.ports.items():
                    if not spec.bind and channel_of(peer_port, spec) == channel:
                        entry = result[peer.actor].setdefault(peer_port, {"bind": [], "connect": [], "dial": []})
                        connect = url(owner, port_name, peer, bind=False)
                        if connect not in entry["connect"]:
                            entry["connect"].append(connect)
                            entry["dial"].append(dial(owner, peer) if channel == WEIGHTS_CHANNEL else "")
            for peer in extra:
                _add(telemetry[peer.process], url(owner, port_name, peer, bind=False))
    # With CURVE on, a binder reachable from other hosts is a CURVE server on all its
    # endpoints, so every connection to it (same host too) must be a CURVE client.
    owner_of_url = {}
    admitted: dict[tuple[str, str], tuple[str, ...]] = {}  # (actor, port) -> client hosts, () = any
    for channel, owners in binders.items():
        for owner, port_name in owners:
            if curve and (owner.actor, port_name) in tcp_ports:
                for peer in [*connectors.get(channel, []), *telemetry_peers]:
                    owner_of_url[url(owner, port_name, peer, bind=False)] = owner.host
                peers = connectors.get(channel, [])
                # Every process publishes telemetry, workers' too; other ports used only by
                # trusted actors admit the keys of their hosts alone.
                if channel != TELEMETRY_CHANNEL and all(peer.trusted for peer in peers):
                    admitted[(owner.actor, port_name)] = tuple(sorted({peer.host for peer in peers}))
    by_actor = {pl.actor: pl for pl in places}

    def stream(actor: str, port: str) -> tuple[str, str]:
        """(bind, announce) URLs of the actor's chunk-stream listener beside its weights port."""
        number = tcp_ports.get((actor, INBOX))
        if number is None or channel_of(port, by_actor[actor].ports[port]) != WEIGHTS_CHANNEL:
            return "", ""
        spec = hosts[by_actor[actor].host]
        # A loopback address is not one to announce (the receiver finds its own address on
        # the route to its publisher, as before ports were fixed).
        return _tcp_url(spec, number, bind=True), "" if _is_loopback(spec.address) else _tcp_url(
            spec, number, bind=False
        )

    ports = {
        actor: {
            port: PortAddresses(
                bind=tuple(urls["bind"]),
                connect=tuple(urls["connect"]),
                curve_server=curve and (actor, port) in tcp_ports,
                curve_servers=tuple(owner_of_url.get(u, "") for u in urls["connect"]) if curve else (),
                curve_clients=admitted.get((actor, port), ()),
                stream_bind=stream(actor, port)[0],
                stream_announce=stream(actor, port)[1],
                stream_dial=tuple(urls["dial"]) if any(urls["dial"]) else (),
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
        metrics_ports=metrics_ports,
    )


def topology_addresses(topology: Topology, run_id: str, run_dir: str = "") -> Addresses:
    """The addresses of a validated topology's ports, joined samplers' included (under
    ``JOINED_SAMPLER`` in ``ports`` and ``telemetry``) when a host has a ``join_port``."""
    places, hosts = placements(topology), dict(topology.hosts)
    joined = joined_placement(topology)
    if joined is not None:
        place, spec = joined
        places.append(place)
        hosts[place.host] = spec
    return derive_addresses(places, hosts, run_id, curve=topology.security.curve, run_dir=run_dir)


def _weight_inboxes(
    binders: Mapping[str, list[tuple[Placement, str]]],
    connectors: Mapping[str, list[Placement]],
    hosts: Mapping[str, HostSpec],
) -> tuple[list[Placement], set[str]]:
    """(actors that get a fixed chunk-stream port, weight receivers that dial instead).

    A weight receiver whose publisher or another receiver (a chain peer) is on another host
    is reached over tcp: on a host that accepts inbound connections it listens on a fixed
    port; on one that does not it dials its publishers, which then listen on one."""
    publishers = [owner for owner, _ in binders.get(WEIGHTS_CHANNEL, [])]
    receivers = list({pl.actor: pl for pl in connectors.get(WEIGHTS_CHANNEL, [])}.values())
    listeners: list[Placement] = []
    dialers: set[str] = set()
    for receiver in receivers:
        if not any(peer.host != receiver.host for peer in [*publishers, *receivers]):
            continue
        if hosts[receiver.host].inbound:
            listeners.append(receiver)
        else:
            dialers.add(receiver.actor)
    dialed = {r.host for r in receivers if r.actor in dialers}
    listeners += [p for p in publishers if any(host != p.host for host in dialed)]
    return listeners, dialers


def _metrics_ports(process_hosts: Mapping[str, str], hosts: Mapping[str, HostSpec]) -> dict[str, int]:
    """Per process, the port of its ``/metrics`` and ``/health``: on a host with
    ``metrics_port = P`` its launcher serves P and its processes, in name order, P+1, P+2, ..."""
    ports: dict[str, int] = {}
    for host, spec in hosts.items():
        if spec.metrics_port == 0:
            continue
        members = sorted(proc for proc, at in process_hosts.items() if at == host)
        if spec.metrics_port + len(members) > 65535:
            raise ConfigError(
                f"metrics ports from {spec.metrics_port} run past 65535", path=f"hosts.{host}.metrics_port"
            )
        for offset, proc in enumerate(members, 1):
            ports[proc] = spec.metrics_port + offset
    return ports


def _check_reachable(
    binders: Mapping[str, list[tuple[Placement, str]]],
    connectors: Mapping[str, list[Placement]],
    telemetry_peers: Sequence[Placement],
    hosts: Mapping[str, HostSpec],
) -> None:
    """A binder that peers on other hosts connect to needs an address they can reach."""
    if all(_is_loopback(hosts[pl.host].address) for pl in telemetry_peers):
        return  # every host holding a process is this machine
    found = []
    for channel, owners in binders.items():
        peers = connectors.get(channel, []) + (list(telemetry_peers) if channel == TELEMETRY_CHANNEL else [])
        for owner, port_name in owners:
            remote = [pl for pl in peers if pl.host != owner.host]
            if remote and _is_loopback(hosts[owner.host].address):
                found.append((owner.host, owner.actor, port_name, remote[0]))
    if found:
        host, actor, port_name, peer = min(found, key=lambda f: f[:3])
        who = peer.actor or f"process {peer.process}"
        raise ConfigError(
            f"{hosts[host].address!r} is a loopback address, but {who} on host {peer.host!r} connects to "
            f"{actor}.{port_name} here; set the address other hosts reach {host!r} at",
            path=f"hosts.{host}.address",
        )


def _check_port_ranges(
    needs_tcp: Mapping[str, list[tuple[str, str]]], hosts: Mapping[str, HostSpec], process_hosts: Mapping[str, str]
) -> None:
    """Hosts at one address are one machine (binders bind every interface): no shared tcp
    port, whether an endpoint's or a metrics server's (a launcher's and its processes')."""
    wanted: list[tuple[str, str, int, int]] = []  # (host, field, first port, last port)
    for host in sorted(hosts):
        spec = hosts[host]
        if needs_tcp.get(host):
            wanted.append((host, "port_base", spec.port_base, spec.port_base + len(needs_tcp[host]) - 1))
        if spec.metrics_port:
            processes = sum(1 for at in process_hosts.values() if at == host)
            wanted.append((host, "metrics_port", spec.metrics_port, spec.metrics_port + processes))
        if spec.join_port:
            wanted.append((host, "join_port", spec.join_port, spec.join_port))
    ranges: list[tuple[str, str, str, int, int]] = []  # (machine, host, field, first port, last port)
    for host, field, first, last in wanted:
        spec = hosts[host]
        machine = "loopback" if _is_loopback(spec.address) else spec.address.lower()
        what = {"port_base": "tcp ports", "metrics_port": "metrics ports", "join_port": "join port"}[field]
        for other_machine, other, other_field, other_first, other_last in ranges:
            if other_machine == machine and first <= other_last and other_first <= last:
                theirs = {"port_base": "", "metrics_port": " (its metrics ports)", "join_port": " (its join port)"}[
                    other_field
                ]
                raise ConfigError(
                    f"{what} {first}-{last} overlap ports {other_first}-{other_last} of host {other!r}{theirs} "
                    f"on the same machine ({spec.address}); move {field} past the other's range",
                    path=f"hosts.{host}.{field}",
                )
        ranges.append((machine, host, field, first, last))


def _check_inbound(
    binders: Mapping[str, list[tuple[Placement, str]]],
    connectors: Mapping[str, list[Placement]],
    telemetry_peers: Sequence[Placement],
    hosts: Mapping[str, HostSpec],
) -> None:
    """No binder that other hosts connect to on a host that accepts no inbound connection."""
    for channel, owners in sorted(binders.items()):
        peers = connectors.get(channel, []) + (list(telemetry_peers) if channel == TELEMETRY_CHANNEL else [])
        for owner, port_name in owners:
            remote = [pl for pl in peers if pl.host != owner.host]
            if remote and not hosts[owner.host].inbound:
                who = remote[0].actor or f"process {remote[0].process}"
                raise ConfigError(
                    f"host {owner.host!r} accepts no inbound connection, but {who} on host {remote[0].host!r} "
                    f"connects to {owner.actor}.{port_name} there; place {owner.actor} on a host others can reach",
                    path=f"hosts.{owner.host}.inbound",
                )


def _check_binds(hosts: Mapping[str, HostSpec]) -> None:
    """A host's ``bind`` is one of its interface addresses: an IP literal, of the family of
    its ``address`` when that is one too."""
    for name, spec in sorted(hosts.items()):
        if not spec.bind:
            continue
        try:
            bound = ipaddress.ip_address(spec.bind)
        except ValueError:
            raise ConfigError(
                f"{spec.bind!r} is not an IP address (bind names an interface address of this host, "
                f"e.g. its private address behind NAT; leave it out to listen on every interface)",
                path=f"hosts.{name}.bind",
            ) from None
        try:
            advertised = ipaddress.ip_address(spec.address)
        except ValueError:
            continue  # a hostname: its family is the resolver's
        if advertised.version != bound.version:
            raise ConfigError(
                f"bind {spec.bind!r} is IPv{bound.version} but address {spec.address!r} is IPv{advertised.version}",
                path=f"hosts.{name}.bind",
            )


def _tcp_url(spec: HostSpec, port: int, *, bind: bool) -> str:
    """Where a host's endpoint on ``port`` listens (``bind``) or is reached."""
    if not bind:
        return f"tcp://{url_host(spec.address)}:{port}"
    if spec.bind:
        return f"tcp://{url_host(spec.bind)}:{port}"
    return f"tcp://[::]:{port}" if is_ipv6_literal(spec.address) else f"tcp://*:{port}"


def _is_loopback(address: str) -> bool:
    return address.lower() in _LOCAL_ADDRESSES or address.startswith("127.")


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


def is_local_address(address: str) -> bool:
    """True if ``address`` names this machine (loopback or this host's name)."""
    if address in _LOCAL_ADDRESSES or address.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return address in names


__all__ = [
    "INBOX",
    "IPC_PATH_MAX",
    "Addresses",
    "derive_addresses",
    "ipc_dir_for",
    "is_local_address",
    "topology_addresses",
]
