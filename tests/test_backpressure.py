"""A Rewarder ten times slower than sampling: every queue stays bounded and issuance
falls to the reward rate (work is pulled, so nothing piles up anywhere)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from echo2 import (
    Buffer,
    JobConfig,
    Learner,
    LearnerConfig,
    Pipeline,
    PromptSource,
    Rewarder,
    RewarderConfig,
    Sampler,
    SamplerConfig,
    WeightPublisher,
)

SLOW_REWARD_S = 0.01
_wait = threading.Event()


def slow_reward(prompt, completion: str) -> float:
    """Test reward: exact match, after a delay that makes scoring the bottleneck."""
    _wait.wait(SLOW_REWARD_S)
    return float(completion == prompt.answer)


@pytest.mark.slow  # ~8-16 s
@pytest.mark.timeout(120)
async def test_slow_rewarder_bounds_queues_and_paces_issuance(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    job = JobConfig(staleness=3, max_new_tokens=5, groups_per_step=4, reward="tests.test_backpressure:slow_reward")
    fast = {"seconds_per_token": 0.0005, "success_rate": 0.5}
    samplers = [
        Sampler(f"sampler-{i}", SamplerConfig(engine="simulated", engine_kwargs=fast, credits=8), job) for i in range(2)
    ]
    source = PromptSource("prompts", job=job)
    rewarder = Rewarder("rewarder", RewarderConfig(threads=1, max_concurrent_groups=2), job)
    buffer = Buffer("buffer", job=job)
    learner = Learner("learner", LearnerConfig(max_steps=12, eval_every=0, eval_prompts=20), job)
    window = job.groups_per_step * 2
    worst = {"inflight": 0, "stored": 0, "rollouts_queued": 0}

    async def watch() -> None:
        while True:
            worst["inflight"] = max(worst["inflight"], source.statistics().inflight)
            worst["stored"] = max(worst["stored"], buffer.statistics().stored_now)
            queued = sum(e.statistics().queued for e in rewarder.ctx.endpoints)
            worst["rollouts_queued"] = max(worst["rollouts_queued"], queued)
            await asyncio.sleep(0.01)  # sampling statistics, not synchronising

    actors = [source, *samplers, rewarder, buffer, learner, WeightPublisher("publisher", job=job)]
    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(watch())
            await pipeline.wait()
            watcher.cancel()
    issued = source.counters["leases_issued"]
    scored = rewarder.counters["groups_scored"] + rewarder.counters["groups_dropped"]
    generated = sum(s.counters["groups_sent"] for s in samplers)
    assert worst["inflight"] <= window
    assert worst["stored"] <= window
    assert worst["rollouts_queued"] <= 2 * 8  # what the rewarder drained, never more than a batch
    # Issuance tracks scoring, not sampling speed: at most one window ahead.
    assert issued - scored <= window, (issued, scored, generated)
    assert generated - scored <= window
