"""Held-out evaluation: the numbers the learner reports, and what each one means.

- ``pass@1`` (greedy): the fraction of held-out prompts whose one greedy completion the
  task's correctness predicate accepts (``task.correct``, see :func:`echo2.tasks.base.correctness`).
  None when the task declares no predicate: a reward is not a verdict (partial credit,
  shaping terms), so echo2 does not guess one from it.
- ``pass@k`` (sampled, off by default): ``n >= k`` completions per prompt sampled at the
  job's temperature and top-p, judged by the same predicate; per prompt the unbiased
  estimator of Chen et al. 2021 (HumanEval, eq. 1), ``1 - C(n - c, k) / C(n, k)`` with ``c``
  of the ``n`` correct, averaged over prompts (:func:`pass_at_k`). With ``n == k`` it is the
  plain "any of k correct" rate; a larger ``n`` lowers its variance.
- ``mean_reward``: the training reward (the job's, override included) averaged over the
  greedy completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.tasks.base import Prompt, Task, correctness

PASS_AT_1 = "pass@1"
"""The name the summary, the report and the terminal give the greedy held-out metric."""


def pass_at_k_name(k: int) -> str:
    """``"pass@4"``: the sampled metric's name in the summary, the report and the terminal."""
    return f"pass@{k}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples of which ``c`` are correct.

    ``1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``
    (Chen et al. 2021's numerically stable form: no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass(frozen=True)
class SampledScore:
    """pass@k of one held-out evaluation from sampled completions."""

    k: int
    samples_per_prompt: int
    """n: completions sampled per prompt (n >= k)."""
    temperature: float
    top_p: float
    pass_at_k: float | None
    """Mean over prompts of the unbiased estimator; None: no correctness predicate."""


@dataclass(frozen=True)
class HeldoutScore:
    """One held-out evaluation: greedy completions, and sampled ones when asked for."""

    step: int
    pass_at_1: float | None
    """Fraction of prompts judged correct; None: the task declares no correctness predicate."""
    mean_reward: float
    """Mean training reward of the same completions."""
    prompts: int
    """Held-out prompts scored."""
    sampled: SampledScore | None = None
    """pass@k of sampled completions; None when the evaluation sampled none (the default)."""


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


def score_sampled(
    task: Task,
    prompts: Sequence[Prompt],
    samples: Sequence[Sequence[str]],
    *,
    k: int,
    temperature: float,
    top_p: float,
) -> SampledScore:
    """pass@k from ``samples[i]``, the completions sampled for ``prompts[i]`` (n each, n >= k)."""
    if len(prompts) != len(samples):
        raise ValueError(f"{len(prompts)} prompts but {len(samples)} lists of samples")
    sizes = {len(s) for s in samples}
    if len(sizes) > 1:
        raise ValueError(f"every prompt needs the same number of samples, got {sorted(sizes)}")
    n = sizes.pop() if sizes else k
    correct = correctness(task)
    value: float | None = None
    if correct is not None and prompts:
        per_prompt = [
            pass_at_k(n, sum(bool(correct(p, c)) for c in completions), k)
            for p, completions in zip(prompts, samples, strict=True)
        ]
        value = sum(per_prompt) / len(per_prompt)
    return SampledScore(k=k, samples_per_prompt=n, temperature=temperature, top_p=top_p, pass_at_k=value)
