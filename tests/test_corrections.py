"""Off-policy corrections (echo2.rl.corrections): values and gradients computed by hand.

Each case picks per-token ratios whose mask/clip decisions are clear, and writes the
expected loss and d loss / d logp out as arithmetic on those numbers (N = response tokens).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests.test_step import Bigram, two_rows

from echo2.rl import LOSSES
from echo2.rl.corrections import (
    cispo_loss,
    geometric_masked_is_loss,
    gspo_loss,
    policy_loss,
    sequence_masked_is_loss,
    token_masked_is_loss,
)
from echo2.rl.grpo import grpo_loss
from echo2.rl.step import StepSettings, optimiser_step

LOG = math.log
NAN = float("nan")


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


# Three rows; per-token learner/sampler ratios rho (pi_prox = sg(pi_theta)):
#   row 0: [1.9, 0.75]   product 1.425, geometric mean sqrt(1.425) = 1.194   A = +1
#   row 1: [1.8, 1.8]    product 3.24,  geometric mean 1.8                  A = -1
#   row 2: [0.6, pad]    product 0.6,   geometric mean 0.6                  A = +2
# N = 5 tokens. With pi_prox = sg(pi_theta) the PPO ratio is 1, so loss_t = -w_t A.
RHO = [[1.9, 0.75], [1.8, 1.8], [0.6, 1.0]]
MASK = t([[1, 1], [1, 1], [1, 0]])
ADV = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)


def three_rows() -> tuple[torch.Tensor, torch.Tensor]:
    logp = t([[-1.0, -2.0], [-0.5, -1.5], [-3.0, NAN]], grad=True)  # a NaN pad must not leak
    sampler = logp.detach() - t([[LOG(r) for r in row] for row in RHO])
    sampler[2, 1] = NAN
    return logp, sampler


def grad_of(loss: torch.Tensor, logp: torch.Tensor) -> list[list[float]]:
    loss.backward()
    assert logp.grad is not None
    return logp.grad.tolist()


def test_token_mask_keeps_tokens_in_band_with_their_ratio_as_weight() -> None:
    logp, sampler = three_rows()
    loss, stats = token_masked_is_loss(logp, None, sampler, ADV, MASK, low=0.5, high=2.0)
    # every token ratio is in [0.5, 2]: loss = (-(1.9 + 0.75) + (1.8 + 1.8) - 2 * 0.6) / 5
    assert loss.item() == pytest.approx(-0.05)
    assert stats.is_masked_fraction == 0.0
    assert stats.is_weight_mean == pytest.approx((1.9 + 0.75 + 3.6 + 0.6) / 5)
    expected = [[-1.9 / 5, -0.75 / 5], [1.8 / 5, 1.8 / 5], [-1.2 / 5, 0.0]]
    assert np.allclose(grad_of(loss, logp), expected)

    # A band [0.7, 1.85] masks the 1.9 and the 0.6 tokens: their gradient is 0, not capped.
    logp, sampler = three_rows()
    loss, stats = token_masked_is_loss(logp, None, sampler, ADV, MASK, low=0.7, high=1.85)
    assert loss.item() == pytest.approx((-0.75 + 3.6) / 5)
    assert stats.is_masked_fraction == pytest.approx(2 / 5)
    assert np.allclose(grad_of(loss, logp), [[0.0, -0.75 / 5], [1.8 / 5, 1.8 / 5], [0.0, 0.0]])


def test_token_mask_keeps_the_ppo_clip_of_the_decoupled_loss() -> None:
    # pi_prox given: PPO ratio r = 0.6 / 0.4 = 1.5 (clipped at 1.2 for A > 0), rho = 0.4 / 0.5 = 0.8.
    logp = t([[LOG(0.6)], [LOG(0.6)]], grad=True)
    prox, sampler = t([[LOG(0.4)], [LOG(0.4)]]), t([[LOG(0.5)], [LOG(0.5)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = token_masked_is_loss(logp, prox, sampler, adv, torch.ones(2, 1), low=0.5, high=2.0)
    # A=+1: -0.8 * min(1.5, 1.2); A=-1: -0.8 * min(-1.5, -1.2) = +0.8 * 1.5
    assert loss.item() == pytest.approx((-0.8 * 1.2 + 0.8 * 1.5) / 2)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert np.allclose(grad_of(loss, logp), [[0.0], [0.8 * 1.5 / 2]])


def test_sequence_mask_tests_the_product_of_a_rows_ratios() -> None:
    logp, sampler = three_rows()
    loss, stats = sequence_masked_is_loss(logp, None, sampler, ADV, MASK, low=0.5, high=2.0)
    # row 1's product 3.24 > 2: masked although each of its tokens is in band; row 0 weighs
    # 1.425 on each token, row 2 0.6: loss = (-1.425 * 2 - 0.6 * 2) / 5
    assert loss.item() == pytest.approx((-2.85 - 1.2) / 5)
    assert stats.is_masked_fraction == pytest.approx(2 / 5)
    expected = [[-1.425 / 5, -1.425 / 5], [0.0, 0.0], [-1.2 / 5, 0.0]]
    assert np.allclose(grad_of(loss, logp), expected)


def test_geometric_mask_tests_the_mean_log_ratio_and_weighs_tokens() -> None:
    logp, sampler = three_rows()
    loss, stats = geometric_masked_is_loss(logp, None, sampler, ADV, MASK, low=0.8, high=1.25)
    # geometric means 1.194 (kept), 1.8 and 0.6 (masked); row 0's tokens keep their own ratios
    assert loss.item() == pytest.approx(-(1.9 + 0.75) / 5)
    assert stats.is_masked_fraction == pytest.approx(3 / 5)
    assert np.allclose(grad_of(loss, logp), [[-1.9 / 5, -0.75 / 5], [0.0, 0.0], [0.0, 0.0]])
    # The same band on the product masks row 0 too (1.425 > 1.25): the two tests differ.
    logp, sampler = three_rows()
    loss, stats = sequence_masked_is_loss(logp, None, sampler, ADV, MASK, low=0.8, high=1.25)
    assert loss.item() == 0.0 and stats.is_masked_fraction == 1.0


def test_a_huge_mismatch_is_masked_not_overflowed() -> None:
    logp = t([[0.0, 0.0]], grad=True)
    sampler = t([[-1e4, -1e4]])  # rho = e^10000 per token, product e^20000
    for fn in (token_masked_is_loss, sequence_masked_is_loss, geometric_masked_is_loss):
        logp.grad = None
        loss, stats = fn(logp, None, sampler, torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
        assert loss.item() == 0.0 and stats.is_masked_fraction == 1.0
        assert grad_of(loss, logp) == [[0.0, 0.0]]


def test_gspo_clips_the_geometric_mean_ratio_per_sequence() -> None:
    # row 0: log(pi_theta / pi_sampler) = [0.2, 0.0] -> s = e^0.1, A = +1 (inside [0.8, 1.2]);
    # row 1: [-0.4, pad] -> s = e^-0.4 = 0.670 < 0.8, A = -1: -min(-0.670, -0.8) = 0.8, clipped.
    logp = t([[-1.0, -2.0], [-0.5, NAN]], grad=True)
    sampler = t([[-1.2, -2.0], [-0.1, NAN]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = t([[1, 1], [1, 0]])
    loss, stats = gspo_loss(logp, sampler, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    s0 = math.exp(0.1)
    # row 0's term -s0 counts once per token: loss = (2 * -s0 + 0.8) / 3
    assert loss.item() == pytest.approx((-2 * s0 + 0.8) / 3)
    assert stats.clip_fraction == pytest.approx(1 / 3)
    assert stats.ratio_mean == pytest.approx((2 * s0 + math.exp(-0.4)) / 3)
    # d/dlogp_t of 2 * (-s0) / 3 with ds0/dlogp_t = s0 / 2: -s0 / 3 on each of row 0's tokens
    assert np.allclose(grad_of(loss, logp), [[-s0 / 3, -s0 / 3], [0.0, 0.0]])


def test_gspo_with_the_papers_tight_clip_cuts_a_small_sequence_drift() -> None:
    logp = t([[-1.0]], grad=True)
    sampler = t([[-1.001]])  # s = e^0.001 > 1 + 4e-4 with A > 0: clipped, no gradient
    loss, stats = gspo_loss(logp, sampler, torch.ones(1, dtype=torch.float64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert stats.clip_fraction == 1.0
    assert grad_of(loss, logp) == [[0.0]]


def test_cispo_clips_the_weight_but_every_token_keeps_its_gradient() -> None:
    # ratios pi_theta / pi_sampler = [0.5, 3, 1.2]; weights clip(., 0, 2) = [0.5, 2, 1.2]; A = 1.5
    logp = t([[-1.0, -2.0, -0.5]], grad=True)
    sampler = logp.detach() - t([[LOG(0.5), LOG(3.0), LOG(1.2)]])
    loss, stats = cispo_loss(logp, sampler, torch.tensor([1.5], dtype=torch.float64), torch.ones(1, 3), high=2.0)
    # loss = -(0.5 * 1.5 * -1 + 2 * 1.5 * -2 + 1.2 * 1.5 * -0.5) / 3 = 7.65 / 3
    assert loss.item() == pytest.approx(7.65 / 3)
    assert stats.clip_fraction == pytest.approx(1 / 3)
    assert stats.is_weight_mean == pytest.approx((0.5 + 2 + 1.2) / 3)
    # d/dlogp_t = -w_t A / 3: the clipped token (ratio 3) still moves, weighed 2 (PPO's clip
    # would have zeroed it)
    assert np.allclose(grad_of(loss, logp), [[-0.25, -1.0, -0.6]])


def test_policy_loss_default_is_the_decoupled_ppo_loss_unchanged() -> None:
    logp, sampler = three_rows()
    for old_policy in ("sampler", "learner"):
        loss, stats = policy_loss("ppo_is", logp, sampler, ADV, MASK, old_policy=old_policy)
        reference, ref_stats = grpo_loss(logp, sampler if old_policy == "sampler" else None, sampler, ADV, MASK)
        assert loss.item() == reference.item() and stats == ref_stats


def test_policy_loss_routes_every_name_with_its_thresholds() -> None:
    logp, sampler = three_rows()
    band = {"low": 0.7, "high": 1.85}
    expected = {
        "tis_token_mask": token_masked_is_loss(logp, None, sampler, ADV, MASK, **band),
        "tis_sequence_mask": sequence_masked_is_loss(logp, None, sampler, ADV, MASK, **band),
        "geo_sequence_mask": geometric_masked_is_loss(logp, None, sampler, ADV, MASK, **band),
        "gspo": gspo_loss(logp, sampler, ADV, MASK, clip_eps_low=0.1, clip_eps_high=0.3),
        "cispo": cispo_loss(logp, sampler, ADV, MASK, high=1.5),
    }
    assert set(expected) | {"ppo_is"} == set(LOSSES)
    for name, (value, stats) in expected.items():
        loss, got = policy_loss(
            name,  # type: ignore[arg-type]
            logp,
            sampler,
            ADV,
            MASK,
            is_cap=1.5,
            mask_low=0.7,
            mask_high=1.85,
            gspo_clip_low=0.1,
            gspo_clip_high=0.3,
        )
        assert (loss.item(), got) == (value.item(), stats), name


def test_bad_bands_are_refused() -> None:
    logp, sampler = three_rows()
    with pytest.raises(ValueError, match="0 < low < high"):
        token_masked_is_loss(logp, None, sampler, ADV, MASK, low=2.0, high=0.5)
    with pytest.raises(ValueError, match="0 <= low < high"):
        cispo_loss(logp, sampler, ADV, MASK, low=2.0, high=2.0)
    with pytest.raises(ValueError, match="loss must be one of"):
        StepSettings(loss="ppo")  # type: ignore[arg-type]


def test_the_learner_step_trains_with_a_correction_and_reports_the_masked_fraction() -> None:
    # Row 0's sampler gave its token 1/8 where the learner gives 1/4: rho = 2, outside
    # [0.5, 1.9], so masked; row 1's two tokens have rho = 1. loss = (0 + 1 + 1) / 3.
    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    settings = StepSettings(loss="tis_token_mask", mask_high=1.9)
    stats = optimiser_step(model, optimizer, two_rows(behaviour_first=-math.log(8)), settings, version=0, pad_id=0)
    assert stats.loss == pytest.approx(2 / 3, rel=1e-5)
    assert stats.record()["is_masked_fraction"] == pytest.approx(1 / 3)
    # the default step reports the field too, as 0
    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    stats = optimiser_step(model, optimizer, two_rows(), StepSettings(), version=0, pad_id=0)
    assert stats.record()["is_masked_fraction"] == 0.0
