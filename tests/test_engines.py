"""The engine contract on the torch engine (tiny model) and the simulated engine."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from echo2.engines import FINISH_EOS, FINISH_LENGTH, Completion, Engine, SamplingParams, make_engine
from echo2.engines.base import EngineThread
from echo2.engines.simulated import SimulatedEngine, simulated_answer
from echo2.engines.torch_engine import TorchEngine
from echo2.models import CharTokenizer, TinyTransformer
from echo2.rl.logprobs import sequence_logprobs
from echo2.tasks import AdditionTask

TOK = CharTokenizer()
TASK = AdditionTask()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from threads, and a second thread competing for a busy
    core slows small ops by orders of magnitude; restore the setting afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def shipped() -> TorchEngine:
    """The shipped warm-start checkpoint; tests must not install weights into it."""
    return TorchEngine(seed=0)


@pytest.fixture
def engine() -> TorchEngine:
    return TorchEngine(seed=0)


def prompt_ids(k: int, seed: int = 0) -> list[list[int]]:
    it = TASK.prompts(seed)
    return [TOK.encode_prompt(next(it).text) for _ in range(k)]


def check_completions(out: list[list[Completion]], n_prompts: int, n: int, max_new: int) -> None:
    assert len(out) == n_prompts and all(len(row) == n for row in out)
    for row in out:
        for c in row:
            assert c.token_ids.dtype == np.int32 and c.token_ids.ndim == 1
            assert c.logprobs.dtype == np.float32 and c.logprobs.shape == c.token_ids.shape
            assert 1 <= len(c.token_ids) <= max_new
            assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
            eos_at = np.flatnonzero(c.token_ids == TOK.eos_id)
            if c.finish_reason == FINISH_EOS:
                assert eos_at.tolist() == [len(c.token_ids) - 1]  # stops at the first EOS
            else:
                assert c.finish_reason == FINISH_LENGTH
                assert len(eos_at) == 0 and len(c.token_ids) == max_new
            assert c.text == TOK.decode(c.token_ids)


@pytest.mark.parametrize("kind", ["torch", "simulated"])
def test_contract_shapes_and_dtypes(kind: str) -> None:
    kwargs = {"seconds_per_token": 0.0, "success_rate": 0.5} if kind == "simulated" else {}
    with make_engine(kind, **kwargs) as eng:
        assert isinstance(eng, Engine) and eng.version == 0
        prompts = prompt_ids(5)
        out = eng.generate(prompts, 3, SamplingParams(max_new_tokens=6, seed=1))
        check_completions(out, 5, 3, 6)


def test_make_engine_unknown_kind() -> None:
    with pytest.raises(ValueError, match="vllm-nope"):
        make_engine("vllm-nope")


def test_sampling_params_validation() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --- torch engine ------------------------------------------------------------------------


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-length", "ragged"])
def test_logprobs_match_learner_recomputation(shipped: TorchEngine, ragged: bool) -> None:
    prompts = prompt_ids(6, seed=3)
    if ragged:  # left padding, per-row positions and the padding mask in the engine
        prompts[1::2] = [TOK.encode_prompt(p.text) for p in itertools.islice(AdditionTask(2).prompts(0), 3)]
    out = shipped.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    flat = [(np.asarray(p), c) for p, row in zip(prompts, out, strict=True) for c in row]
    with torch.no_grad():
        logp, mask = sequence_logprobs(shipped.model, [p for p, _ in flat], [c.token_ids for _, c in flat], TOK.pad_id)
    for b, (_, c) in enumerate(flat):
        T = len(c.token_ids)
        assert mask[b].sum() == T
        np.testing.assert_allclose(c.logprobs, logp[b, :T].numpy(), atol=1e-4)


def test_temperature_and_top_p_logprobs(shipped: TorchEngine) -> None:
    prompts = prompt_ids(8, seed=4)
    out = shipped.generate(prompts, 4, SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=8, seed=2))
    check_completions(out, 8, 4, 8)
    # Truncating to the nucleus and renormalising can only raise a kept token's probability.
    for p, row in zip(prompts, out, strict=True):
        for c in row:
            ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]  # (1, T)
            with torch.no_grad():
                lsm = torch.log_softmax(shipped.model(ids)[0] / 0.7, dim=-1)  # (T, V)
            untruncated = lsm[len(p) - 1 + np.arange(len(c.token_ids)), c.token_ids].numpy()  # (T_resp,)
            assert np.all(c.logprobs >= untruncated - 1e-4)


def test_tiny_top_p_is_greedy(shipped: TorchEngine) -> None:
    prompts = prompt_ids(10, seed=6)
    greedy = shipped.greedy(prompts)
    nucleus = shipped.generate(prompts, 2, SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    for g, row in zip(greedy, nucleus, strict=True):
        assert np.all(g.logprobs == 0)
        for c in row:
            np.testing.assert_array_equal(c.token_ids, g.token_ids)
            np.testing.assert_allclose(c.logprobs, 0.0, atol=1e-6)  # a single-token nucleus


def test_seed_makes_sampling_reproducible(shipped: TorchEngine) -> None:
    prompts = prompt_ids(4)
    params = SamplingParams(temperature=1.0, seed=11)
    a, b = shipped.generate(prompts, 3, params), shipped.generate(prompts, 3, params)
    for ra, rb in zip(a, b, strict=True):
        for ca, cb in zip(ra, rb, strict=True):
            np.testing.assert_array_equal(ca.token_ids, cb.token_ids)


def test_length_limit_and_eos(shipped: TorchEngine) -> None:
    prompts = prompt_ids(4)
    short = shipped.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=2))
    check_completions(short, 4, 2, 2)
    assert all(c.finish_reason == FINISH_LENGTH for row in short for c in row)  # answers have >= 3 digits
    full = shipped.greedy(prompts)
    assert all(c.finish_reason == FINISH_EOS and c.token_ids[-1] == TOK.eos_id for c in full)


def test_ragged_prompts_decode_like_single_prompts(shipped: TorchEngine) -> None:
    texts = ["12+34=", "123+456=", "7+8=", "500+500="]
    prompts = [TOK.encode_prompt(t) for t in texts]
    batched = shipped.greedy(prompts)
    for p, c in zip(prompts, batched, strict=True):
        np.testing.assert_array_equal(shipped.greedy([p])[0].token_ids, c.token_ids)


def test_rejects_prompts_that_do_not_fit(shipped: TorchEngine) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        shipped.generate([[1] * 30], 1, SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="non-empty"):
        shipped.generate([[]], 1, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        shipped.generate([[1, 99]], 1, SamplingParams())


def test_warm_start_checkpoint_accuracy(shipped: TorchEngine) -> None:
    heldout = TASK.heldout(200)
    completions = shipped.greedy([shipped.encode_prompt(p.text) for p in heldout])
    accuracy = np.mean([TASK.reward(p, c.text) for p, c in zip(heldout, completions, strict=True)])
    assert 0.25 <= accuracy <= 0.6


def _numpy_weights(model: TinyTransformer) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_install_rejects_bad_layout_and_changes_nothing(engine: TorchEngine) -> None:
    prompts = prompt_ids(8)
    before = [c.token_ids for c in engine.greedy(prompts)]
    good = _numpy_weights(engine.model)
    layout = engine.state_layout()
    assert layout["tok_emb.weight"] == ((15, 128), "float32")
    assert set(layout) == set(good)

    wrong_shape = dict(good, **{"blocks.3.mlp.2.weight": np.zeros((128, 500), np.float32)})
    wrong_dtype = dict(good, **{"ln_f.bias": good["ln_f.bias"].astype(np.float64)})
    missing = {k: v for k, v in good.items() if k != "pos_emb.weight"}
    extra = dict(good, **{"head.weight": np.zeros((15, 128), np.float32)})
    # A corrupt tensor early in the dict must not be installed when a later one is bad.
    poisoned_first = {"tok_emb.weight": np.zeros((15, 128), np.float32), **wrong_shape}
    for bad, match in [
        (wrong_shape, "blocks.3.mlp.2.weight"),
        (wrong_dtype, "float64"),
        (missing, "pos_emb.weight"),
        (extra, "head.weight"),
        (poisoned_first, "blocks.3"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.install_weights(bad, version=7)
        assert engine.version == 0
    after = [c.token_ids for c in engine.greedy(prompts)]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


def test_install_new_weights_changes_outputs_and_version(engine: TorchEngine) -> None:
    prompts = prompt_ids(32)
    params = SamplingParams(temperature=1.0, seed=3)
    before = engine.generate(prompts, 1, params)
    torch.manual_seed(123)
    fresh = _numpy_weights(TinyTransformer(engine.model.config))
    for arr in fresh.values():
        arr.setflags(write=False)  # as received from a transport buffer
    engine.install_weights(fresh, version=5)
    assert engine.version == 5
    for name, tensor in engine.model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), fresh[name])
    after = engine.generate(prompts, 1, params)
    assert any(
        not np.array_equal(a[0].token_ids, b[0].token_ids) or not np.allclose(a[0].logprobs, b[0].logprobs)
        for a, b in zip(before, after, strict=True)
    )


def test_closed_engine_refuses_work() -> None:
    eng = TorchEngine()
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.greedy(prompt_ids(1))


# --- simulated engine --------------------------------------------------------------------


def test_simulated_success_rate_is_the_addition_tasks_reward_rate() -> None:
    eng = SimulatedEngine(seconds_per_token=0.0, success_rate=0.3, seed=0)
    batch = list(itertools.islice(TASK.prompts(1), 50))
    out = eng.generate([TOK.encode_prompt(p.text) for p in batch], 80, SamplingParams())
    rewards = [TASK.reward(p, c.text) for p, row in zip(batch, out, strict=True) for c in row]
    # 4000 Bernoulli(0.3) draws: sd 0.0072; 5 sd tolerance.
    assert abs(np.mean(rewards) - 0.3) < 0.036


@pytest.mark.parametrize("digits", [1, 2, 3, 5])
def test_simulated_answer_is_the_addition_tasks_answer(digits: int) -> None:
    task = AdditionTask(digits)
    prompts = [*itertools.islice(task.prompts(7), 200), *task.heldout(5)]
    assert all(simulated_answer(p.text) == p.answer for p in prompts)


@pytest.mark.parametrize("text", ["", "12", "1+2", "1+2=3", "+1=", "1+2=="])
def test_simulated_answer_of_a_prompt_it_cannot_read_is_none(text: str) -> None:
    assert simulated_answer(text) is None


def _texts(out: list[list[Completion]]) -> list[list[str]]:
    return [[c.text for c in row] for row in out]


def test_simulated_rule_is_a_function_of_prompt_text_and_seed() -> None:
    prompts = prompt_ids(6, seed=2)
    params = SamplingParams(max_new_tokens=6)
    one = SimulatedEngine(seconds_per_token=0.0, success_rate=0.5, seed=3)
    first = _texts(one.generate(prompts, 8, params))
    assert _texts(one.generate(prompts, 8, params)) == first  # no hidden stream: a re-issued lease repeats
    other = SimulatedEngine(seconds_per_token=0.0, success_rate=0.5, seed=3)  # another sampler, same seed
    assert _texts(other.generate(prompts[::-1], 8, params)) == first[::-1]  # batch order does not matter
    assert [row[:3] for row in _texts(other.generate(prompts, 3, params))] == [row[:3] for row in first]
    reseeded = SimulatedEngine(seconds_per_token=0.0, success_rate=0.5, seed=4)
    assert _texts(reseeded.generate(prompts, 8, params)) != first
    assert _texts(reseeded.generate(prompts, 8, SamplingParams(max_new_tokens=6, seed=3))) == first


def test_simulated_sleeps_once_per_call_and_records_version() -> None:
    slept: list[float] = []
    eng = SimulatedEngine(seconds_per_token=0.01, success_rate=1.0, response_tokens=4, sleep=slept.append)
    out = eng.generate([TOK.encode_prompt("5+7=")] * 7, 5, SamplingParams(max_new_tokens=6))
    assert slept == [pytest.approx(0.06)]  # one batched decode of max_new_tokens steps
    assert all(c.text == "21" and c.finish_reason == FINISH_EOS for row in out for c in row)
    eng.install_weights({"anything": np.zeros(3)}, version=9)
    assert eng.version == 9 and eng.state_layout() == {}


def test_simulated_never_answers_an_unreadable_prompt_and_truncates() -> None:
    eng = SimulatedEngine(seconds_per_token=0.0, success_rate=1.0, response_tokens=5, sleep=lambda s: None)
    out = eng.generate([TOK.encode_prompt("12")] * 3, 2, SamplingParams(max_new_tokens=8))
    assert all(len(c.text) == 4 and c.text.isdigit() for row in out for c in row)
    cut = eng.generate([TOK.encode_prompt("99999+99999=")], 4, SamplingParams(max_new_tokens=2))
    check_completions(cut, 1, 4, 2)
    assert all(c.finish_reason == FINISH_LENGTH and c.text == "89" for c in cut[0])
    with pytest.raises(ValueError, match="n must be"):
        eng.generate([TOK.encode_prompt("1+2=")], 0, SamplingParams())


async def test_many_engines_in_one_process_each_run_a_call_at_once() -> None:
    """Samplers co-located in one process (simulated ones, or one process driving several
    GPUs) each run their engine call at the same time: asyncio's shared default pool has
    only ``cpu_count + 4`` threads, so the 7th of 6 samplers on 2 cores used to wait."""
    count = (os.cpu_count() or 1) + 8
    all_in = threading.Barrier(count, timeout=30.0)  # passes only with every call running
    threads = [EngineThread(f"e{i}") for i in range(count)]
    try:
        waited = await asyncio.gather(*(t.call(all_in.wait) for t in threads))
    finally:
        for t in threads:
            t.close()
    assert sorted(waited) == list(range(count))
