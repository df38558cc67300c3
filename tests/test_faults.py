"""Faults a real fleet has: a sampler process killed with SIGKILL, twice, mid-run.

The launcher restarts it (``restart = "on-failure"``), the restarted sampler catches up on
weights, its old leases are expired and re-issued, and the run finishes its steps with no
rollout trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    audit = subprocess.run(
        [sys.executable, "-m", "echo2.audit", str(run), "--json"], capture_output=True, text=True, timeout=60
    )
    report = json.loads(audit.stdout)
    assert audit.returncode == 0, audit.stdout
    assert report["lost"] == [] and report["duplicated"] == [] and report["late_accepted"] == []
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
    audit = subprocess.run(
        [sys.executable, "-m", "echo2.audit", str(run), "--json"], capture_output=True, text=True, timeout=60
    )
    report = json.loads(audit.stdout)
    assert audit.returncode == 0, audit.stdout
    assert report["duplicated"] == [] and report["lost"] == []
    assert report["voided_by_resume"] > 0  # the crashed incarnation trained past its checkpoint
