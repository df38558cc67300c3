"""Topology: schema, one-line validation errors, overrides, placement, addresses, threads, resolution."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest

from echo2.actor import Port, PortAddresses
from echo2.actors import load_actor_class
from echo2.actors.testing import CounterSink, CounterSource, Idle
from echo2.errors import ConfigError
from echo2.job import JobConfig
from echo2.topology import (
    HostSpec,
    Placement,
    ResolvedTopology,
    build_process,
    derive_addresses,
    load_topology,
    parse_override,
    resolve,
    torch_threads,
    validate,
)
from echo2.topology.addresses import INBOX

SMOKE = """
[run]
name = "t"

[actors.source]
kind = "counter_source"
replicas = 2
process = "source-{i}"
config = { count = 10 }

[actors.sink]
kind = "counter_sink"
config = { expected_producers = 2 }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    message = str(info.value)
    assert "\n" not in message
    return message


def counters(**extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "actors": {
            "source": {"kind": "counter_source"},
            "sink": {"kind": "counter_sink"},
        }
    }
    for key, value in extra.items():
        raw[key] = value
    return raw


# -- valid topologies (every example: tests/test_config.py) -----------------------------


def test_smoke_topology_defaults_and_placement(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, SMOKE))
    assert topology.run.name == "t" and topology.run.drain_timeout_s == 10.0
    assert topology.run.deadline_s == 0.0 and topology.run.run_dir == "runs"
    assert topology.job == JobConfig()
    assert list(topology.hosts) == ["local"] and topology.hosts["local"].address == "127.0.0.1"
    assert {n: a.process for n, a in topology.actors.items()} == {
        "source-0": "source-0",
        "source-1": "source-1",
        "sink": "sink",
    }
    assert topology.actors["source-1"].cls is CounterSource
    assert topology.actors["source-1"].config == CounterSource.Config(count=10)
    assert topology.actors["sink"].config == CounterSink.Config(expected_producers=2)


def test_replicas_without_index_share_one_process() -> None:
    raw = counters()
    raw["actors"]["source"].update(replicas=3, process="sources")
    topology = validate(raw)
    assert [a.name for a in topology.actors_in("sources")] == ["source-0", "source-1", "source-2"]
    assert set(topology.processes) == {"sources", "sink"}


def test_replicas_without_process_get_one_process_each() -> None:
    raw = counters()
    raw["actors"]["source"]["replicas"] = 2
    assert set(validate(raw).processes) == {"source-0", "source-1", "sink"}


def test_declared_processes_and_templates() -> None:
    raw = counters(
        hosts={"a": {}, "b": {"address": "10.0.0.2"}},
        processes={"main": {"host": "a", "torch_threads": 3}, "worker-{i}": {"host": "b"}},
    )
    raw["actors"]["sink"]["process"] = "main"
    raw["actors"]["source"].update(replicas=2, process="worker-{i}")
    topology = validate(raw)
    assert topology.processes["main"].torch_threads == 3
    assert topology.processes["worker-1"].host == "b"
    assert "worker-{i}" not in topology.processes


def test_load_actor_class_by_path() -> None:
    assert load_actor_class("echo2.actors.testing:Idle") is Idle
    assert load_actor_class("idle") is Idle


# -- one-line errors with the field path -------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            counters(actors={"sink": {"kind": "counter_sink", "config": {"expected_producers": "x"}}}),
            "actors.sink.config.expected_producers: Expected `int`, got `str`",
        ),
        (
            counters(actors={"sink": {"kind": "counter_sink", "config": {"expected_producers": 0}}}),
            "actors.sink.config.expected_producers: Expected `int` >= 1",
        ),
        (
            counters(actors={"sink": {"kind": "counter_sink", "config": {"typo": 1}}}),
            "actors.sink.config.typo: unknown field (allowed: expected_producers)",
        ),
        (
            counters(job={"temperature": "hot"}),
            "job.temperature: Expected `float`, got `str`",
        ),
        (counters(job={"staleness": -1}), "job.staleness: Expected `int` >= 0"),
        (counters(jobs={}), "jobs: unknown table (allowed: run, job, hosts, processes, actors, security)"),
        (
            counters(run={"nmae": "x"}),
            "run.nmae: unknown field (allowed: name, run_dir, drain_timeout_s, heartbeat_s, deadline_s, "
            "record, record_max_mb, metric_writers, wandb_project, wandb_mode)",
        ),
        (counters(run={"heartbeat_s": 0}), "run.heartbeat_s: Expected `float` > 0.0"),
        (counters(run="x"), "run: expected a table, got str"),
        (
            counters(actors={"sink": {"kind": "counter_sink", "replica": 2}}),
            "actors.sink.replica: unknown field (allowed: kind, process, replicas, config)",
        ),
        (counters(actors={"sink": {"process": "p"}}), "actors.sink.kind: missing required field"),
        (
            counters(actors={"sink": {"kind": "counter_sink", "replicas": 0}}),
            "actors.sink.replicas: Expected `int` >= 1",
        ),
        (
            counters(
                processes={"p": {}},
                actors={"sink": {"kind": "counter_sink", "process": "x"}},
            ),
            "actors.sink.process: unknown process 'x' (declared: p)",
        ),
        (counters(processes={"p": {"host": "h"}}), "processes.p.host: unknown host 'h'"),
        (
            counters(hosts={"h": {}}),
            "actors.source.process: process 'source' is on unknown host 'local' "
            "(declare [processes.source] with a host)",
        ),
        (counters(hosts={"h": {"port_base": 70000}}), "hosts.h.port_base: Expected `int` <= 65535"),
        (
            {"actors": {"sink": {"kind": "counter_sink", "replicas": 2}, "sink-1": {"kind": "idle"}}},
            "actors.sink-1: duplicate actor name 'sink-1' (from actors.sink and actors.sink-1)",
        ),
        (
            {"actors": {"x": {"kind": "foo:Bar"}}},
            "actors.x.kind: cannot import 'foo:Bar': ModuleNotFoundError: No module named 'foo'",
        ),
        (
            {"actors": {"x": {"kind": "echo2.actors.testing:Nope"}}},
            "actors.x.kind: cannot import 'echo2.actors.testing:Nope': AttributeError: "
            "module 'echo2.actors.testing' has no attribute 'Nope'",
        ),
        (
            {"actors": {"x": {"kind": "echo2.errors:ConfigError"}}},
            "actors.x.kind: 'echo2.errors:ConfigError' is not an echo2 Actor class",
        ),
        (
            {"actors": {"source": {"kind": "counter_source"}}},
            "actors.source.ports.out: no actor binds channel 'numbers'",
        ),
        ({"actors": {"a.b": {"kind": "idle"}}}, "actors.a.b: name must match [A-Za-z0-9_][A-Za-z0-9_-]*"),
        (
            {"run": {"name": "a b"}, "actors": {"i": {"kind": "idle"}}},
            "run.name: Expected a name of letters, digits, '_' and '-', not starting with '-', got 'a b'",
        ),
        ({}, "actors: the topology has no actors"),
    ],
)
def test_validation_errors_are_one_line_with_the_field_path(raw: dict[str, Any], expected: str) -> None:
    assert error_of(raw) == expected


def test_unknown_registry_kind_lists_the_known_ones() -> None:
    message = error_of({"actors": {"x": {"kind": "samplr"}}})
    assert message.startswith("actors.x.kind: unknown kind 'samplr' (known: ")
    assert "counter_sink" in message and "sampler" in message


def test_toml_syntax_error_is_one_line_with_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "[run]\nname = \n")
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert str(info.value) == "invalid TOML: Invalid value (at line 2, column 8)"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot read: No such file or directory$"):
        load_topology(tmp_path / "nope.toml")


# -- overrides ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "keys", "value"),
    [
        ("job.staleness=0", ["job", "staleness"], 0),
        ("run.drain_timeout_s=2.5", ["run", "drain_timeout_s"], 2.5),
        ('run.name="x y"', ["run", "name"], "x y"),
        ("run.name=plain", ["run", "name"], "plain"),
        ("job.task_kwargs={ digits = 2 }", ["job", "task_kwargs"], {"digits": 2}),
        ("a.b=[1, 2]", ["a", "b"], [1, 2]),
        ("flag = true", ["flag"], True),
        ("path=/tmp/x=y", ["path"], "/tmp/x=y"),
    ],
)
def test_parse_override(text: str, keys: list[str], value: Any) -> None:
    assert parse_override(text) == (keys, value)


@pytest.mark.parametrize("text", ["novalue", "=1", "a..b=1"])
def test_malformed_override(text: str) -> None:
    with pytest.raises(ConfigError, match="expected path=value"):
        parse_override(text)


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    path = write(tmp_path, SMOKE)
    topology = load_topology(
        path,
        [
            "job.staleness=0",
            "run.drain_timeout_s=2.5",
            'run.name="renamed"',
            "actors.source.replicas=4",
            "actors.source.config.count=50",
            "actors.sink.config.expected_producers=4",
            "hosts.local.cores=3",
        ],
    )
    assert topology.job.staleness == 0
    assert topology.run.drain_timeout_s == 2.5 and topology.run.name == "renamed"
    assert sorted(topology.processes) == ["sink", "source-0", "source-1", "source-2", "source-3"]
    assert topology.actors["source-3"].config == CounterSource.Config(count=50)
    assert topology.hosts["local"].cores == 3


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actors.sink.config.nope=1", "actors.sink.config.nope: unknown field (allowed: expected_producers)"),
        ("job.nope=1", "job.nope: unknown field"),
        (
            "actors.sink.config.expected_producers=many",
            "actors.sink.config.expected_producers: Expected `int`, got `str`",
        ),
        ("actors.new.replicas=2", "actors.new.kind: missing required field"),
        ("run.name.x=1", "--set 'run.name.x=1': run.name is not a table"),
    ],
)
def test_override_errors(tmp_path: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(write(tmp_path, SMOKE), [override])
    assert str(info.value).startswith(expected)


# -- address derivation ------------------------------------------------------------------

PUSH = {"out": Port("push", bind=False, channel="numbers")}
PULL = {"in": Port("pull", bind=True, channel="numbers")}
HOSTS = {"a": HostSpec(address="10.0.0.1", port_base=5000), "b": HostSpec(address="10.0.0.2", port_base=6000)}


def test_same_process_is_inproc() -> None:
    derived = derive_addresses([Placement("src", "p", "a", PUSH), Placement("sink", "p", "a", PULL)], HOSTS, "r1")
    assert derived.ports["sink"]["in"] == PortAddresses(bind=("inproc://echo2-r1/sink/in",))
    assert derived.ports["src"]["out"] == PortAddresses(connect=("inproc://echo2-r1/sink/in",))
    assert derived.tcp_ports == {}


def test_same_host_other_process_is_ipc() -> None:
    derived = derive_addresses([Placement("src", "p1", "a", PUSH), Placement("sink", "p2", "a", PULL)], HOSTS, "r1")
    url = "ipc:///tmp/echo2-r1/sink.in"
    assert derived.ports["sink"]["in"] == PortAddresses(bind=(url,))
    assert derived.ports["src"]["out"] == PortAddresses(connect=(url,))
    assert derived.ipc_dir == "/tmp/echo2-r1"


def test_other_host_is_tcp_with_deterministic_ports() -> None:
    places = [
        Placement("src", "p1", "a", PUSH),
        Placement("sink-b", "p2", "b", PULL),
        Placement("sink-a", "p3", "b", {**PULL, "extra": Port("pull", bind=True, channel="numbers")}),
    ]
    derived = derive_addresses(places, HOSTS, "r1")
    # sorted by (actor, port) on host b: sink-a.extra, sink-a.in, sink-b.in
    assert derived.tcp_ports == {("sink-a", "extra"): 6000, ("sink-a", "in"): 6001, ("sink-b", "in"): 6002}
    assert derived.ports["sink-b"]["in"] == PortAddresses(bind=("tcp://*:6002",))
    assert derived.ports["src"]["out"].connect == (
        "tcp://10.0.0.2:6002",  # one URL per binder, in placement order
        "tcp://10.0.0.2:6001",
        "tcp://10.0.0.2:6000",
    )
    # A different run id changes nothing for tcp: every host derives the same ports.
    assert derive_addresses(places, HOSTS, "other-run").tcp_ports == derived.tcp_ports


def test_binder_with_mixed_connectors_binds_every_medium() -> None:
    places = [
        Placement("sink", "p", "a", PULL),
        Placement("near", "p", "a", PUSH),
        Placement("local", "q", "a", PUSH),
        Placement("far", "r", "b", PUSH),
    ]
    derived = derive_addresses(places, HOSTS, "r1")
    assert derived.ports["sink"]["in"].bind == (
        "inproc://echo2-r1/sink/in",
        "ipc:///tmp/echo2-r1/sink.in",
        "tcp://*:5000",
    )
    assert derived.ports["near"]["out"].connect == ("inproc://echo2-r1/sink/in",)
    assert derived.ports["local"]["out"].connect == ("ipc:///tmp/echo2-r1/sink.in",)
    assert derived.ports["far"]["out"].connect == ("tcp://10.0.0.1:5000",)


WEIGHTS_PUB = {"weights": Port("router", bind=True)}
WEIGHTS_SUB = {"weights": Port("dealer", bind=False)}


def test_relay_inboxes_take_fixed_ports_after_the_hosts_binders_and_listen_on_bind() -> None:
    hosts = {
        "a": HostSpec(address="10.0.0.1", port_base=5000),
        "b": HostSpec(address="203.0.113.7", bind="192.168.1.5", port_base=6000),  # NAT, ports forwarded
        "c": HostSpec(address="2001:db8::3", port_base=7000),
    }
    places = [
        Placement("pub", "p", "a", WEIGHTS_PUB),
        Placement("s-b2", "q", "b", WEIGHTS_SUB),
        Placement("s-b1", "q", "b", {**WEIGHTS_SUB, **PULL}),
        Placement("s-c", "r", "c", WEIGHTS_SUB),
        Placement("src", "p", "a", PUSH),
    ]
    derived = derive_addresses(places, hosts, "r1")
    # Host b: its binder first, then the inboxes by actor name; never an ephemeral port.
    assert derived.tcp_ports[("s-b1", "in")] == 6000
    assert (derived.tcp_ports[("s-b1", INBOX)], derived.tcp_ports[("s-b2", INBOX)]) == (6001, 6002)
    b1 = derived.ports["s-b1"]["weights"]
    assert (b1.stream_bind, b1.stream_announce) == ("tcp://192.168.1.5:6001", "tcp://203.0.113.7:6001")
    assert derived.ports["s-b1"]["in"].bind == ("tcp://192.168.1.5:6000",)
    assert derived.ports["src"]["out"].connect == ("tcp://203.0.113.7:6000",)
    c = derived.ports["s-c"]["weights"]  # IPv6: brackets, and every interface is [::]
    assert (c.stream_bind, c.stream_announce) == ("tcp://[::]:7000", "tcp://[2001:db8::3]:7000")
    assert derived.ports["s-c"]["weights"].connect == ("tcp://10.0.0.1:5000",)
    assert ("pub", INBOX) not in derived.tcp_ports  # nobody dials: the publisher needs no listener


def test_a_host_that_accepts_no_connection_dials_the_publisher() -> None:
    hosts = {**HOSTS, "n": HostSpec(address="10.0.0.9", inbound=False, port_base=7000)}
    places = [Placement("pub", "p", "a", WEIGHTS_PUB), Placement("s-n", "q", "n", WEIGHTS_SUB)]
    derived = derive_addresses(places, hosts, "r1")
    assert ("s-n", INBOX) not in derived.tcp_ports
    assert derived.tcp_ports[("pub", INBOX)] == 5001  # after the publisher's own binder (5000)
    assert derived.ports["s-n"]["weights"].stream_dial == ("tcp://10.0.0.1:5001",)
    assert derived.ports["pub"]["weights"].stream_bind == "tcp://*:5001"
    # Nothing other hosts connect to may run behind it.
    with pytest.raises(ConfigError, match="accepts no inbound connection") as info:
        derive_addresses([Placement("sink", "p", "n", PULL), Placement("src", "q", "a", PUSH)], hosts, "r1")
    assert info.value.path == "hosts.n.inbound"


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (HostSpec(address="10.0.0.1", bind="eth0"), "is not an IP address"),
        (HostSpec(address="10.0.0.1", bind="::1"), "is IPv6 but address '10.0.0.1' is IPv4"),
    ],
)
def test_a_bind_that_is_not_an_interface_address_is_refused(spec: HostSpec, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        derive_addresses([Placement("sink", "p", "x", PULL)], {"x": spec}, "r1")
    assert info.value.path == "hosts.x.bind"


def test_binder_without_connectors_still_binds_inproc() -> None:
    derived = derive_addresses([Placement("sink", "p", "a", PULL)], HOSTS, "r1")
    assert derived.ports["sink"]["in"].bind == ("inproc://echo2-r1/sink/in",)


def test_channel_defaults_to_port_name() -> None:
    places = [
        Placement("a", "p", "a", {"tasks": Port("router", bind=True)}),
        Placement("b", "p", "a", {"tasks": Port("dealer", bind=False)}),
    ]
    assert derive_addresses(places, HOSTS, "r").ports["b"]["tasks"].connect == ("inproc://echo2-r/a/tasks",)
    with pytest.raises(ConfigError, match=r"^actors\.b\.ports\.tasks: no actor binds channel 'tasks'$"):
        derive_addresses(places[1:], HOSTS, "r")


def test_telemetry_reaches_every_process() -> None:
    monitor = {"hb": Port("sub", bind=True, channel="telemetry")}
    places = [
        Placement("mon", "p", "a", monitor),
        Placement("x", "q", "a", {}),
        Placement("y", "r", "b", {}),
    ]
    derived = derive_addresses(places, HOSTS, "r1")
    assert derived.telemetry == {
        "p": ("inproc://echo2-r1/mon/hb",),
        "q": ("ipc:///tmp/echo2-r1/mon.hb",),
        "r": ("tcp://10.0.0.1:5000",),
    }
    assert set(derived.ports["mon"]["hb"].bind) == {
        "inproc://echo2-r1/mon/hb",
        "ipc:///tmp/echo2-r1/mon.hb",
        "tcp://*:5000",
    }


def test_ipc_paths_stay_short() -> None:
    long = "x" * 60
    places = [
        Placement(long, "p1", "a", {long: Port("pull", bind=True)}),
        Placement("c", "p2", "a", {long: Port("push", bind=False)}),
    ]
    derived = derive_addresses(places, HOSTS, "r" * 80)
    (url,) = derived.ports[long][long].bind
    assert url.startswith("ipc:///tmp/echo2-") and len(url) < 100


def test_runs_of_one_name_started_in_the_same_second_from_two_directories_get_two_ipc_directories(
    tmp_path: Path,
) -> None:
    topology = load_topology(write(tmp_path, SMOKE))
    first = resolve(topology, "smoke-20260101-000000", str(tmp_path / "a" / "smoke-20260101-000000"))
    second = resolve(topology, "smoke-20260101-000000", str(tmp_path / "b" / "smoke-20260101-000000"))
    assert first.ipc_dir != second.ipc_dir
    again = resolve(topology, "smoke-20260101-000000", str(tmp_path / "a" / "smoke-20260101-000000"))
    assert again.ipc_dir == first.ipc_dir  # a --resume of the same run dir finds its own


# -- torch threads -----------------------------------------------------------------------


def idle_topology(weights: dict[str, float], cores: int, **process_threads: int) -> dict[str, Any]:
    return {
        "hosts": {"h": {"cores": cores}},
        "processes": {name: {"host": "h", "torch_threads": process_threads.get(name, 0)} for name in weights},
        "actors": {
            name: {"kind": "idle", "process": name, "config": {"torch_weight": w}} for name, w in weights.items()
        },
    }


def test_torch_threads_share_cores_by_weight() -> None:
    threads = torch_threads(validate(idle_topology({"learner": 3.0, "sampler": 1.0, "buffer": 0.0}, 8)))
    assert threads == {"learner": 6, "sampler": 2, "buffer": 0}


def test_torch_threads_explicit_values_win() -> None:
    threads = torch_threads(validate(idle_topology({"a": 1.0, "b": 1.0}, 8, a=5)))
    assert threads == {"a": 5, "b": 8}


def test_torch_threads_at_least_one_and_oversubscription_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    weights = {f"s{i}": 1.0 for i in range(4)}
    with caplog.at_level(logging.WARNING, logger="echo2.topology"):
        threads = torch_threads(validate(idle_topology(weights, 2)))
    assert threads == {name: 1 for name in weights}
    assert "4 torch threads on 2 cores" in caplog.text


def test_torch_threads_sum_within_cores() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    threads = torch_threads(validate(idle_topology(weights, 16)))
    assert sum(threads.values()) <= 16 and min(threads.values()) == 5


# -- resolution --------------------------------------------------------------------------


def test_resolved_json_round_trip_and_build_process(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, SMOKE), ["actors.source.config.batch=5"])
    resolved = resolve(topology, "t-20250101-000000", str(tmp_path / "run"))
    path = tmp_path / "topology.resolved.json"
    resolved.dump(path)
    loaded = ResolvedTopology.load(path)
    assert loaded == resolved
    assert loaded.run_id == "t-20250101-000000" and loaded.run_dir == str(tmp_path / "run")
    assert loaded.actors_of("sink") == ["sink"]
    assert loaded.processes["source-0"].actors[0].config == {"count": 10, "batch": 5}

    actors, addresses, telemetry = build_process(loaded, "source-1")
    (source,) = actors
    assert isinstance(source, CounterSource) and source.name == "source-1"
    assert source.config == CounterSource.Config(count=10, batch=5)
    assert source.job == topology.job
    assert addresses == {"source-1": {"out": PortAddresses(connect=(f"ipc://{loaded.ipc_dir}/sink.in",))}}
    assert loaded.ipc_dir.startswith("/tmp/echo2-t-20250101-000000-")
    assert telemetry == []
    with pytest.raises(ConfigError, match="unknown process 'nope'"):
        build_process(loaded, "nope")


def test_resolve_keeps_kind_as_written() -> None:
    topology = validate({"actors": {"c": {"kind": "echo2.actors.testing:Idle"}}})
    resolved = resolve(topology, "r", "/tmp/r")
    assert resolved.processes["c"].actors[0].kind == "echo2.actors.testing:Idle"
    actors, _, _ = build_process(resolved, "c")
    assert isinstance(actors[0], Idle)
