"""The launcher, run as users run it: ``python -m echo2.launch`` in a subprocess.

Synchronisation is on the launcher's own output (banner lines, child log lines) and on
process exit, never on sleeps.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from tests.ports import SPAN, port_bases, ports_free

from echo2.launch import main, select_processes
from echo2.rundir import RunDir
from echo2.topology import load_topology
from echo2.topology.preflight import EPHEMERAL_RANGE_FILE

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "examples" / "smoke.toml"
LAUNCH = [sys.executable, "-m", "echo2.launch"]


def launch(*args: str | Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def start(*args: str | Path, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*LAUNCH, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        preexec_fn=preexec_fn,
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


def wait_ready(proc: subprocess.Popen[str], seen: list[str], names: set[str]) -> None:
    """Until every named idle child's runtime is up (its signal handlers are installed)."""
    assert proc.stdout is not None
    while names:
        line = read_until(proc.stdout, lambda s: "running until stopped" in s, seen)
        names.discard(line[1 : line.index("]")])


def wait_gone(pids: dict[str, int], timeout_s: float) -> None:
    """Poll until none of ``pids`` runs (a zombie no one reaps counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [name for name, pid in pids.items() if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"still running after {timeout_s} s: {alive}"


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition on the run's files until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat[stat.rindex(")") + 2] != "Z"


def _default_sighup() -> None:  # in the launcher before exec: a test run under nohup ignores SIGHUP
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_stop_signal_drains_children_and_writes_status(tmp_path: Path, sig: signal.Signals) -> None:
    topology = write(tmp_path, IDLE.format(drain=10.0, stubborn="false"))
    with start(topology, "--run-dir", tmp_path / "runs", preexec_fn=_default_sighup) as proc:
        seen: list[str] = []
        wait_ready(proc, seen, {"a", "b"})
        run = RunDir(the_run_dir(tmp_path / "runs"))
        pids = json.loads(run.pids_path.read_text())["processes"]
        proc.send_signal(sig)
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert proc.wait() == 128 + sig, "".join(seen) + rest  # the test's timeout bounds a hang
    assert f"stopping ({sig.name} received)" in rest
    # Drained, not cut short: each actor returned by itself before any deadline passed.
    assert "a: actor a finished" in rest and "b: actor b finished" in rest, rest
    assert "cancelling actors" not in rest and "killing" not in rest, rest
    status = json.loads(run.status_path.read_text())
    assert status == {"exit_code": 128 + sig, "reason": f"{sig.name} received", "processes": {"a": 0, "b": 0}}
    assert "a: actor a finished" in run.log_path("a").read_text()  # the drain's output reached the log
    assert f"echo2: run {run.name} interrupted: {sig.name} received (exit {128 + sig})" in rest, rest
    assert_gone(pids)
    assert not Path(json.loads(run.topology_path.read_text())["ipc_dir"]).exists()


ORPHANS = (
    IDLE.format(drain=10.0, stubborn="false")
    + """
[actors.source]
kind = "counter_source"
config = { count = 0 }
[actors.sink]
kind = "counter_sink"
config = { expected_producers = 2 }   # one never comes: the sink waits, bound on ipc
"""
)


@pytest.mark.timeout(40)
def test_children_of_a_killed_launcher_drain_and_log_to_their_files(tmp_path: Path) -> None:
    topology = write(tmp_path, ORPHANS)
    with start(topology, "--run-dir", tmp_path / "runs") as proc:
        wait_ready(proc, [], {"a", "b"})
        run = RunDir(the_run_dir(tmp_path / "runs"))
        ipc_dir = Path(json.loads(run.topology_path.read_text())["ipc_dir"])
        wait_for(lambda: ipc_dir.is_dir() and any(ipc_dir.iterdir()), 20, "the sink's ipc socket")
        pids = json.loads(run.pids_path.read_text())["processes"]
        proc.kill()  # SIGKILL: the launcher can do nothing; the kernel tells its children
        proc.wait()
    wait_gone(pids, timeout_s=20)
    assert not ipc_dir.exists()  # the last child out removed it
    for name in ("a", "b"):
        log = run.log_path(name).read_text()
        assert "running until stopped" in log  # copied by the launcher while it lived
        assert f"launcher (pid {proc.pid}) exited" in log and f"actor {name} finished" in log, log
    # The last process out wrote the status the launcher could not.
    status = json.loads(run.status_path.read_text())
    assert status["exit_code"] == 137 and set(status["processes"]) == set(pids), status
    # The source (count = 0) may have finished before the launcher died: its exit is unknown.
    assert {status["processes"][name] for name in ("a", "b", "sink")} == {0}, status
    assert "the launcher died before the run ended" in status["reason"]


STARVED = """
[run]
name = "starved"
drain_timeout_s = 20.0
[job]
groups_per_step = 2
group_size = 2
[processes.main]
[actors.prompt_source]
kind = "prompt_source"
process = "main"
[actors.rewarder]
kind = "rewarder"
process = "main"
[actors.buffer]
kind = "buffer"
process = "main"
[actors.learner]
kind = "learner"
process = "main"
config = { max_steps = 5, eval_prompts = 4, eval_every = 0, warmup_steps = 0 }
[actors.weight_publisher]
kind = "weight_publisher"
process = "main"
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "stop",
    [pytest.param("SIGINT", marks=pytest.mark.slow), "deadline", pytest.param("max_wall_s", marks=pytest.mark.slow)],
)
def test_a_starved_learner_stopped_writes_its_summary_and_exits_non_zero(tmp_path: Path, stop: str) -> None:
    # No sampler: no batch ever reaches the learner, which waits until it is stopped. The
    # deadline may pass while the learner's process still starts (imports, the model): it
    # drains all the same.
    topology = write(tmp_path, STARVED)
    deadline = {
        "deadline": ["--set", "run.deadline_s=3.0"],
        "max_wall_s": ["--set", "actors.learner.config.max_wall_s=1.0"],  # the learner's own budget
    }.get(stop, [])
    with start(topology, "--run-dir", tmp_path / "runs", *deadline) as proc:
        seen: list[str] = []
        assert proc.stdout is not None
        if stop == "SIGINT":
            read_until(proc.stdout, lambda s: "step 0: held-out" in s, seen)  # the learner's loop began
            proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        code = proc.wait()
    expected_code, reason = {
        "SIGINT": (130, "SIGINT received"),
        "deadline": (124, "deadline of 3 s reached before the run completed"),
        "max_wall_s": (124, "process 'main' stopped (max_wall_s) before training any step"),
    }[stop]
    assert code == expected_code, "".join(seen) + rest
    run = RunDir(the_run_dir(tmp_path / "runs"))
    summary = json.loads(run.summary_path.read_text())
    stopped_by = "max_wall_s" if stop == "max_wall_s" else "stop_request"
    assert summary["steps"] == 0 and summary["max_steps"] == 5 and summary["stopped_by"] == stopped_by
    stopped = "wall-clock budget reached" if stop == "max_wall_s" else "stopped before max_steps"
    assert f"done ({stopped}): 0 of 5 steps" in rest, rest
    assert "cancelling actors" not in rest, rest  # it returned by itself, well before the drain deadline
    status = json.loads(run.status_path.read_text())
    assert status["exit_code"] == expected_code and status["reason"] == f"{reason} (0 steps trained)"
    outcome = "interrupted" if stop == "SIGINT" else "INCOMPLETE"
    assert f"echo2: run {run.name} {outcome}: {reason} (0 steps trained) (exit {expected_code})" in rest, rest


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, to fill or make read-only (needs root, as CI and this project's machines have)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _fill(directory: Path) -> None:
    """Write a file in ``directory`` until its file system has no block left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        chunk = b"\0" * 65536
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return
    finally:
        os.close(fd)


@pytest.mark.timeout(30)
def test_a_full_disk_stops_the_run_with_one_line(tiny_disk: Path) -> None:
    topology = write(tiny_disk.parent, IDLE.format(drain=10.0, stubborn="false"))
    with start(topology, "--run-dir", tiny_disk / "runs") as proc:
        seen: list[str] = []
        wait_ready(proc, seen, {"a", "b"})
        run = RunDir(the_run_dir(tiny_disk / "runs"))
        pids = json.loads(run.pids_path.read_text())["processes"]
        # tmpfs counts whole pages: pad a's log to a page boundary, so that the next line
        # the launcher copies there needs a page the full disk no longer has.
        log_a = run.log_path("a")
        with open(log_a, "a") as pad:
            pad.write("#" * (-(log_a.stat().st_size + 1) % os.sysconf("SC_PAGE_SIZE")) + "\n")
        _fill(tiny_disk)
        os.kill(pids["a"], signal.SIGTERM)  # a logs that it stops: the launcher's write fails
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert proc.wait() == 1, "".join(seen) + rest
    error = f"cannot write {log_a}: No space left on device (ENOSPC)"
    assert f"echo2: {error}\n" in rest, rest
    assert "Traceback" not in rest and "killing" not in rest, rest  # the launcher neither crashed nor killed
    assert "b: actor b finished" in rest, rest  # b drained on the launcher's SIGTERM
    assert f"echo2: status not written: cannot write {run.status_path}: No space left on device" in rest, rest
    assert f"echo2: run {run.name} FAILED: {error} (exit 1)" in rest, rest
    assert_gone(pids)


def test_a_read_only_run_directory_is_one_line(tiny_disk: Path) -> None:
    run = RunDir(tiny_disk / "run")
    run.logs_dir.mkdir(parents=True)
    run.topology_path.write_text("{}")  # a run directory, as far as --resume looks before writing
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    result = launch(SMOKE, "--resume", run.root, "--allow-changes")  # "{}" differs in every field
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == (
        f"echo2: cannot write {run.resume_topology_path(1).parent}: Read-only file system (EROFS); nothing started\n"
    )


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


def _two_port_bases() -> dict[str, int]:
    port_a, port_b = port_bases(2)
    return {"port_a": port_a, "port_b": port_b}


MULTI_HOST = """
[run]
name = "mh"
drain_timeout_s = 5.0
deadline_s = 60.0
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


@pytest.mark.timeout(30)
def test_two_hosts_meet_over_tcp(tmp_path: Path) -> None:
    topology = write(tmp_path, MULTI_HOST.format(**_two_port_bases()))
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


def test_a_tcp_port_in_use_stops_the_launch_with_one_line_naming_port_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port_a, port_b = port_bases(2)
    topology = write(tmp_path, MULTI_HOST.format(port_a=port_a, port_b=port_b))
    with socket.socket() as squatter:  # another program listening on host b's first port
        squatter.bind(("", port_b))
        squatter.listen()
        assert main([str(topology), "--host", "b", "--dry-run", "--run-dir", str(tmp_path)]) == 2
        assert main([str(topology), "--host", "a", "--dry-run", "--run-dir", str(tmp_path)]) == 0  # a binds none of b's
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"{topology}: hosts.b.port_base: tcp port {port_b} (sink.in) is in use on this machine; "
        "stop what holds it or move port_base"
    ), err


@pytest.mark.skipif(not EPHEMERAL_RANGE_FILE.exists(), reason="no Linux procfs: no ephemeral port range to read")
def test_ports_in_the_ephemeral_range_get_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
    base = next(b for b in range(low, high - SPAN, 97) if ports_free(b, SPAN))
    topology = write(tmp_path, MULTI_HOST.format(port_a=port_bases(1)[0], port_b=base))
    assert main([str(topology), "--host", "b", "--dry-run", "--run-dir", str(tmp_path)]) == 0
    assert f"note: hosts.b.port_base: tcp ports {base}-" in capsys.readouterr().err


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


TWO_HOST_JOB = """
[run]
name = "ends"
drain_timeout_s = 5.0
deadline_s = 90.0
[job]
staleness = 2
group_size = 2
groups_per_step = 2
max_new_tokens = 5
[hosts.a]
address = "127.0.0.1"
port_base = {port_a}
[hosts.b]
address = "127.0.0.1"
port_base = {port_b}
[processes.data]
host = "a"
[processes.learner]
host = "a"
[processes.edge]
host = "b"
[actors.prompt_source]
kind = "prompt_source"
process = "data"
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.learner]
kind = "learner"
process = "learner"
config = {{ max_steps = 4, simulated_train_s = 0.05, eval_every = 0, eval_prompts = 2, checkpoint_every = 0 }}
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
[actors.sampler]
kind = "sampler"
process = "edge"
config = {{ engine = "simulated", engine_kwargs = {{ seconds_per_token = 0.001, success_rate = 0.5 }}, credits = 2 }}
"""


@pytest.mark.timeout(100)
def test_a_workers_only_host_stops_when_the_run_ends_not_at_its_deadline(tmp_path: Path) -> None:
    """The learner's host finishes the run; the edge host's launcher, which holds only a
    sampler, hears RunEnded from the PromptSource and exits 0 (not 124 at ``deadline_s``)."""
    topology = write(tmp_path, TWO_HOST_JOB.format(**_two_port_bases()))
    with start(topology, "--host", "b", "--run-dir", tmp_path / "b") as edge:
        with start(topology, "--host", "a", "--run-dir", tmp_path / "a") as learner_host:
            out_a, _ = learner_host.communicate(timeout=80)
            assert learner_host.returncode == 0, out_a
            out_b, _ = edge.communicate(timeout=15)  # well before its 90 s deadline
    assert edge.returncode == 0, out_b
    assert "the run is over" in out_b and "completed the run" in out_b, out_b
    assert "did not acknowledge the end of the run" not in out_a, out_a  # the sampler's EndOfStreamMsg came back
    status = json.loads(RunDir(the_run_dir(tmp_path / "b")).status_path.read_text())
    assert status["exit_code"] == 0 and status["processes"] == {"edge": 0}, status


# The learner's process once aborted at exit, a finished run reported FAILED: an executor
# thread that ran torch code runs its thread-local destructors after Python's join of it
# returned, and one that needs the GIL during the interpreter's finalization aborts the
# process (``terminate called without an active exception``; pytorch issue 117762). Many
# Python objects in torch's thread-local storage make the window wide enough to hit always.
TORCH_TLS_AT_EXIT = """
import asyncio, logging, sys
import torch
from echo2.launch.exits import exit_process

def work():
    for i in range(50_000):
        torch._C._stash_obj_in_tls(f"k{i}", object())

async def main():
    await asyncio.to_thread(work)

asyncio.run(main())
logging.basicConfig(stream=sys.stderr)
logging.getLogger("t").warning("the last log line")
print("the last output line")
if sys.argv[1] == "exit_process":
    exit_process(0)
"""


def _exit_with_torch_objects_in_thread_local_storage(tmp_path: Path, how: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "tls_at_exit.py"
    script.write_text(TORCH_TLS_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.timeout(90)
def test_a_finished_process_exits_cleanly_whatever_torch_keeps_in_its_threads(tmp_path: Path) -> None:
    """How every launched process ends (``exits.exit_process``): exit 0, and nothing said
    before it is lost."""
    done = _exit_with_torch_objects_in_thread_local_storage(tmp_path, "exit_process")
    assert done.returncode == 0, done.stderr
    assert "the last log line" in done.stderr and done.stdout == "the last output line\n"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_interpreters_own_exit_aborts_with_torch_objects_in_thread_local_storage(tmp_path: Path) -> None:
    """The cause, kept as a check of its own: when this turns red, torch (or Python) no
    longer aborts there, and ``exit_process`` may give finalization back."""
    done = _exit_with_torch_objects_in_thread_local_storage(tmp_path, "interpreter")
    assert done.returncode == -signal.SIGABRT, done
    assert "terminate called without an active exception" in done.stderr
