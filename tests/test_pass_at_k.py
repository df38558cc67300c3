"""pass@k: the unbiased estimator (hand-computed cases) and the sampled held-out score."""

from __future__ import annotations

from collections.abc import Iterator
from math import comb

import pytest

from echo2.actors.learner import LearnerConfig
from echo2.config import convert_config
from echo2.errors import ConfigError
from echo2.tasks.base import Prompt, exact_match
from echo2.tasks.evaluation import pass_at_k, score_sampled


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),  # nothing correct
        (5, 2, 1, 2 / 5),  # k = 1: the fraction correct
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (5, 4, 2, 1.0),  # n - c < k: every pair holds a correct one
        (3, 3, 3, 1.0),
        (3, 0, 3, 0.0),
    ],
)
def test_estimator_matches_hand_computed_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_estimator_equals_the_binomial_form_on_larger_n() -> None:
    for c in range(0, 41):
        assert pass_at_k(40, c, 7) == pytest.approx(1 - comb(40 - c, 7) / comb(40, 7), abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)])
def test_estimator_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


class SevenTask:
    """Every answer is "7"; ``correct`` only when ``with_predicate``."""

    name = "seven"

    def __init__(self, with_predicate: bool) -> None:
        if with_predicate:
            self.correct = lambda p, c: exact_match(p, c) == 1.0

    def prompts(self, seed: int) -> Iterator[Prompt]:
        raise NotImplementedError

    def heldout(self, n: int) -> list[Prompt]:
        return [Prompt(f"h{i}", "q", "7") for i in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return exact_match(prompt, completion)


def test_sampled_score_averages_the_estimator_over_prompts() -> None:
    task = SevenTask(with_predicate=True)
    prompts = task.heldout(2)
    samples = [["7", "1", "2", "7"], ["1", "2", "3", "4"]]  # c = 2 of 4, then 0 of 4
    one = score_sampled(task, prompts, samples, k=1, temperature=1.0, top_p=1.0)
    two = score_sampled(task, prompts, samples, k=2, temperature=0.7, top_p=0.9)
    assert one.pass_at_k == pytest.approx((2 / 4 + 0) / 2)
    assert two.pass_at_k == pytest.approx(((1 - comb(2, 2) / comb(4, 2)) + 0) / 2)  # (5/6) / 2
    assert (two.k, two.samples_per_prompt, two.temperature, two.top_p) == (2, 4, 0.7, 0.9)


def test_sampled_score_without_a_predicate_is_none() -> None:
    task = SevenTask(with_predicate=False)
    score = score_sampled(task, task.heldout(1), [["7", "7"]], k=1, temperature=1.0, top_p=1.0)
    assert score.pass_at_k is None  # a reward is not a verdict


def test_sampled_score_refuses_ragged_samples() -> None:
    task = SevenTask(with_predicate=True)
    with pytest.raises(ValueError, match="same number of samples"):
        score_sampled(task, task.heldout(2), [["7"], ["7", "1"]], k=1, temperature=1.0, top_p=1.0)


def test_learner_config_needs_n_at_least_k() -> None:
    assert LearnerConfig().eval_pass_at_k == 0  # off by default: it costs generation time
    with pytest.raises(ConfigError, match=r"eval_samples \(2\) must be >= eval_pass_at_k \(4\)"):
        convert_config({"eval_pass_at_k": 4, "eval_samples": 2}, LearnerConfig, "actors.learner.config")
    assert convert_config({"eval_pass_at_k": 4}, LearnerConfig, "x").eval_samples == 0  # n = k
