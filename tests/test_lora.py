"""LoRA runs (issue 16): the learner trains and publishes only adapters, checkpoints and
resumes them; the torch and HF engines serve them by adapter forward (the same function as
the learner's model), refuse what does not fit, and write the PEFT directory vLLM loads;
the vLLM engine keeps S + 1 adapter versions resident (against a stand-in of its API)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("peft", reason="LoRA needs the 'lora' extra (peft)")
import torch
from tests.test_hf_models import _Ctx, make_tiny_llama, scored_group

from echo2.actors.learner import Learner, LearnerConfig
from echo2.engines.base import SamplingParams, make_engine
from echo2.job import JobConfig
from echo2.messages import LoraAdapter
from echo2.models.adapters import LoraConfig, adapted_modules, load_peft, save_peft
from echo2.weights.chunks import flatten_tensors, unflatten


def learner_with(lora: LoraConfig, model: str = "") -> Learner:
    job = JobConfig(model=model, task="addition", max_new_tokens=5, group_size=4, groups_per_step=1)
    learner = Learner("learner", LearnerConfig(eval_prompts=3, warmup_steps=1, lr=1e-2, lora=lora), job)
    learner.ctx = _Ctx()  # type: ignore[assignment]
    learner._build()
    return learner


def published(learner: Learner) -> dict[str, np.ndarray]:
    """What a member installs: the learner's publication, through the flat wire buffer."""
    specs, flat = flatten_tensors(learner.trainer.state_for_publication())
    return unflatten(specs, flat)


def test_a_lora_learner_trains_and_publishes_only_the_adapter_and_the_torch_engine_serves_it() -> None:
    learner = learner_with(LoraConfig(rank=4, alpha=8.0))
    core = learner.policy.core
    base = {n: p.detach().clone() for n, p in core.named_parameters() if not p.requires_grad}
    trained = [n for n, p in core.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    sampler = make_engine("torch", seed=0)
    before = published(learner)
    assert sorted(adapted_modules(before)) == sorted(
        f"blocks.{i}.{m}" for i in range(4) for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    )
    adapter_bytes = sum(p.numel() * p.element_size() for p in core.parameters() if p.requires_grad)
    assert sum(a.nbytes for a in before.values()) == adapter_bytes  # a version is the adapter's bytes
    record = learner._train_step([scored_group(sampler, "12+34=")])
    assert np.isfinite(record["loss"])
    after = published(learner)
    assert any(not np.array_equal(before[k], after[k]) for k in after)
    assert all(torch.equal(p, base[n]) for n, p in core.named_parameters() if n in base)  # the base is frozen
    assert learner.trainer.adapter == LoraAdapter(rank=4, alpha=8.0)  # type: ignore[attr-defined]

    sampler.install_adapter(after, LoraAdapter(rank=4, alpha=8.0), 1)
    assert sampler.version == 1
    prompts = [sampler.encode_prompt(p) for p in ("12+34=", "99+1=", "5+50=")]
    ids = torch.tensor(prompts[0])[None]
    with torch.no_grad():
        served = sampler.model(ids)  # type: ignore[attr-defined]
        learned = learner.policy.model(ids)
    torch.testing.assert_close(served, learned)  # adapter forward: the learner's function
    assert [c.token_ids.tolist() for c in sampler.greedy(prompts, 5)] == [  # type: ignore[attr-defined]
        c.token_ids.tolist() for c in learner._eval_engine.greedy(prompts, 5)
    ]


def test_an_adapter_install_refuses_what_does_not_fit_and_changes_nothing() -> None:
    learner = learner_with(LoraConfig(rank=4, alpha=8.0))
    adapter = published(learner)
    engine = make_engine("torch", seed=0)
    prompt = [engine.encode_prompt("12+34=")]
    plain = engine.greedy(prompt, 5)[0].token_ids.tolist()  # type: ignore[attr-defined]
    wrong_rank = {k: v for k, v in adapter.items()}
    with pytest.raises(ValueError, match="rank"):
        engine.install_adapter(wrong_rank, LoraAdapter(rank=8, alpha=8.0), 1)
    renamed = {k.replace("blocks.0.", "blocks.9."): v for k, v in adapter.items()}
    with pytest.raises(ValueError, match="no linear layer"):
        engine.install_adapter(renamed, LoraAdapter(rank=4, alpha=8.0), 1)
    unpaired = {k: v for k, v in adapter.items() if not k.startswith("blocks.0.attn.qkv.lora_B")}
    with pytest.raises(ValueError, match="without both A and B"):
        engine.install_adapter(unpaired, LoraAdapter(rank=4, alpha=8.0), 1)
    assert engine.version == 0 and engine.greedy(prompt, 5)[0].token_ids.tolist() == plain  # type: ignore[attr-defined]
    engine.install_adapter(adapter, LoraAdapter(rank=4, alpha=8.0), 2)
    with pytest.raises(ValueError, match="serves"):
        engine.install_adapter(adapter, LoraAdapter(rank=4, alpha=16.0), 3)  # another scale than the one served
    with pytest.raises(ValueError, match="LoRA adapters"):
        engine.install_weights({}, 3)  # a full state does not fit the adapted modules
    assert engine.version == 2


def test_a_lora_checkpoint_resumes_the_adapter_and_its_optimiser(tmp_path: Path) -> None:
    learner = learner_with(LoraConfig(rank=4, alpha=8.0))
    learner._train_step([scored_group(make_engine("torch", seed=0), "12+34=")])
    learner.trainer.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"}
    resumed = learner_with(LoraConfig(rank=4, alpha=8.0))
    resumed.trainer.load(tmp_path)
    saved, restored = published(learner), published(resumed)
    assert all(np.array_equal(saved[k], restored[k]) for k in saved)
    a = learner.trainer.optimizer.state_dict()["state"]  # type: ignore[attr-defined]
    b = resumed.trainer.optimizer.state_dict()["state"]  # type: ignore[attr-defined]
    assert a.keys() == b.keys() and all(torch.equal(a[i]["exp_avg"], b[i]["exp_avg"]) for i in a)
    other = learner_with(LoraConfig(rank=2, alpha=8.0))
    with pytest.raises(ValueError, match="adapter"):
        other.trainer.load(tmp_path)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT on transformers 5
def test_hf_lora_adapters_served_by_the_hf_engine_and_as_the_peft_directory_vllm_loads(tmp_path: Path) -> None:
    """A Hugging Face policy (tiny random Llama) under LoRA: the HF engine's adapter forward
    and PEFT loading ``save_peft``'s directory (the format of vLLM's LoRARequest) both give
    the learner's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llama = make_tiny_llama(tmp_path / "llama")
    learner = learner_with(LoraConfig(rank=4, alpha=8.0), model=str(llama))
    sampler = make_engine("hf", model_dir=str(llama), seed=0)
    learner._train_step([scored_group(sampler, "12+34=")])
    adapter = published(learner)
    modules = adapted_modules(adapter)
    assert any(m.endswith("self_attn.q_proj") for m in modules) and not any("lm_head" in m for m in modules)
    sampler.install_adapter(adapter, LoraAdapter(rank=4, alpha=8.0), 1)
    ids = torch.tensor([sampler.encode_prompt("12+34=")])
    with torch.no_grad():
        learned = learner.policy.model(ids)
        served = sampler.policy.model(ids)  # type: ignore[attr-defined]
        directory = save_peft(tmp_path / "peft", adapter, LoraAdapter(rank=4, alpha=8.0))
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), directory).eval()
        loaded = peft_model(input_ids=ids).logits
    torch.testing.assert_close(served, learned)
    torch.testing.assert_close(loaded, learned, rtol=1e-4, atol=1e-5)
    tensors, spec = load_peft(directory)
    assert spec == LoraAdapter(rank=4, alpha=8.0) and set(tensors) == set(adapter)


# -- vLLM, against a stand-in of its documented API ------------------------------------------


class _FakeLLM:
    """``vllm.LLM`` as far as the engine uses it: generate (with lora_request) and the
    LLMEngine's add_lora / remove_lora."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.loaded: dict[int, Any] = {}
        self.removed: list[int] = []
        self.generated_with: list[Any] = []
        self.llm_engine = self

    def add_lora(self, request: Any) -> bool:
        load_peft(request.lora_path)  # vLLM reads the directory as PEFT wrote it
        self.loaded[request.lora_int_id] = request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.loaded.pop(lora_id, None) is not None

    def generate(
        self, requests: list[Any], sampling: Any, use_tqdm: bool = False, lora_request: Any = None
    ) -> list[Any]:
        self.generated_with.append(lora_request)
        out = types.SimpleNamespace(token_ids=[2], logprobs=[{2: types.SimpleNamespace(logprob=0.0)}])
        return [types.SimpleNamespace(outputs=[out] * sampling.n) for _ in requests]

    def collective_rpc(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = types.ModuleType("vllm")
    vllm.LLM = _FakeLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)  # type: ignore[attr-defined]
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_id, path: types.SimpleNamespace(  # type: ignore[attr-defined]
        lora_name=name, lora_int_id=lora_id, lora_path=path
    )
    for name, module in {
        "vllm": vllm,
        "vllm.inputs": inputs,
        "vllm.platforms": platforms,
        "vllm.lora": lora,
        "vllm.lora.request": request,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_the_vllm_engine_keeps_s_plus_1_adapter_versions_resident(fake_vllm: None, tmp_path: Path) -> None:
    llama = make_tiny_llama(tmp_path / "llama")
    learner = learner_with(LoraConfig(rank=4, alpha=8.0), model=str(llama))
    adapter = published(learner)
    engine = make_engine("vllm", model_dir=str(llama), max_lora_rank=8, resident_adapters=3, warmup_install=False)
    llm: _FakeLLM = engine.llm  # type: ignore[attr-defined]
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 and llm.kwargs["max_loras"] == 3
    prompt = [engine.encode_prompt("12+34=")]
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    engine.generate(prompt, 2, params)
    paths = []
    for version in range(1, 6):
        engine.install_adapter(adapter, LoraAdapter(rank=4, alpha=8.0), version)
        paths.append(Path(llm.loaded[max(llm.loaded)].lora_path))
        engine.generate(prompt, 2, params)
    assert llm.generated_with[0] is None  # no adapter yet: the base model
    assert [r.lora_name.split("-")[1] for r in llm.generated_with[1:]] == ["v1", "v2", "v3", "v4", "v5"]
    assert sorted(llm.loaded) == [3, 4, 5] and llm.removed == [1, 2]  # the newest S + 1 = 3 stay
    assert [p.exists() for p in paths] == [False, False, True, True, True]
    assert engine.version == 5
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.install_adapter(adapter, LoraAdapter(rank=16, alpha=8.0), 6)
    engine.close()


# -- end to end ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_lora_run_publishes_adapter_versions_that_samplers_install(tmp_path: Path) -> None:
    """The colocated main job, tiny, under LoRA with delta versions on: every version on the
    wire is the adapter (its bytes, not the model's), and the sampler installs them."""
    from tests.test_replay import ROOT, TINY

    from echo2.models.adapters import adapter_state
    from echo2.rundir import RunDir
    from echo2.runtime import ProcessRuntime
    from echo2.tools.plan import _apply_bytes, apply_run, make_plan, render
    from echo2.tools.plan import inputs_from_topology as plan_inputs
    from echo2.topology import build_process, load_topology, resolve

    overrides = [
        *TINY[1:],
        "actors.learner.config.max_steps=4",
        "actors.learner.config.kappa=1",
        "actors.learner.config.lora={rank=4, alpha=8.0}",
        "actors.weight_publisher.config.delta_anchor_every=3",
    ]
    topology = load_topology(ROOT / "examples" / "colocated.toml", overrides)
    run = RunDir.create(tmp_path, "lora")
    resolved = resolve(topology, run.name, str(run.root))
    actors, addresses, telemetry = build_process(resolved, "all")
    await ProcessRuntime(actors, addresses, process="all", run_dir=run.root, telemetry_connect=telemetry).run()
    (learner,) = [a for a in actors if isinstance(a, Learner)]
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter_state(learner.policy.core).values())
    model_bytes = sum(p.numel() * p.element_size() for p in learner.policy.core.parameters() if not p.requires_grad)
    assert adapter_bytes < model_bytes / 20
    versions = run.metrics("weight_publisher", "broadcast")
    assert len(versions) >= 3 and all(v["dense_bytes"] == adapter_bytes for v in versions)
    assert all(v["wire_bytes"] <= adapter_bytes for v in versions)
    assert all(v["installed"] == v["active"] == 1 for v in versions if not v["superseded"])
    summary = run.summary_path.read_text()
    assert '"steps": 4' in summary
    # The plan sees what LoRA does: versions of the adapter, against the full model's.
    (record,) = run.metrics("learner", "lora")
    assert (record["adapter_bytes"], record["model_bytes"]) == (adapter_bytes, model_bytes)
    inputs = plan_inputs(topology)
    apply_run(inputs, run.root)
    _apply_bytes(inputs, None, 10.0)
    plan = make_plan(inputs)
    assert plan["bytes_per_version"] == adapter_bytes and plan["model_bytes_per_version"] == model_bytes
    assert plan["t_bcast_full_model_s"] == pytest.approx(model_bytes * 8 / 10e6, rel=1e-4)
    assert plan["t_bcast_s"] == pytest.approx(adapter_bytes * 8 / 10e6, rel=1e-4)
    assert "LoRA: versions carry the adapter" in render(plan)
