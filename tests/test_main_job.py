"""The main job end to end: the six actors train the built-in model, and it learns.

Two ways in, both real: the embedding API in this process (learning is asserted), and the
launcher with several processes (the bounds every run must keep are asserted).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo2.actors.buffer import Buffer
from echo2.actors.learner import Learner, LearnerConfig
from echo2.actors.prompt_source import PromptSource
from echo2.actors.rewarder import Rewarder
from echo2.actors.sampler import Sampler, SamplerConfig
from echo2.actors.weight_publisher import WeightPublisher
from echo2.job import JobConfig
from echo2.pipeline import Pipeline
from echo2.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
async def test_grpo_in_one_process_learns(tmp_path: Path) -> None:
    torch.set_num_threads(1)  # sampler and learner threads share the two cores
    job = JobConfig(staleness=3, max_new_tokens=5)
    actors = [
        PromptSource("prompt_source", job=job),
        Sampler("sampler", SamplerConfig(credits=16, max_batch_groups=16), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        Learner("learner", LearnerConfig(max_steps=150, eval_every=0, eval_prompts=300), job),
        WeightPublisher("weight_publisher", job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        await pipeline.wait()
    summary = json.loads(RunDir(tmp_path).summary_path.read_text())
    assert summary["steps"] == 150
    assert summary["final_accuracy"] >= summary["initial_accuracy"] + 0.10, summary
    assert summary["staleness_max"] <= 3
    assert summary["rollouts_trained_twice"] == 0
    assert summary["rollouts_trained"] == 150 * 16 * 8


@pytest.mark.timeout(240)
async def test_a_sampler_beside_the_publisher_takes_versions_from_shared_memory(tmp_path: Path) -> None:
    from echo2.actors.weight_publisher import WeightPublisherConfig

    torch.set_num_threads(1)
    shm = tmp_path / "shm"
    shm.mkdir()
    job = JobConfig(staleness=1, max_new_tokens=5)
    sampler = Sampler("sampler", SamplerConfig(credits=16, max_batch_groups=16, shm_dir=str(shm)), job)
    actors = [
        PromptSource("prompt_source", job=job),
        sampler,
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        Learner("learner", LearnerConfig(max_steps=6, eval_every=0, eval_prompts=20), job),
        WeightPublisher("weight_publisher", WeightPublisherConfig(shm_dir=str(shm)), job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path / "run") as pipeline:
        await pipeline.wait()
        stats = sampler.statistics()
    assert stats.weight_shm_versions >= 2, stats  # versions came through shared memory
    assert stats.installed_version >= 4, stats  # S = 1: the sampler kept up
    assert stats.weight_chunks_forwarded == 0
    assert list(shm.iterdir()) == []  # the publisher removed its files


def _launch(topology: str, run_dir: Path, *overrides: str) -> dict:
    command = [sys.executable, "-m", "echo2.launch", str(ROOT / "examples" / topology), "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    return json.loads(RunDir(run).summary_path.read_text()) | {"_run": str(run)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("topology", "budget"), [("topology.toml", 3), pytest.param("sync.toml", 0, marks=pytest.mark.slow)]
)
def test_launched_job_keeps_staleness_within_budget(tmp_path: Path, topology: str, budget: int) -> None:
    summary = _launch(
        topology,
        tmp_path,
        "actors.learner.config.max_steps=30",
        "actors.learner.config.eval_prompts=100",
        "actors.learner.config.checkpoint_every=15",
    )
    assert summary["steps"] == 30
    assert summary["staleness_budget"] == budget
    assert summary["staleness_max"] <= budget
    assert summary["rollouts_trained_twice"] == 0
    run = RunDir(Path(summary["_run"]))
    assert run.is_run_dir()
    assert (run.checkpoint_dir(30) / "model.safetensors").is_file()
    steps = run.metrics("learner", "step")
    assert [s["step"] for s in steps] == list(range(1, 31))
    assert all(s["staleness_max"] <= budget for s in steps)
    from echo2.tools.audit import audit

    report = audit([run.root])
    assert report.ok, report
    assert report.trained == 30 * 16


@pytest.mark.timeout(120)
def test_custom_pipeline_example_runs_with_its_own_reward_and_actor() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_pipeline.py"), "--steps", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[printer] learner v" in done.stdout  # the user's actor received heartbeats
    assert "done: 6 steps" in done.stdout
