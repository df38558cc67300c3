"""Off-policy GRPO objective used by the learner (pure functions, torch).

Variant: decoupled PPO (ECHO-2 appendix; AReaL's "decoupled PPO"), three policies per token:
  pi_theta   the policy being optimised                  -> `logp` (carries the gradient)
  pi_prox    learner's policy at the start of this step  -> `logp_prox` ("pi_old", detached)
  pi_sampler policy the remote worker actually sampled   -> `logp_sampler` (behaviour)

  A_i      = (r_i - mean_G(r)) / (std_G(r) + 1e-6)                 group z-score, per prompt
  ratio    = exp(logp - logp_prox)                                  (B, T)
  surr     = min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)   PPO-clip
  w        = sg(min(exp(logp_prox - logp_sampler), C))              truncated IS weight
  loss_tok = -w * surr + beta * k3(logp, logp_ref)
  loss     = sum(loss_tok * mask) / sum(mask)                       token-mean over the batch

Choices and deviations (the paper is silent or we extend it):
- std_G is the population std (unbiased=False): G is small (e.g. 16) and this is what the
  reference GRPO implementations use; a group with all-equal rewards gets advantage 0
  exactly (no signal, no NaN).
- Token-mean over *all* response tokens of the batch (DAPO-style), not per-sequence mean:
  long responses weigh in proportion to their tokens. `mask` may hold float weights.
- `clip_eps_high` (DAPO "clip-higher") is an extension; it defaults to `clip_eps`, which
  is the paper's symmetric clip.
- `is_cap=None` disables truncation (plain IS); the paper always truncates (default C=2).
  w is computed in log space (`exp(min(log w, log C))`) so a huge mismatch cannot overflow.
- The KL term is added per token inside the token-mean and is *not* multiplied by w; it
  uses the k3 estimator exp(ref - logp) - (ref - logp) - 1 (unbiased, non-negative).
- `logp_prox=None` means one optimiser step per batch: pi_prox = sg(pi_theta), so ratio == 1,
  the clip is inactive and the gradient is the IS-weighted policy gradient
  -w * A * grad(logp); w alone carries the off-policy (staleness) correction.
- Padded tokens (mask == 0) are zeroed *before* any arithmetic, so NaN/inf padding cannot
  reach the loss or the gradient. An all-zero mask gives loss 0.
- clip_fraction counts tokens whose gradient the clip removes: (A > 0, ratio > 1 + eps_high)
  or (A < 0, ratio < 1 - eps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ADV_EPS = 1e-6  # the paper's epsilon in the group z-score


@dataclass(frozen=True)
class GRPOStats:
    """Per-batch diagnostics, all means over masked (response) tokens."""

    clip_fraction: float  # tokens whose gradient the PPO clip zeroed
    is_weight_mean: float  # mean truncated weight w
    is_truncated_fraction: float  # tokens where exp(logp_prox - logp_sampler) > C
    kl: float  # mean k3(logp, logp_ref); 0.0 when no reference is given
    approx_kl_sampler: float  # mean(logp_sampler - logp): sampler/learner mismatch (k1)
    ratio_mean: float  # mean pi_theta / pi_prox
    tokens: float  # sum(mask)
    is_masked_fraction: float = 0.0  # tokens a masked-IS correction zeroed (echo2.rl.corrections)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / sum(mask); 0 for an empty mask (no division by zero)."""
    total = mask.sum()  # ()
    return (x * mask).sum() / torch.where(total > 0, total, 1.0)  # ()


def group_advantages(rewards: Tensor) -> Tensor:
    """Group z-score advantages: rewards (N prompts, G samples) -> (N, G)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (N, G), got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=-1, keepdim=True)  # (N, 1)
    std = rewards.std(dim=-1, correction=0, keepdim=True)  # (N, 1), population std
    flat = (rewards == rewards[:, :1]).all(dim=-1, keepdim=True)  # (N, 1): mean may round
    return torch.where(flat, 0.0, (rewards - mean) / (std + ADV_EPS))  # (N, G)


def grpo_loss(
    logp: Tensor,
    logp_prox: Tensor | None,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float | None = 2.0,
    kl_beta: float = 0.0,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, GRPOStats]:
    """Decoupled-PPO GRPO loss (scalar, differentiable w.r.t. `logp`) and its stats."""
    check_shapes(logp, logp_prox, logp_sampler, advantages, mask, logp_ref)
    if kl_beta != 0.0 and logp_ref is None:
        raise ValueError("kl_beta != 0 needs logp_ref")
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0 or None, got {is_cap}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = mask.to(logp.dtype)  # (B, T)
    pad = mask <= 0  # (B, T) bool
    logp = logp.masked_fill(pad, 0.0)  # (B, T)
    prox = (logp if logp_prox is None else logp_prox).detach().masked_fill(pad, 0.0)  # (B, T)
    sampler = logp_sampler.detach().masked_fill(pad, 0.0)  # (B, T)
    adv = advantages.detach().to(logp.dtype)[:, None]  # (B, 1)

    ratio = torch.exp(logp - prox)  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)  # (B, T)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    log_cap = math.inf if is_cap is None else math.log(is_cap)
    w = torch.exp((prox - sampler).clamp(max=log_cap))  # (B, T), detached by construction
    per_token = -w * surrogate  # (B, T)
    k3 = torch.zeros_like(logp)  # (B, T)
    if logp_ref is not None:
        d = logp_ref.detach().masked_fill(pad, 0.0) - logp  # (B, T), log(ref / theta)
        k3 = torch.exp(d) - d - 1.0  # (B, T)
        per_token = per_token + kl_beta * k3  # (B, T)
    loss = masked_mean(per_token, mask)  # ()

    with torch.no_grad():
        high = (adv > 0) & (ratio > 1.0 + eps_high)  # (B, T) clip zeroed the gradient
        low = (adv < 0) & (ratio < 1.0 - clip_eps)  # (B, T)
        is_clipped = high | low  # (B, T)
        truncated = (prox - sampler) > log_cap  # (B, T)
        stats = GRPOStats(
            clip_fraction=masked_mean(is_clipped.to(mask.dtype), mask).item(),
            is_weight_mean=masked_mean(w, mask).item(),
            is_truncated_fraction=masked_mean(truncated.to(mask.dtype), mask).item(),
            kl=masked_mean(k3, mask).item(),
            approx_kl_sampler=masked_mean(sampler - logp, mask).item(),
            ratio_mean=masked_mean(ratio, mask).item(),
            tokens=mask.sum().item(),
        )
    return loss, stats


def check_shapes(
    logp: Tensor,
    logp_prox: Tensor | None,
    logp_sampler: Tensor,
    advantages: Tensor,
    mask: Tensor,
    logp_ref: Tensor | None,
) -> None:
    """Fail loudly on shape mistakes that broadcasting would otherwise hide."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    named = {"logp_prox": logp_prox, "logp_sampler": logp_sampler, "mask": mask, "logp_ref": logp_ref}
    for name, t in named.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be (B,) = {tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")
