"""LoRA training: AdamW on adapters over a frozen base model, published and saved alone.

``LoraTrainer`` is a ``TorchTrainer`` whose policy got LoRA layers (``echo2.models.adapters``)
on its ``target_modules`` before training: only the adapters are parameters of the optimiser,
``state_for_publication`` gives only them (so a weight version is the adapter: its bytes on
the wire are the adapter's size), and a checkpoint holds the adapter in PEFT's format
(``adapter_model.safetensors``, ``adapter_config.json``) and the optimiser's state. The base
is the job's model, which a resume loads again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from echo2.messages import LoraAdapter
from echo2.models.adapters import (
    LoraConfig,
    adapter_state,
    adapter_state_params,
    default_targets,
    inject,
    load_peft,
    save_peft,
)
from echo2.models.hf import to_wire
from echo2.models.policy import Policy
from echo2.rl.step import StepSettings
from echo2.training.trainer import OPTIMIZER_FILE, TorchTrainer


class LoraTrainer(TorchTrainer):
    """AdamW on the LoRA adapters of ``policy`` (injected here; the base frozen)."""

    def __init__(self, policy: Policy, settings: StepSettings, lora: LoraConfig) -> None:
        self.lora = lora
        self.adapter: LoraAdapter = lora.adapter
        """How the published tensors act on the base (``Snapshot.adapter``)."""
        targets = lora.target_modules or default_targets(policy.kind)
        inject(policy.core, self.adapter, targets, lora.dropout)
        super().__init__(policy, settings)  # its optimiser takes the trainable parameters: the adapters

    def state_for_publication(self) -> dict[str, np.ndarray]:
        return {name: to_wire(t) for name, t in adapter_state(self.policy.core).items()}

    def save(self, directory: Path) -> None:
        save_peft(directory, self.state_for_publication(), self.adapter)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        tensors, adapter = load_peft(directory)
        if adapter != self.adapter:
            raise ValueError(f"the checkpoint's adapter is {adapter}, this run trains {self.adapter}")
        live = dict(adapter_state(self.policy.core))
        if set(tensors) != set(live):
            raise ValueError("the checkpoint's adapter adapts other modules than this run's target_modules")
        params = adapter_state_params(self.policy.core)
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].dtype))
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))
