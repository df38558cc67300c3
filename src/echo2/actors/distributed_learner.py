"""The Learner across GPUs: data-parallel GRPO under ``torchrun`` (DDP or FSDP2; NCCL on GPUs, gloo on CPU).

Layout: the launcher starts the process holding it under torchrun (``[processes.NAME]
nproc_per_node``, ``nnodes``, ``gpus``; ``echo2.launch.torchrun``); by hand it is
``torchrun --nproc-per-node N -m echo2.launch.torchrun <echo2.launch.child arguments>``.

- Rank 0 runs the learner's echo2 process as usual (``echo2.launch.child``) with the actor kind
  ``"distributed_learner"`` (this class): a Learner whose trainer is a
  ``echo2.training.distributed.DistributedTrainer``. It alone talks to the Buffer and the
  WeightPublisher, evaluates, accounts, logs and checkpoints.
- Ranks 1..N-1 run ``echo2.launch.torchrun.follower_loop``: they receive the job and learner config from
  rank 0, build the same trainer, and run every step (and checkpoint load) rank 0 announces.
- A step trains each rank on a share of the batch's rows; the gradient, loss and statistics
  are those of the whole batch (see ``echo2.training.distributed``), and the groups are
  accounted once, by rank 0, after the step.

``strategy`` chooses how the ranks hold the model: ``"ddp"`` (every rank a full replica,
``echo2.training.distributed``) or ``"fsdp"`` (weights, gradients and AdamW state sharded,
``echo2.training.sharded``; with ``compute_dtype`` and ``activation_checkpointing``). An FSDP
learner evaluates and publishes from an unsharded copy on rank 0, gathered when stale.

Under torchrun a ``device`` of ``"cuda"`` (or ``"cuda:N"``) means ``cuda:LOCAL_RANK`` on each rank.
``simulated_train_s`` is not supported here (there is nothing to share).

Tested: 2 CPU ranks over gloo, DDP (tests/test_learner_dist.py) and FSDP2
(tests/test_learner_fsdp.py), stepped directly and in a launched, audited run; started by
the launcher, stopped and killed, and over two launchers as two nodes
(tests/test_launch_torchrun.py). Untested without GPUs: NCCL, ``device = "cuda"`` placement.
"""

from __future__ import annotations

import os
from typing import ClassVar, Literal

import msgspec
import torch.distributed as dist

from echo2.actors.learner import Learner, LearnerConfig, build_trainer
from echo2.job import JobConfig
from echo2.tasks.evaluation import HeldoutScore
from echo2.training.distributed import DistributedTrainer, broadcast_bytes
from echo2.training.sharded import ComputeDtype, FSDPTrainer
from echo2.training.trainer import Trainer

Strategy = Literal["ddp", "fsdp"]


class DistributedLearnerConfig(LearnerConfig, frozen=True):
    strategy: Strategy = "ddp"
    """How the ranks hold the model: "ddp" (a full replica each) or "fsdp" (FSDP2: weights,
    gradients and AdamW state sharded over the ranks)."""
    compute_dtype: ComputeDtype = "float32"
    """With "fsdp": dtype the layers compute in ("bfloat16", "float16": mixed precision;
    master weights and AdamW stay in ``model_dtype``, gradients are reduced in float32)."""
    activation_checkpointing: bool = False
    """With "fsdp": recompute each layer's activations in backward (less memory, ~1/3 more compute)."""

    def __post_init__(self) -> None:
        if self.strategy == "ddp" and (self.compute_dtype != "float32" or self.activation_checkpointing):
            raise ValueError('compute_dtype and activation_checkpointing need strategy = "fsdp"')


def rank_config(config: DistributedLearnerConfig) -> DistributedLearnerConfig:
    """This rank's copy of ``config``: a CUDA device means this rank's GPU (``LOCAL_RANK``)."""
    if config.device.startswith("cuda"):
        return msgspec.structs.replace(config, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return config


class DistributedLearner(Learner):
    """Rank 0's Learner actor; see the module docstring."""

    kind: ClassVar[str] = "distributed_learner"
    torchrun: ClassVar[bool] = True
    Config = DistributedLearnerConfig
    config: DistributedLearnerConfig

    def build_trainer(self) -> Trainer:
        if not dist.is_initialized():
            raise RuntimeError("DistributedLearner runs under torchrun: python -m echo2.launch.torchrun ...")
        if not isinstance(self.config, DistributedLearnerConfig):  # a plain LearnerConfig: DDP
            self.config = DistributedLearnerConfig(**msgspec.structs.asdict(self.config))
        self.config = rank_config(self.config)
        # the followers build from the same job and config
        broadcast_bytes(msgspec.json.encode({"job": self.job, "config": self.config}))
        self.distributed = distributed_trainer(self.job, self.config)
        return self.distributed

    def evaluate(self) -> HeldoutScore:
        if isinstance(self.distributed, FSDPTrainer):
            self.distributed.gather()  # the unsharded copy the eval engine runs
        return super().evaluate()


def distributed_trainer(job: JobConfig, config: DistributedLearnerConfig) -> DistributedTrainer:
    """This rank's trainer (every rank builds the same one)."""
    inner = build_trainer(job, config)
    if config.strategy == "fsdp":
        return FSDPTrainer(
            inner, compute_dtype=config.compute_dtype, activation_checkpointing=config.activation_checkpointing
        )
    return DistributedTrainer(inner)
