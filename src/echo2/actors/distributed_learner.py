"""The Learner across GPUs: data-parallel GRPO under ``torchrun`` (DDP; NCCL on GPUs, gloo on CPU).

Layout: ``torchrun --nproc-per-node N -m echo2.launch.torchrun <echo2.launch.child arguments>``.

- Rank 0 runs the learner's echo2 process as usual (``echo2.launch.child``) with the actor kind
  ``"distributed_learner"`` (this class): a Learner whose trainer is a
  ``echo2.training.distributed.DistributedTrainer``. It alone talks to the Buffer and the
  WeightPublisher, evaluates, accounts, logs and checkpoints.
- Ranks 1..N-1 run ``echo2.launch.torchrun.follower_loop``: they receive the job and learner config from
  rank 0, build the same trainer, and run every step (and checkpoint load) rank 0 announces.
- A step trains each rank on a share of the batch's rows; the gradient, loss and statistics
  are those of the whole batch (see ``echo2.training.distributed``), and the groups are
  accounted once, by rank 0, after the step.

Under torchrun a ``device`` of ``"cuda"`` (or ``"cuda:N"``) means ``cuda:LOCAL_RANK`` on each rank.
``simulated_train_s`` is not supported here (there is nothing to share).

Tested: 2 CPU ranks over gloo (tests/test_learner_dist.py), stepped directly and in a
launched, audited run. Untested without GPUs: NCCL, ``device = "cuda"`` placement, multi-node.
"""

from __future__ import annotations

import os
from typing import ClassVar

import msgspec
import torch.distributed as dist

from echo2.actors.learner import Learner, LearnerConfig, build_trainer
from echo2.training.distributed import DistributedTrainer, broadcast_bytes
from echo2.training.trainer import Trainer


def rank_config(config: LearnerConfig) -> LearnerConfig:
    """This rank's copy of ``config``: a CUDA device means this rank's GPU (``LOCAL_RANK``)."""
    if config.device.startswith("cuda"):
        return msgspec.structs.replace(config, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return config


class DistributedLearner(Learner):
    """Rank 0's Learner actor; see the module docstring."""

    kind: ClassVar[str] = "distributed_learner"

    def build_trainer(self) -> Trainer:
        if not dist.is_initialized():
            raise RuntimeError("DistributedLearner runs under torchrun: python -m echo2.launch.torchrun ...")
        self.config = rank_config(self.config)
        # the followers build from the same job and config
        broadcast_bytes(msgspec.json.encode({"job": self.job, "config": self.config}))
        return DistributedTrainer(build_trainer(self.job, self.config))
