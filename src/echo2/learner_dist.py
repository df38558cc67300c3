"""The Learner across GPUs: data-parallel GRPO under ``torchrun`` (DDP; NCCL on GPUs, gloo on CPU).

Layout: ``torchrun --nproc-per-node N -m echo2.learner_dist <echo2.launch.child arguments>``.

- Rank 0 runs the learner's echo2 process as usual (``echo2.launch.child``) with the actor kind
  ``"echo2.learner_dist:DistributedLearner"``: a Learner whose trainer is a
  ``echo2.training.distributed.DistributedTrainer``. It alone talks to the Buffer and the
  WeightPublisher, evaluates, accounts, logs and checkpoints.
- Ranks 1..N-1 run :func:`follower_loop`: they receive the job and learner config from
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
import sys
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from echo2.actors.learner import Learner, LearnerConfig, build_trainer
from echo2.job import JobConfig
from echo2.training.distributed import DistributedTrainer, broadcast_bytes
from echo2.training.trainer import Trainer


def _rank_config(config: LearnerConfig) -> LearnerConfig:
    if config.device.startswith("cuda"):
        return msgspec.structs.replace(config, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return config


class DistributedLearner(Learner):
    """Rank 0's Learner actor; see the module docstring."""

    def build_trainer(self) -> Trainer:
        if not dist.is_initialized():
            raise RuntimeError("DistributedLearner runs under torchrun: python -m echo2.learner_dist ...")
        self.config = _rank_config(self.config)
        # the followers build from the same job and config
        broadcast_bytes(msgspec.json.encode({"job": self.job, "config": self.config}))
        return DistributedTrainer(build_trainer(self.job, self.config))


def follower_loop() -> DistributedTrainer:
    """Ranks > 0: build the trainer from rank 0's config, then follow rank 0 until it closes."""
    spec = msgspec.json.decode(broadcast_bytes(None))
    job = msgspec.convert(spec["job"], JobConfig)
    config = _rank_config(msgspec.convert(spec["config"], LearnerConfig))
    trainer = DistributedTrainer(build_trainer(job, config))
    trainer.follow()
    return trainer


def init_distributed(timeout_s: float = 1800.0) -> None:
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("ECHO2_DIST_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: rank 0 runs ``echo2.launch.child`` with ``argv``; the others follow."""
    argv = list(sys.argv[1:] if argv is None else argv)
    init_distributed()
    try:
        if dist.get_rank() == 0:
            from echo2.launch.child import main as runtime_main

            return runtime_main(argv)
        follower_loop()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
