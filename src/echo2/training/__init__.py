"""Training the Learner's policy: the trainer seam, its implementations and the accounting.

* ``trainer``: the ``Trainer`` protocol, ``TorchTrainer`` (optimiser steps in this process),
  ``SimulatedTrainer`` (a fixed time per step, weights unchanged) and ``make_trainer``.
* ``distributed``: ``DistributedTrainer``, a trainer shared over data-parallel ranks (DDP).
* ``accounting``: ``TrainingAccount``, the one place a group is counted as trained.

The step itself is pure and lives in ``echo2.rl.step``.
"""
