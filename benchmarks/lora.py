"""LoRA adapter versions: bytes on the wire, and install time against the base model's size.

    python -m benchmarks.lora [--repeats 30] [--json PATH]

1. Bytes per version: the main job's LoRA learner (``examples/lora.toml``: rank 16, every
   linear layer of the tiny model's blocks) publishes its adapter; the version's chunks carry
   exactly the adapter's tensors, and its manifest (msgpack, as encoded on the wire) is the
   only other thing a member receives. Compared with the full model's state.
2. Install time vs base size: the same adapter (rank 16 on the first block's four linear
   modules, so the adapter's bytes are fixed) installed into the torch engine on tiny models
   of 4 and 32 blocks (d = 128), and into the HF engine on random Llamas of 2 and 16 layers,
   against installing the full state into the same engines (``install_weights``, the dense
   path). Medians of ``--repeats`` installs; ratios taken in the same run.

Floor (issue 16): install time independent of base size: adapter install time on the larger
base within noise of the smaller one, while the dense install grows with the base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo2.engines.base import Engine
from echo2.engines.hf_engine import HFTorchEngine
from echo2.engines.torch_engine import TorchEngine
from echo2.messages import LoraAdapter, Snapshot
from echo2.models import TinyConfig, TinyTransformer
from echo2.models.adapters import LoraConfig, adapter_state, inject
from echo2.models.hf import to_wire
from echo2.models.policy import load_policy
from echo2.transport.codec import Codec
from echo2.weights.chunks import flatten_tensors, make_manifest

ADAPTER = LoraAdapter(rank=16, alpha=32.0)


def median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def wire_adapter(model: torch.nn.Module, targets: list[str]) -> dict[str, np.ndarray]:
    """A trained-looking adapter (B non-zero) on ``targets`` of a copy of ``model``'s modules."""
    inject(model, ADAPTER, targets)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.02)
    return {name: to_wire(t).copy() for name, t in adapter_state(model).items()}


def bytes_per_version() -> dict[str, Any]:
    policy = load_policy("")
    full = sum(a.nbytes for a in policy.wire_tensors().values())
    from echo2.training.lora import LoraTrainer
    from echo2.training.trainer import StepSettings

    trainer = LoraTrainer(policy, StepSettings(), LoraConfig(rank=16, alpha=32.0))
    specs, flat = flatten_tensors(trainer.state_for_publication())
    snapshot = Snapshot(1, 1, specs, flat, time.time(), adapter=trainer.adapter)
    manifest = make_manifest(snapshot)
    manifest_bytes = sum(len(memoryview(f).cast("B")) for f in Codec().encode(manifest))
    adapter = sum(p.numel() * p.element_size() for p in policy.core.parameters() if p.requires_grad)
    return {
        "model_state_bytes": full,
        "adapter_param_bytes": adapter,
        "version_chunk_bytes": int(flat.nbytes),
        "manifest_bytes": manifest_bytes,
        "version_over_model": flat.nbytes / full,
    }


def case(
    name: str, engine: Engine, dense: dict[str, np.ndarray], adapter: dict[str, np.ndarray], repeats: int
) -> dict[str, Any]:
    base_bytes = sum(a.nbytes for a in dense.values())
    dense_s = median_s(lambda: engine.install_weights(dense, 1), repeats)
    adapter_s = median_s(lambda: engine.install_adapter(adapter, ADAPTER, 2), repeats)
    row = {
        "case": name,
        "base_bytes": base_bytes,
        "adapter_bytes": sum(a.nbytes for a in adapter.values()),
        "dense_install_s": dense_s,
        "adapter_install_s": adapter_s,
    }
    print(
        f"{name}: base {base_bytes / 2**20:.1f} MiB, adapter {row['adapter_bytes'] / 2**10:.0f} KiB: "
        f"dense install {dense_s * 1e3:.2f} ms, adapter install {adapter_s * 1e3:.3f} ms",
        file=sys.stderr,
        flush=True,
    )
    return row


def tiny_case(layers: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(n_layers=layers))
    engine = TorchEngine(model=model)
    dense = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    donor = TinyTransformer(TinyConfig(n_layers=layers))
    adapter = wire_adapter(donor, ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2"])
    return case(f"tiny, {layers} blocks", engine, dense, adapter, repeats)


def llama_case(layers: int, repeats: int, directory: Path) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    from tests.test_hf_models import make_tiny_llama  # the tokenizer only

    make_tiny_llama(directory)
    LlamaForCausalLM(config).save_pretrained(directory)
    engine = HFTorchEngine(model_dir=str(directory))
    dense = {k: v.copy() for k, v in engine.policy.wire_tensors().items()}
    donor = LlamaForCausalLM(config)
    targets = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    adapter = wire_adapter(donor, targets)
    return case(f"llama, {layers} layers", engine, dense, adapter, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"bytes": bytes_per_version()}
    b = out["bytes"]
    print(
        f"bytes per version: {b['version_chunk_bytes']} of adapter (+ {b['manifest_bytes']} B manifest) "
        f"against {b['model_state_bytes']} for the model ({b['version_over_model']:.3f})",
        file=sys.stderr,
    )
    rows = [tiny_case(4, args.repeats), tiny_case(32, args.repeats)]
    with tempfile.TemporaryDirectory() as small, tempfile.TemporaryDirectory() as large:
        rows += [llama_case(2, args.repeats, Path(small)), llama_case(16, args.repeats, Path(large))]
    for first, second in (rows[0:2], rows[2:4]):
        second["base_over_smaller"] = second["base_bytes"] / first["base_bytes"]
        second["adapter_install_over_smaller"] = second["adapter_install_s"] / first["adapter_install_s"]
        second["dense_install_over_smaller"] = second["dense_install_s"] / first["dense_install_s"]
        print(
            f"{second['case']} vs {first['case']}: base x{second['base_over_smaller']:.1f}, adapter install "
            f"x{second['adapter_install_over_smaller']:.2f}, dense install x{second['dense_install_over_smaller']:.2f}",
            file=sys.stderr,
        )
    out["install"] = rows
    out["load"] = os.getloadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
