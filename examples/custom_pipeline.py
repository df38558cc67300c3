"""Embedding echo2: your own reward function and your own actor, no topology file.

    python examples/custom_pipeline.py [--steps 60]

Two things are plugged in:

* ``digit_credit``: a reward with partial credit (the fraction of answer digits right),
  named by import path exactly as a topology would name it (``job.reward``);
* ``HeartbeatPrinter``: an actor of your own. It binds the ``telemetry`` channel, so every
  process's runtime sends it heartbeats, and prints a one-line view of the pipeline each
  time the learner's step count moves (from the learner's ``LearnerStats`` record); its
  own statistics are a ``CustomStats``.

All actors run in this process (every channel is ``inproc://``). The same actors, named in
a topology file, run in separate processes or on other hosts without code changes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from typing import ClassVar

import torch

from echo2 import (
    Actor,
    Buffer,
    JobConfig,
    Learner,
    LearnerConfig,
    Pipeline,
    Port,
    PromptSource,
    Rewarder,
    Sampler,
    SamplerConfig,
    WeightPublisher,
    run_until_stopped,
)
from echo2.messages import CustomStats, Heartbeat, LearnerStats
from echo2.tasks.base import Prompt


def digit_credit(prompt: Prompt, completion: str) -> float:
    """Fraction of the reversed answer's digits in the right place (1.0 = exact)."""
    answer = prompt.answer
    if completion == answer:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return 0.5 * hits / max(len(answer), len(completion), 1)


class HeartbeatPrinter(Actor):
    """Prints the learner's version and rollouts trained whenever they change."""

    kind: ClassVar[str] = "heartbeat_printer"
    ports: ClassVar[dict[str, Port]] = {"telemetry": Port("sub", bind=True, channel="telemetry")}

    async def setup(self, ctx) -> None:  # type: ignore[no-untyped-def]
        await super().setup(ctx)
        self._telemetry = ctx.open("telemetry", subscribe=[b"hb|"])
        self.lines = 0

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._print())

    async def _print(self) -> None:
        last_version = -1
        async for beat in self._telemetry:
            if not isinstance(beat, Heartbeat):
                continue
            for stats in beat.actor_stats.values():  # actor name -> its typed statistics record
                if isinstance(stats, LearnerStats) and stats.version != last_version:
                    last_version = stats.version
                    self.lines += 1
                    print(
                        f"[{self.name}] learner v{stats.version}: {stats.rollouts_trained} rollouts trained, "
                        f"bubble {100 * stats.bubble_ratio:.1f}%",
                        flush=True,
                    )

    def statistics(self) -> CustomStats:
        return CustomStats(values={"lines": self.lines})  # an actor of your own reports this way


async def main(steps: int) -> int:
    torch.set_num_threads(1)  # sampler and learner threads share this process's cores
    job = JobConfig(staleness=3, max_new_tokens=5, reward=f"{__name__}:digit_credit")
    actors = [
        PromptSource("prompts", job=job),
        Sampler("sampler", SamplerConfig(credits=16, max_batch_groups=16), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        Learner("learner", LearnerConfig(max_steps=steps, eval_every=0, eval_prompts=200), job),
        WeightPublisher("publisher", job=job),
        HeartbeatPrinter("printer"),
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        async with Pipeline(actors, run_dir=run_dir) as pipeline:
            await pipeline.wait()
    learner = actors[4]
    assert isinstance(learner, Learner)
    summary = learner.summary
    print(
        f"done: {summary['steps']} steps, held-out pass@1 (greedy) "
        f"{summary['initial_pass_at_1']:.3f} -> {summary['final_pass_at_1']:.3f}, "
        f"staleness max {summary['staleness_max']}"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    sys.exit(asyncio.run(main(parser.parse_args().steps)))
