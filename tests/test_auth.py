"""CURVE + ZAP on a remote-facing endpoint: only allow-listed keys get in.

Rejections are observed through ZeroMQ's socket monitor (handshake events), not by waiting
for a message that never comes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from tests.ports import port_bases
from zmq.utils.monitor import parse_monitor_message

from echo2.messages import Hello
from echo2.rundir import RunDir
from echo2.tools.keys import main as keys_main
from echo2.transport import Transport
from echo2.transport.auth import CurveClient, CurveServer, load_keypair, load_public_keys

pytestmark = pytest.mark.timeout(30)

FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert keys_main([str(tmp_path), "server", "worker", "stranger", "impostor"]) == 0
    (tmp_path / "allowed").mkdir()
    (tmp_path / "worker.key").rename(tmp_path / "allowed" / "worker.key")
    return tmp_path


async def _next_event(monitor: zmq.asyncio.Socket, mask: int) -> dict:
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        if event["event"] & mask:
            return event


async def test_curve_admits_allowed_keys_and_rejects_the_rest(transport: Transport, keys: Path) -> None:
    server_keys = load_keypair(keys / "server.key_secret")
    transport.enable_curve(load_public_keys([keys / "allowed"]))
    server = transport.router(name="server", bind=["tcp://127.0.0.1:0"], curve=CurveServer(server_keys))
    url = server.endpoints[0]
    monitor = server._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
    clients = []
    try:
        # An allowed worker: gets in, and its identity is its public key.
        worker = load_keypair(keys / "worker.key_secret")
        good = transport.dealer(
            name="worker", connect=[url], identity=b"claims-to-be-anyone",
            curve=CurveClient(worker, {url: server_keys.public}),
        )  # fmt: skip
        clients.append(good)
        await good.send(Hello(peer_id="w", role="sampler"))
        assert (await _next_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED))[
            "event"
        ] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        peer, hello = await server.recv()
        assert isinstance(hello, Hello)
        assert server.user_id(peer) == worker.public.decode()

        # An unknown key, a plaintext client, and a client pinning the wrong server key.
        stranger = transport.dealer(
            name="stranger", connect=[url],
            curve=CurveClient(load_keypair(keys / "stranger.key_secret"), {url: server_keys.public}),
        )  # fmt: skip
        plaintext = transport.dealer(name="plaintext", connect=[url])
        impostor_keys = load_keypair(keys / "impostor.key_secret")
        wrong_server = transport.dealer(
            name="wrong-server", connect=[url], curve=CurveClient(worker, {url: impostor_keys.public})
        )
        clients += [stranger, plaintext, wrong_server]
        for _bad in (stranger, plaintext, wrong_server):
            event = await _next_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
            assert event["event"] & FAILED, event
        assert transport._authenticator is not None and transport._authenticator.refused >= 1
        assert server.statistics().received == 1  # only the allowed worker's message
    finally:
        server._socket.disable_monitor()
        monitor.close(linger=0)
        for client in clients:
            client.close()
        server.close()


def test_two_hosts_talk_over_curve_with_allow_listed_keys(tmp_path: Path) -> None:
    """Launcher level: [security] curve = true between two hosts (both on loopback)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    keys = tmp_path / "keys"
    assert keys_main([str(keys), "a", "b"]) == 0
    (keys / "allowed").mkdir()
    (keys / "allowed" / "a.key").write_bytes((keys / "a.key").read_bytes())
    port_a, port_b = port_bases(2)
    topology = tmp_path / "topology.toml"
    topology.write_text(
        f"""
[run]
name = "curve"
drain_timeout_s = 3.0
deadline_s = 20.0
[security]
curve = true
keys_dir = "{keys}"
[hosts.a]
address = "127.0.0.1"
port_base = {port_a}
[hosts.b]
address = "127.0.0.1"
port_base = {port_b}
[processes.src]
host = "a"
[processes.dst]
host = "b"
[actors.source]
kind = "counter_source"
process = "src"
config = {{ count = 25 }}
[actors.sink]
kind = "counter_sink"
process = "dst"
"""
    )

    def launch(host: str, run_dir: Path) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "echo2.launch", str(topology), "--host", host, "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
        )  # fmt: skip

    sink = launch("b", tmp_path / "b")
    source = launch("a", tmp_path / "a")
    out_b, _ = sink.communicate(timeout=30)
    out_a, _ = source.communicate(timeout=30)
    assert sink.returncode == 0, out_b
    assert source.returncode == 0, out_a
    (run_b,) = (tmp_path / "b").iterdir()
    resolved = json.loads(RunDir(run_b).topology_path.read_text())
    resolved_port = resolved["processes"]["dst"]["actors"][0]["ports"]["in"]
    assert resolved_port["curve_server"] is True
    received = RunDir(run_b).metrics("sink")[-1]
    assert received["count"] == 25


async def test_a_port_of_trusted_actors_admits_its_hosts_keys_not_a_workers(transport: Transport, keys: Path) -> None:
    """A worker's allowed key opens the worker channels only: a CURVE server that admits
    the learner host's key alone (``CurveServer.admits``) refuses it at the handshake."""
    server_keys = load_keypair(keys / "server.key_secret")
    learner = load_keypair(keys / "impostor.key_secret")  # stands for a trusted host's key
    worker = load_keypair(keys / "worker.key_secret")  # allowed: it may use the worker channels
    transport.enable_curve(load_public_keys([keys / "allowed"]))
    open_port = transport.router(name="tasks", bind=["tcp://127.0.0.1:0"], curve=CurveServer(server_keys))
    internal = transport.router(
        name="batch", bind=["tcp://127.0.0.1:0"], curve=CurveServer(server_keys, admits=frozenset({learner.public}))
    )
    monitors = {
        ep.name: ep._socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED) for ep in (open_port, internal)
    }
    clients = []
    try:

        def client(name: str, pair, server) -> None:  # type: ignore[no-untyped-def]
            url = server.endpoints[0]
            clients.append(
                transport.dealer(name=name, connect=[url], curve=CurveClient(pair, {url: server_keys.public}))
            )

        client("worker-tasks", worker, open_port)
        event = await _next_event(monitors["tasks"], zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
        assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED  # its own channel
        client("worker-batch", worker, internal)
        event = await _next_event(monitors["batch"], zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
        assert event["event"] & FAILED, event  # allowed, but not on this port
        client("learner-batch", learner, internal)
        event = await _next_event(monitors["batch"], zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED)
        assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED  # not on the allow-list, but this port's host
        await clients[-1].send(Hello(peer_id="learner", role="learner"))
        peer, hello = await internal.recv()
        assert isinstance(hello, Hello) and internal.user_id(peer) == learner.public.decode()
        assert internal.statistics().received == 1
    finally:
        for ep in (open_port, internal):
            ep._socket.disable_monitor()
        for monitor in monitors.values():
            monitor.close(linger=0)
        for c in clients:
            c.close()
        open_port.close()
        internal.close()


def test_curve_ports_of_trusted_actors_admit_only_their_peers_hosts() -> None:
    """Derived addresses: with CURVE on, ports samplers connect to admit every allowed key;
    the Buffer's ``batch`` port (the learner's host connects) admits that host alone."""
    from echo2.topology import load_topology
    from echo2.topology.addresses import derive_addresses
    from echo2.topology.schema import placements

    root = Path(__file__).resolve().parents[1]
    # The data process moved to an edge host: the learner reaches its Buffer across hosts.
    overrides = ["security.curve=true", 'processes.data.host="edge-a"']
    topology = load_topology(root / "examples" / "multihost.toml", overrides)
    addresses = derive_addresses(placements(topology), topology.hosts, "t", curve=True)
    ports = {(actor, port): a for actor, by_port in addresses.ports.items() for port, a in by_port.items()}
    servers = {key: a for key, a in ports.items() if a.curve_server}
    assert servers, "the example has cross-host ports"
    sampler_channels = {"tasks", "rollouts", "weights", "telemetry"}
    for (actor, port), a in servers.items():
        if port in sampler_channels:
            assert a.curve_clients == (), (actor, port)
        else:
            assert a.curve_clients and all(h in topology.hosts for h in a.curve_clients), (actor, port, a)
    assert servers[("buffer", "batch")].curve_clients == ("learner",)
