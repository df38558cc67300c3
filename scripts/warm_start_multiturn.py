"""Warm-start the tiny model on chain addition (supervised), for ``examples/multiturn.toml``.

Why: the shipped addition checkpoint answers a first turn ("123+456=") about half the
time, but a second turn sits at positions it never saw (after its first answer and the
environment's "579+321="): greedy and sampled accuracy there are 0, so GRPO would find no
reward on it. As for the addition job (``scripts/warm_start.py``), a short supervised phase
brings the held-out success rate (both answers right, greedy) off zero and then stops,
leaving the rest to RL.

Recipe: from the shipped addition checkpoint, teacher forcing on whole two-turn episodes
``BOS a+b= answer1 EOS s+c= answer2 EOS`` played by the built-in environment
(``chain_addition``, operands revealed from each task's episode seed), cross-entropy on the
answer and EOS tokens only (the environment's are masked, as the learner masks them).
Every ``--eval-every`` steps the held-out success rate of greedy episodes
(``echo2.envs.evaluation``, the learner's own measure) is computed; training stops the first
time it lies in [--low, --high].

    python scripts/warm_start_multiturn.py      # writes examples/models/tiny_chain
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from echo2.engines.torch_engine import TorchEngine
from echo2.envs.base import Action, episode_seed, load_environment
from echo2.envs.codec import load_episode_codec
from echo2.envs.episode import EpisodeLimits
from echo2.envs.evaluation import evaluate_episodes
from echo2.models import CharTokenizer, TinyTransformer, default_checkpoint_dir
from echo2.rl.logprobs import sequence_logprobs
from echo2.tasks import AdditionTask, Prompt

OUT = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny_chain"
ENVIRONMENT_KWARGS = {"operands": 3, "digits": 3}
LIMITS = EpisodeLimits(max_turns=2, max_episode_tokens=23, max_new_tokens=5)


def expert_episode(env, tokenizer: CharTokenizer, prompt: Prompt, seed: int) -> tuple[list[int], list[int]]:
    """The right answers to every turn: (tokens after the prompt, loss mask)."""
    tokens: list[int] = []
    mask: list[int] = []
    env.reset(prompt, seed)
    total = sum(int(x) for x in prompt.text.rstrip("=").split("+"))
    while True:
        answer = [*tokenizer.encode(str(total)[::-1]), tokenizer.eos_id]
        tokens += answer
        mask += [1] * len(answer)
        result = env.step(Action(token_ids=tuple(answer), text=tokenizer.decode(answer), finished=True))
        if result.done:
            return tokens, mask
        observation = tokenizer.encode(result.observation)
        tokens += observation
        mask += [0] * len(observation)
        total = int(result.observation.split("+")[0]) + int(result.observation.rstrip("=").split("+")[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128, help="episodes per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--eval-prompts", type=int, default=300)
    parser.add_argument("--low", type=float, default=0.10, help="lowest accepted held-out success rate")
    parser.add_argument("--high", type=float, default=0.25, help="highest accepted held-out success rate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    task = AdditionTask(digits=3)
    spec = load_environment("chain_addition", ENVIRONMENT_KWARGS)
    codec = load_episode_codec("")
    heldout = task.heldout(args.eval_prompts)
    model = TinyTransformer.load(default_checkpoint_dir())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    stream = task.prompts(args.seed + 1)  # not the RL job's stream (seed 0)
    env = spec.factory()

    def success_rate(step: int) -> float:
        model.eval()
        evaluation = evaluate_episodes(
            TorchEngine(model=model), heldout, step=step, spec=spec, codec=codec, limits=LIMITS, job_seed=0,
            timeout_s=10.0,
        )  # fmt: skip
        model.train()
        assert evaluation.score.pass_at_1 is not None
        return evaluation.score.pass_at_1

    start = time.perf_counter()
    success = success_rate(0)
    print(f"step     0  held-out success {success:.3f}", flush=True)
    step = 0
    for step in range(1, args.max_steps + 1):
        batch = list(itertools.islice(stream, args.batch_size))
        episodes = [expert_episode(env, tokenizer, p, episode_seed(args.seed + 1, p.task_id)) for p in batch]
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
        if step % args.eval_every:
            continue
        success = success_rate(step)
        print(
            f"step {step:5d}  loss {loss.item():.4f}  held-out success {success:.3f}  {time.perf_counter() - start:6.1f}s",
            flush=True,
        )
        if args.low <= success <= args.high:
            break
        if success > args.high:
            print(f"overshot: success {success:.3f} > {args.high}; lower --eval-every or --lr", file=sys.stderr)
            return 1
    else:
        print(f"no accepted success rate within {args.max_steps} steps (last {success:.3f})", file=sys.stderr)
        return 1
    model.eval()
    model.save(args.out)
    record = {
        "from": "the shipped addition checkpoint",
        "steps": step,
        "seconds": round(time.perf_counter() - start, 2),
        "heldout_success": success,
        "heldout_n": len(heldout),
        "environment": "chain_addition",
        "environment_kwargs": ENVIRONMENT_KWARGS,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": args.lr,
    }
    (args.out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
