"""Warm-start the built-in tiny model on reversed-answer addition (supervised).

Why: RL from a random policy would see reward 0 for a long time. A short supervised phase
brings held-out greedy accuracy into 30-50%, where GRPO has signal and plenty left to learn.
The result is shipped in git as ``src/echo2/models/assets/tiny_addition`` so a job starts
learning at once.

Recipe: teacher forcing on ``BOS prompt answer EOS``, cross-entropy on the answer and EOS
tokens only, AdamW. Every ``--eval-every`` steps (every ``--eval-every-near`` steps once
accuracy passes ``--near``) the held-out greedy accuracy on ``AdditionTask().heldout(500)`` is
measured; training stops the first time it lies in [--low, --high].

    python scripts/warm_start.py            # writes the shipped checkpoint
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
from echo2.models import CharTokenizer, TinyConfig, TinyTransformer, default_checkpoint_dir
from echo2.rl.logprobs import sequence_logprobs
from echo2.tasks import AdditionTask, Prompt


def heldout_accuracy(model: TinyTransformer, task: AdditionTask, prompts: list[Prompt]) -> float:
    """Fraction of ``prompts`` the model answers exactly with greedy decoding."""
    model.eval()
    engine = TorchEngine(model=model)
    completions = engine.greedy([engine.encode_prompt(p.text) for p in prompts])
    model.train()
    return float(np.mean([task.reward(p, c.text) for p, c in zip(prompts, completions, strict=True)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_checkpoint_dir(), help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128, help="prompts per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    parser.add_argument("--eval-every-near", type=int, default=10, help="steps between evaluations once near")
    parser.add_argument("--near", type=float, default=0.05, help="accuracy above which evaluation is denser")
    parser.add_argument("--low", type=float, default=0.30, help="lowest accepted held-out accuracy")
    parser.add_argument("--high", type=float, default=0.50, help="highest accepted held-out accuracy")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    task = AdditionTask()
    heldout = task.heldout(500)
    model = TinyTransformer(TinyConfig(vocab_size=tokenizer.vocab_size))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    stream = task.prompts(args.seed)

    start = time.perf_counter()
    accuracy = 0.0
    next_eval = args.eval_every
    step = 0
    for step in range(1, args.max_steps + 1):
        batch = list(itertools.islice(stream, args.batch_size))
        prompts = [np.asarray(tokenizer.encode_prompt(p.text)) for p in batch]
        answers = [np.asarray([*tokenizer.encode(p.answer), tokenizer.eos_id]) for p in batch]
        logp, mask = sequence_logprobs(model, prompts, answers, tokenizer.pad_id)  # (B, T), (B, T)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step < next_eval:
            continue
        accuracy = heldout_accuracy(model, task, heldout)
        elapsed = time.perf_counter() - start
        print(
            f"step {step:5d}  loss {loss.item():.4f}  heldout acc {accuracy:.3f}  {elapsed:6.1f}s",
            flush=True,
        )
        if args.low <= accuracy <= args.high:
            break
        if accuracy > args.high:
            print(
                f"overshot: accuracy {accuracy:.3f} > {args.high}; lower --near or --eval-every-near",
                file=sys.stderr,
            )
            return 1
        next_eval = step + (args.eval_every_near if accuracy >= args.near else args.eval_every)
    else:
        print(f"no accepted accuracy within {args.max_steps} steps (last {accuracy:.3f})", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start

    model.eval()
    model.save(args.out)
    record = {
        "steps": step,
        "seconds": round(seconds, 2),
        "heldout_accuracy": accuracy,
        "heldout_n": len(heldout),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "threads": args.threads,
        "parameters": model.num_parameters(),
    }
    (args.out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
