"""Elastic workers: ``python -m echo2.join`` against a running job (issue 19 item 1).

The exchange (``JoinRequest`` -> ``JoinInfo``), the addresses a join port adds, a sampler
leaving with ``Goodbye``, and launched runs that samplers join from outside the topology:
one short run in the default suite, and the floor (16 joined, 8 leaving mid-run, under
cost-aware activation) behind ``-m slow``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import msgspec
import pytest
from tests.polling import until
from tests.ports import port_bases
from tests.test_actors import running
from tests.test_bounds import _welcomed

from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.sampler import Sampler
from echo2.errors import ConfigError
from echo2.job import JobConfig
from echo2.launch.join import build_samplers, join_url, main, rewrite_loopback
from echo2.launch.join_server import JoinServer
from echo2.messages import (
    PROTOCOL_VERSION,
    ExpireLease,
    Goodbye,
    GoodbyeSeen,
    JoinRequest,
    SamplerStats,
    TaskLease,
    WorkRequest,
)
from echo2.rundir import RunDir
from echo2.tools.audit import audit
from echo2.tools.keys import main as keys_main
from echo2.topology import load_topology, resolve
from echo2.transport import Transport

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / "examples" / "topology.toml"


def _resolved(*overrides: str):  # type: ignore[no-untyped-def]
    return resolve(load_topology(MAIN_JOB, ["hosts.local.join_port=29990", *overrides]), "run-1", "/tmp/run-1")


# -- the exchange --------------------------------------------------------------------------


def test_a_join_port_puts_every_channel_a_sampler_uses_on_tcp() -> None:
    resolved = _resolved()
    assert resolved.joined is not None and resolved.joined.host == "local"
    (stand_in,) = resolved.joined.actors
    for port in ("tasks", "rollouts", "weights"):
        (url,) = stand_in.ports[port].connect
        assert url.startswith("tcp://127.0.0.1:"), url
    assert all(url.startswith("tcp://") for url in resolved.joined.telemetry_connect)
    # A joined sampler's machine is unknown (often behind NAT): it dials the publisher's
    # fixed chunk-stream listener for its weights instead of waiting for a relay to reach it.
    (dial,) = stand_in.ports["weights"].stream_dial
    publisher = resolved.processes["learner"].actors
    listeners = [a.ports["weights"].stream_bind for a in publisher if a.kind == "weight_publisher"]
    assert dial.startswith("tcp://127.0.0.1:") and listeners and listeners[0].endswith(dial.rsplit(":", 1)[1])
    assert not stand_in.ports["weights"].stream_bind
    info = JoinServer(resolved).answer(JoinRequest(name="w"))
    assert info.ports["weights"].stream_dial == [dial]
    # The declared samplers on the job's host keep their ipc paths; binders bind both.
    declared = resolved.processes["sampler-0"].actors[0].ports["tasks"].connect
    assert all(url.startswith("ipc://") for url in declared)
    binds = resolved.processes["data"].actors[0].ports["tasks"].bind
    assert {url.split(":")[0] for url in binds} == {"ipc", "tcp"}
    # Without a join port nothing changes: no tcp at all on a one-host topology.
    plain = resolve(load_topology(MAIN_JOB), "run-1", "/tmp/run-1")
    assert plain.joined is None and not plain.tcp_ports


def test_join_info_gives_unique_names_the_job_and_the_portable_sampler_config() -> None:
    resolved = _resolved('actors.sampler.config.relay_host="10.0.0.9"', "actors.sampler.config.credits=3")
    server = JoinServer(resolved)
    first = server.answer(JoinRequest(name="gpu box/7", samplers=3))
    second = server.answer(JoinRequest(name="gpu box/7", samplers=2))
    assert first.accepted and second.accepted
    assert len(set(first.names + second.names)) == 5
    assert all(re.fullmatch(r"gpu-box-7-[0-9a-f]{6}-\d", name) for name in first.names), first.names
    assert msgspec.convert(first.job, JobConfig) == resolved.job
    # The declared sampler's settings, less those of its own machine.
    assert first.sampler_config["credits"] == 3 and "relay_host" not in first.sampler_config
    assert set(first.ports) == set(Sampler.ports) and first.telemetry.connect
    assert not first.curve and first.heartbeat_s == resolved.run.heartbeat_s


@pytest.mark.parametrize(
    ("request_", "stopping", "reason"),
    [
        (JoinRequest(name="w", samplers=0), False, "samplers: 0"),
        (JoinRequest(name="w", samplers=1, protocol_version=PROTOCOL_VERSION + 1), False, "protocol"),
        (JoinRequest(name="w", samplers=1), True, "stopping"),
    ],
)
def test_join_requests_it_cannot_serve_are_refused_with_a_reason(
    request_: JoinRequest, stopping: bool, reason: str
) -> None:
    info = JoinServer(_resolved(), stopping=lambda: stopping).answer(request_)
    assert not info.accepted and reason in info.reason and not info.names


def test_a_joined_sampler_takes_sets_price_and_capacity_from_its_command_line() -> None:
    info = JoinServer(_resolved()).answer(JoinRequest(name="w", samplers=2))
    samplers = build_samplers(
        info,
        ["engine=simulated", "credits=2", "job.model=somewhere/else"],
        price_per_hour=0.7,
        capacity=12.5,
    )
    assert [s.name for s in samplers] == info.names
    config = samplers[0].config
    assert (config.engine, config.credits, config.max_batch_groups) == ("simulated", 2, 8)  # 8: the declared one's
    assert (config.price_per_hour, config.capacity) == (0.7, 12.5)
    assert samplers[0].job.model == "somewhere/else"
    with pytest.raises(ConfigError, match=r"credits"):
        build_samplers(info, ['credits="2"'], price_per_hour=None, capacity=None)
    with pytest.raises(ConfigError, match=r"job.FIELD"):
        build_samplers(info, ["job.prompt_format.system=x"], price_per_hour=None, capacity=None)


def test_loopback_endpoints_are_reached_where_the_join_port_was() -> None:
    assert rewrite_loopback("tcp://127.0.0.1:28100", "learner.example") == "tcp://learner.example:28100"
    assert rewrite_loopback("tcp://10.1.2.3:28100", "learner.example") == "tcp://10.1.2.3:28100"
    assert join_url("learner.example:29000") == "tcp://learner.example:29000"
    with pytest.raises(ConfigError, match="HOST:PORT"):
        join_url("learner.example")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nowhere"], "expected HOST:PORT"),
        (["127.0.0.1:1", "--samplers", "0"], "--samplers"),
        (["127.0.0.1:1", "--key", "k.key_secret"], "--key and --server-key go together"),
        (["127.0.0.1:1", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_join_options_exit_2_with_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err


# -- leaving -------------------------------------------------------------------------------


async def test_goodbye_hands_the_leases_back_at_once(transport: Transport) -> None:
    """A sampler that leaves gets its leases expired now (ExpireLease to the Buffer), not at
    their deadlines, and the scheduler stops counting it at once."""
    job = JobConfig(groups_per_step=4, staleness=1)
    config = PromptSourceConfig(lease_ttl_s=3600.0, expiry_check_s=0.02, max_inflight_groups=16)
    source = PromptSource("ps", config, job)
    async with running(source, transport) as prefix:
        buffer_control = transport.pull(name="buf.control", bind=[f"inproc://{prefix}/peer-lease_control"])
        leaver = await _welcomed(transport, prefix, "leaver")
        try:
            await leaver.send(WorkRequest(sampler_id="leaver", credits=3, incarnation=0, installed_version=0))
            leases = [await leaver.recv() for _ in range(3)]
            assert all(isinstance(lease, TaskLease) for lease in leases)
            source.scheduler.observe_heartbeat(0.0, {"leaver": SamplerStats()})
            assert source.scheduler.available(0.0) == ["leaver"]
            await leaver.send(Goodbye(sampler_id="leaver"))
            seen = await leaver.recv()
            assert isinstance(seen, GoodbyeSeen) and seen.leases_returned == 3
            expired = [await buffer_control.recv() for _ in range(3)]
        finally:
            leaver.close()
            buffer_control.close()
        assert all(isinstance(message, ExpireLease) for message in expired)
        assert {m.lease_id for m in expired} == {lease.lease_id for lease in leases}  # type: ignore[union-attr]
        assert source.scheduler.available(0.0) == []  # gone now, not a heartbeat timeout later
        source.scheduler.observe_heartbeat(0.1, {"leaver": SamplerStats()})  # one still in flight
        assert source.scheduler.available(0.1) == []
        stats = source.statistics()
        assert (stats.samplers_left, stats.leases_returned_on_leaving) == (1, 3)
        await until(lambda: source._peers.route_of("leaver") is None, what="the name released")


# -- launched runs that samplers join ------------------------------------------------------

JOIN_TOPOLOGY = """
[run]
name = "joined"
drain_timeout_s = 3.0
deadline_s = {deadline}
heartbeat_s = 0.5

[job]
staleness = 3
group_size = 2
groups_per_step = 4
max_new_tokens = 5

[hosts.local]
port_base = {port_base}
join_port = {join_port}

[actors.prompt_source]
kind = "prompt_source"
process = "data"
config = {{ activation = "{activation}", learner_price_per_hour = 1.0, warmup_s = 2.0, activation_interval_s = 0.25, activation_record_s = 1.0, heartbeat_timeout_s = 2.0, shortfall_window_s = 1.0, surplus_window_s = 1.0, lease_ttl_s = 120.0 }}
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.learner]
kind = "learner"
process = "learner"
config = {{ max_steps = {steps}, simulated_train_s = 0.2, eval_every = 0, eval_prompts = 4, checkpoint_every = 0, log_every = 10 }}
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
"""
JOIN_ARGS = ["--set", "engine=simulated", "--set", "engine_kwargs={seconds_per_token=0.02, success_rate=0.5}"]
JOIN_ARGS += ["--set", "credits=1", "--set", "max_batch_groups=1"]


def _write_topology(
    tmp_path: Path, *, steps: int, activation: str = "all", deadline: float = 90.0, extra: str = ""
) -> Path:
    port_base, join_base = port_bases(2)
    path = tmp_path / "joined.toml"
    path.write_text(
        JOIN_TOPOLOGY.format(
            port_base=port_base, join_port=join_base, steps=steps, activation=activation, deadline=deadline
        )
        + extra
    )
    return path


def _launch(topology: Path, run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )


def _join(address: str, *args: str, log: Path) -> subprocess.Popen[str]:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "echo2.join", address, *JOIN_ARGS, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )


def _lines_until(stream: IO[str], pattern: str, seen: list[str]) -> re.Match[str]:
    for line in stream:
        seen.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError("the launcher's output ended before " + pattern + ":\n" + "".join(seen[-40:]))


def _stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(90)
def test_samplers_joined_over_curve_train_the_run_and_a_stranger_gets_no_answer(tmp_path: Path) -> None:
    """The one fast launched check: a job that declares no sampler, with [security] curve,
    trains on two samplers joined with an allowed key, which stop with it (exit 0); the
    audit holds. A worker whose key is not allowed gets no answer from the join port."""
    keys = tmp_path / "keys"
    assert keys_main([str(keys), "local", "worker", "stranger"]) == 0
    (keys / "allowed").mkdir()
    for host in ("local", "worker"):
        (keys / "allowed" / f"{host}.key").write_bytes((keys / f"{host}.key").read_bytes())
    security = f'\n[security]\ncurve = true\nkeys_dir = "{keys}"\n'
    topology = _write_topology(tmp_path, steps=8, extra=security)
    launcher = _launch(topology, tmp_path / "runs")
    procs: list[subprocess.Popen[str]] = [launcher]
    try:
        assert launcher.stdout is not None
        seen: list[str] = []
        address = _lines_until(launcher.stdout, r"python -m echo2\.join (\S+)", seen)[1]
        server_key = ["--server-key", str(keys / "local.key")]
        worker = _join(
            address, "--samplers", "2", "--name", "w", "--key", str(keys / "worker.key_secret"), *server_key,
            log=tmp_path / "join.log",
        )  # fmt: skip
        stranger = _join(
            address, "--key", str(keys / "stranger.key_secret"), *server_key, "--wait-s", "2",
            log=tmp_path / "stranger.log",
        )  # fmt: skip
        procs += [worker, stranger]
        assert stranger.wait(timeout=30) == 1
        seen += launcher.stdout.readlines()
        assert launcher.wait(timeout=60) == 0, "".join(seen[-40:])
        assert worker.wait(timeout=30) == 0, (tmp_path / "join.log").read_text()[-3000:]
    finally:
        _stop_all(procs)
    assert "did not answer within 2 s" in (tmp_path / "stranger.log").read_text()
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = RunDir(run_dir)
    assert json.loads(run.summary_path.read_text())["steps"] == 8
    report = audit([run_dir])
    assert report.ok and report.trained == 8 * 4, report
    names = re.search(r"joining run \S+ as (.+)$", (tmp_path / "join.log").read_text(), re.M)
    assert names is not None
    leased_to = {
        e["sampler"]
        for e in map(json.loads, run.ledger_path("prompt_source").read_text().splitlines())
        if e["ev"] == "leased"
    }
    assert leased_to == set(names[1].split(", "))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sixteen_join_eight_leave_mid_run_nothing_lost_and_activation_follows_its_target(tmp_path: Path) -> None:
    """The floor: 16 samplers join with echo2.join (four workers of four) under cost-aware
    activation. The cheap ones are slow (4 rollouts/s each at $0.05/h: the cheapest per
    rollout, all active, each holding its lease most of the time); the dear ones fast
    (20/s at $0.9/h: one or two fill the target). Mid-run both cheap workers leave with
    Ctrl-C. Their leases go back at once (not at the 120 s lease TTL), the scheduler drops
    them and activates dear ones to meet its target, and the audit finds nothing lost or
    duplicated."""
    steps = 140
    topology = _write_topology(tmp_path, steps=steps, activation="cost_aware", deadline=200.0)
    launcher = _launch(topology, tmp_path / "runs")
    procs: list[subprocess.Popen[str]] = [launcher]
    slow = ["--set", "engine_kwargs={seconds_per_token=0.1, success_rate=0.5}", "--price-per-hour", "0.05"]
    fast = ["--price-per-hour", "0.9"]
    try:
        assert launcher.stdout is not None
        seen: list[str] = []
        address = _lines_until(launcher.stdout, r"python -m echo2\.join (\S+)", seen)[1]
        workers = {
            name: _join(address, "--samplers", "4", "--name", name, *args, log=tmp_path / f"{name}.log")
            for name, args in (("cheap-a", slow), ("cheap-b", slow), ("dear-a", fast), ("dear-b", fast))
        }
        procs += workers.values()
        # Mid-run, once the scheduler has settled past its warm-up.
        _lines_until(launcher.stdout, r"\[learner\].* step 60 ", seen)
        for name in ("cheap-a", "cheap-b"):
            workers[name].send_signal(signal.SIGINT)
        for name in ("cheap-a", "cheap-b"):
            assert workers[name].wait(timeout=30) == 128 + signal.SIGINT, (tmp_path / f"{name}.log").read_text()[-2000:]
        seen += launcher.stdout.readlines()
        assert launcher.wait(timeout=150) == 0, "".join(seen[-60:])
        for name in ("dear-a", "dear-b"):
            assert workers[name].wait(timeout=30) == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
    finally:
        _stop_all(procs)
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = RunDir(run_dir)
    joined = {
        name: re.search(r"joining run \S+ as (.+)$", (tmp_path / f"{name}.log").read_text(), re.M)[1].split(", ")  # type: ignore[index]
        for name in workers
    }
    assert sum(len(names) for names in joined.values()) == 16
    leavers = set(joined["cheap-a"] + joined["cheap-b"])
    dear = set(joined["dear-a"] + joined["dear-b"])

    report = audit([run_dir])
    assert report.ok, report
    assert not report.lost and not report.duplicated and report.trained == steps * 4, report

    # Every leaver said Goodbye, and the leases it held went back at once.
    data_log = run.log_path("data").read_text()
    left = dict(re.findall(r"sampler (\S+) left \(.*\); re-issuing its (\d+) leases", data_log))
    assert set(left) == leavers, data_log[-3000:]
    returned = sum(int(n) for n in left.values())
    assert returned > 0, "the leavers held no lease when they left: the check below is empty"
    events = [e for path in run.ledger_dir.glob("*.jsonl") for e in map(json.loads, path.read_text().splitlines())]
    leased_to = {e["lease"]: e["sampler"] for e in events if e["ev"] == "leased"}
    expired_at = {e["lease"]: e["t"] for e in events if e["ev"] == "lease_closed" and e["outcome"] == "expired"}
    handed_back = [
        expired_at[lease] for lease, sampler in leased_to.items() if sampler in leavers and lease in expired_at
    ]
    assert len(handed_back) >= returned
    assert max(handed_back) - min(handed_back) < 10.0  # together, at the leave: the TTL is 120 s

    # The active set follows the target: all the cheap ones while they are there (the
    # cheapest per rollout); at the leave, at once, dear ones enough to meet the target
    # (already active, or activated then); never a leaver again.
    activations = [r for r in run.metrics("prompt_source") if r["kind"] == "activation"]
    drops = [i for i, r in enumerate(activations) if "dropped unavailable" in r["reason"]]  # one per worker, or one
    assert drops and leavers <= set(activations[drops[0] - 1]["active"]), activations[drops[0] - 1]
    assert set().union(*(activations[i]["parked"] for i in drops)) == leavers
    assert all(activations[i]["active_mu"] >= activations[i]["target_mu"] for i in drops), [
        activations[i] for i in drops
    ]
    after = activations[drops[-1] :]
    assert all(set(r["active"]) <= dear for r in after), after[0]
    last = activations[-1]
    assert last["active_mu"] >= last["target_mu"] * 0.9, last
