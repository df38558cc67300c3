"""The learner step's pure functions (echo2.rl.step): hand-computed packing, advantages and
one optimiser step on a model small enough to differentiate by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from echo2 import ledger
from echo2.messages import RolloutGroup, ScoredGroup
from echo2.rl.step import StepSettings, StepStats, TrainingRows, optimiser_step, pack_groups
from echo2.training.accounting import TrainingAccount

SQRT2 = math.sqrt(2.0)


def scored(
    task: str,
    responses: list[list[int]],
    rewards: list[float],
    keep: list[bool] | None = None,
    *,
    sampler: str = "s",
    version: int = 0,
) -> ScoredGroup:
    lengths = [len(r) for r in responses]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = np.array([t for r in responses for t in r], dtype=np.int32)
    return ScoredGroup(
        group=RolloutGroup(
            lease_id=0,
            task_id=task,
            attempt=0,
            sampler_id=sampler,
            incarnation=0,
            version=version,
            prompt="",
            prompt_token_ids=np.array([1, 4], dtype=np.int32),
            token_ids=tokens,
            logprobs=-(np.arange(len(tokens), dtype=np.float32) + 1.0),  # -1, -2, ... per token
            offsets=offsets,
            texts=[""] * len(responses),
            finish_reasons=["eos"] * len(responses),
        ),
        rewards=np.array(rewards, dtype=np.float32),
        keep=np.array(keep if keep is not None else [True] * len(responses)),
    )


# ----------------------------------------------------------------------------- packing


def test_pack_rows_and_group_advantages_over_kept_completions() -> None:
    groups = [
        # rewards 1, 0, 1: mean 2/3, population std sqrt(2)/3 -> A = 1/sqrt2, -sqrt2, 1/sqrt2
        scored("a", [[5, 6], [7], [8, 9, 10]], [1, 0, 1], sampler="s1"),
        # the failed completion (reward 9) is neither a row nor part of the baseline:
        # kept 1, 0, 0 -> A = sqrt2, -1/sqrt2, -1/sqrt2
        scored("b", [[5], [6, 6], [7], [8]], [1, 9, 0, 0], [True, False, True, True], sampler="s2"),
        scored("c", [[5], [6]], [1, 1], sampler="s1"),  # all equal: exactly 0
        scored("d", [[5], [6]], [0, 0], [False, False]),  # nothing kept: no rows
    ]
    rows = pack_groups(groups)

    assert len(rows) == 3 + 3 + 2
    np.testing.assert_allclose(
        rows.advantages, [1 / SQRT2, -SQRT2, 1 / SQRT2, SQRT2, -1 / SQRT2, -1 / SQRT2, 0, 0], rtol=1e-5
    )
    assert rows.advantages.dtype == np.float32
    assert rows.advantages[-2:].tolist() == [0.0, 0.0]
    assert rows.rewards.tolist() == [1, 0, 1, 1, 0, 0, 1, 1]
    assert [r.tolist() for r in rows.responses] == [[5, 6], [7], [8, 9, 10], [5], [7], [8], [5], [6]]
    # behaviour log-probs are the rollout's own slices (token j of the group: -(j + 1))
    assert [b.tolist() for b in rows.behaviour_logprobs[:5]] == [[-1, -2], [-3], [-4, -5, -6], [-1], [-4]]
    assert rows.sampler_ids == ("s1",) * 3 + ("s2",) * 3 + ("s1",) * 2
    assert all(p.tolist() == [1, 4] for p in rows.prompts)
    assert rows.tokens == 2 + 1 + 3 + 1 + 1 + 1 + 1 + 1
    assert rows.reward_mean == pytest.approx(5 / 8)


def test_take_selects_rows_in_order_and_empty_batches_pack_to_nothing() -> None:
    rows = pack_groups([scored("a", [[5], [6, 7], [8]], [1, 0, 0], sampler="x")])
    part = rows.take([2, 0])
    assert [r.tolist() for r in part.responses] == [[8], [5]]
    assert part.advantages.tolist() == [rows.advantages[2], rows.advantages[0]]
    assert part.sampler_ids == ("x", "x") and part.tokens == 2

    empty = pack_groups([])
    assert len(empty) == 0 and empty.tokens == 0 and empty.reward_mean == 0.0


# ----------------------------------------------------------------------------- one optimiser step


class Bigram(nn.Module):
    """logits(next | token) = W[token]: log-probs and their gradients are easy by hand."""

    def __init__(self, vocab: int = 4) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, ids: torch.Tensor, **packed: torch.Tensor) -> torch.Tensor:
        return self.W[ids]  # (B, T, V): no context, so packed rows (positions, segments) change nothing


def two_rows(behaviour_first: float = -math.log(4)) -> TrainingRows:
    # prompt [0]; row 0 answers [1] (A = +1), row 1 answers [2, 3] (A = -1). With W = 0 every
    # token has log-prob -log 4.
    return TrainingRows(
        prompts=(np.array([0], np.int32),) * 2,
        responses=(np.array([1], np.int32), np.array([2, 3], np.int32)),
        behaviour_logprobs=(np.array([behaviour_first], np.float32), np.full(2, -math.log(4), np.float32)),
        advantages=np.array([1.0, -1.0], np.float32),
        rewards=np.array([1.0, 0.0], np.float32),
        sampler_ids=("a", "b"),
    )


def test_one_step_hand_values_warmup_and_adam_sign_update() -> None:
    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    settings = StepSettings(lr=0.1, warmup_steps=4, weight_decay=0.0, grad_clip=10.0)
    stats = optimiser_step(model, optimizer, two_rows(), settings, version=0, pad_id=0)

    # ratio 1, w 1: loss = token mean of -A = (-1 + 1 + 1) / 3
    assert stats.loss == pytest.approx(1 / 3)
    assert stats.objective is not None
    assert stats.objective.tokens == 3.0
    assert stats.objective.ratio_mean == pytest.approx(1.0)
    assert stats.objective.clip_fraction == 0.0 and stats.objective.is_weight_mean == pytest.approx(1.0)
    assert stats.mismatch_by_sampler == pytest.approx({"a": 0.0, "b": 0.0}, abs=1e-6)
    # d loss / d W[0] = -(1/3)((e1 - p) - (e2 - p)) = (0, -1/3, 1/3, 0) (tokens 1 and 2 follow 0)
    # d loss / d W[2] = (1/3)(e3 - p) = (1/3)(-1/4, -1/4, -1/4, 3/4)  (token 3 follows 2)
    assert stats.grad_norm == pytest.approx(math.sqrt(2 / 9 + 0.75 / 9), rel=1e-5)
    # Adam's first step moves each weight by lr_0 against its gradient's sign; lr_0 = 0.1 / 4
    lr0 = 0.1 / 4
    expected = torch.zeros(4, 4)
    expected[0] = torch.tensor([0.0, lr0, -lr0, 0.0])
    expected[2] = torch.tensor([lr0, lr0, lr0, -lr0])
    torch.testing.assert_close(model.W.detach(), expected, atol=1e-6, rtol=0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr0)


def test_sampler_policy_clips_and_mismatch_is_per_sampler() -> None:
    # Row 0's sampler gave its token log 1/8: under old_policy "sampler" the ratio is
    # (1/4) / (1/8) = 2, clipped at 1.2 for A > 0: loss = (-1.2 + 1 + 1) / 3.
    rows = two_rows(behaviour_first=-math.log(8))
    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    stats = optimiser_step(model, optimizer, rows, StepSettings(old_policy="sampler"), version=0, pad_id=0)
    assert stats.loss == pytest.approx(0.8 / 3, rel=1e-5)
    assert stats.objective is not None and stats.objective.clip_fraction == pytest.approx(1 / 3)
    assert stats.mismatch_by_sampler["a"] == pytest.approx(-math.log(2), abs=1e-5)  # (log 1/8 - log 1/4) / 1
    assert stats.mismatch_by_sampler["b"] == pytest.approx(0.0, abs=1e-6)

    # old_policy "learner": ratio 1; the IS weight min((1/4) / (1/8), C = 2) = 2 scales row 0.
    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    stats = optimiser_step(model, optimizer, rows, StepSettings(old_policy="learner"), version=0, pad_id=0)
    assert stats.loss == pytest.approx((-2.0 + 1 + 1) / 3, abs=1e-6)
    assert stats.objective is not None and stats.objective.is_weight_mean == pytest.approx(4 / 3, rel=1e-5)


def test_step_contract_errors_and_settings() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        optimiser_step(
            Bigram(), torch.optim.AdamW(Bigram().parameters()), pack_groups([]), StepSettings(), version=0, pad_id=0
        )
    with pytest.raises(ValueError, match="old_policy"):
        StepSettings(old_policy="learnr")  # type: ignore[arg-type]
    warm = StepSettings(lr=1.0, warmup_steps=50)
    assert [warm.learning_rate(v) for v in (0, 24, 49, 500)] == pytest.approx([1 / 50, 0.5, 1.0, 1.0])
    # linear decay after warm-up: 1.0 at step 50, halfway (0.55) at 475, final_lr_ratio at 900 and after
    decay = StepSettings(lr=1.0, warmup_steps=50, decay_steps=900, final_lr_ratio=0.1)
    assert [decay.learning_rate(v) for v in (0, 49, 50, 475, 900, 2000)] == pytest.approx(
        [1 / 50, 1.0, 1.0, 0.55, 0.1, 0.1]
    )


def test_stats_record_carries_only_what_the_step_measured() -> None:
    assert StepStats(loss=0.0).record() == {"loss": 0.0}  # a simulated step
    model = Bigram()
    stats = optimiser_step(
        model, torch.optim.AdamW(model.parameters()), two_rows(), StepSettings(), version=0, pad_id=0
    )
    assert set(stats.record()) == {
        "loss",
        "grad_norm",
        "clip_fraction",
        "is_weight_mean",
        "is_truncated_fraction",
        "is_masked_fraction",
        "approx_kl_sampler",
        "mismatch_by_sampler",
    }


# ----------------------------------------------------------------------------- accounting


def test_account_counts_each_group_once_with_its_staleness() -> None:
    events: list[ledger.LedgerEvent] = []
    account = TrainingAccount()
    batch = [scored("a", [[5], [6]], [1, 0], version=3), scored("b", [[5], [6]], [1, 0], [True, False], version=1)]
    lags = account.commit(batch, learner_version=4, incarnation=2, ledger=events.append)
    assert lags == [1, 3]
    assert account.staleness == {1: 1, 3: 1}
    assert account.rollouts_trained == 3
    assert events == [
        ledger.Trained(task="a", version=3, learner_version=4, incarnation=2, sampler="s"),
        ledger.Trained(task="b", version=1, learner_version=4, incarnation=2, sampler="s"),
    ]
    account.commit(batch[:1], learner_version=5, incarnation=2, ledger=lambda event: None)
    summary = account.summary()
    assert summary["rollouts_trained_twice"] == 1 and summary["groups_trained"] == 2
    assert summary["staleness_histogram"] == {"1": 1, "2": 1, "3": 1} and summary["staleness_max"] == 3
