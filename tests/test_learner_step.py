"""The Learner's one step and one accounting path: a group is trained in the ledger only
after its step committed, and a simulated-train run audits as cleanly as a real one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from echo2.actor import ActorContext
from echo2.actors.buffer import Buffer
from echo2.actors.learner import Learner, LearnerConfig
from echo2.actors.prompt_source import PromptSource
from echo2.actors.rewarder import Rewarder
from echo2.actors.sampler import Sampler, SamplerConfig
from echo2.actors.weight_publisher import WeightPublisher
from echo2.job import JobConfig
from echo2.messages import RolloutGroup, ScoredGroup
from echo2.pipeline import Pipeline
from echo2.rl.step import StepStats, TrainingRows
from echo2.rundir import RunDir, read_jsonl
from echo2.tools.audit import audit
from echo2.training.trainer import Trainer


def _group(i: int, version: int = 0) -> ScoredGroup:
    return ScoredGroup(
        group=RolloutGroup(
            lease_id=i,
            task_id=f"t{i}",
            attempt=0,
            sampler_id="s",
            incarnation=0,
            version=version,
            prompt="1+2=",
            prompt_token_ids=np.array([1, 4, 13, 5, 14], dtype=np.int32),
            token_ids=np.array([6, 2, 7, 8, 2], dtype=np.int32),
            logprobs=np.full(5, -2.0, np.float32),
            offsets=np.array([0, 2, 5], dtype=np.int32),
            texts=["", ""],
            finish_reasons=["eos", "eos"],
        ),
        rewards=np.array([1.0, 0.0], dtype=np.float32),
        keep=np.array([True, True]),
    )


class CrashingTrainer:
    """A trainer whose optimiser step fails on demand (a CUDA error, an OOM, a NaN check)."""

    def __init__(self, inner: Trainer) -> None:
        self.inner = inner
        self.fail = True

    @property
    def policy(self):  # type: ignore[no-untyped-def]
        return self.inner.policy

    def step(self, rows: TrainingRows, version: int) -> StepStats:
        if self.fail:
            raise RuntimeError("the optimiser step failed")
        return self.inner.step(rows, version)

    def state_for_publication(self):  # type: ignore[no-untyped-def]
        return self.inner.state_for_publication()

    def save(self, directory: Path) -> None:
        self.inner.save(directory)

    def load(self, directory: Path) -> None:
        self.inner.load(directory)

    def close(self) -> None:
        self.inner.close()


class CrashingLearner(Learner):
    def build_trainer(self) -> Trainer:
        return CrashingTrainer(super().build_trainer())


def _trained(run_dir: Path) -> list[dict]:
    path = RunDir(run_dir).ledger_path("learner")
    return [e for e in (read_jsonl(path).records if path.exists() else []) if e["ev"] == "trained"]


@pytest.mark.timeout(60)
def test_a_step_that_raises_leaves_its_groups_untrained(tmp_path: Path) -> None:
    learner = CrashingLearner("learner", LearnerConfig(eval_prompts=2, warmup_steps=1), JobConfig())
    learner.ctx = ActorContext(
        actor_name="learner",
        process="p",
        transport=None,  # type: ignore[arg-type]  # the step opens no socket
        ports={},
        declared={},
        run_dir=tmp_path,
        stopping=asyncio.Event(),
    )
    try:
        learner._build()
        with pytest.raises(RuntimeError, match="optimiser step failed"):
            learner._train_step([_group(0), _group(1)])
        assert _trained(tmp_path) == []
        assert learner.rollouts_trained == 0 and not learner.staleness and not learner.account.trained_tasks

        learner.trainer.fail = False  # type: ignore[attr-defined]
        learner.version = 2
        record = learner._train_step([_group(0), _group(1, version=1)])
        assert [(e["task"], e["version"], e["learner_version"]) for e in _trained(tmp_path)] == [
            ("t0", 0, 2),
            ("t1", 1, 2),
        ]
        assert record["rollouts"] == 4 and record["tokens"] == 10
        assert record["staleness_max"] == 2 and record["staleness_mean"] == 1.5
        assert np.isfinite(record["loss"]) and record["grad_norm"] > 0
    finally:
        learner.ctx.close()


@pytest.mark.timeout(120)
async def test_a_simulated_train_run_audits_non_vacuously(tmp_path: Path) -> None:
    job = JobConfig(staleness=2, group_size=2, groups_per_step=2, max_new_tokens=5)
    simulated = {"seconds_per_token": 0.0, "success_rate": 0.5}
    actors = [
        PromptSource("prompt_source", job=job),
        Sampler("sampler", SamplerConfig(engine="simulated", engine_kwargs=simulated, credits=4), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        Learner(
            "learner",
            LearnerConfig(max_steps=6, simulated_train_s=0.01, eval_every=0, eval_prompts=2, checkpoint_every=0),
            job,
        ),
        WeightPublisher("weight_publisher", job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        await pipeline.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["groups_trained"] == 6 * 2 and summary["rollouts_trained"] == 6 * 2 * 2
    report = audit([tmp_path])
    assert report.trained == 6 * 2, report
    assert not report.lost and not report.duplicated, report
    assert report.ok, report
    steps = [json.loads(line) for line in (tmp_path / "metrics" / "learner.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert len(steps) == 6
    assert all(s["loss"] == 0.0 and "grad_norm" not in s and s["rollouts"] == 4 for s in steps)
