"""Off-policy corrections beside the decoupled-PPO loss (pure functions, torch), and the one
``policy_loss`` the learner step calls to pick among them (``LearnerConfig.loss``).

Notation as in ``echo2.rl.grpo``: per token t of row i, ``logp`` = log pi_theta (carries the
gradient), ``logp_prox`` = log pi_prox (the learner's policy at the step start; None means
sg(pi_theta), the one-step-per-batch case), ``logp_sampler`` = log pi_sampler (the policy
the remote worker sampled with), A_i the group advantage, m the response mask. n_i = tokens
of row i, N = tokens of the batch.

  rho_t   = exp(logp_prox - logp_sampler)                     learner/sampler IS ratio (B, T)
  r_t     = exp(logp - logp_prox)                             PPO ratio                (B, T)
  surr_t  = min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i)  PPO-clip surrogate     (B, T)

Masked importance sampling (mask, don't truncate: a token or sequence whose ratio is far
out of band carries no gradient at all instead of a capped one):

``tis_token_mask``     token-level MIS, IcePop (Ling team 2025, "Small Leak Can Sink a Great
                       Ship"), token MIS of Liu, Li et al. 2025 ("When Speed Kills Stability"):
                       loss_t = -sg(rho_t) * 1[low <= rho_t <= high] * surr_t
``tis_sequence_mask``  sequence-level MIS (Seq-MIS, Liu, Li et al. 2025): the sequence ratio
                       rho_i = prod_t rho_t = exp(sum_t log rho_t) is the weight and the test,
                       loss_t = -sg(rho_i) * 1[low <= rho_i <= high] * surr_t
``geo_sequence_mask``  geometric-mean sequence mask (Geo-Mask, Liu, Li et al. 2025; verl's
                       "geometric" rejection): the length-normalised ratio
                       g_i = exp(mean_t log rho_t) is the test, the token ratios the weights,
                       loss_t = -sg(rho_t) * 1[low <= g_i <= high] * surr_t

Sequence-level and clipped-weight objectives, whose ratio is to the behaviour policy
pi_sampler (pi_old of both papers: the policy that generated the data):

``gspo``   GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"):
           s_i = exp(mean_t (logp_t - logp_sampler_t))       geometric mean of token ratios
           loss_t = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)   for every t of i
``cispo``  CISPO (MiniMax-M1, 2025): REINFORCE with the clipped IS weight detached,
           loss_t = -sg(clip(exp(logp_t - logp_sampler_t), low, high)) * A_i * logp_t

Choices and deviations (shared with ``grpo_loss`` unless said):
- Every loss is a token mean over the batch, sum_t loss_t m_t / N (DAPO-style, as
  ``grpo_loss``), so packing and data-parallel shares rescale it the same way. GSPO's paper
  averages per sequence (1/G sum_i); here a sequence's term counts once per token, which is
  the GSPO-token form with token-mean aggregation: d loss / d logp_t = -s_i A_i / N (unclipped).
- Sequence sums and means run over tokens with m > 0; ratios are formed in log space and
  the mask tested there (log low <= log rho <= log high), so a product over a long sequence
  cannot overflow before the test; a masked weight is exactly 0.
- In the one-step learner (``logp_prox=None``) r = 1 and surr_t = A_i: the masked losses are
  then IS-weighted policy gradients, -sg(rho) * 1[in band] * A * grad(logp).
- CISPO: the paper sets no lower bound (eps_low large) and tunes the upper; the learner
  passes low = 0 and high = ``is_cap`` (C = 1 + eps_high). GSPO's clip range is its own
  (the paper: 3e-4 / 4e-4), far tighter than the token clip, since s_i is a geometric mean.
- The k3 KL term to a reference (``kl_beta``) is added per token, unweighted, as in ``grpo_loss``.
- Stats: ``is_masked_fraction`` counts tokens a mask zeroed; ``clip_fraction`` tokens whose
  gradient a clip removed (PPO clip; GSPO's sequence clip; CISPO: weight clipped at a bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from echo2.rl import LossName, OldPolicy
from echo2.rl.grpo import GRPOStats, check_shapes, grpo_loss, masked_mean

_MAX_LOG_WEIGHT = 80.0
"""exp(80) ~ 5.5e34 < float32's largest finite value: the cap of an unbounded log weight."""


@dataclass(frozen=True)
class _Batch:
    """The inputs with padding zeroed before any arithmetic (NaN/inf padding never reaches
    the loss), the per-token ratios every correction starts from, and per-row token counts."""

    logp: Tensor  # (B, T) carries the gradient
    mask: Tensor  # (B, T) float weights
    valid: Tensor  # (B, T) bool: m > 0
    adv: Tensor  # (B, 1) detached
    log_rho: Tensor  # (B, T) log pi_prox / pi_sampler, detached
    log_r: Tensor  # (B, T) log pi_theta / pi_prox, differentiable
    log_behaviour: Tensor  # (B, T) log pi_theta / pi_sampler, differentiable
    lengths: Tensor  # (B, 1) n_i
    sampler: Tensor  # (B, T) detached


def _prepare(logp: Tensor, logp_prox: Tensor | None, logp_sampler: Tensor, advantages: Tensor, mask: Tensor) -> _Batch:
    mask = mask.to(logp.dtype)  # (B, T)
    pad = mask <= 0  # (B, T)
    logp = logp.masked_fill(pad, 0.0)  # (B, T)
    prox = (logp if logp_prox is None else logp_prox).detach().masked_fill(pad, 0.0)  # (B, T)
    sampler = logp_sampler.detach().masked_fill(pad, 0.0)  # (B, T)
    return _Batch(
        logp=logp,
        mask=mask,
        valid=~pad,
        adv=advantages.detach().to(logp.dtype)[:, None],
        log_rho=prox - sampler,
        log_r=logp - prox,
        log_behaviour=logp - sampler,
        lengths=(~pad).sum(dim=1, keepdim=True).to(logp.dtype),
        sampler=sampler,
    )


def _in_band(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """1[low <= exp(log_ratio) <= high], tested in log space (bool, same shape)."""
    if not 0 < low < high:
        raise ValueError(f"the mask band needs 0 < low < high, got [{low}, {high}]")
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


def _ppo_surrogate(b: _Batch, clip_eps: float, clip_eps_high: float | None) -> tuple[Tensor, Tensor]:
    """surr_t (B, T) and where the PPO clip removed the gradient (B, T bool)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(b.log_r)  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)  # (B, T)
    surrogate = torch.minimum(ratio * b.adv, clipped * b.adv)  # (B, T)
    removed = ((b.adv > 0) & (ratio > 1.0 + eps_high)) | ((b.adv < 0) & (ratio < 1.0 - clip_eps))  # (B, T)
    return surrogate, removed


def _reduce(
    b: _Batch,
    policy_term: Tensor,
    *,
    weight: Tensor,
    clipped: Tensor,
    masked: Tensor,
    ratio: Tensor,
    kl_beta: float,
    logp_ref: Tensor | None,
) -> tuple[Tensor, GRPOStats]:
    """Token mean of ``policy_term`` (+ kl_beta * k3) and the batch's diagnostics."""
    if kl_beta != 0.0 and logp_ref is None:
        raise ValueError("kl_beta != 0 needs logp_ref")
    per_token = policy_term  # (B, T)
    k3 = torch.zeros_like(b.logp)  # (B, T)
    if logp_ref is not None:
        d = logp_ref.detach().masked_fill(~b.valid, 0.0) - b.logp  # (B, T)
        k3 = torch.exp(d) - d - 1.0  # (B, T)
        per_token = per_token + kl_beta * k3
    loss = masked_mean(per_token, b.mask)  # ()
    with torch.no_grad():
        m = b.mask
        stats = GRPOStats(
            clip_fraction=masked_mean(clipped.to(m.dtype), m).item(),
            is_weight_mean=masked_mean(weight.detach(), m).item(),
            is_truncated_fraction=0.0,  # these losses mask or clip; none truncates rho
            kl=masked_mean(k3, m).item(),
            approx_kl_sampler=masked_mean(b.sampler - b.logp, m).item(),
            ratio_mean=masked_mean(ratio.detach(), m).item(),
            tokens=m.sum().item(),
            is_masked_fraction=masked_mean(masked.to(m.dtype), m).item(),
        )
    return loss, stats


def _masked_ppo(
    b: _Batch,
    keep: Tensor,
    weight: Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    kl_beta: float,
    logp_ref: Tensor | None,
) -> tuple[Tensor, GRPOStats]:
    """What the masked-IS losses share: -weight * PPO surrogate, tokens outside ``keep`` masked."""
    surrogate, clipped = _ppo_surrogate(b, clip_eps, clip_eps_high)
    return _reduce(
        b, -weight * surrogate, weight=weight, clipped=clipped & keep, masked=~keep, ratio=torch.exp(b.log_r),
        kl_beta=kl_beta, logp_ref=logp_ref,
    )  # fmt: skip


def token_masked_is_loss(
    logp: Tensor,
    logp_prox: Tensor | None,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """Token-level masked IS (IcePop): loss_t = -sg(rho_t) 1[low <= rho_t <= high] surr_t,
    rho_t = pi_prox / pi_sampler per token; token mean over the batch."""
    check_shapes(logp, logp_prox, logp_sampler, advantages, mask, logp_ref)
    b = _prepare(logp, logp_prox, logp_sampler, advantages, mask)
    keep = _in_band(b.log_rho, low, high)  # (B, T)
    weight = torch.where(keep, torch.exp(b.log_rho.clamp(max=math.log(high))), 0.0)  # (B, T)
    return _masked_ppo(b, keep, weight, clip_eps, clip_eps_high, kl_beta, logp_ref)


def sequence_masked_is_loss(
    logp: Tensor,
    logp_prox: Tensor | None,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """Sequence-level masked IS (Seq-MIS): rho_i = exp(sum_t log rho_t) over row i's tokens;
    loss_t = -sg(rho_i) 1[low <= rho_i <= high] surr_t; token mean over the batch."""
    check_shapes(logp, logp_prox, logp_sampler, advantages, mask, logp_ref)
    b = _prepare(logp, logp_prox, logp_sampler, advantages, mask)
    log_rho_seq = (b.log_rho * b.valid).sum(dim=1, keepdim=True)  # (B, 1)
    keep = _in_band(log_rho_seq, low, high).expand_as(b.logp)  # (B, T)
    weight = torch.where(keep, torch.exp(log_rho_seq.clamp(max=math.log(high))), 0.0)  # (B, T)
    return _masked_ppo(b, keep, weight, clip_eps, clip_eps_high, kl_beta, logp_ref)


def geometric_masked_is_loss(
    logp: Tensor,
    logp_prox: Tensor | None,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """Geometric-mean sequence mask (Geo-Mask): g_i = exp(mean_t log rho_t) over row i's
    tokens; loss_t = -sg(rho_t) 1[low <= g_i <= high] surr_t; token mean over the batch."""
    check_shapes(logp, logp_prox, logp_sampler, advantages, mask, logp_ref)
    b = _prepare(logp, logp_prox, logp_sampler, advantages, mask)
    log_geo = (b.log_rho * b.valid).sum(dim=1, keepdim=True) / b.lengths.clamp(min=1.0)  # (B, 1)
    keep = _in_band(log_geo, low, high).expand_as(b.logp)  # (B, T)
    # A kept sequence may hold a token far out of band (the band bounds the mean only): its
    # exponent is capped below float32's range so the weight stays finite.
    weight = torch.where(keep, torch.exp(b.log_rho.clamp(max=_MAX_LOG_WEIGHT)), 0.0)  # (B, T)
    return _masked_ppo(b, keep, weight, clip_eps, clip_eps_high, kl_beta, logp_ref)


def gspo_loss(
    logp: Tensor,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """GSPO: s_i = exp(mean_t (logp_t - logp_sampler_t)) (differentiable);
    loss_t = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) for every token of row i;
    token mean over the batch."""
    check_shapes(logp, None, logp_sampler, advantages, mask, logp_ref)
    b = _prepare(logp, None, logp_sampler, advantages, mask)
    log_s = (b.log_behaviour * b.valid).sum(dim=1, keepdim=True) / b.lengths.clamp(min=1.0)  # (B, 1)
    s = torch.exp(log_s)  # (B, 1)
    surrogate = torch.minimum(s * b.adv, s.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * b.adv)  # (B, 1)
    removed = ((b.adv > 0) & (s > 1.0 + clip_eps_high)) | ((b.adv < 0) & (s < 1.0 - clip_eps_low))  # (B, 1)
    per_token = (-surrogate).expand_as(b.logp)  # (B, T)
    ones = torch.ones_like(b.logp)
    return _reduce(
        b, per_token, weight=ones, clipped=removed.expand_as(b.logp), masked=torch.zeros_like(b.valid),
        ratio=s.expand_as(b.logp), kl_beta=kl_beta, logp_ref=logp_ref,
    )  # fmt: skip


def cispo_loss(
    logp: Tensor,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    low: float = 0.0,
    high: float = 2.0,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """CISPO: loss_t = -sg(clip(exp(logp_t - logp_sampler_t), low, high)) A_i logp_t;
    token mean over the batch. Every token keeps a gradient (only its weight is clipped)."""
    check_shapes(logp, None, logp_sampler, advantages, mask, logp_ref)
    if not 0 <= low < high:
        raise ValueError(f"CISPO needs 0 <= low < high, got [{low}, {high}]")
    b = _prepare(logp, None, logp_sampler, advantages, mask)
    ratio = torch.exp(b.log_behaviour.detach().clamp(max=math.log(high) + 1.0))  # (B, T), no overflow
    weight = ratio.clamp(low, high)  # (B, T), detached
    clipped = (ratio < low) | (ratio > high)  # (B, T)
    return _reduce(
        b, -weight * b.adv * b.logp, weight=weight, clipped=clipped, masked=torch.zeros_like(b.valid),
        ratio=ratio, kl_beta=kl_beta, logp_ref=logp_ref,
    )  # fmt: skip


def policy_loss(
    loss: LossName,
    logp: Tensor,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    old_policy: OldPolicy = "sampler",
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """The learner's objective ``loss`` on one batch (the names of ``echo2.rl.LossName``).

    ``old_policy`` applies to "ppo_is" only (pi_old of its PPO ratio, as before). The masked
    losses test the learner/sampler ratio, so their pi_prox is always the learner's policy
    at the step start, sg(pi_theta); GSPO and CISPO take their ratio to pi_sampler.
    """
    lp, ls, adv, m = logp, logp_sampler, advantages, mask
    match loss:
        case "ppo_is":
            prox = ls if old_policy == "sampler" else None
            return grpo_loss(lp, prox, ls, adv, m, clip_eps=clip_eps, is_cap=is_cap, kl_beta=kl_beta, logp_ref=logp_ref)
        case "tis_token_mask" | "tis_sequence_mask" | "geo_sequence_mask":
            masked_is = _MASKED_IS[loss]
            return masked_is(
                lp, None, ls, adv, m, low=mask_low, high=mask_high, clip_eps=clip_eps, kl_beta=kl_beta,
                logp_ref=logp_ref,
            )  # fmt: skip
        case "gspo":
            return gspo_loss(
                lp, ls, adv, m, clip_eps_low=gspo_clip_low, clip_eps_high=gspo_clip_high, kl_beta=kl_beta,
                logp_ref=logp_ref,
            )  # fmt: skip
        case "cispo":
            return cispo_loss(lp, ls, adv, m, low=0.0, high=is_cap, kl_beta=kl_beta, logp_ref=logp_ref)
    raise ValueError(f"unknown loss {loss!r}")


_MASKED_IS = {
    "tis_token_mask": token_masked_is_loss,
    "tis_sequence_mask": sequence_masked_is_loss,
    "geo_sequence_mask": geometric_masked_is_loss,
}
