"""The Hugging Face path on a tiny random Llama built inside the test (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the HF path needs the 'hf' extra (transformers)")
import torch

from echo2.engines.base import SamplingParams, make_engine
from echo2.messages import RolloutGroup, ScoredGroup
from echo2.models.policy import load_policy
from echo2.rl.logprobs import sequence_logprobs

CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz ?.,"


def make_tiny_llama(directory: Path, *, seed: int = 0, chat: bool = False) -> Path:
    """A ~50k-parameter random LlamaForCausalLM + a character-level fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat:
        fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}={% endfor %}"
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_load_policy_hf(llama_dir: Path) -> None:
    policy = load_policy(str(llama_dir))
    assert policy.kind == "hf"
    ids = torch.tensor([policy.tokenizer.encode_prompt("12+3=")])
    logits = policy.model(ids)
    assert logits.shape == (1, ids.shape[1], policy.tokenizer.vocab_size)
    layout = policy.wire_layout()
    assert "lm_head.weight" not in layout  # tied: travels once
    assert all(dtype == "float32" for _, dtype in layout.values())


def test_policy_save_reloads_the_same_policy(llama_dir: Path, tmp_path: Path) -> None:
    policy = load_policy(str(llama_dir))
    policy.save(tmp_path / "saved")
    again = load_policy(str(tmp_path / "saved"))
    assert again.kind == "hf"
    assert again.wire_tensors().keys() == policy.wire_tensors().keys()
    for name, array in policy.wire_tensors().items():
        np.testing.assert_array_equal(again.wire_tensors()[name], array)
    assert again.tokenizer.encode_prompt("12+3=") == policy.tokenizer.encode_prompt("12+3=")


def test_engine_logprobs_match_learner(llama_dir: Path) -> None:
    """Sampled log-probs (T=1, ragged prompts, n>1) equal the learner's re-scored ones."""
    engine = make_engine("hf", model_dir=str(llama_dir), seed=3)
    policy = load_policy(str(llama_dir))
    prompts = [engine.encode_prompt(t) for t in ("1+2=", "123+45=", "a b")]
    out = engine.generate(prompts, 3, SamplingParams(temperature=1.0, max_new_tokens=6))
    assert [len(row) for row in out] == [3, 3, 3]
    flat_p, flat_r, flat_lp = [], [], []
    for p, row in zip(prompts, out, strict=True):
        for c in row:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.finish_reason in ("eos", "length")
            flat_p.append(np.array(p))
            flat_r.append(c.token_ids)
            flat_lp.append(c.logprobs)
    with torch.no_grad():
        logp, _ = sequence_logprobs(policy.model, flat_p, flat_r, pad_id=0)
    for b, lp in enumerate(flat_lp):
        np.testing.assert_allclose(logp[b, : len(lp)].numpy(), lp, atol=2e-4)


def test_top_p_and_greedy(llama_dir: Path) -> None:
    engine = make_engine("hf", model_dir=str(llama_dir))
    prompt = [engine.encode_prompt("9+9=")]
    greedy = engine.generate(prompt, 2, SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    np.testing.assert_array_equal(greedy[0].token_ids, greedy[1].token_ids)
    assert np.all(greedy[0].logprobs == 0)
    nucleus = engine.generate(prompt, 4, SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=5, seed=1))[0]
    assert all(np.all(c.logprobs <= 0) for c in nucleus)


def test_install_weights_bf16_wire_and_atomicity(llama_dir: Path, tmp_path: Path) -> None:
    other = load_policy(str(make_tiny_llama(tmp_path / "other", seed=1)), dtype="bfloat16")
    wire = other.wire_tensors()
    assert {str(a.dtype) for a in wire.values()} == {"uint16"}  # bf16 as raw bits
    engine = make_engine("hf", model_dir=str(llama_dir), dtype="bfloat16")
    assert engine.state_layout() == other.wire_layout()
    prompt = [engine.encode_prompt("1+1=")]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompt, 1, params)[0][0].token_ids
    bad = dict(wire)
    bad.pop(next(iter(bad)))
    with pytest.raises(ValueError):
        engine.install_weights(bad, 5)
    assert engine.version == 0
    np.testing.assert_array_equal(engine.generate(prompt, 1, params)[0][0].token_ids, before)
    engine.install_weights(wire, 7)
    assert engine.version == 7
    reference = make_engine("hf", model_dir=str(tmp_path / "other"), dtype="bfloat16")
    np.testing.assert_array_equal(
        engine.generate(prompt, 1, params)[0][0].token_ids, reference.generate(prompt, 1, params)[0][0].token_ids
    )
    # an fp32 learner can feed a bf16 sampler: floats are cast on install
    engine.install_weights(load_policy(str(llama_dir)).wire_tensors(), 8)
    np.testing.assert_array_equal(engine.generate(prompt, 1, params)[0][0].token_ids, before)


def test_chat_template(tmp_path: Path) -> None:
    from echo2.job import PromptFormat

    policy = load_policy(str(make_tiny_llama(tmp_path / "chat", chat=True)))
    plain = load_policy(str(tmp_path / "chat"), prompt_format=PromptFormat(chat_template="off"))
    assert policy.tokenizer.encode_prompt("1+2")[-1] == plain.tokenizer.encode_prompt("=")[-1]
    assert len(policy.tokenizer.encode_prompt("1+2")) > len(plain.tokenizer.encode_prompt("1+2"))


def scored_group(engine: Any, prompt_text: str) -> ScoredGroup:
    """Four samples of ``prompt_text`` from ``engine`` as a scored group (rewards 1, 0, 1, 0)."""
    prompt = engine.encode_prompt(prompt_text)
    (group,) = engine.generate([prompt], 4, SamplingParams(temperature=1.0, max_new_tokens=5, seed=1))
    offsets = np.cumsum([0] + [len(c.token_ids) for c in group]).astype(np.int32)
    return ScoredGroup(
        group=RolloutGroup(
            lease_id=0,
            task_id="t0",
            attempt=0,
            sampler_id="s",
            incarnation=0,
            version=0,
            prompt=prompt_text,
            prompt_token_ids=np.array(prompt, dtype=np.int32),
            token_ids=np.concatenate([c.token_ids for c in group]).astype(np.int32),
            logprobs=np.concatenate([c.logprobs for c in group]).astype(np.float32),
            offsets=offsets,
            texts=[c.text for c in group],
            finish_reasons=[c.finish_reason for c in group],
        ),
        rewards=np.array([1.0, 0.0, 1.0, 0.0], dtype=np.float32),
        keep=np.ones(4, dtype=bool),
    )


class _Ctx:
    """The bits of an actor context the Learner's build/step/evaluate touch."""

    run_dir = None
    resume = False
    job_objects = None

    def ledger(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object, **kwargs: object) -> None:
        pass


def test_learner_trains_and_publishes_hf_model(llama_dir: Path) -> None:
    """The Learner actor's HF path: build, evaluate, one GRPO step, publish -> sampler install."""
    from echo2.actors.learner import Learner, LearnerConfig
    from echo2.job import JobConfig
    from echo2.weights.chunks import flatten_tensors, unflatten

    job = JobConfig(model=str(llama_dir), task="addition", max_new_tokens=5, group_size=4, groups_per_step=1)
    learner = Learner("learner", LearnerConfig(eval_prompts=3, warmup_steps=1, lr=1e-2), job)
    learner.ctx = _Ctx()  # type: ignore[assignment]
    learner._build()
    assert learner.policy.kind == "hf"
    score = learner.evaluate()
    assert score.prompts == 3 and score.pass_at_1 is not None and 0.0 <= score.pass_at_1 <= 1.0
    sampler = make_engine("hf", model_dir=str(llama_dir), seed=0)
    prompt = sampler.encode_prompt("12+34=")
    scored = scored_group(sampler, "12+34=")
    before = {k: v.copy() for k, v in learner.policy.wire_tensors().items()}
    record = learner._train_step([scored])
    assert record["rollouts"] == 4 and np.isfinite(record["loss"])
    specs, flat = flatten_tensors(learner.policy.wire_tensors())
    assert any(
        not np.array_equal(before[s.name], v) for s, v in zip(specs, unflatten(specs, flat).values(), strict=True)
    )
    sampler.install_weights(unflatten(specs, flat), 1)
    assert [c.token_ids.tolist() for c in sampler.greedy([prompt], 5)] == [
        c.token_ids.tolist() for c in learner._eval_engine.greedy([prompt], 5)
    ]


def test_close_stops_a_running_generate(llama_dir: Path) -> None:
    """A closing engine ends a running decode at the next step (a Sampler's shutdown must not
    wait for a long generation whose result nobody reads)."""
    from echo2.engines.hf_engine import hf_decode_batch

    policy = load_policy(str(llama_dir))
    polls: list[int] = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) >= 3

    tokens, _, lengths, hit_eos = hf_decode_batch(
        policy.core,
        [[1, 4, 5]],
        4,
        SamplingParams(max_new_tokens=50, seed=0),
        eos_ids=[10_000],
        pad_id=0,
        should_stop=should_stop,
    )
    assert tokens.shape == (4, 3) and not hit_eos.any() and (lengths == 3).all()
    engine = make_engine("hf", policy=policy)
    engine.close()
    with pytest.raises(RuntimeError):
        engine.generate([[1, 4]], 1, SamplingParams())


def test_the_job_side_and_the_engine_agree_on_the_model_identity(llama_dir: Path, tmp_path: Path) -> None:
    """What a PromptSource reads from the files equals what an engine that loaded the model
    reports, and a different architecture or vocabulary changes it."""
    from echo2.models.identity import model_identity

    job = model_identity(str(llama_dir))
    assert job.vocab_size == len(CHARS) + 3
    assert make_engine("hf", model_dir=str(llama_dir)).model_identity() == job
    saved = tmp_path / "saved"
    load_policy(str(llama_dir)).save(saved)  # re-saved: the same model, another directory
    served = make_engine("hf", model_dir=str(saved)).model_identity()
    assert (served.tokenizer_digest, served.architecture_digest) == (job.tokenizer_digest, job.architecture_digest)
    chat = model_identity(str(make_tiny_llama(tmp_path / "chat", chat=True)))
    assert chat.architecture_digest == job.architecture_digest and chat.tokenizer_digest != job.tokenizer_digest
