"""Sequence packing for the learner step: a batch's sequences in few dense micro-batches.

The padded layout (``echo2.rl.logprobs``) gives every sequence a row as long as the batch's
longest; on a mixed-length batch most of that tensor is padding, and the model computes on
it. Packing places several sequences in one row instead, and splits the rows into
micro-batches of at most ``max_tokens`` tensor slots each (rows x width: what compute and
activation memory scale with), whose gradients the step accumulates.

Layout of one micro-batch (R rows of width W, padding at the ends of rows):

  ids         (R, W)  prompt_b + response_b of each sequence, one after another; pad_id after
  positions   (R, W)  0, 1, ..., len_b - 1 for each sequence (restarting at 0); 0 on padding
  segment_ids (R, W)  1, 2, ... for the sequences of a row, in order; 0 on padding

Attention stays inside a sequence: the built-in model masks it block-diagonally from
``segment_ids``; Hugging Face models get ``position_ids`` only, from which transformers
derives the same block-diagonal causal mask (sdpa, eager) or per-sequence varlen kernels
(flash attention, see ``echo2.models.hf.LogitsLM``). Every sequence starts at position 0,
so the two descriptions of the boundaries agree.

Planning (pure, deterministic):
- rows: best-fit decreasing (longest sequence first, into the fullest row it still fits)
  with row capacity ``min(max_tokens, longest sequence)``. Rows no longer than the longest
  sequence keep the dense attention of sdpa/eager at the padded path's cost per row; longer
  rows would only help varlen kernels.
- micro-batches: rows by used width, widest first, taken while rows x width of the first
  row stays within ``max_tokens``.
- A sequence longer than ``max_tokens`` gets a row and a micro-batch of its own (over the
  budget, but no larger than the padded path would have made it) rather than failing the
  step: the budget bounds every other micro-batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn


def plan_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row: best-fit decreasing into rows of ``capacity`` tokens.

    A sequence longer than ``capacity`` is a row of its own. Within a row, sequences keep the
    order they were placed in; rows come out in the order they were opened.
    """
    if capacity < 1:
        raise ValueError(f"row capacity must be >= 1 token, got {capacity}")
    rows: list[list[int]] = []
    # (room left, row index) of the rows that can take more, sorted: the first entry with
    # room >= n is the fullest row that fits n (best fit).
    open_rows: list[tuple[int, int]] = []
    for b in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[b]
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
            rows[row].append(b)
            room -= n
        else:
            rows.append([b])
            row, room = len(rows) - 1, capacity - n
        if room > 0:
            bisect.insort(open_rows, (room, row))
    return rows


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Rows of sequence indices per micro-batch; each micro-batch's rows x width <= ``max_tokens``
    except a lone sequence longer than ``max_tokens`` (see the module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1 to pack, got {max_tokens}")
    if not lengths:
        return []
    rows = plan_rows(lengths, min(max_tokens, max(lengths)))
    widths = [sum(lengths[b] for b in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: (-widths[r], r))
    batches: list[list[list[int]]] = []
    width = 0
    for r in order:
        if batches and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(rows[r])
        else:
            batches.append([rows[r]])
            width = widths[r]  # the widest row of the micro-batch: its tensor's width
    return batches


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch in the packed layout (see the module docstring), ready for the model."""

    sequences: tuple[int, ...]
    """Batch indices of its sequences, in the order of the log-prob rows ``packed_logprobs`` returns."""
    ids: Tensor  # (R, W) int64
    positions: Tensor  # (R, W) int64
    segment_ids: Tensor  # (R, W) int64
    predictors: Tensor  # (N,) int64: flat index into R * W of the logits predicting each response token
    targets: Tensor  # (N,) int64: that response token
    mask: Tensor  # (n, T) bool: response token j of sequence i exists; N = mask.sum()


def pack_sequences(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], rows: Sequence[Sequence[int]], *, pad_id: int
) -> PackedBatch:
    """The micro-batch holding ``rows`` (sequence indices per row) of ``prompts`` + ``responses``.

    Response tokens are gathered sequence by sequence, token by token, which is the row-major
    order of ``mask``: ``packed_logprobs`` scatters them back with ``masked_scatter``.
    """
    sequences = tuple(b for row in rows for b in row)
    if any(len(prompts[b]) == 0 for b in sequences):
        raise ValueError("every prompt needs at least one token")
    width = max(sum(len(prompts[b]) + len(responses[b]) for b in row) for row in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)  # (R, W)
    positions = np.zeros((len(rows), width), dtype=np.int64)  # (R, W)
    segments = np.zeros((len(rows), width), dtype=np.int64)  # (R, W)
    by_sequence: dict[int, np.ndarray] = {}
    for r, row in enumerate(rows):
        start = 0
        for s, b in enumerate(row, start=1):
            p, resp = len(prompts[b]), len(responses[b])
            end = start + p + resp
            ids[r, start : start + p] = prompts[b]
            ids[r, start + p : end] = responses[b]
            positions[r, start:end] = np.arange(p + resp)
            segments[r, start:end] = s
            # response token j sits at start + p + j and is predicted by the logits before it
            by_sequence[b] = r * width + start + p - 1 + np.arange(resp)
            start = end
    predictors = [by_sequence[b] for b in sequences]
    r_lens = torch.tensor([len(responses[b]) for b in sequences], dtype=torch.long)  # (n,)
    mask = torch.arange(max(int(r_lens.max()), 1))[None, :] < r_lens[:, None]  # (n, T)
    targets = [np.asarray(responses[b], dtype=np.int64) for b in sequences]
    return PackedBatch(
        sequences=sequences,
        ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions),
        segment_ids=torch.from_numpy(segments),
        predictors=torch.from_numpy(np.concatenate(predictors).astype(np.int64)),
        targets=torch.from_numpy(np.concatenate(targets)),
        mask=mask,
    )


def packed_logprobs(model: nn.Module, batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """Log-probs of each response token of ``batch``'s sequences, in the padded layout.

    ``model(ids, positions=..., segment_ids=...)`` maps (R, W) ids to (R, W, V) logits with
    attention inside each segment. Returns logp (n, T) float32 with grad, 0 past each response,
    and mask (n, T) float32: what ``sequence_logprobs`` returns for the same sequences.
    """
    device = next(model.parameters()).device
    logits = model(
        batch.ids.to(device), positions=batch.positions.to(device), segment_ids=batch.segment_ids.to(device)
    )  # (R, W, V)
    flat = logits.reshape(-1, logits.shape[-1])  # (R * W, V)
    picked = flat.index_select(0, batch.predictors.to(device)).float()  # (N, V)
    token = picked.gather(1, batch.targets.to(device)[:, None]).squeeze(1)  # (N,)
    values = token - torch.logsumexp(picked, dim=-1)  # (N,)
    mask = batch.mask.to(device)  # (n, T)
    logp = torch.zeros(mask.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)  # (n, T)
    return logp, mask.to(torch.float32)
