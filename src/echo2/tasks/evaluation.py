"""Held-out evaluation: the two numbers the learner reports, and what each one means.

- ``pass@1`` (greedy): the fraction of held-out prompts whose one greedy completion the
  task's correctness predicate accepts (``task.correct``, see :func:`echo2.tasks.base.correctness`).
  None when the task declares no predicate: a reward is not a verdict (partial credit,
  shaping terms), so echo2 does not guess one from it.
- ``mean_reward``: the training reward (the job's, override included) averaged over the same
  greedy completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.tasks.base import Prompt, Task, correctness

PASS_AT_1 = "pass@1"
"""The name the summary, the report and the terminal give the held-out metric."""


@dataclass(frozen=True)
class HeldoutScore:
    """One held-out evaluation of greedy completions."""

    step: int
    pass_at_1: float | None
    """Fraction of prompts judged correct; None: the task declares no correctness predicate."""
    mean_reward: float
    """Mean training reward of the same completions."""
    prompts: int
    """Held-out prompts scored."""


def score_heldout(task: Task, step: int, prompts: Sequence[Prompt], completions: Sequence[str]) -> HeldoutScore:
    """Score one greedy completion per held-out prompt (same order)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    n = len(prompts)
    rewards = [task.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
    correct = correctness(task)
    passed = None if correct is None else sum(bool(correct(p, c)) for p, c in zip(prompts, completions, strict=True))
    return HeldoutScore(
        step=step,
        pass_at_1=None if passed is None or n == 0 else passed / n,
        mean_reward=sum(rewards) / n if n else 0.0,
        prompts=n,
    )
