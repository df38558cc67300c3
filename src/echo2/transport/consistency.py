"""Well-formed but inconsistent messages: the counts and lengths a message states about itself.

The typed decoder checks each field's type; it cannot check that fields agree with each
other (a manifest whose chunk digests do not cover its ``total_bytes``, a scored group with
more rewards than completions, a repair request for a million chunks). ``check`` does, for
every message type with arrays or counts, once, as each endpoint decodes what it
receives, so that no actor sees such a message and the endpoint counts it by reason
(``EndpointStats.inconsistent``). A bundle is dropped whole if one of its messages fails.

What is not here, and where it is: a ``RolloutGroup``'s offsets, lengths and vocabulary are
checked against its lease by admission (``echo2.actors.admission``), which needs the lease's
group size and the job's tokenizer and attributes a rejection to the lease's holder (a
decode error could not). A group inside a ``ScoredGroup`` or a ``Batch`` has passed
admission upstream; ``check`` still holds it to the shape that needs neither (offsets
monotone from 0 to the token count, one log-probability per token, one text per sample).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from echo2.errors import DecodeError
from echo2.messages import (
    Batch,
    BatchRequest,
    ChunkRequest,
    Message,
    RolloutGroup,
    ScoredGroup,
    WeightChunk,
    WeightManifest,
)

MAX_CHUNK_INDICES = 1 << 16
"""Most chunk indices one ``ChunkRequest`` may name (a 64 GiB snapshot in 1 MiB chunks)."""
MAX_BATCH_GROUPS = 1 << 16
"""Most groups one ``Batch`` or ``BatchRequest`` may carry or ask for."""


class InconsistentMessage(DecodeError):
    """A message whose fields contradict each other; ``reason`` names the check."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"inconsistent {reason}: {detail}")
        self.reason = reason


def _group(group: RolloutGroup) -> str | None:
    offsets = group.offsets
    if offsets.ndim != 1 or offsets.size < 2 or offsets.dtype.kind not in "iu":
        return "offsets must be a 1-d integer array of G + 1 entries"
    if group.token_ids.ndim != 1 or group.logprobs.ndim != 1:
        return "token_ids and logprobs must be 1-d"
    bounds = offsets.astype(np.int64)
    if bounds[0] != 0 or bool((np.diff(bounds) < 0).any()) or bounds[-1] != group.token_ids.size:
        return "offsets are not monotone from 0 to len(token_ids)"
    if group.logprobs.size != group.token_ids.size:
        return "not one log-probability per token"
    size = offsets.size - 1
    if len(group.texts) != size or len(group.finish_reasons) != size:
        return "texts or finish_reasons do not hold one entry per sample"
    return None


def _scored_group(message: ScoredGroup) -> tuple[str, str] | None:
    problem = _group(message.group)
    if problem is not None:
        return "rollout_group", problem
    size = message.group.offsets.size - 1
    if message.rewards.shape != (size,) or message.keep.shape != (size,):
        return "scored_group", f"rewards {message.rewards.shape} and keep {message.keep.shape} for {size} samples"
    return None


def _batch(message: Batch) -> tuple[str, str] | None:
    if len(message.groups) > MAX_BATCH_GROUPS:
        return "batch", f"{len(message.groups)} groups (at most {MAX_BATCH_GROUPS})"
    for group in message.groups:
        problem = _scored_group(group)
        if problem is not None:
            return problem
    return None


def _batch_request(message: BatchRequest) -> tuple[str, str] | None:
    if not 1 <= message.num_groups <= MAX_BATCH_GROUPS:
        return "batch_request", f"num_groups {message.num_groups} (1..{MAX_BATCH_GROUPS})"
    return None


def _chunk_request(message: ChunkRequest) -> tuple[str, str] | None:
    if len(message.indices) > MAX_CHUNK_INDICES:
        return "chunk_request", f"{len(message.indices)} indices (at most {MAX_CHUNK_INDICES})"
    if any(i < 0 for i in message.indices):
        return "chunk_request", "a negative chunk index"
    return None


def _manifest(message: WeightManifest) -> tuple[str, str] | None:
    if message.chunk_bytes < 1 or message.total_bytes < 0:
        return "manifest", f"chunk_bytes {message.chunk_bytes}, total_bytes {message.total_bytes}"
    chunks = -(-message.total_bytes // message.chunk_bytes)
    if len(message.chunk_digests) != chunks:
        return "manifest", f"{len(message.chunk_digests)} chunk digests for {chunks} chunks"
    for spec in message.tensors:
        if spec.offset < 0 or spec.nbytes < 0 or spec.offset + spec.nbytes > message.total_bytes:
            return "manifest", f"tensor {spec.name!r} lies outside the snapshot's {message.total_bytes} bytes"
    return None


def _chunk(message: WeightChunk) -> tuple[str, str] | None:
    if message.index < 0 or message.data.ndim != 1:
        return "chunk", f"index {message.index}, data of shape {message.data.shape}"
    return None


_CHECKS: dict[type[Message], Callable[[Any], tuple[str, str] | None]] = {
    ScoredGroup: _scored_group,
    Batch: _batch,
    BatchRequest: _batch_request,
    ChunkRequest: _chunk_request,
    WeightManifest: _manifest,
    WeightChunk: _chunk,
}


def check(message: Message) -> None:
    """Raise ``InconsistentMessage`` if ``message`` contradicts itself (a dict lookup for
    the types without checks)."""
    checker = _CHECKS.get(type(message))
    if checker is not None:
        problem = checker(message)
        if problem is not None:
            raise InconsistentMessage(*problem)
