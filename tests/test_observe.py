"""Live metrics and health: ``/metrics`` and ``/health`` of a launched run, as a user scrapes them.

The one end-to-end check launches three processes with ``[hosts.local] metrics_port`` set,
scrapes a process's ``/metrics`` and compares it with its metrics file, then SIGSTOPs a
process and times how long the launcher's ``/health`` takes to say not-ready.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.polling import until

from echo2.actors.testing import Idle
from echo2.observe.health import heartbeat_timeout_s
from echo2.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_S = 0.5
TOPOLOGY = """
[run]
name = "observed"
heartbeat_s = {heartbeat_s}
drain_timeout_s = 5.0
deadline_s = 120.0
[hosts.local]
metrics_port = {port}
[actors.a]
kind = "idle"
[actors.b]
kind = "idle"
[actors.monitor]
kind = "heartbeat_sink"
"""


def free_port_range(count: int) -> int:
    """A first port such that it and the ``count - 1`` after it can be bound now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no free range of ports")


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2.0) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_status(port: int, path: str, status: int, timeout_s: float) -> tuple[float, bytes]:
    """Poll ``GET path`` until it answers ``status``; returns when (monotonic) and the body."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            code, body = get(port, path)
        except OSError:  # not listening yet
            code, body = 0, b""
        if code == status:
            return time.monotonic(), body
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} on port {port} did not answer {status} within {timeout_s} s: {code} {body!r}")
        time.sleep(0.02)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.timeout(120)
def test_metrics_match_the_files_and_health_turns_not_ready_when_a_process_is_stopped(tmp_path: Path) -> None:
    port = free_port_range(4)  # the launcher, then a, b, monitor (process name order)
    topology = tmp_path / "observed.toml"
    topology.write_text(textwrap.dedent(TOPOLOGY.format(heartbeat_s=HEARTBEAT_S, port=port)))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(tmp_path / "runs")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    stopped: int | None = None
    try:
        _, body = wait_status(port, "/health", 200, 60)
        health = json.loads(body)
        assert sorted(health["processes"]) == ["a", "b", "monitor"]
        assert all(view["ready"] for view in health["processes"].values())
        (run_root,) = (tmp_path / "runs").iterdir()
        run = RunDir(run_root)
        resolved = json.loads(run.topology_path.read_text())
        assert {name: p["metrics_port"] for name, p in resolved["processes"].items()} == {
            "a": port + 1,
            "b": port + 2,
            "monitor": port + 3,
        }

        # /metrics of the monitor against metrics/monitor.jsonl, written before each sample moves.
        status, text = get(port + 3, "/metrics")
        assert status == 200
        scraped = samples(text.decode())
        records = run.metrics("monitor", "heartbeat")
        key = (("actor", "monitor"), ("kind", "heartbeat"), ("process", "monitor"))
        count = int(scraped[("echo2_records_total", key)])
        assert 1 <= count <= len(records)
        last = records[count - 1]
        assert scraped[("echo2_record_heartbeat_pid", (("actor", "monitor"), ("process", "monitor")))] == last["pid"]
        seen = {r["process"] for r in records[:count]}
        stats_key = (("actor", "monitor"), ("process", "monitor"), ("record", "CustomStats"))
        assert scraped[("echo2_stats_processes_seen", stats_key)] >= len(seen)
        assert scraped[("echo2_ready", (("process", "monitor"),))] == 1.0
        launcher_metrics = samples(get(port, "/metrics")[1].decode())
        assert launcher_metrics[("echo2_process_ready", (("process", "b"),))] == 1.0

        # SIGSTOP b: it cannot answer; its launcher says not ready within one heartbeat timeout.
        stopped = json.loads(run.pids_path.read_text())["processes"]["b"]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        not_ready_at, body = wait_status(port, "/health", 503, 30)
        timeout_s = heartbeat_timeout_s(HEARTBEAT_S)
        # The last ready answer came at most one probe before the stop: not ready by then.
        print(f"not ready {not_ready_at - stopped_at:.3f} s after SIGSTOP (timeout {timeout_s:g} s)")
        assert not_ready_at - stopped_at <= timeout_s + 0.5, (not_ready_at - stopped_at, body)
        views = json.loads(body)["processes"]
        assert not views["b"]["ready"] and views["a"]["ready"] and views["monitor"]["ready"]
        assert "no answer on port" in views["b"]["reason"], views["b"]
        assert get(port, "/health/live")[0] == 200  # the launcher itself is fine

        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_status(port, "/health", 200, 30)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signal.SIGTERM, output[-3000:]
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    with pytest.raises(OSError):  # every server closed with its process
        get(port, "/health")


def test_metrics_ports_that_overlap_tcp_ports_are_one_line_and_exit_2(tmp_path: Path) -> None:
    topology = tmp_path / "clash.toml"
    topology.write_text(
        textwrap.dedent(
            """
            [hosts.a]
            address = "127.0.0.1"
            port_base = 47000
            metrics_port = 46999
            [hosts.b]
            address = "127.0.0.2"
            port_base = 48000
            [actors.sink]
            kind = "counter_sink"
            process = "sink"
            [actors.source]
            kind = "counter_source"
            process = "source"
            [processes.sink]
            host = "a"
            [processes.source]
            host = "b"
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(topology), "--dry-run", "--host", "a"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        f"{topology}: hosts.a.metrics_port: metrics ports 46999-47000 overlap ports 47000-47000 "
        "of host 'a' on the same machine (127.0.0.1); move metrics_port past the other's range\n"
    )


# -- one process's own /health and /metrics, in-process ----------------------------------------


class Recording(Idle):
    """Writes one ``ctx.record`` line per entry of ``values``, then drains until ``released``."""

    values: ClassVar[list[float]] = [0.5, 0.25]

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.released = asyncio.Event()

    async def run(self) -> None:
        for value in self.values:
            self.ctx.record("probe", loss=value, done=value < 0.3, note="not a number")
        await self.ctx.stopping.wait()
        await self.released.wait()  # a drain the test can look at


async def test_a_process_serves_its_own_readiness_and_records(tmp_path: Path) -> None:
    from echo2.observe.http import get as http_get
    from echo2.runtime import ProcessRuntime

    port = free_port_range(1)
    actor = Recording("probe")
    runtime = ProcessRuntime([actor], {}, process="main", run_dir=tmp_path, heartbeat_s=0.05, metrics_port=port)
    async with asyncio.TaskGroup() as group:
        run = group.create_task(runtime.run())
        await runtime.wait_ready()
        await until(lambda: runtime.health().ready, 5, "the first heartbeat tick")  # no event announces a tick
        status, body = await http_get(port, "/health", 2.0)
        assert status == 200, body
        health = json.loads(body)
        assert health["ready"] and health["actors"] == {"probe": "running"}
        await until(lambda: len(RunDir(tmp_path).metrics("probe", "probe")) == 2, 5, "both records")
        status, text = await http_get(port, "/metrics", 2.0)
        scraped = samples(text.decode())
        labels = (("actor", "probe"), ("process", "main"))
        assert scraped[("echo2_records_total", (("actor", "probe"), ("kind", "probe"), ("process", "main")))] == 2
        assert scraped[("echo2_record_probe_loss", labels)] == 0.25  # the last line's
        assert scraped[("echo2_record_probe_done", labels)] == 1.0
        assert not any(name.startswith("echo2_record_probe_note") for name, _ in scraped)

        runtime.request_stop("test")
        status, body = await http_get(port, "/health/ready", 2.0)
        assert status == 503 and json.loads(body)["reason"] == "stopping (test)"
        assert (await http_get(port, "/health/live", 2.0))[0] == 200
        actor.released.set()
        await run
    with pytest.raises(OSError):  # closed with the runtime
        await http_get(port, "/health", 2.0)


async def test_the_launcher_view_trusts_a_not_ready_answer_at_once_and_silence_for_one_timeout() -> None:
    from echo2.observe.health import ProcessHealth, ProcessWatch
    from echo2.observe.http import serve

    answer = {"ready": True}

    def health() -> tuple[int, str, bytes]:
        body = ProcessHealth(process="p", ready=answer["ready"], reason="" if answer["ready"] else "actors setting up")
        return (200 if body.ready else 503), "application/json", msgspec.json.encode(body)

    server = await serve(0, {"/health/ready": health})
    port = server.sockets[0].getsockname()[1]
    silent = free_port_range(1)  # nobody listens: a process that cannot answer
    watch = ProcessWatch({"p": port, "q": silent}, 0.05, lambda: {"p": 1, "q": 2})
    try:
        async with asyncio.TaskGroup() as group:
            probing = group.create_task(watch.run())
            await until(lambda: watch.health().processes["p"].ready, 5, "p ready")
            view = watch.health()
            assert not view.ready and not view.processes["q"].ready
            assert view.processes["q"].reason.startswith(f"no answer on port {silent}")
            answer["ready"] = False
            await until(lambda: not watch.health().processes["p"].ready, 5, "p not ready")
            assert watch.health().processes["p"].reason.startswith("not ready: actors setting up; last ready ")
            probing.cancel()
    finally:
        server.close()
        await server.wait_closed()
