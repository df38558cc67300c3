"""Sharded data-parallel training: a ``TorchTrainer`` whose weights, gradients and AdamW state
are split over the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

The protocol is ``echo2.training.distributed``'s (rank 0 announces, the other ranks follow;
each rank trains a share of the rows; the gradient is the whole batch's token mean): FSDP2's
reduce-scatter averages the gradients over ranks as DDP's all-reduce does, so the step and
its statistics are the same code. What a sharded state changes:

* sharding: every decoder layer (the tiny model's blocks; an HF model's
  ``_no_split_modules`` classes) is one FSDP unit, the rest of the model the root unit.
  Rank 0's weights are broadcast first, so every rank shards the same model.
* mixed precision (``compute_dtype``): the layers compute in bf16/fp16 while the master
  weights and AdamW stay in the model's dtype and gradients are reduced in float32
  (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32, output_dtype=float32)``).
* activation checkpointing (option): each layer's activations are recomputed in backward
  (``torch.distributed._composable.checkpoint``, which keeps the parameter names).
* publication and evaluation: rank 0 keeps an unsharded copy of the weights (on the
  learner's device) that the Learner evaluates and publishes. It is refreshed, when a step
  or load made it stale, by a gather every rank joins: one tensor at a time,
  ``full_tensor()`` under ``no_grad``, copied into rank 0's copy and freed, so no rank other
  than 0 ever holds more than one full tensor, and rank 0 holds one copy (the published
  snapshot is a full copy on rank 0 anyway).
* checkpoints: ``dcp/`` in the checkpoint directory, a ``torch.distributed.checkpoint``
  (DCP) of the model and optimiser state, written by every rank into rank 0's staging
  directory (one node, or a filesystem the nodes share) and digested with the rest. DCP
  reshards on load, so a checkpoint resumes at any world size (tested: 2 -> 1 and 2 -> 2).
  Rank 0 also writes the gathered weights as a model directory (``model.safetensors``),
  so the checkpoint is usable by ``load_policy`` (warm starts, inference) as a DDP one is.

Works on CPU with gloo (torch 2.13): all-gather, reduce-scatter, DTensor gradient clipping
and DCP, in float32 and bf16. Only a GPU can check NCCL, CUDA placement of the shards, the
speed and memory of mixed precision, and HF models at a size where sharding matters
(``scripts/gpu_check.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from echo2.models.policy import Policy
from echo2.rl.step import StepStats, TrainingRows
from echo2.training.distributed import OP_GATHER, OP_SAVE, DistributedTrainer, broadcast_bytes
from echo2.training.trainer import Trainer, adamw, save_weights

ComputeDtype = Literal["float32", "bfloat16", "float16"]
SHARDED_DIR = "dcp"
"""The checkpoint directory's subdirectory holding the sharded state (DCP)."""


def layers(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units of their own: the decoder layers."""
    from echo2.models.hf import LogitsLM
    from echo2.models.tiny import TinyTransformer

    if isinstance(model, TinyTransformer):
        return list(model.blocks)
    if isinstance(model, LogitsLM):
        names = set(getattr(model.hf, "_no_split_modules", None) or ())
        return [m for m in model.hf.modules() if type(m).__name__ in names]
    raise TypeError(f"no sharding plan for a {type(model).__name__}")


def shard(model: nn.Module, *, compute_dtype: ComputeDtype, activation_checkpointing: bool) -> None:
    """Apply FSDP2 to ``model`` in place: each layer a unit, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = (
        MixedPrecisionPolicy()  # FSDP2's default: compute in the parameters' dtype
        if compute_dtype == "float32"
        else MixedPrecisionPolicy(
            param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    )
    for layer in layers(model):
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(layer)
        fully_shard(layer, mp_policy=precision)
    fully_shard(model, mp_policy=precision)


class FSDPTrainer(DistributedTrainer):
    """A ``TorchTrainer`` sharded over every rank with FSDP2; see the module docstring."""

    def __init__(
        self, inner: Trainer, *, compute_dtype: ComputeDtype = "float32", activation_checkpointing: bool = False
    ) -> None:
        self.compute_dtype: ComputeDtype = compute_dtype
        self.activation_checkpointing = activation_checkpointing
        super().__init__(inner)

    def _parallelise(self) -> None:
        model = self.inner.policy.model
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        # Rank 0's unsharded copy for evaluation and publication (see the module docstring).
        self._full: Policy | None = self.inner.policy.clone() if self.rank == 0 else None
        self._stale = False
        for module in (model, self.inner.reference):
            if module is not None:
                shard(module, compute_dtype=self.compute_dtype, activation_checkpointing=self.activation_checkpointing)
        # fully_shard replaced the parameters with sharded ones: the optimiser must hold those.
        self.inner.optimizer = adamw(model, self.inner.settings)

    @property
    def policy(self) -> Policy:
        """Rank 0: the unsharded copy (current after ``gather``); other ranks: the sharded policy."""
        return self._full if self._full is not None else self.inner.policy

    # -- rank 0 ----------------------------------------------------------------------

    def step(self, rows: TrainingRows, version: int) -> StepStats:
        self._stale = True
        return super().step(rows, version)

    def load(self, directory: Path) -> None:
        self._stale = True
        super().load(directory)

    def gather(self) -> None:
        """Bring rank 0's unsharded copy up to date (every rank joins; nothing when current)."""
        if self._stale:
            self._announce(OP_GATHER, 0)
            self._gather_here()
            self._stale = False

    def state_for_publication(self) -> dict[str, np.ndarray]:
        self.gather()
        return self.policy.wire_tensors()

    def save(self, directory: Path) -> None:
        self._announce(OP_SAVE, 0)
        broadcast_bytes(str(directory).encode())
        self._save_here(directory)
        self.gather()
        save_weights(self.policy, directory)

    # -- every rank ------------------------------------------------------------------

    def _follow(self, op: int, version: int) -> None:
        if op == OP_GATHER:
            self._gather_here()
        elif op == OP_SAVE:
            self._save_here(Path(broadcast_bytes(None).decode()))
        else:
            super()._follow(op, version)

    def _gather_here(self) -> None:
        from torch.distributed.tensor import DTensor

        targets = self._full.model.state_dict() if self._full is not None else None
        with torch.no_grad():
            for name, tensor in self.inner.policy.model.state_dict().items():
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if targets is not None:
                    targets[name].copy_(whole)
                del whole  # one full tensor at a time

    def _save_here(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimiser = get_state_dict(self.inner.policy.model, self.inner.optimizer)
        dcp.save({"model": model, "optimizer": optimiser}, checkpoint_id=directory / SHARDED_DIR)

    def load_here(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimiser = get_state_dict(self.inner.policy.model, self.inner.optimizer)
        # in place, resharded to this world size
        dcp.load({"model": model, "optimizer": optimiser}, checkpoint_id=directory / SHARDED_DIR)
        set_state_dict(
            self.inner.policy.model, self.inner.optimizer, model_state_dict=model, optim_state_dict=optimiser
        )
