"""Warm-start the tiny model on the multi-turn job of ``examples/multiturn.toml`` (supervised).

Why: the shipped addition checkpoint answers a first turn ("123+456=") about half the time,
but a second turn sits at positions it never saw (after its first answer and the
environment's "579+3="): greedy success there is 0, so GRPO would find no reward on it. As
for the addition job (``scripts/warm_start.py``), a short supervised phase brings the
held-out success rate (both answers right, greedy, the environment's own verdict) off zero
and then stops, leaving the rest to RL. The result is shipped in git as
``examples/models/tiny_chain`` (the example's ``job.model``).

Recipe: from the shipped addition checkpoint, teacher forcing on whole episodes
``BOS a+b= answer1 EOS s+c= answer2 EOS`` played by the example's environment with the right
answers (operands revealed from each task's episode seed), cross-entropy on the answers and
their EOS only (the environment's tokens are masked, as the learner masks them), AdamW.
The job (task, environment and its kwargs, turn and token limits, seed) is read from the
topology, so the warm start fits the job it is for. Every ``--eval-every`` steps (every
``--eval-every-near`` once success passes ``--near``) the held-out success rate of greedy
episodes is measured exactly as the learner measures it at step 0 (``echo2.envs.evaluation``,
the job's seed); training stops the first time it lies in [--low, --high].

Measured (``--threads 1``, load ~3): 160 steps, 44 s, held-out success 0.263 (the record is
``warm_start.json`` next to the checkpoint; the same seed and thread count give the same
bytes).

    python scripts/warm_start_multiturn.py      # writes examples/models/tiny_chain
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from echo2.engines.torch_engine import TorchEngine
from echo2.envs.base import Action, episode_seed, load_job_environment
from echo2.envs.codec import load_episode_codec
from echo2.envs.episode import EpisodeLimits
from echo2.envs.evaluation import evaluate_episodes
from echo2.models import CharTokenizer, TinyTransformer, default_checkpoint_dir
from echo2.rl.logprobs import sequence_logprobs
from echo2.tasks.base import Prompt, load_job_task
from echo2.topology import load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "examples" / "multiturn.toml"
OUT = ROOT / "examples" / "models" / "tiny_chain"


def expert_episode(env, tokenizer: CharTokenizer, prompt: Prompt, seed: int) -> tuple[list[int], list[int]]:
    """The right answers to every turn: (tokens after the prompt, loss mask)."""
    tokens: list[int] = []
    mask: list[int] = []
    env.reset(prompt, seed)
    context = prompt.text
    while True:
        a, b = context.rstrip("=").split("+")
        answer = [*tokenizer.encode(str(int(a) + int(b))[::-1]), tokenizer.eos_id]
        tokens += answer
        mask += [1] * len(answer)
        result = env.step(Action(token_ids=tuple(answer), text=tokenizer.decode(answer), finished=True))
        if result.done:
            return tokens, mask
        context = result.observation
        observation = tokenizer.encode(context)
        tokens += observation
        mask += [0] * len(observation)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", type=Path, default=TOPOLOGY, help="the multi-turn job to warm-start for")
    parser.add_argument("--out", type=Path, default=OUT, help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128, help="episodes per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--eval-every-near", type=int, default=5, help="steps between evaluations once near")
    parser.add_argument("--near", type=float, default=0.02, help="success rate above which evaluation is denser")
    parser.add_argument("--eval-prompts", type=int, default=300, help="held-out prompts (the example's eval_prompts)")
    parser.add_argument("--low", type=float, default=0.20, help="lowest accepted held-out success rate")
    parser.add_argument("--high", type=float, default=0.35, help="highest accepted held-out success rate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    job = load_topology(args.topology, ['job.model=""']).job  # its model is what this makes
    if not job.multi_turn:
        print(f"{args.topology}: not a multi-turn job ([job.episode] environment)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    task = load_job_task(job)
    spec = load_job_environment(job)
    codec = load_episode_codec("")
    limits = EpisodeLimits.of_job(job)
    heldout = task.heldout(args.eval_prompts)
    model = TinyTransformer.load(default_checkpoint_dir())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    stream = task.prompts(job.seed + 1)  # not the RL job's stream
    env = spec.factory()

    def success_rate(step: int) -> float:
        model.eval()
        evaluation = evaluate_episodes(
            TorchEngine(model=model), heldout, step=step, spec=spec, codec=codec, limits=limits, job_seed=job.seed,
            timeout_s=job.episode.turn_timeout_s,
        )  # fmt: skip
        model.train()
        assert evaluation.score.pass_at_1 is not None, "the environment declares no succeeded()"
        return evaluation.score.pass_at_1

    start = time.perf_counter()
    success = success_rate(0)
    print(f"step     0  held-out success {success:.3f}", flush=True)
    next_eval = args.eval_every
    step = 0
    for step in range(1, args.max_steps + 1):
        batch = list(itertools.islice(stream, args.batch_size))
        episodes = [expert_episode(env, tokenizer, p, episode_seed(job.seed + 1, p.task_id)) for p in batch]
        prompts = [np.asarray(tokenizer.encode_prompt(p.text)) for p in batch]
        responses = [np.asarray(tokens) for tokens, _ in episodes]
        logp, mask = sequence_logprobs(model, prompts, responses, tokenizer.pad_id)  # (B, T), (B, T)
        loss_mask = torch.zeros_like(mask)  # (B, T): the answers' tokens only
        for b, (_, m) in enumerate(episodes):
            loss_mask[b, : len(m)] = torch.tensor(m, dtype=mask.dtype)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step < next_eval:
            continue
        success = success_rate(step)
        print(
            f"step {step:5d}  loss {loss.item():.4f}  held-out success {success:.3f}  {time.perf_counter() - start:6.1f}s",
            flush=True,
        )
        if args.low <= success <= args.high:
            break
        if success > args.high:
            print(f"overshot: success {success:.3f} > {args.high}; lower --near or --eval-every-near", file=sys.stderr)
            return 1
        next_eval = step + (args.eval_every_near if success >= args.near else args.eval_every)
    else:
        print(f"no accepted success rate within {args.max_steps} steps (last {success:.3f})", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    model.eval()
    model.save(args.out)
    record = {
        "from": "the shipped addition checkpoint (src/echo2/models/assets/tiny_addition)",
        "topology": str(args.topology.resolve().relative_to(ROOT)) if args.topology.resolve().is_relative_to(ROOT)
        else str(args.topology),
        "environment": job.episode.environment,
        "environment_kwargs": job.episode.environment_kwargs,
        "steps": step,
        "seconds": round(seconds, 2),
        "heldout_success": success,
        "heldout_n": len(heldout),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 1),
    }  # fmt: skip
    (args.out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
