"""The learner trains on the model's tokens only: a multi-turn episode's environment
tokens are context, never loss (``RolloutGroup.loss_mask`` -> ``TrainingRows.loss_masks``
-> the mask of every objective in ``echo2.rl.corrections``, padded or packed)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tests.test_envs import group_of, play, right

from echo2.messages import ScoredGroup
from echo2.models import TinyConfig, TinyTransformer
from echo2.rl import LOSSES
from echo2.rl.corrections import policy_loss
from echo2.rl.step import StepSettings, optimiser_step, pack_groups

torch.set_num_threads(1)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_objective_ignores_masked_tokens_whatever_their_values(loss: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 7, generator=gen) - 0.1  # (B, T)
    sampler = logp - 0.05 * torch.randn(3, 7, generator=gen)  # (B, T)
    advantages = torch.tensor([1.0, -0.5, 0.25])  # (B,)
    mask = torch.ones(3, 7)
    mask[:, 2:4] = 0.0  # an observation in the middle of each row
    mask[1, 5:] = 0.0  # and at the end of one
    garbage_logp, garbage_sampler = logp.clone(), sampler.clone()
    garbage_logp[mask == 0] = -30.0
    garbage_sampler[mask == 0] = 5.0  # even a positive "log-prob": never read
    results = []
    for lp, ls in ((logp, sampler), (garbage_logp, garbage_sampler)):
        lp = lp.clone().requires_grad_(True)
        value, stats = policy_loss(loss, lp, ls, advantages, mask, old_policy="learner")  # type: ignore[arg-type]
        value.backward()
        assert lp.grad is not None
        results.append((value.item(), lp.grad.clone(), stats.tokens))
    (clean, clean_grad, tokens), (dirty, dirty_grad, _) = results
    assert tokens == mask.sum().item()
    assert dirty == pytest.approx(clean, rel=1e-6, abs=1e-7)
    assert torch.equal(dirty_grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert torch.allclose(dirty_grad, clean_grad, atol=1e-7)


def multi_turn_groups() -> list[ScoredGroup]:
    """Two groups of played episodes (one answers the second turn wrong)."""
    wrong_second = play(lambda context, length: right(context, length) if length < 15 else "1", n=2)
    honest = play(n=2)
    out = []
    for played, rewards in (
        (honest + wrong_second, [1.0, 1.0, 0.5, 0.5]),
        (wrong_second + honest, [0.5, 0.5, 1.0, 1.0]),
    ):
        group = group_of(played)
        out.append(ScoredGroup(group=group, rewards=np.array(rewards, np.float32), keep=np.ones(4, bool)))
    return out


def test_packing_a_multi_turn_group_masks_exactly_the_environment_tokens() -> None:
    groups = multi_turn_groups()
    rows = pack_groups(groups)
    assert len(rows) == 8 and len(rows.loss_masks) == 8
    for b, (g, i) in enumerate((g, i) for g in groups for i in range(4)):
        lo, hi = int(g.group.offsets[i]), int(g.group.offsets[i + 1])
        sources = g.group.loss_mask()[lo:hi]
        assert np.array_equal(rows.loss_masks[b], sources)
        assert np.array_equal(rows.responses[b], g.group.token_ids[lo:hi])
    assert rows.tokens == sum(int(g.group.loss_mask().sum()) for g in groups)
    assert rows.tokens < sum(len(r) for r in rows.responses)


@pytest.mark.parametrize("microbatch_tokens", [0, 64])  # padded, then packed several to a row
def test_a_step_never_learns_from_environment_tokens(microbatch_tokens: int) -> None:
    """Garbage behaviour log-probs on the environment's tokens change nothing (they are never
    read); the gradient is that of the model's tokens alone."""
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64))
    rows = pack_groups(multi_turn_groups())
    dirty = copy.deepcopy(rows)
    behaviour = tuple(
        np.where(mask == 0, 7.5, lp).astype(np.float32)
        for lp, mask in zip(dirty.behaviour_logprobs, dirty.loss_masks, strict=True)
    )
    dirty = type(rows)(**{**{f: getattr(rows, f) for f in rows.__struct_fields__}, "behaviour_logprobs": behaviour})
    settings = StepSettings(lr=1e-2, warmup_steps=1, max_tokens_per_microbatch=microbatch_tokens)
    after = []
    for batch in (rows, dirty):
        m = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(m.parameters(), lr=settings.lr)
        stats = optimiser_step(m, optimizer, batch, settings, version=0, pad_id=0)
        after.append((stats, m.state_dict()))
    (clean, clean_state), (noisy, noisy_state) = after
    assert clean.objective is not None and clean.objective.tokens == rows.tokens
    assert noisy.loss == pytest.approx(clean.loss, rel=1e-6)
    assert all(torch.allclose(clean_state[k], noisy_state[k], atol=1e-6) for k in clean_state)
    assert clean.mismatch_by_sampler == noisy.mismatch_by_sampler
