"""Faults a real fleet has: a sampler process killed with SIGKILL, twice, mid-run; the data
process (PromptSource, Rewarder, Buffer) killed with SIGKILL mid-run.

The launcher restarts it (``restart = "on-failure"``), the restarted sampler catches up on
weights, its old leases are expired and re-issued, and the run finishes its steps with no
rollout trained twice. A restarted data process continues from its journals: the learner
and the samplers find it again, and the audit finds every task at an end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from echo2.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(condition, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    """Poll a file-backed condition (the run's own outputs) until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _learner_steps(run: Path) -> int:
    return max((record["step"] for record in RunDir(run).metrics("learner", "step")), default=0)


def _sampler_pid(run: Path, name: str) -> int | None:
    try:
        return json.loads(RunDir(run).pids_path.read_text())["processes"].get(name)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _audited(run: Path) -> dict:
    """``python -m echo2.audit RUN --json``, which must pass: nothing lost, unresolved,
    accepted twice, trained twice or accepted late."""
    audit = subprocess.run(
        [sys.executable, "-m", "echo2.audit", str(run), "--json"], capture_output=True, text=True, timeout=60
    )
    report = json.loads(audit.stdout)
    assert audit.returncode == 0, audit.stdout
    for violation in ("lost", "unresolved", "accepted_twice", "duplicated", "late_accepted"):
        assert report[violation] == [], (violation, report)
    return report


@pytest.mark.timeout(240)
def test_sampler_killed_twice_is_restarted_and_nothing_is_trained_twice(tmp_path: Path) -> None:
    steps = 70
    command = [
        sys.executable, "-m", "echo2.launch", str(ROOT / "examples" / "topology.toml"),
        "--run-dir", str(tmp_path),
        "--set", f"actors.learner.config.max_steps={steps}",
        "--set", "actors.learner.config.eval_prompts=100",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.prompt_source.config.lease_ttl_s=5.0",
        "--set", 'processes.sampler-{i}.restart="on-failure"',
        "--set", "processes.sampler-{i}.restart_backoff_s=0.2",
    ]  # fmt: skip
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run = _wait_for(lambda: next((p for p in tmp_path.iterdir() if p.is_dir()), None), 30, "the run dir")
        killed = []
        for target_step in (10, 30):
            _wait_for(
                lambda target_step=target_step: _learner_steps(run) >= target_step, 90, f"learner step {target_step}"
            )
            pid = _sampler_pid(run, "sampler-0")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            _wait_for(lambda: _sampler_pid(run, "sampler-0") not in (None, *killed), 30, "the restart")
        output, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, output[-4000:]
    assert output.count("restarted process 'sampler-0'") == 2, output[-4000:]
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == steps
    assert summary["rollouts_trained_twice"] == 0
    assert summary["staleness_max"] <= 3
    report = _audited(run)
    assert report["trained"] == steps * 16


@pytest.mark.slow  # ~30 s: the default suite keeps the sampler-kill check; -m slow runs this
@pytest.mark.timeout(300)
def test_learner_killed_then_resumed_trains_nothing_twice(tmp_path: Path) -> None:
    steps = 50
    common = [
        "--run-dir", str(tmp_path),
        "--set", f"actors.learner.config.max_steps={steps}",
        "--set", "actors.learner.config.eval_prompts=100",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.learner.config.checkpoint_every=10",
    ]  # fmt: skip
    topology = str(ROOT / "examples" / "topology.toml")
    first = subprocess.Popen(
        [sys.executable, "-m", "echo2.launch", topology, *common],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        run = _wait_for(lambda: next((p for p in tmp_path.iterdir() if p.is_dir()), None), 30, "the run dir")
        _wait_for(lambda: _learner_steps(run) >= 25, 120, "learner step 25")
        learner_pid = json.loads(RunDir(run).pids_path.read_text())["processes"]["learner"]
        os.kill(learner_pid, signal.SIGKILL)
        output, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 1, output[-3000:]  # the run stopped, naming the dead process
    assert "process 'learner'" in output

    resumed = subprocess.run(
        [sys.executable, "-m", "echo2.launch", topology, *common, "--resume", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert "resumed from step_000020" in resumed.stdout
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == steps  # the step count continues from the checkpoint
    assert summary["rollouts_trained_twice"] == 0
    report = _audited(run)
    assert report["voided_by_resume"] > 0  # the crashed incarnation trained past its checkpoint


SIMULATED_JOB = """
[run]
name = "durable"
drain_timeout_s = 5.0
deadline_s = 120.0
[job]
staleness = 2
group_size = 4
groups_per_step = 4
max_new_tokens = 5
[processes.data]
restart = "on-failure"
restart_backoff_s = 0.1
[processes.learner]
[processes.samplers]
[actors.prompt_source]
kind = "prompt_source"
process = "data"
config = { lease_ttl_s = 10.0 }
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.learner]
kind = "learner"
process = "learner"
config = { max_steps = 40, simulated_train_s = 0.05, eval_every = 0, eval_prompts = 2, checkpoint_every = 0 }
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
[actors.sampler]
kind = "sampler"
replicas = 2
process = "samplers"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.002, success_rate = 0.5 }, credits = 4 }
"""


@pytest.mark.timeout(120)
def test_data_process_killed_mid_run_is_restarted_and_the_run_completes_with_nothing_lost(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(textwrap.dedent(SIMULATED_JOB))
    command = [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(tmp_path / "runs")]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        runs = tmp_path / "runs"
        run = _wait_for(lambda: runs.is_dir() and next(runs.iterdir(), None), 30, "the run dir")
        _wait_for(lambda: _learner_steps(run) >= 15, 60, "learner step 15")
        pid = _sampler_pid(run, "data")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, output[-4000:]
    assert output.count("restarted process 'data'") == 1, output[-4000:]
    # Both journals were replayed by the restarted process.
    assert "prompt_source: incarnation 2 recovered" in output and "buffer: incarnation 2 recovered" in output
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == 40 and summary["rollouts_trained_twice"] == 0
    report = _audited(run)
    assert report["trained"] == 40 * 4
    # No sampler was taken for a forger by the restarted PromptSource.
    assert report["quarantined"] == {}


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 64 MiB tmpfs to fill (needs root, as CI and this project's machines have)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow  # ~40 s: a full disk mid-run, then --resume once there is space again
@pytest.mark.timeout(180)
def test_a_disk_full_mid_run_loses_nothing_once_resumed_with_space(small_disk: Path, tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(textwrap.dedent(SIMULATED_JOB).replace("checkpoint_every = 0", "checkpoint_every = 10"))
    runs = small_disk / "runs"
    command = [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(runs)]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    filler = small_disk / "filler"
    try:
        run = _wait_for(lambda: runs.is_dir() and next(runs.iterdir(), None), 30, "the run dir")
        _wait_for(lambda: _learner_steps(run) >= 15, 60, "learner step 15")
        with open(filler, "wb") as file:  # every process's next write fails: ENOSPC
            with pytest.raises(OSError, match="No space left"):
                while True:
                    file.write(b"\0" * 65536)
                    file.flush()
        output, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 1, output[-4000:]
    assert "No space left on device (ENOSPC)" in output, output[-4000:]
    filler.unlink()  # space again
    resumed = subprocess.run(
        [*command[:4], "--resume", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == 40
    _audited(run)


@pytest.mark.slow  # ~2.5 min: benchmarks/chaos.py's chaos run, short
@pytest.mark.timeout(400)
def test_a_short_chaos_run_loses_nothing_and_trains_nothing_twice() -> None:
    """A sampler and the data process killed (both restarted), the learner killed (the run
    resumed), a sampler frozen: every leased task reaches an end, none twice."""
    from benchmarks.chaos import FAULTS, Faults, run_case

    seconds = 120.0
    schedule = Faults.draw(seconds, seed=3, stop_s=15.0, kill_every=0.0)
    result = run_case(seconds, faults=schedule, bad_frames=1000)
    assert sorted(fault for _, fault, _ in result["faults"]) == sorted(FAULTS), result
    assert result["resumed"] and result["exit_codes"][0] == 1, result
    assert result["steps"] > 0 and result["audit_ok"], result
    for violation in ("lost", "unresolved", "accepted_twice", "duplicated", "late_accepted"):
        assert result[violation] == 0, (violation, result)
    assert result["crashes_other_than_kills"] == 0, result
    assert result["stale_fraction"] <= 0.05, result
