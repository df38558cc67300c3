"""Sequence packing (echo2.rl.packing): hand-checked plans and layout, and a packed step that
is the padded step (loss, statistics, gradients, weights) for the tiny model and an HF Llama."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from echo2.models.tiny import TinyConfig, TinyTransformer
from echo2.rl.logprobs import sequence_logprobs
from echo2.rl.packing import pack_sequences, packed_logprobs, plan_microbatches, plan_rows
from echo2.rl.step import StepSettings, StepStats, TrainingRows, optimiser_step

# ----------------------------------------------------------------------------- planning


def test_rows_best_fit_decreasing() -> None:
    # longest first: 6 opens row 0 (room 2), 5 opens row 1 (room 3), 3 fills row 1,
    # 2 fills row 0 (the fullest that fits), 2 opens row 2, 1 joins it.
    assert plan_rows([2, 6, 3, 5, 2, 1], capacity=8) == [[1, 0], [3, 2], [4, 5]]
    assert plan_rows([9, 2], capacity=8) == [[0], [1]]  # too long for a row: a row of its own
    with pytest.raises(ValueError, match="capacity"):
        plan_rows([1], capacity=0)


def test_microbatches_keep_rows_times_width_within_the_budget() -> None:
    lengths = [2, 6, 3, 5, 2, 1]  # rows (capacity 6): [6], [5, 1], [3, 2], [2]
    assert plan_rows(lengths, 6) == [[1], [3, 5], [2, 0], [4]]
    # widths 6, 6, 5, 2: two rows of width 6 fill 12 slots, then 5 and 2 in rows of width 5
    assert plan_microbatches(lengths, 12) == [[[1], [3, 5]], [[2, 0], [4]]]
    for plan in (plan_microbatches(lengths, budget) for budget in (6, 7, 12, 13, 100)):
        assert sorted(b for batch in plan for row in batch for b in row) == list(range(6))
    assert plan_microbatches([], 8) == []
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_microbatches([3], 0)


def test_a_sequence_over_the_budget_gets_a_microbatch_of_its_own() -> None:
    # budget 4 < the longest (7): rows of capacity 4; the 7 is alone, the rest packed
    assert plan_microbatches([7, 2, 2, 1], 4) == [[[0]], [[1, 2]], [[3]]]


def test_settings_reject_a_negative_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        StepSettings(max_tokens_per_microbatch=-1)


def test_packed_layout_restarts_positions_and_segments_per_sequence() -> None:
    prompts = [np.array([1, 2]), np.array([3]), np.array([4])]
    responses = [np.array([5]), np.array([6, 7]), np.array([], dtype=np.int64)]
    packed = pack_sequences(prompts, responses, [[0, 1], [2]], pad_id=0)
    assert packed.sequences == (0, 1, 2)
    assert packed.ids.tolist() == [[1, 2, 5, 3, 6, 7], [4, 0, 0, 0, 0, 0]]
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert packed.segment_ids.tolist() == [[1, 1, 1, 2, 2, 2], [1, 0, 0, 0, 0, 0]]
    # token 5 is predicted at flat index 1, tokens 6, 7 at 3, 4; the empty response has none
    assert packed.predictors.tolist() == [1, 3, 4] and packed.targets.tolist() == [5, 6, 7]
    assert packed.mask.tolist() == [[True, False], [True, True], [False, False]]


# ----------------------------------------------------------------------------- the tiny model

TINY = TinyConfig(vocab_size=15, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)


def mixed_rows(vocab: int, n: int = 24, seed: int = 0) -> TrainingRows:
    """Prompts of 1-12 tokens and responses of 0-14: a batch the padded layout wastes."""
    rng = np.random.default_rng(seed)
    prompts = tuple(rng.integers(1, vocab, size=rng.integers(1, 13)).astype(np.int32) for _ in range(n))
    responses = tuple(rng.integers(0, vocab, size=rng.integers(0, 15)).astype(np.int32) for _ in range(n))
    return TrainingRows(
        prompts=prompts,
        responses=responses,
        behaviour_logprobs=tuple(rng.uniform(-4, -1, size=len(r)).astype(np.float32) for r in responses),
        advantages=rng.normal(size=n).astype(np.float32),
        rewards=rng.uniform(size=n).astype(np.float32),
        sampler_ids=tuple(f"s{i % 3}" for i in range(n)),
    )


def step_both_ways(model: nn.Module, rows: TrainingRows, budget: int, **settings: object) -> list[tuple]:
    """(stats, gradients, weights after) of one step padded and one packed, from the same model."""
    out = []
    for tokens in (0, budget):
        m = copy.deepcopy(model)
        reference = copy.deepcopy(model).eval() if settings.get("kl_beta") else None
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        config = StepSettings(warmup_steps=1, grad_clip=1e9, max_tokens_per_microbatch=tokens, **settings)  # type: ignore[arg-type]
        stats = optimiser_step(m, optimizer, rows, config, version=0, pad_id=0, reference=reference)
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        out.append((stats, grads, {k: v.clone() for k, v in m.state_dict().items()}))
    return out


def assert_same_step(padded: tuple, packed: tuple) -> None:
    (s0, g0, w0), (s1, g1, w1) = padded, packed
    assert isinstance(s0, StepStats) and isinstance(s1, StepStats)
    assert s1.loss == pytest.approx(s0.loss, rel=1e-5, abs=1e-7)
    assert s1.grad_norm == pytest.approx(s0.grad_norm, rel=1e-5)
    assert s1.objective is not None and s0.objective is not None
    assert s1.objective.tokens == s0.objective.tokens
    for name in ("is_weight_mean", "approx_kl_sampler", "kl", "ratio_mean", "clip_fraction"):
        assert getattr(s1.objective, name) == pytest.approx(getattr(s0.objective, name), rel=1e-5, abs=1e-7)
    assert s1.mismatch_by_sampler == pytest.approx(s0.mismatch_by_sampler, abs=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(TINY)


def test_tiny_packed_logprobs_are_the_padded_ones(tiny: TinyTransformer) -> None:
    rows = mixed_rows(TINY.vocab_size)
    with torch.no_grad():
        padded, mask = sequence_logprobs(tiny, rows.prompts, rows.responses, pad_id=0)
        plans = plan_microbatches(rows.sequence_lengths, 40)
        assert sum(len(row) for plan in plans for row in plan) > sum(len(plan) for plan in plans)  # really packed
        for plan in plans:
            packed = pack_sequences(rows.prompts, rows.responses, plan, pad_id=0)
            logp, m = packed_logprobs(tiny, packed)
            index = list(packed.sequences)
            torch.testing.assert_close(m, mask[index, : m.shape[1]])
            torch.testing.assert_close(logp, padded[index, : logp.shape[1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [40, 10])  # 10 < the longest sequence: those get their own
@pytest.mark.parametrize("old_policy", ["sampler", "learner"])
def test_tiny_packed_step_is_the_padded_step(tiny: TinyTransformer, budget: int, old_policy: str) -> None:
    rows = mixed_rows(TINY.vocab_size)
    assert max(rows.sequence_lengths) > 10
    padded, packed = step_both_ways(tiny, rows, budget, old_policy=old_policy, kl_beta=0.1, is_cap=1.5)
    assert_same_step(padded, packed)


def test_tiny_model_rejects_segments_with_a_cache(tiny: TinyTransformer) -> None:
    from echo2.models.tiny import KVCache

    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="segment_ids"):
        tiny(ids, KVCache(TINY, 1), positions=torch.zeros_like(ids), segment_ids=torch.ones_like(ids))
    with pytest.raises(ValueError, match="segment_ids"):
        tiny(ids, segment_ids=torch.ones_like(ids))


# ----------------------------------------------------------------------------- an HF Llama


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_packed_step_is_the_padded_step(tmp_path, attention: str) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers", reason="the HF path needs the 'hf' extra (transformers)")
    from tests.test_hf_models import make_tiny_llama

    from echo2.models.policy import load_policy

    policy = load_policy(str(make_tiny_llama(tmp_path / "llama")))
    policy.model.hf.set_attn_implementation(attention)
    assert policy.model.hf.config._attn_implementation == attention
    rows = mixed_rows(policy.tokenizer.vocab_size, n=16, seed=1)
    padded, packed = step_both_ways(policy.model, rows, 48, old_policy="sampler")
    assert_same_step(padded, packed)
