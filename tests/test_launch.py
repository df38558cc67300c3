"""The launcher, run as users run it: ``python -m echo2.launch`` in a subprocess.

Synchronisation is on the launcher's own output (banner lines, child log lines) and on
process exit, never on sleeps.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from echo2.launch import main, select_processes
from echo2.rundir import RunDir
from echo2.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "examples" / "smoke.toml"
LAUNCH = [sys.executable, "-m", "echo2.launch"]


def launch(*args: str | Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*LAUNCH, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )


def read_until(stream: IO[str], predicate: Callable[[str], bool], seen: list[str]) -> str:
    """Read lines until one matches (pytest-timeout bounds a launcher that never prints it)."""
    for line in stream:
        seen.append(line)
        if predicate(line):
            return line
    raise AssertionError("output ended before the expected line:\n" + "".join(seen))


def the_run_dir(parent: Path) -> Path:
    (run_dir,) = parent.iterdir()
    return run_dir


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(textwrap.dedent(text))
    return path


def assert_gone(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
            print(f"process {name} (pid {pid}) is still alive")


def test_smoke_runs_to_completion(tmp_path: Path) -> None:
    result = launch(SMOKE, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = the_run_dir(tmp_path)
    run = RunDir(run_dir)
    assert run_dir.name.startswith("smoke-")
    resolved = json.loads(run.topology_path.read_text())
    assert resolved["run_id"] == run_dir.name and resolved["run_dir"] == str(run_dir)
    assert sorted(resolved["processes"]) == ["sink", "source-0", "source-1"]
    assert sorted(p.name for p in run.log_paths()) == ["sink.log", "source-0.log", "source-1.log"]
    assert "actor sink finished" in run.log_path("sink").read_text()
    received = run.metrics("sink")[-1]
    assert received["count"] == 2000 and received["complete"]
    status = json.loads(run.status_path.read_text())
    assert status["exit_code"] == 0 and set(status["processes"].values()) == {0}
    assert "[sink] " in result.stdout and "completed the run" in result.stdout
    assert_gone(json.loads(run.pids_path.read_text())["processes"])
    assert not Path(resolved["ipc_dir"]).exists()


def test_set_reaches_the_children(tmp_path: Path) -> None:
    result = launch(SMOKE, "--run-dir", tmp_path, "--set", "actors.source.config.count=7", "--set", "run.name=small")
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = the_run_dir(tmp_path)
    assert run_dir.name.startswith("small-")
    received = RunDir(run_dir).metrics("sink")[-1]
    assert received["count"] == 14


def test_failing_actor_fails_the_run(tmp_path: Path) -> None:
    topology = write(
        tmp_path,
        """
        [run]
        name = "fail"
        drain_timeout_s = 5.0
        [actors.boom]
        kind = "failing"
        config = { after_s = 0.1, message = "injected failure" }
        [actors.calm]
        kind = "idle"
        """,
    )
    result = launch(topology, "--run-dir", tmp_path / "runs")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "echo2: process 'boom' (actors boom) failed with exit code 1" in result.stderr
    assert "RuntimeError: injected failure" in result.stdout
    status = json.loads(RunDir(the_run_dir(tmp_path / "runs")).status_path.read_text())
    assert status["processes"] == {"boom": 1, "calm": 0}  # calm drained on SIGTERM


def test_bad_field_exits_2_with_one_line(tmp_path: Path) -> None:
    result = launch(SMOKE, "--run-dir", tmp_path, "--set", "actors.sink.config.expected_producers=two")
    assert result.returncode == 2
    assert result.stderr == (f"{SMOKE}: actors.sink.config.expected_producers: Expected `int`, got `str`\n")
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "run.nope=1"], "run.nope: unknown field"),
        (["--host", "elsewhere"], "--host: unknown host 'elsewhere' (hosts: local)"),
        (["--set", "novalue"], "--set 'novalue': expected path=value"),
    ],
)
def test_bad_options_exit_2_in_process(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SMOKE), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{SMOKE}: {expected}")


def test_unknown_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SMOKE), "--bogus"]) == 2
    assert capsys.readouterr().err == "python -m echo2.launch: unrecognized arguments: --bogus\n"


def test_dry_run_prints_the_resolved_topology(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main([str(SMOKE), "--dry-run", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert '"run_id": "smoke-' in out and "source-1 (counter_source)" in out
    assert list(tmp_path.iterdir()) == []


IDLE = """
[run]
name = "idle"
drain_timeout_s = {drain}
[actors.a]
kind = "idle"
[actors.b]
kind = "idle"
config = {{ ignore_stop = {stubborn} }}
"""


@pytest.mark.timeout(30)
def test_sigint_stops_everything_gracefully(tmp_path: Path) -> None:
    topology = write(tmp_path, IDLE.format(drain=10.0, stubborn="false"))
    with start(topology, "--run-dir", tmp_path / "runs") as proc:
        seen: list[str] = []
        assert proc.stdout is not None
        ready = {"a", "b"}
        while ready:  # every child's runtime is up (its signal handlers are installed)
            line = read_until(proc.stdout, lambda s: "running until stopped" in s, seen)
            ready.discard(line[1 : line.index("]")])
        run_dir = the_run_dir(tmp_path / "runs")
        pids = json.loads(RunDir(run_dir).pids_path.read_text())["processes"]
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait() == 130, "".join(seen) + rest  # the test's timeout bounds a hang
    assert "stopping (SIGINT received)" in rest
    # Drained, not cut short: each actor returned by itself before any deadline passed.
    assert "a: actor a finished" in rest and "b: actor b finished" in rest, rest
    assert "cancelling actors" not in rest and "killing" not in rest, rest
    assert json.loads(RunDir(run_dir).status_path.read_text())["processes"] == {"a": 0, "b": 0}
    assert_gone(pids)


@pytest.mark.timeout(30)
def test_second_sigint_kills_children_that_do_not_drain(tmp_path: Path) -> None:
    topology = write(tmp_path, IDLE.format(drain=60.0, stubborn="true"))
    with start(topology, "--run-dir", tmp_path / "runs") as proc:
        seen: list[str] = []
        assert proc.stdout is not None
        read_until(proc.stdout, lambda s: "ignoring stop requests" in s, seen)
        run_dir = the_run_dir(tmp_path / "runs")
        pids = json.loads(RunDir(run_dir).pids_path.read_text())["processes"]
        proc.send_signal(signal.SIGINT)
        read_until(proc.stdout, lambda s: "stopping (SIGINT received)" in s, seen)
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait() == 130, "".join(seen) + rest  # the test's timeout bounds a hang
    # Killed by the second signal, not by the drain deadline (60 s, past the test's timeout).
    assert re.search(r"echo2: killing (a, )?b: second signal \(SIGINT\)", rest), rest  # a may be gone
    assert "still running" not in rest, rest
    assert json.loads(RunDir(run_dir).status_path.read_text())["processes"]["b"] == -signal.SIGKILL
    assert_gone(pids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


MULTI_HOST = """
[run]
name = "mh"
drain_timeout_s = 5.0
deadline_s = 60.0
[hosts.a]
address = "127.0.0.1"
[hosts.b]
address = "127.0.0.1"
port_base = {port}
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


@pytest.mark.timeout(30)
def test_two_hosts_meet_over_tcp(tmp_path: Path) -> None:
    topology = write(tmp_path, MULTI_HOST.format(port=_free_port()))
    assert select_processes(load_topology(topology), "b") == ["dst"]
    assert select_processes(load_topology(topology), None) == ["src", "dst"]  # both local
    with start(topology, "--host", "b", "--run-dir", tmp_path / "b") as sink:
        with start(topology, "--host", "a", "--run-dir", tmp_path / "a") as source:
            out_b, _ = sink.communicate(timeout=20)
            out_a, _ = source.communicate(timeout=20)
    assert sink.returncode == 0, out_b
    assert source.returncode == 0, out_a
    received = RunDir(the_run_dir(tmp_path / "b")).metrics("sink")[-1]
    assert received["count"] == 25


def test_only_the_learner_process_spins_its_openmp_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from echo2.launch import Child, Launcher

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    launcher = object.__new__(Launcher)  # _child_env reads nothing from the launcher

    def env(critical: bool) -> dict[str, str]:
        child = Child(name="p", actors=[], completes_run=False, torch_threads=2, log=io.StringIO(), critical=critical)
        return launcher._child_env(child)

    assert env(critical=True)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert env(critical=False)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env(critical=False)["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a user's own setting wins
    assert env(critical=True)["OMP_WAIT_POLICY"] == "PASSIVE"
