"""The trainer seam: what the Learner calls to train, publish and checkpoint its policy.

A ``Trainer`` owns the policy being trained and whatever updates it. The Learner packs each
batch (``echo2.rl.step.pack_groups``), calls ``step``, and accounts for the groups only
after ``step`` returned. Implementations:

* ``TorchTrainer``: one ``echo2.rl.step.optimiser_step`` per batch, in this process.
* ``SimulatedTrainer``: each step takes ``train_s`` seconds and changes nothing; for
  capacity and scheduling experiments, where a stable ``T_train`` matters and the model
  does not. Publication, evaluation and checkpoints still use the real (unchanged) policy.
* ``echo2.training.distributed.DistributedTrainer``: a ``TorchTrainer`` over DDP ranks;
  ``echo2.training.sharded.FSDPTrainer``: over FSDP2 ranks (sharded state).

* ``echo2.training.lora.LoraTrainer``: a ``TorchTrainer`` of LoRA adapters on a frozen base.

``echo2.training.choose.make_trainer`` chooses among the single-process ones from the
Learner's configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from echo2.models.policy import Policy
from echo2.rl.step import WHOLE_BATCH, Share, StepSettings, StepStats, TrainingRows, optimiser_step

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class Trainer(Protocol):
    """What the Learner needs of whatever trains its policy."""

    @property
    def policy(self) -> Policy:
        """The policy being trained (the Learner evaluates it)."""
        ...

    def step(self, rows: TrainingRows, version: int) -> StepStats:
        """Train on ``rows`` as the step from ``version`` to ``version + 1``; stats of the whole batch."""
        ...

    def state_for_publication(self) -> dict[str, np.ndarray]:
        """The current weights in wire form (views: copy before the next step)."""
        ...

    def save(self, directory: Path) -> None:
        """Write the trainer's state (weights, optimiser) into the existing, empty ``directory``
        (a staging directory that ``echo2.training.checkpoint.write_checkpoint`` digests and
        commits; any file written there becomes part of the checkpoint)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what ``save`` wrote."""
        ...

    def close(self) -> None:
        """No more steps will come (a distributed trainer releases its other ranks)."""
        ...


def save_weights(policy: Policy, directory: Path) -> None:
    """Weights as a model directory ``load_policy`` reads back (HF: ``save_pretrained``)."""
    policy.save(directory)


def load_weights(policy: Policy, directory: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(directory / WEIGHTS_FILE)
    # HF: names without LogitsLM's "hf." prefix; a tied lm_head is not in the file
    policy.core.load_state_dict(weights, strict=policy.kind == "tiny")


def adamw(model: nn.Module, settings: StepSettings) -> torch.optim.AdamW:
    """The optimiser of ``model``'s trainable parameters (all of them, or a LoRA policy's
    adapters: ``echo2.training.lora``); rebuilt by a trainer that replaces them (FSDP)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)


class TorchTrainer:
    """AdamW on the policy, one ``optimiser_step`` per batch."""

    def __init__(self, policy: Policy, settings: StepSettings) -> None:
        self._policy = policy
        self.settings = settings
        self.model: nn.Module = policy.model
        """The module the step runs: the policy's model, or a DDP wrapper of it."""
        policy.model.train()
        self.optimizer = adamw(policy.model, settings)
        self.reference = policy.clone().model if settings.kl_beta > 0 else None
        """The frozen initial policy of the KL term."""

    @property
    def policy(self) -> Policy:
        return self._policy

    def step(self, rows: TrainingRows, version: int, *, share: Share = WHOLE_BATCH) -> StepStats:
        return optimiser_step(
            self.model,
            self.optimizer,
            rows,
            self.settings,
            version=version,
            pad_id=self._policy.tokenizer.pad_id,
            reference=self.reference,
            share=share,
        )

    def state_for_publication(self) -> dict[str, np.ndarray]:
        return self._policy.wire_tensors()  # unaliased, bf16 as raw uint16

    def save(self, directory: Path) -> None:
        save_weights(self._policy, directory)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        load_weights(self._policy, directory)
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))

    def close(self) -> None:
        pass


class SimulatedTrainer:
    """Each step sleeps ``train_s`` seconds; the weights never change (see the module docstring)."""

    def __init__(self, policy: Policy, train_s: float, *, sleep: Callable[[float], None] = time.sleep) -> None:
        if train_s <= 0:
            raise ValueError(f"train_s must be > 0, got {train_s}")
        self._policy = policy
        self.train_s = train_s
        self._sleep = sleep

    @property
    def policy(self) -> Policy:
        return self._policy

    def step(self, rows: TrainingRows, version: int) -> StepStats:
        self._sleep(self.train_s)
        return StepStats(loss=0.0)

    def state_for_publication(self) -> dict[str, np.ndarray]:
        return self._policy.wire_tensors()

    def save(self, directory: Path) -> None:
        save_weights(self._policy, directory)

    def load(self, directory: Path) -> None:
        load_weights(self._policy, directory)

    def close(self) -> None:
        pass
