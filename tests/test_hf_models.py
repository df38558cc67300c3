"""The Hugging Face path on a tiny random Llama built inside the test (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the HF path needs the 'hf' extra (transformers)")
import torch  # noqa: E402

from echo2.engines.base import SamplingParams, make_engine  # noqa: E402
from echo2.models.policy import load_policy  # noqa: E402
from echo2.rl.logprobs import sequence_logprobs  # noqa: E402

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
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
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
        logp, mask = sequence_logprobs(policy.model, flat_p, flat_r, pad_id=0)
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
    policy = load_policy(str(make_tiny_llama(tmp_path / "chat", chat=True)))
    plain = load_policy(str(tmp_path / "chat"), chat_template=False)
    assert policy.tokenizer.encode_prompt("1+2")[-1] == plain.tokenizer.encode_prompt("=")[-1]
    assert len(policy.tokenizer.encode_prompt("1+2")) > len(plain.tokenizer.encode_prompt("1+2"))
