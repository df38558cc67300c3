"""One learner step of off-policy GRPO: pack scored groups into rows, take one optimiser step.

Variant (the loss itself is ``echo2.rl.grpo.grpo_loss``, or the correction ``loss`` names in
``echo2.rl.corrections``):

  pack:   every kept completion of every group is a row b = (prompt, response, behaviour
          log-probs, A_b, sampler); A = group_advantages over the group's kept rewards
  step:   logp = log pi_theta(response | prompt)                                  (B, T)
          [packed: per micro-batch of packed rows, ``echo2.rl.packing``; each micro-batch's
           grpo_loss weighted by its tokens / the batch's tokens, gradients accumulated]
          pi_old = pi_sampler (old_policy = "sampler", the default) or sg(pi_theta) ("learner")
          loss = grpo_loss(logp, pi_old, pi_sampler, A, mask)   token mean over the whole batch
          lr_t = lr * min(1, (t + 1) / warmup_steps)  [x linear decay to final_lr_ratio, optional]
          clip the gradient norm;  one AdamW step

What ``old_policy`` means for the correction:
- "sampler": the PPO ratio is pi_theta / pi_sampler and its clip is the trust region around
  the policy that generated the data; the truncated IS weight is exp(0) = 1 (inactive).
- "learner": one step per batch, so pi_old = sg(pi_theta): the ratio is 1, the clip inactive,
  and the truncated IS weight min(pi_theta / pi_sampler, C) alone corrects for staleness.

Choices and deviations:
- Advantages are computed over the *kept* completions of a group only (a completion whose
  reward failed is no row and no part of the baseline); the group decides, never the batch.
- One optimiser step per batch (no PPO epochs, no minibatches); the paper does not say.
  Micro-batches (``max_tokens_per_microbatch > 0``) only split the computation: the loss is
  still the token mean over the whole batch, normalised by the batch's total token count,
  not per micro-batch, so it equals the padded path's up to float summation order.
- The batch may be split over data-parallel ranks (``Share``): each rank scores its rows,
  and the loss is scaled so that gradients averaged over ranks are those of the token mean
  over the *whole* batch; the reported loss and token means are also of the whole batch.
- Staleness is a property of a group and is accounted per group by the learner, not here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
from torch import Tensor, nn

from echo2.messages import ScoredGroup
from echo2.rl import DEFAULT_MICROBATCH_TOKENS, LOSSES, OLD_POLICIES, LossName, OldPolicy
from echo2.rl.corrections import policy_loss
from echo2.rl.grpo import GRPOStats, group_advantages
from echo2.rl.logprobs import sequence_logprobs
from echo2.rl.packing import pack_sequences, packed_logprobs, plan_microbatches


class TrainingRows(msgspec.Struct, frozen=True, kw_only=True):
    """B training rows, one per kept completion (a Struct so ranks can share it over the codec)."""

    prompts: tuple[np.ndarray, ...]  # B x int32 (P_b,): the group's prompt ids, per row
    responses: tuple[np.ndarray, ...]  # B x int32 (R_b,)
    behaviour_logprobs: tuple[np.ndarray, ...]  # B x float32 (R_b,): log pi_sampler per token
    advantages: np.ndarray  # float32 (B,)
    rewards: np.ndarray  # float32 (B,)
    sampler_ids: tuple[str, ...]  # (B,): who sampled each row
    loss_masks: tuple[np.ndarray, ...] = ()
    """B x uint8 (R_b,): 1 for a response token the loss trains on, 0 for a token the
    policy did not sample (a multi-turn episode's environment observations); () when every
    response token is trained (single-turn)."""

    def __len__(self) -> int:
        return len(self.responses)

    def loss_mask(self, b: int) -> np.ndarray:
        """uint8 (R_b,): row ``b``'s loss mask."""
        return self.loss_masks[b] if self.loss_masks else np.ones(len(self.responses[b]), dtype=np.uint8)

    @property
    def tokens(self) -> int:
        """Trained response tokens in the batch: what the token mean divides by."""
        if self.loss_masks:
            return int(sum(int(m.sum()) for m in self.loss_masks))
        return sum(len(r) for r in self.responses)

    @property
    def sequence_lengths(self) -> list[int]:
        """Prompt + response tokens of each row: what it occupies of the model's input."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)]

    @property
    def reward_mean(self) -> float:
        return float(self.rewards.astype(np.float64).mean()) if len(self) else 0.0

    def take(self, indices: Sequence[int]) -> TrainingRows:
        """The rows at ``indices``, in that order (a data-parallel rank's share)."""
        return TrainingRows(
            prompts=tuple(self.prompts[i] for i in indices),
            responses=tuple(self.responses[i] for i in indices),
            behaviour_logprobs=tuple(self.behaviour_logprobs[i] for i in indices),
            advantages=self.advantages[list(indices)],
            rewards=self.rewards[list(indices)],
            sampler_ids=tuple(self.sampler_ids[i] for i in indices),
            loss_masks=tuple(self.loss_masks[i] for i in indices) if self.loss_masks else (),
        )


def pack_groups(groups: Sequence[ScoredGroup]) -> TrainingRows:
    """One row per kept completion of each group, with the group's z-score advantage. A
    multi-turn episode is one row (its whole record after the prompt) whose loss mask
    leaves out the environment's tokens (``RolloutGroup.loss_mask``)."""
    prompts, responses, behaviour, samplers, masks = [], [], [], [], []
    multi_turn = any(scored.group.multi_turn for scored in groups)
    advantages: list[np.ndarray] = []
    rewards: list[np.ndarray] = []
    for scored in groups:
        g = scored.group
        kept = np.flatnonzero(scored.keep)  # (K,)
        if not kept.size:
            continue
        r = scored.rewards[kept].astype(np.float32)  # (K,)
        a = group_advantages(torch.from_numpy(r.astype(np.float64))[None, :])[0]  # (K,) float64
        rewards.append(r)
        advantages.append(a.numpy().astype(np.float32))
        mask = g.loss_mask() if multi_turn else None  # (sum T_i,)
        for i in kept.tolist():
            lo, hi = int(g.offsets[i]), int(g.offsets[i + 1])
            prompts.append(g.prompt_token_ids)
            responses.append(g.token_ids[lo:hi])
            behaviour.append(g.logprobs[lo:hi])
            samplers.append(g.sampler_id)
            if mask is not None:
                masks.append(mask[lo:hi])
    return TrainingRows(
        prompts=tuple(prompts),
        responses=tuple(responses),
        behaviour_logprobs=tuple(behaviour),
        advantages=np.concatenate(advantages) if advantages else np.zeros(0, np.float32),
        rewards=np.concatenate(rewards) if rewards else np.zeros(0, np.float32),
        sampler_ids=tuple(samplers),
        loss_masks=tuple(masks),
    )


@dataclass(frozen=True)
class StepSettings:
    """Hyper-parameters of the step (the Learner's config fields of the same names)."""

    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    is_cap: float = 2.0
    kl_beta: float = 0.0
    old_policy: OldPolicy = "sampler"
    decay_steps: int = 0
    """When > 0: after warm-up the rate falls linearly to ``lr * final_lr_ratio`` at this step."""
    final_lr_ratio: float = 0.1
    max_tokens_per_microbatch: int = DEFAULT_MICROBATCH_TOKENS
    """0: the whole batch in one padded forward. N > 0: sequences packed into micro-batches of
    at most N tensor slots (rows x width), gradients accumulated (``echo2.rl.packing``)."""
    loss: LossName = "ppo_is"
    """The objective (``echo2.rl.corrections.policy_loss``); ``old_policy`` applies to "ppo_is"."""
    mask_low: float = 0.5
    mask_high: float = 2.0
    """The band [mask_low, mask_high] of the masked-IS losses' ratio test."""
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4

    def __post_init__(self) -> None:
        if self.old_policy not in OLD_POLICIES:
            raise ValueError(f"old_policy must be one of {', '.join(OLD_POLICIES)}, got {self.old_policy!r}")
        if self.max_tokens_per_microbatch < 0:
            raise ValueError(f"max_tokens_per_microbatch must be >= 0, got {self.max_tokens_per_microbatch}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")

    def learning_rate(self, version: int) -> float:
        """Linear warm-up over the first ``warmup_steps`` steps, then ``lr`` (or, with
        ``decay_steps``, a linear decay from ``lr`` to ``lr * final_lr_ratio`` at that step)."""
        warm = min(1.0, (version + 1) / max(1, self.warmup_steps))
        if self.decay_steps <= self.warmup_steps:
            return self.lr * warm
        done = min(1.0, max(0, version - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.lr * warm * (1.0 - done * (1.0 - self.final_lr_ratio))


@dataclass(frozen=True)
class StepStats:
    """What one optimiser step did, over the whole batch (every rank's share together)."""

    loss: float
    """Token-mean GRPO loss (0.0 for a simulated step)."""
    grad_norm: float | None = None
    """Norm of the whole batch's gradient before clipping; None when no gradient was taken."""
    objective: GRPOStats | None = None
    """Token means of the objective's diagnostics over the whole batch."""
    mismatch_by_sampler: dict[str, float] = field(default_factory=dict)
    """Per sampler: mean (sampler log-prob - learner log-prob) per token. Rollouts from remote
    workers are claims; one whose numbers disagree with the learner's recomputation (another
    model, tampered log-probs) stands out here."""

    def record(self) -> dict[str, object]:
        """The fields a step's metrics line carries (those the step measured)."""
        out: dict[str, object] = {"loss": self.loss}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        if self.objective is not None:
            out["clip_fraction"] = self.objective.clip_fraction
            out["is_weight_mean"] = self.objective.is_weight_mean
            out["is_truncated_fraction"] = self.objective.is_truncated_fraction
            out["is_masked_fraction"] = self.objective.is_masked_fraction
            out["approx_kl_sampler"] = self.objective.approx_kl_sampler
            out["mismatch_by_sampler"] = dict(self.mismatch_by_sampler)
        return out


def _no_reduction(totals: Tensor) -> Tensor:
    return totals


@dataclass(frozen=True)
class Share:
    """How the rows given to ``optimiser_step`` relate to the whole batch.

    One process trains the whole batch (``WHOLE_BATCH``). Under data parallelism each of
    ``ranks`` processes gets a share, ``sum_over_ranks`` sums a tensor over all of them
    (an all-reduce), gradients are averaged over ranks after backward (DDP), and ``samplers``
    lists the whole batch's sampler ids so per-sampler totals line up across ranks.
    """

    ranks: int = 1
    sum_over_ranks: Callable[[Tensor], Tensor] = _no_reduction
    samplers: tuple[str, ...] | None = None


WHOLE_BATCH = Share()

# Token means of GRPOStats that the whole batch's stats are rebuilt from (weighted by tokens).
_MEANS = (
    "clip_fraction",
    "is_weight_mean",
    "is_truncated_fraction",
    "kl",
    "approx_kl_sampler",
    "ratio_mean",
    "is_masked_fraction",
)


def optimiser_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: TrainingRows,
    settings: StepSettings,
    *,
    version: int,
    pad_id: int,
    reference: nn.Module | None = None,
    share: Share = WHOLE_BATCH,
) -> StepStats:
    """One GRPO optimiser step of ``model`` on ``rows`` at learner ``version``; see the module docstring."""
    if not len(rows):
        raise ValueError("a training step needs at least one row")
    device = next(model.parameters()).device
    # Every micro-batch's loss is its own token mean; weighted by its share of the whole
    # batch's tokens (summed over ranks; DDP averages over them), the accumulated gradient
    # is that of the token mean over the whole batch (a weight of exactly 1 for one padded
    # micro-batch in one process).
    local_tokens = torch.tensor([float(rows.tokens)], dtype=torch.float64, device=device)
    batch_tokens = max(float(share.sum_over_ranks(local_tokens)[0]), 1.0)
    samplers = share.samplers if share.samplers is not None else tuple(dict.fromkeys(rows.sampler_ids))
    sampler_index = [samplers.index(s) for s in rows.sampler_ids]  # (B,)

    for param_group in optimizer.param_groups:
        param_group["lr"] = settings.learning_rate(version)
    optimizer.zero_grad(set_to_none=True)
    # This share's totals: tokens, loss and stats weighted by tokens, per sampler (gap, tokens).
    head = torch.zeros(2 + len(_MEANS), dtype=torch.float64, device=device)  # (2 + len(_MEANS),)
    per_sampler = torch.zeros(len(samplers), 2, dtype=torch.float64, device=device)  # (S, 2)
    parts = _micro_batches(rows, settings.max_tokens_per_microbatch, pad_id)
    for k, (indices, score) in enumerate(parts):
        # gradients are synchronised over ranks once, in the last micro-batch's backward
        last = k == len(parts) - 1
        with contextlib.nullcontext() if last else _without_gradient_sync(model):
            logp, mask = score(model)  # (n, T), (n, T)
            if rows.loss_masks:  # environment tokens are context, never trained
                mask = mask * _loss_mask(rows, indices, mask)  # (n, T)
            behaviour = torch.zeros_like(logp)  # (n, T)
            for i, b in enumerate(indices):
                lp = rows.behaviour_logprobs[b]
                behaviour[i, : len(lp)] = torch.from_numpy(np.array(lp, dtype=np.float32))
            logp_ref = None
            if reference is not None:
                with torch.no_grad():
                    logp_ref, _ = score(reference)  # (n, T)
            advantages = torch.from_numpy(np.array(rows.advantages[list(indices)], dtype=np.float32)).to(device)
            loss, stats = policy_loss(
                settings.loss,
                logp,
                behaviour,
                advantages,  # (n,)
                mask,
                old_policy=settings.old_policy,
                clip_eps=settings.clip_eps,
                is_cap=settings.is_cap,
                mask_low=settings.mask_low,
                mask_high=settings.mask_high,
                gspo_clip_low=settings.gspo_clip_low,
                gspo_clip_high=settings.gspo_clip_high,
                kl_beta=settings.kl_beta,
                logp_ref=logp_ref,
            )
            (loss * (share.ranks * stats.tokens / batch_tokens)).backward()
        with torch.no_grad():
            tokens = stats.tokens
            local = [tokens, loss.item() * tokens, *(getattr(stats, name) * tokens for name in _MEANS)]
            head += torch.tensor(local, dtype=torch.float64, device=device)
            index = torch.tensor([sampler_index[b] for b in indices], device=device)  # (n,)
            per_sampler[:, 0].index_add_(0, index, ((behaviour - logp) * mask).sum(dim=1).double())
            per_sampler[:, 1].index_add_(0, index, mask.sum(dim=1).double())
    totals = share.sum_over_ranks(torch.cat([head, per_sampler.flatten()]))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    optimizer.step()

    means = {name: float(totals[2 + k]) / batch_tokens for k, name in enumerate(_MEANS)}
    gaps = totals[2 + len(_MEANS) :].reshape(len(samplers), 2).tolist()
    return StepStats(
        loss=float(totals[1]) / batch_tokens,
        grad_norm=float(grad_norm),
        objective=GRPOStats(tokens=float(totals[0]), **means),
        mismatch_by_sampler={s: round(g / max(n, 1.0), 6) for s, (g, n) in zip(samplers, gaps, strict=True)},
    )


def _loss_mask(rows: TrainingRows, indices: Sequence[int], like: Tensor) -> Tensor:
    """(n, T) float: the rows' loss masks in the padded layout of ``like`` (0 past each response)."""
    out = torch.zeros_like(like)  # (n, T)
    for i, b in enumerate(indices):
        m = rows.loss_mask(b)  # (R_b,)
        out[i, : len(m)] = torch.from_numpy(m.astype(np.float32))
    return out


def _without_gradient_sync(model: nn.Module) -> contextlib.AbstractContextManager[object]:
    """DDP's ``no_sync()`` (backward accumulates locally); a no-op for a plain module."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


Scorer = Callable[[nn.Module], tuple[Tensor, Tensor]]
"""A micro-batch's ``model -> (logp (n, T), mask (n, T))`` of its sequences, in its order."""


def _micro_batches(rows: TrainingRows, max_tokens: int, pad_id: int) -> list[tuple[tuple[int, ...], Scorer]]:
    """(sequence indices, scorer) per micro-batch: the whole batch padded (``max_tokens`` 0),
    or micro-batches of at most ``max_tokens`` tensor slots (``echo2.rl.packing``). A
    micro-batch whose rows hold one sequence each is already the padded layout and runs as
    such (plain causal attention, no block mask to build)."""
    if max_tokens == 0:
        return [_padded(rows, tuple(range(len(rows))), pad_id)]
    out: list[tuple[tuple[int, ...], Scorer]] = []
    for plan in plan_microbatches(rows.sequence_lengths, max_tokens):
        if all(len(row) == 1 for row in plan):
            out.append(_padded(rows, tuple(row[0] for row in plan), pad_id))
            continue
        packed = pack_sequences(rows.prompts, rows.responses, plan, pad_id=pad_id)
        out.append((packed.sequences, functools.partial(packed_logprobs, batch=packed)))
    return out


def _padded(rows: TrainingRows, indices: tuple[int, ...], pad_id: int) -> tuple[tuple[int, ...], Scorer]:
    prompts = [rows.prompts[b] for b in indices]
    responses = [rows.responses[b] for b in indices]

    def padded(m: nn.Module) -> tuple[Tensor, Tensor]:
        return sequence_logprobs(m, prompts, responses, pad_id=pad_id)

    return indices, padded
