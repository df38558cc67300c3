"""Data-parallel training: a ``TorchTrainer`` whose every step is shared over DDP ranks.

Rank 0 (the Learner's process) calls a ``DistributedTrainer`` like any trainer. Each call
that changes the model is announced to the other ranks, which run the same trainer in
``follow()`` until rank 0 closes it:

* step: rank 0 broadcasts the version and the packed rows (msgspec frames through echo2's
  codec: no pickle). Rank r trains the r-th of ``world`` contiguous, balanced slices of the
  rows (advantages were computed per group before packing, so any split is exact). DDP
  averages the gradients; ``optimiser_step`` rescales each rank's loss so that the average
  is the gradient of the token mean over the *whole* batch, and all-reduces the loss and
  the objective's statistics, so the stats rank 0 reports describe the whole batch. Clipping
  and AdamW then run identically on every rank.
* load: the checkpoint directory's path is broadcast and every rank loads it (a path every
  rank can read: one node, or a filesystem the nodes share).
* publication and save: every rank holds the full state, so rank 0 uses its own copy.

Sharded training (FSDP2, for models whose replicated state does not fit one GPU) is
``echo2.training.sharded.FSDPTrainer``: the same protocol, with the ops a sharded state
needs (save, gather) announced to every rank as well.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from echo2.models.policy import Policy
from echo2.rl.step import Share, StepStats, TrainingRows
from echo2.training.trainer import TorchTrainer, Trainer
from echo2.transport.codec import Codec

OP_STOP, OP_STEP, OP_LOAD, OP_SAVE, OP_GATHER = 0, 1, 2, 3, 4
"""What rank 0 announces; save and gather are the sharded trainer's."""
_INLINE_ALL = 1 << 62  # every array inside the one header frame that is broadcast


def device() -> torch.device:
    """The device collectives run on: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (the length first, then a uint8 tensor)."""
    where = device()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=where)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8).to(where)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
    if int(size.item()):
        dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes()


def _sum_over_ranks(totals: Tensor) -> Tensor:
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals


class DistributedTrainer:
    """A ``TorchTrainer`` shared over every rank of the process group; see the module docstring."""

    def __init__(self, inner: Trainer) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a DistributedTrainer runs under torchrun: python -m echo2.launch.torchrun ...")
        if not isinstance(inner, TorchTrainer):
            raise TypeError(f"data-parallel training wraps a TorchTrainer, not a {type(inner).__name__}")
        self.inner = inner
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._codec = Codec(TrainingRows, inline_limit=_INLINE_ALL)
        self._closed = False
        self._parallelise()

    def _parallelise(self) -> None:
        """Wrap the inner trainer's model for data parallelism (here: DDP)."""
        from torch.nn.parallel import DistributedDataParallel

        where = next(self.inner.policy.model.parameters()).device
        # DDP's constructor broadcasts rank 0's weights: every rank starts from the same model.
        self.inner.model = DistributedDataParallel(
            self.inner.policy.model, device_ids=[where.index] if where.type == "cuda" else None
        )

    @property
    def policy(self) -> Policy:
        return self.inner.policy

    # -- rank 0 ----------------------------------------------------------------------

    def step(self, rows: TrainingRows, version: int) -> StepStats:
        self._announce(OP_STEP, version)
        broadcast_bytes(bytes(self._codec.encode(rows)[0]))  # type: ignore[arg-type]  # a Struct, not a Message
        return self._train_share(rows, version)

    def load(self, directory: Path) -> None:
        self._announce(OP_LOAD, 0)
        broadcast_bytes(str(directory).encode())
        self.load_here(directory)

    def save(self, directory: Path) -> None:
        self.inner.save(directory)

    def state_for_publication(self) -> dict[str, np.ndarray]:
        return self.inner.state_for_publication()

    def close(self) -> None:
        if self.rank == 0 and not self._closed:
            self._closed = True
            self._announce(OP_STOP, 0)

    def _announce(self, op: int, version: int) -> None:
        dist.broadcast(torch.tensor([op, version], dtype=torch.int64, device=device()), src=0)

    # -- every rank ------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run every op rank 0 announces (steps, loads), until it closes."""
        while True:
            command = torch.zeros(2, dtype=torch.int64, device=device())
            dist.broadcast(command, src=0)
            op, version = (int(x) for x in command.tolist())
            if op == OP_STOP:
                return
            self._follow(op, version)

    def _follow(self, op: int, version: int) -> None:
        if op == OP_LOAD:
            self.load_here(Path(broadcast_bytes(None).decode()))
        elif op == OP_STEP:
            rows = cast(TrainingRows, self._codec.decode([broadcast_bytes(None)]))
            self._train_share(rows, version)
        else:
            raise RuntimeError(f"rank {self.rank}: rank 0 announced an unknown op {op}")

    def load_here(self, directory: Path) -> None:
        """This rank's part of a load (every rank runs it)."""
        self.inner.load(directory)

    def _train_share(self, rows: TrainingRows, version: int) -> StepStats:
        if len(rows) < self.world:
            raise ValueError(f"a batch of {len(rows)} rows cannot be shared by {self.world} ranks")
        mine = np.array_split(np.arange(len(rows)), self.world)[self.rank]
        share = Share(ranks=self.world, sum_over_ranks=_sum_over_ranks, samplers=tuple(dict.fromkeys(rows.sampler_ids)))
        return self.inner.step(rows.take(mine.tolist()), version, share=share)
