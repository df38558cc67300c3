"""The Learner across GPUs: data-parallel GRPO under ``torchrun`` (DDP; NCCL on GPUs, gloo on CPU).

Layout: ``torchrun --nproc-per-node N -m echo2.learner_dist <echo2.launch.child arguments>``.

- Rank 0 runs the learner's echo2 process as usual (``echo2.launch.child``) with the actor kind
  ``"echo2.learner_dist:DistributedLearner"``: it alone talks to the Buffer and the
  WeightPublisher, evaluates, logs and checkpoints.
- Ranks 1..N-1 run :func:`follower_loop`: they receive the job and learner config from
  rank 0, build the same policy, and then execute every step rank 0 announces.
- A step: rank 0 broadcasts the batch (the ``ScoredGroup`` list, msgspec-encoded with echo2's
  codec: no pickle) and the learner version; every rank trains on its share of the groups
  (``groups[rank::N]``, whole groups, so group advantages are exact); DDP averages the
  gradients; clipping and AdamW then run identically on every rank.
- Publication: with DDP every rank holds the full state, so rank 0 publishes its own copy
  and no rank waits for it (the gather costs nothing). Sharded training (FSDP2
  ``fully_shard``, for models that do not fit one GPU) would gather with
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` on every rank at publication steps only; not implemented here.

Deviation from the single-process Learner: the loss is the token mean *per rank*, averaged
over ranks (equal to the global token mean when ranks hold equally many tokens).
``groups_per_step`` must be a multiple of the world size. Metrics in rank 0's records
(``loss``, ``tokens``, ``grad_norm``) are of rank 0's share; counters cover all groups.

Tested: 2 CPU ranks over gloo (tests/test_learner_dist.py). Untested without GPUs: NCCL,
``device = "cuda"`` placement (each rank uses ``cuda:LOCAL_RANK``), multi-node.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from echo2.actors.learner import Learner, LearnerConfig
from echo2.job import JobConfig
from echo2.messages import ScoredGroup
from echo2.transport.codec import Codec

OP_STOP, OP_STEP = 0, 1
_INLINE_ALL = 1 << 62


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (length first, then a uint8 tensor)."""
    device = _device()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes()


def encode_groups(groups: list[ScoredGroup]) -> bytes:
    codec = Codec(ScoredGroup, inline_limit=_INLINE_ALL)
    frames = [bytes(codec.encode(g)[0]) for g in groups]
    return msgspec.msgpack.encode(frames)


def decode_groups(data: bytes) -> list[ScoredGroup]:
    codec = Codec(ScoredGroup, inline_limit=_INLINE_ALL)
    return [codec.decode([frame]) for frame in msgspec.msgpack.decode(data, type=list[bytes])]


def _share(groups: list[ScoredGroup], rank: int, world: int) -> list[ScoredGroup]:
    if len(groups) % world:
        raise ValueError(f"{len(groups)} groups cannot be split over {world} ranks (groups_per_step % world != 0)")
    return groups[rank::world]


def _wrap_ddp(learner: Learner) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = next(learner.policy.model.parameters()).device
    learner.model = DDP(learner.policy.model, device_ids=[device.index] if device.type == "cuda" else None)


class DistributedLearner(Learner):
    """Rank 0's Learner actor; see the module docstring."""

    def _build(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedLearner runs under torchrun: python -m echo2.learner_dist ...")
        if self.config.device == "cuda":
            self.config = msgspec.structs.replace(self.config, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
        # the followers build from the same job and config
        _broadcast_bytes(msgspec.json.encode({"name": self.name, "job": self.job, "config": self.config}))
        super()._build()
        _wrap_ddp(self)

    def _train_step(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _share(groups, rank, world)
        command = torch.tensor([OP_STEP, self.version], dtype=torch.int64, device=_device())
        dist.broadcast(command, src=0)
        _broadcast_bytes(encode_groups(groups))
        record = super()._train_step(mine)
        others = [g for g in groups if not any(g is m for m in mine)]
        for scored in others:  # bookkeeping of the shares the other ranks trained
            g = scored.group
            if g.task_id in self.trained_tasks:
                self.trained_twice += 1
            self.trained_tasks.add(g.task_id)
            self.staleness[self.version - g.version] += 1
            self.rollouts_trained += int(np.count_nonzero(scored.keep))
        return record

    async def _finish(self, wall_s: float) -> None:
        stop_followers()
        await super()._finish(wall_s)


def stop_followers() -> None:
    if dist.is_initialized() and dist.get_rank() == 0:
        dist.broadcast(torch.tensor([OP_STOP, 0], dtype=torch.int64, device=_device()), src=0)


class _FollowerContext:
    """What a follower's Learner may touch of an actor context: records go nowhere."""

    run_dir = None
    resume = False

    def __init__(self) -> None:
        import asyncio
        import logging

        self.log = logging.getLogger("echo2.learner_dist.follower")
        self.stopping = asyncio.Event()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def ledger(self, *args: Any, **kwargs: Any) -> None:
        pass


def follower_loop() -> Learner:
    """Ranks > 0: build the policy from rank 0's config, then run every announced step;
    returns the (unconnected) Learner once rank 0 says stop."""
    spec = msgspec.json.decode(_broadcast_bytes(None))
    job = msgspec.convert(spec["job"], JobConfig)
    config = msgspec.convert(spec["config"], LearnerConfig)
    if config.device.startswith("cuda"):
        config = msgspec.structs.replace(config, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    learner = Learner(spec["name"], config, job)
    learner.ctx = _FollowerContext()  # type: ignore[assignment]
    Learner._build(learner)
    _wrap_ddp(learner)
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        command = torch.zeros(2, dtype=torch.int64, device=_device())
        dist.broadcast(command, src=0)
        op, version = (int(x) for x in command.tolist())
        if op == OP_STOP:
            return learner
        groups = decode_groups(_broadcast_bytes(None))
        learner.version = version
        Learner._train_step(learner, _share(groups, rank, world))


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
