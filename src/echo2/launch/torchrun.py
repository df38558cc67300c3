"""The torchrun entry point of a data-parallel Learner (``echo2.actors.distributed_learner``).

    torchrun --nproc-per-node N -m echo2.launch.torchrun --topology RUN_DIR/topology.resolved.json --process learner

Rank 0 runs the learner's process as the launcher would (``echo2.launch.child``); the other
ranks build the same trainer from rank 0's job and config and follow its steps.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from echo2.actors.distributed_learner import DistributedLearnerConfig, distributed_trainer, rank_config
from echo2.job import JobConfig
from echo2.training.distributed import DistributedTrainer, broadcast_bytes


def follower_loop() -> DistributedTrainer:
    """Ranks > 0: build the trainer from rank 0's config, then follow rank 0 until it closes."""
    spec = msgspec.json.decode(broadcast_bytes(None))
    job = msgspec.convert(spec["job"], JobConfig)
    config = rank_config(msgspec.convert(spec["config"], DistributedLearnerConfig))
    trainer = distributed_trainer(job, config)
    trainer.follow()
    return trainer


def init_distributed(timeout_s: float = 1800.0) -> None:
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("ECHO2_DIST_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> int:
    """Rank 0 runs ``echo2.launch.child`` with ``argv``; the others follow."""
    argv = list(sys.argv[1:] if argv is None else argv)
    init_distributed()
    try:
        if dist.get_rank() == 0:
            from echo2.launch.child import main as child_main

            return child_main(argv)
        follower_loop()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from echo2.launch.exits import exit_process

    exit_process(main())  # after destroy_process_group: no finalization racing gloo's or torch's threads
