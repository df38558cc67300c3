"""Multi-turn faults a real fleet has: a sampler killed with SIGKILL mid-episode, and an
environment that raises or hangs on 10% of its steps (``tests.faulty_env``).

The launched multi-turn job must finish its steps with nothing lost and nothing trained
twice (the audit), every failed episode's lease re-issued and counted by reason
(``environment_raised`` / ``environment_timeout``, whether the sampler's environment or the
trusted replay failed), and no failed episode scored: no reward failure, no dropped group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.test_faults import _learner_steps, _sampler_pid, _wait_for

from echo2.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a launched job with a kill and a restart: ~1-2 min on 2 cores
@pytest.mark.timeout(420)
def test_sampler_killed_mid_episode_and_a_flaky_environment_lose_nothing(tmp_path: Path) -> None:
    steps = 30
    command = [
        sys.executable, "-m", "echo2.launch", str(ROOT / "examples" / "multiturn.toml"),
        "--run-dir", str(tmp_path),
        "--set", 'job.model=""',  # the shipped addition checkpoint: learning is not the point here
        "--set", 'job.episode.environment="tests.faulty_env:FaultyChain"',
        "--set", "job.episode.environment_kwargs={raise_rate=0.05, hang_rate=0.05, hang_s=3.0}",
        "--set", "job.episode.turn_timeout_s=0.5",
        "--set", "job.group_size=4",
        "--set", f"actors.learner.config.max_steps={steps}",
        "--set", "actors.learner.config.eval_prompts=50",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.prompt_source.config.lease_ttl_s=10.0",
        "--set", "actors.prompt_source.config.max_attempts=50",
        "--set", 'processes.sampler-{i}.restart="on-failure"',
        "--set", "processes.sampler-{i}.restart_backoff_s=0.2",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run = _wait_for(lambda: next((p for p in tmp_path.iterdir() if p.is_dir()), None), 60, "the run dir")
        _wait_for(lambda: _learner_steps(run) >= 8, 240, "learner step 8")
        pid = _sampler_pid(run, "sampler-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # a sampler is always mid-episode: its turns run back to back
        output, _ = launcher.communicate(timeout=360)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, output[-4000:]
    assert "restarted process 'sampler-0'" in output, output[-4000:]
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == steps and summary["rollouts_trained_twice"] == 0
    failures = summary["episode_failures_by_reason"]
    assert failures.get("environment_raised", 0) > 0 and failures.get("environment_timeout", 0) > 0, failures
    # Failures in the trusted replay fail the lease too (re-issued, among the same reasons):
    # none is a reward, none a dropped group.
    assert summary["reward_failures_by_reason"] == {} and "reward_failed" not in summary["drops_by_reason"], summary
    audit = subprocess.run(
        [sys.executable, "-m", "echo2.audit", str(run), "--json"], capture_output=True, text=True, timeout=120
    )
    report = json.loads(audit.stdout)
    assert audit.returncode == 0, audit.stdout
    assert report["lost"] == [] and report["duplicated"] == [] and report["late_accepted"] == []
    assert report["rejected"].get("rejected:environment_raised", 0) > 0, report["rejected"]
    # Every failed episode's lease came back: trained tasks are all distinct and each step
    # trained its full batch.
    assert report["trained"] == steps * 16
