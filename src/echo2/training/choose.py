"""Which trainer a single-process Learner gets, from its configuration (one place, above
the trainers it chooses among, so ``trainer`` and ``lora`` never import each other)."""

from __future__ import annotations

from echo2.models.adapters import LoraConfig
from echo2.models.policy import Policy
from echo2.rl.step import StepSettings
from echo2.training.lora import LoraTrainer
from echo2.training.trainer import SimulatedTrainer, TorchTrainer, Trainer


def make_trainer(
    policy: Policy, settings: StepSettings, *, simulated_train_s: float = 0.0, lora: LoraConfig | None = None
) -> Trainer:
    """A ``SimulatedTrainer`` when ``simulated_train_s > 0``, else a ``LoraTrainer`` with
    ``lora``, else a ``TorchTrainer``."""
    if simulated_train_s > 0:
        return SimulatedTrainer(policy, simulated_train_s)
    if lora is not None:
        return LoraTrainer(policy, settings, lora)
    return TorchTrainer(policy, settings)


__all__ = ["make_trainer"]
