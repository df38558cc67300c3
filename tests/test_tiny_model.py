"""The character tokenizer, the tiny transformer (KV cache, padding, checkpoints) and the
learner's sequence log-probs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.models import CharTokenizer, KVCache, TinyConfig, TinyTransformer
from echo2.models.policy import load_policy
from echo2.models.tiny import CONFIG_FILE, WEIGHTS_FILE
from echo2.rl.logprobs import sequence_logprobs

SMALL = TinyConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=24)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from threads, and a second thread competing for a busy
    core slows small ops by orders of magnitude; restore the setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(SMALL).eval()


# --- tokenizer ---------------------------------------------------------------------------


@settings(deadline=None)  # a busy shared machine must not fail a pure function
@given(st.text(alphabet="0123456789+=", max_size=30))
def test_tokenizer_round_trip(text: str) -> None:
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_prompt(text)) == text


def test_tokenizer_specials() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 15)
    assert tok.encode_prompt("1+2=") == [tok.bos_id, *tok.encode("1+2=")]
    ids = [tok.bos_id, *tok.encode("12"), tok.pad_id, *tok.encode("3"), tok.eos_id, *tok.encode("99")]
    assert tok.decode(ids) == "123"  # specials skipped, stops at EOS
    assert tok.decode(np.array(tok.encode("45"), dtype=np.int32)) == "45"


def test_tokenizer_rejects_unknown() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("12x")
    with pytest.raises(ValueError, match="99"):
        tok.decode([3, 99])


# --- config ------------------------------------------------------------------------------


def test_config_json_round_trip_and_validation() -> None:
    assert TinyConfig.from_json(SMALL.to_json()) == SMALL
    assert json.loads(TinyConfig().to_json())["d_model"] == 128
    with pytest.raises(ValueError, match="bogus"):
        TinyConfig.from_json('{"bogus": 1}')
    with pytest.raises(ValueError, match="divisible"):
        TinyConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        TinyConfig(n_layers=0)


def test_default_size() -> None:
    n = TinyTransformer().num_parameters()
    assert 0.7e6 < n < 0.9e6


# --- forward -----------------------------------------------------------------------------


def test_forward_shape(model: TinyTransformer) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (3, 7))  # (B, T)
    assert model(ids).shape == (3, 7, SMALL.vocab_size)


def test_forward_rejects_too_long(model: TinyTransformer) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros((1, SMALL.max_seq_len + 1), dtype=torch.long))


def test_kv_cache_decoding_equals_full_forward(model: TinyTransformer) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (4, 12))  # (B, T)
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        cache = KVCache(SMALL, batch_size=4)
        parts = [model(ids[:, :5], cache)]  # prefill
        parts.append(model(ids[:, 5:8], cache))  # a multi-token chunk after a prefix
        parts += [model(ids[:, t : t + 1], cache) for t in range(8, 12)]  # one token at a time
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_with_mask_matches_unpadded(model: TinyTransformer) -> None:
    short = torch.tensor([[1, 4, 5, 13, 6, 14]])  # (1, 6)
    pad = 3
    padded = torch.cat([torch.zeros((1, pad), dtype=torch.long), short], dim=1)  # (1, 9)
    positions = (torch.arange(9) - pad).clamp(min=0)[None]  # (1, 9)
    key_mask = torch.arange(9)[None] >= pad  # (1, 9)
    with torch.no_grad():
        expected = model(short)  # (1, 6, V)
        got = model(padded, positions=positions, key_padding_mask=key_mask)[:, pad:]  # (1, 6, V)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_save_load_round_trip(model: TinyTransformer, tmp_path) -> None:
    model.save(tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {WEIGHTS_FILE, CONFIG_FILE}
    loaded = TinyTransformer.load(tmp_path / "ckpt")
    assert loaded.config == SMALL
    ids = torch.randint(0, SMALL.vocab_size, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


def test_policy_save_reloads_the_same_policy(tmp_path) -> None:
    policy = load_policy("")
    policy.save(tmp_path / "ckpt")
    again = load_policy(str(tmp_path / "ckpt"))
    assert again.kind == "tiny"
    assert again.wire_tensors().keys() == policy.wire_tensors().keys()
    for name, array in policy.wire_tensors().items():
        np.testing.assert_array_equal(again.wire_tensors()[name], array)


def test_init_scales_the_residual_projections() -> None:
    """GPT-2 init: N(0, 0.02), and 0.02 / sqrt(2 * n_layers) for the layers that write into
    the residual stream (the attention output and the MLP's second layer)."""
    torch.manual_seed(0)
    model = TinyTransformer(SMALL)
    residual_std = 0.02 / (2 * SMALL.n_layers) ** 0.5
    for block in model.blocks:
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.15)
        assert block.mlp[0].weight.std().item() == pytest.approx(0.02, rel=0.15)
        assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.15)
        assert block.mlp[2].weight.std().item() == pytest.approx(residual_std, rel=0.15)


def test_state_dict_keys_are_stable() -> None:
    keys = list(TinyTransformer(SMALL).state_dict())
    per_block = [
        "ln1.weight",
        "ln1.bias",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "ln2.weight",
        "ln2.bias",
        "mlp.0.weight",
        "mlp.0.bias",
        "mlp.2.weight",
        "mlp.2.bias",
    ]
    expected = ["tok_emb.weight", "pos_emb.weight"]
    expected += [f"blocks.{i}.{k}" for i in range(SMALL.n_layers) for k in per_block]
    expected += ["ln_f.weight", "ln_f.bias"]
    assert keys == expected  # the head is tied to tok_emb: no alias key


# --- sequence_logprobs -------------------------------------------------------------------


def test_sequence_logprobs_matches_per_row_forward(model: TinyTransformer) -> None:
    prompts = [np.array([1, 4, 13, 5, 14]), np.array([1, 7, 14])]
    responses = [np.array([8, 2]), np.array([0, 9, 9, 2])]  # PAD id as a real token is allowed
    logp, mask = sequence_logprobs(model, prompts, responses, pad_id=0)
    assert logp.shape == mask.shape == (2, 4)
    assert logp.requires_grad
    np.testing.assert_array_equal(mask.numpy(), [[1, 1, 0, 0], [1, 1, 1, 1]])
    assert torch.all(logp[0, 2:] == 0)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.from_numpy(np.concatenate([p, r]))[None]  # (1, T_b)
        with torch.no_grad():
            lsm = torch.log_softmax(model(ids)[0], dim=-1)  # (T_b, V)
        expected = [lsm[len(p) - 1 + j, int(r[j])] for j in range(len(r))]
        torch.testing.assert_close(logp[b, : len(r)].detach(), torch.stack(expected), atol=1e-5, rtol=1e-5)
    (logp * mask).sum().backward()
    assert model.tok_emb.weight.grad is not None


def test_sequence_logprobs_validates(model: TinyTransformer) -> None:
    with pytest.raises(ValueError, match="equally many"):
        sequence_logprobs(model, [np.array([1])], [], pad_id=0)
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(model, [np.array([], dtype=np.int64)], [np.array([3])], pad_id=0)
