"""GRPO objective: hand-computed values (not re-implementations of the formula)."""

from __future__ import annotations

import math

import pytest
import torch

from echo2.rl.grpo import GRPOStats, group_advantages, grpo_loss, masked_mean

LOG = math.log


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_hand_example() -> None:
    # group 0: mean 0.5, population std 0.5; group 1: mean 3, std 1
    adv = group_advantages(t([[1, 0, 0, 1], [2, 4, 2, 4]]))
    expected = t([[1, -1, -1, 1], [-1, 1, -1, 1]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    assert adv.shape == (2, 4)


def test_all_equal_group_gives_exact_zeros() -> None:
    adv = group_advantages(t([[0.7, 0.7, 0.7], [0, 0, 0]]))
    assert torch.equal(adv, torch.zeros(2, 3, dtype=torch.float64))


def test_group_advantages_rejects_flat_input() -> None:
    with pytest.raises(ValueError, match=r"\(N, G\)"):
        group_advantages(torch.ones(4))


# ----------------------------------------------------------------------------- clipping


def test_clip_ratio_1_5_positive_and_negative_advantage() -> None:
    # ratio = 0.6 / 0.4 = 1.5, sampler == prox (w = 1), eps = 0.2.
    logp = t([[LOG(0.6)], [LOG(0.6)]], grad=True)
    prox = t([[LOG(0.4)], [LOG(0.4)]])
    adv = t([[1.0], [-1.0]]).squeeze(1)
    loss, stats = grpo_loss(logp, prox, prox, adv, torch.ones(2, 1))
    # A=+1: -min(1.5, 1.2) = -1.2 (clipped); A=-1: -min(-1.5, -1.2) = +1.5 (not clipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.ratio_mean == pytest.approx(1.5)
    loss.backward()
    # clipped token: no gradient; other: d/dlogp (+ratio)/2 = 1.5/2
    assert logp.grad is not None
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.75])


def test_clip_eps_high_widens_upper_bound_only() -> None:
    logp = t([[LOG(0.6)], [LOG(0.2)]])  # ratios 1.5 and 0.5
    prox = t([[LOG(0.4)], [LOG(0.4)]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = grpo_loss(logp, prox, prox, adv, torch.ones(2, 1), clip_eps_high=0.6)
    # A=+1, r=1.5 < 1.6: -1.5 (unclipped); A=-1, r=0.5 < 0.8: -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.5 + 0.8) / 2)
    assert stats.clip_fraction == pytest.approx(0.5)


# ----------------------------------------------------------------------------- IS weight


def test_is_weight_truncated_at_cap() -> None:
    logp = t([[0.0, 0.0]])
    prox = t([[0.0, 0.0]])  # ratio 1
    sampler = t([[-LOG(5.0), LOG(2.0)]])  # prox - sampler: log 5 (w 5 -> 2), log 0.5 (w 0.5)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, stats = grpo_loss(logp, prox, sampler, adv, torch.ones(1, 2), is_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert stats.is_weight_mean == pytest.approx(1.25)
    assert stats.is_truncated_fraction == pytest.approx(0.5)
    # mean(logp_sampler - logp) = (-log 5 + log 2) / 2
    assert stats.approx_kl_sampler == pytest.approx((LOG(2) - LOG(5)) / 2)

    loss_uncapped, stats_uncapped = grpo_loss(logp, prox, sampler, adv, torch.ones(1, 2), is_cap=None)
    assert loss_uncapped.item() == pytest.approx(-(5.0 + 0.5) / 2)
    assert stats_uncapped.is_truncated_fraction == 0.0


def test_is_weight_does_not_overflow_on_huge_mismatch() -> None:
    adv = torch.ones(1, dtype=torch.float64)
    loss, stats = grpo_loss(t([[0.0]]), t([[0.0]]), t([[-1e4]]), adv, torch.ones(1, 1))
    assert loss.item() == pytest.approx(-2.0)
    assert stats.is_weight_mean == pytest.approx(2.0)


# ----------------------------------------------------------------------------- masks, token mean


def test_padding_does_not_change_loss_or_gradient() -> None:
    adv = torch.tensor([0.5, -2.0], dtype=torch.float64)
    short_logp = t([[-1.0], [-0.5]], grad=True)
    short_prox, short_sampler = t([[-1.2], [-0.4]]), t([[-1.0], [-0.9]])
    loss_short, _ = grpo_loss(short_logp, short_prox, short_sampler, adv, torch.ones(2, 1))
    loss_short.backward()

    nan, inf = math.nan, math.inf
    logp = t([[-1.0, nan, 50.0], [-0.5, -inf, 3.0]], grad=True)  # garbage in padding
    prox = t([[-1.2, 7.0, -inf], [-0.4, nan, 0.0]])
    sampler = t([[-1.0, -90.0, nan], [-0.9, inf, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, stats = grpo_loss(logp, prox, sampler, adv, mask, kl_beta=0.1, logp_ref=prox)
    loss_nokl, _ = grpo_loss(logp.detach(), prox, sampler, adv, mask)
    assert torch.isfinite(loss)
    assert loss_nokl.item() == pytest.approx(loss_short.item())
    assert stats.tokens == 2.0

    loss_padded, _ = grpo_loss(logp, prox, sampler, adv, mask)
    loss_padded.backward()
    assert logp.grad is not None and short_logp.grad is not None
    torch.testing.assert_close(logp.grad[:, :1], short_logp.grad)
    assert torch.equal(logp.grad[:, 1:], torch.zeros(2, 2, dtype=torch.float64))


def test_token_mean_differs_from_sequence_mean_on_uneven_lengths() -> None:
    # ratio 1, w 1. Seq 0: 1 token, A=+1 -> per-token loss -1. Seq 1: 3 tokens, A=-1 -> +1 each.
    # token-mean = (-1 + 3) / 4 = 0.5; a sequence-mean would give (-1 + 1) / 2 = 0.
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = grpo_loss(logp, logp, logp, adv, mask)
    assert loss.item() == pytest.approx(0.5)
    assert stats.tokens == 4.0


def test_empty_mask_gives_zero_loss() -> None:
    z = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = grpo_loss(z, z, z, torch.ones(1, dtype=torch.float64), z)
    assert loss.item() == 0.0 and stats.tokens == 0.0


def test_masked_mean() -> None:
    x = t([[1.0, 2.0, 100.0]])
    assert masked_mean(x, t([[1.0, 1.0, 0.0]])).item() == pytest.approx(1.5)
    assert masked_mean(x, t([[0.25, 0.25, 0.0]])).item() == pytest.approx(1.5)  # float weights
    assert masked_mean(x, t([[0.0, 0.0, 0.0]])).item() == 0.0


# ----------------------------------------------------------------------------- gradient, KL


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_sgd_step_moves_logp_with_advantage_sign(advantage: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    token = 3
    sampler = torch.log_softmax(logits.detach(), -1)[token].reshape(1, 1) - 0.3  # stale sampler

    def logp_of_token() -> torch.Tensor:
        return torch.log_softmax(logits, -1)[token].reshape(1, 1)  # (1, 1)

    before = logp_of_token().item()
    loss, _ = grpo_loss(logp_of_token(), None, sampler, torch.tensor([advantage]), torch.ones(1, 1))
    loss.backward()
    with torch.no_grad():
        assert logits.grad is not None
        logits -= 0.1 * logits.grad
    after = logp_of_token().item()
    assert (after - before) * advantage > 0


def test_kl_k3_hand_value() -> None:
    # d = log(ref / theta) = log(0.25 / 0.5) = -log 2; k3 = e^d - d - 1 = 0.5 + log 2 - 1
    logp = t([[LOG(0.5)]], grad=True)
    ref = t([[LOG(0.25)]])
    k3 = 0.5 + LOG(2.0) - 1.0
    loss, stats = grpo_loss(
        logp, None, logp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), kl_beta=0.1, logp_ref=ref
    )
    assert stats.kl == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)  # A = 0: only the KL term
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.item() == pytest.approx(0.1 * (1.0 - 0.5))  # d k3 / d logp = 1 - e^d


def test_kl_stat_reported_without_penalty_and_zero_without_ref() -> None:
    logp, ref = t([[LOG(0.5)]]), t([[LOG(0.25)]])
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 1)
    loss_ref, stats_ref = grpo_loss(logp, None, logp, adv, mask, logp_ref=ref)
    loss_plain, stats_plain = grpo_loss(logp, None, logp, adv, mask)
    assert stats_ref.kl == pytest.approx(0.5 + LOG(2.0) - 1.0)
    assert stats_plain.kl == 0.0
    assert loss_ref.item() == loss_plain.item() == pytest.approx(-1.0)


def test_prox_none_equals_detached_logp() -> None:
    torch.manual_seed(1)
    base = -torch.rand(3, 4, dtype=torch.float64)
    sampler = base - 0.5 * torch.rand(3, 4, dtype=torch.float64)
    adv = torch.randn(3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    results = []
    for use_none in (True, False):
        logp = base.clone().requires_grad_(True)
        loss, stats = grpo_loss(logp, None if use_none else logp.detach(), sampler, adv, mask)
        loss.backward()
        results.append((loss.detach(), logp.grad, stats))
    (l1, g1, s1), (l2, g2, s2) = results
    assert torch.equal(l1, l2) and g1 is not None and g2 is not None and torch.equal(g1, g2)
    assert s1 == s2 and s1.ratio_mean == 1.0 and s1.clip_fraction == 0.0


# ----------------------------------------------------------------------------- contract


def test_shape_and_argument_errors() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(z, z, z, torch.zeros(3), z)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(z, z, z, torch.zeros(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(z, z, z, torch.zeros(2), z, kl_beta=0.1)


def test_stats_is_frozen_record_of_floats() -> None:
    z = torch.zeros(1, 1)
    _, stats = grpo_loss(z, z, z, torch.zeros(1), torch.ones(1, 1))
    assert isinstance(stats, GRPOStats)
    assert all(isinstance(v, float) for v in vars(stats).values())
    with pytest.raises(AttributeError):
        stats.tokens = 3.0  # type: ignore[misc]
