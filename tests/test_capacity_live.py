"""Cost-aware activation end to end: a real launch with simulated samplers and learner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from echo2.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # ~25-40 s: launches six processes

# 6 samplers, 12 rollouts/s each (one group of G = 2 per 0.02 * 5 = 0.1 s... slowed by the
# pipeline to far less): 3 cheap, 3 dear. Demand: R = 8 rollouts per 0.25 s step = 32/s,
# so about 3 samplers cover the target and the dear ones are parked after the warm-up.
TOPOLOGY = """
[run]
name = "capacity-live"
drain_timeout_s = 3.0
deadline_s = 60.0
heartbeat_s = 0.5

[job]
staleness = 3
group_size = 2
groups_per_step = 4
max_new_tokens = 5

[actors.prompt_source]
kind = "prompt_source"
process = "data"
config = { activation = "cost_aware", learner_price_per_hour = 1.0, warmup_s = 2.0, activation_interval_s = 0.5, activation_record_s = 1.0, heartbeat_timeout_s = 2.0 }
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.learner]
kind = "learner"
process = "learner"
config = { max_steps = 40, simulated_train_s = 0.25, eval_every = 0, eval_prompts = 4, checkpoint_every = 0 }
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
[actors.cheap]
kind = "sampler"
replicas = 3
process = "samplers-a"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.02, success_rate = 0.5 }, credits = 1, max_batch_groups = 1, price_per_hour = 0.3 }
[actors.dear]
kind = "sampler"
replicas = 3
process = "samplers-b"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.02, success_rate = 0.5 }, credits = 1, max_batch_groups = 1, price_per_hour = 0.9 }
"""


def test_cost_aware_run_parks_dear_samplers_and_reports_cost(tmp_path: Path) -> None:
    topology = tmp_path / "live.toml"
    topology.write_text(TOPOLOGY)
    proc = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(tmp_path / "runs")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root,) = (tmp_path / "runs").iterdir()
    run = RunDir(root)
    records = run.metrics("prompt_source")
    acts = [r for r in records if r["kind"] == "activation"]
    assert acts and all("reason" in r and "active" in r for r in acts)
    assert "every available sampler" in acts[0]["reason"]  # warm-up / before T_train is known
    planned = [r for r in acts if r["parked"]]
    assert planned, "the scheduler parked nobody"
    parked = {name for r in planned for name in r["parked"]}
    assert {"dear-0", "dear-1", "dear-2"} <= parked, planned  # cheap ones may be parked too, then re-added
    last = acts[-1]
    # Both measured from typed heartbeat records of another process: the Learner's
    # LearnerStats (T_train) and the WeightPublisher's PublisherStats (T_bcast).
    assert last["t_train_s"] >= 0.24  # measured: the simulated step's 0.25 s sleep; load only adds to it
    assert last["t_bcast_s"] > 0
    assert last["mu_min"] and last["active_mu"] >= last["target_mu"] * 0.9
    assert all(name.startswith("cheap") for name in last["active"])
    (summary,) = [r for r in records if r["kind"] == "activation_summary"]
    assert summary["steps"] == 40 and summary["dollars_per_step"] > 0
    assert (run.report_dir / "capacity.png").is_file()
    assert "Capacity" in (run.report_dir / "report.md").read_text()
