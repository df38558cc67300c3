"""Training the Learner's policy: the trainer seam, its implementations and the accounting.

* ``trainer``: the ``Trainer`` protocol, ``TorchTrainer`` (optimiser steps in this process),
  ``SimulatedTrainer`` (a fixed time per step, weights unchanged).
* ``lora``: ``LoraTrainer``, LoRA adapters (PEFT) trained on a frozen base.
* ``choose``: ``make_trainer``, the single-process trainer a Learner's configuration asks for.
* ``distributed``: ``DistributedTrainer``, a trainer shared over data-parallel ranks (DDP).
* ``accounting``: ``TrainingAccount``, the one place a group is counted as trained.

The step itself is pure and lives in ``echo2.rl.step``.
"""
