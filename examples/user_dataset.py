"""Embedding echo2 with your own dataset: the task and reward are Python objects.

    python examples/user_dataset.py [--data FILE.jsonl] [--steps 40] [--pass-at-k 4]

What is yours here, and how it is plugged in:

* the data: a JSON-lines file of rows ``{"id", "question", "answer", ...}`` (by default the
  shipped ``examples/data/addition500.jsonl``; the tiny model reads only ``0123456789+=``),
  loaded once into a ``DatasetTask`` object;
* the metric: ``answer_is_right``, the correctness predicate held-out pass@1 (greedy) and
  pass@k (sampled) count, given to the task as a function;
* the training reward: ``digit_credit``, partial credit, given to the ``Pipeline`` as a
  function (it replaces the task's own reward; the task's predicate stays the metric);
* a watcher: ``StepWatcher`` subscribes to the Learner's ``LearnerMetrics`` stream on the
  telemetry channel, prints each step's reward and loss and each held-out evaluation, and
  returns from ``run()`` once it has seen ``watch_steps`` steps (the runtime counts it as
  finished; the run goes on until the Learner completes it).

Objects work because every actor runs in this process. A launched run (a topology file)
names the task and reward by import string instead, since each process imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch

from echo2 import (
    Actor,
    Buffer,
    JobConfig,
    Learner,
    LearnerConfig,
    LearnerMetrics,
    Pipeline,
    Port,
    PromptSource,
    Rewarder,
    Sampler,
    SamplerConfig,
    WeightPublisher,
    run_until_stopped,
)
from echo2.messages import LEARNER_METRICS_TOPIC, TELEMETRY_CHANNEL, CustomStats
from echo2.tasks.base import Prompt, declares_reward_range
from echo2.tasks.dataset import DatasetTask

SHIPPED_DATA = Path(__file__).parent / "data" / "addition500.jsonl"


def answer_is_right(prompt: Prompt, completion: str) -> bool:
    """The metric: the completion is the reference answer (whitespace aside)."""
    return completion.strip() == prompt.answer.strip()


@declares_reward_range(0.0, 1.0)
def digit_credit(prompt: Prompt, completion: str) -> float:
    """The training reward: 1 when right, else half the fraction of digits in place."""
    if answer_is_right(prompt, completion):
        return 1.0
    answer = prompt.answer
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return 0.5 * hits / max(len(answer), len(completion), 1)


class StepWatcher(Actor):
    """Prints the Learner's metrics stream; ends its own loop after ``watch_steps`` steps."""

    kind: ClassVar[str] = "step_watcher"
    ports: ClassVar[dict[str, Port]] = {"telemetry": Port("sub", bind=True, channel=TELEMETRY_CHANNEL, on_full="drop")}

    def __init__(self, name: str, *, watch_steps: int) -> None:
        super().__init__(name)
        self.watch_steps = watch_steps
        self.seen: list[LearnerMetrics] = []

    async def setup(self, ctx: Any) -> None:
        await super().setup(ctx)
        self._metrics = ctx.open("telemetry", subscribe=[LEARNER_METRICS_TOPIC])

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._watch())

    async def _watch(self) -> None:
        steps = 0
        async for message in self._metrics:
            if not isinstance(message, LearnerMetrics):
                continue
            self.seen.append(message)
            line = f"[{self.name}] step {message.step}"
            if message.loss is not None:
                steps += 1
                line += f": reward {message.reward_mean:.3f}, loss {message.loss:+.4f}"
            if message.evaluated:
                line += f" | held-out pass@1 (greedy) {_number(message.eval_pass_at_1)}"
                if message.eval_k:
                    line += f", pass@{message.eval_k} (sampled) {_number(message.eval_pass_at_k)}"
            print(line, flush=True)
            if steps >= self.watch_steps:
                return  # finished: the runtime logs it and the run goes on

    def statistics(self) -> CustomStats:
        return CustomStats(values={"metrics_seen": len(self.seen)})


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


async def run(data: Path, steps: int, pass_at_k: int, run_dir: Path) -> tuple[dict[str, Any], StepWatcher]:
    """Train for ``steps`` steps on ``data``; the Learner's summary and the watcher."""
    torch.set_num_threads(1)  # sampler and learner threads share this process's cores
    task = DatasetTask(str(data), prompt_field="question", id_field="id", heldout_fraction=0.2, correct=answer_is_right)
    job = JobConfig(staleness=3, max_new_tokens=5)  # job.task / job.reward: the objects below instead
    learner = Learner(
        "learner",
        LearnerConfig(max_steps=steps, eval_every=max(1, steps // 2), eval_prompts=64, eval_pass_at_k=pass_at_k),
        job,
    )
    watcher = StepWatcher("watcher", watch_steps=max(1, steps // 2))
    actors = [
        PromptSource("prompts", job=job),
        Sampler("sampler", SamplerConfig(credits=16, max_batch_groups=16), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        learner,
        WeightPublisher("publisher", job=job),
        watcher,
    ]
    async with Pipeline(actors, run_dir=run_dir, task=task, reward=digit_credit) as pipeline:
        await pipeline.wait()
    return learner.summary, watcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=SHIPPED_DATA, help="JSON lines with id, question, answer")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pass-at-k", type=int, default=4, help="k of the sampled held-out pass@k (0: off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        summary, _ = asyncio.run(run(args.data, args.steps, args.pass_at_k, Path(run_dir)))
    line = (
        f"done: {summary['steps']} steps, held-out pass@1 (greedy) "
        f"{_number(summary['initial_pass_at_1'])} -> {_number(summary['final_pass_at_1'])}"
    )
    if "final_pass_at_k" in summary:
        line += (
            f", {summary['eval_pass_at_k_metric']} ({summary['eval_pass_at_k_decoding']}) "
            f"{_number(summary['initial_pass_at_k'])} -> {_number(summary['final_pass_at_k'])}"
        )
    print(line + f", eval mean reward (digit credit) {summary['final_eval_mean_reward']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
