"""Per-token log-probs of sampled responses under the learner's current policy.

The learner re-scores (prompt, response) pairs the samplers produced: it needs
log pi_theta(response_t | prompt, response_<t) with gradients, aligned token-for-token
with the sampler's logprobs, to form importance ratios.

Layout: each row is ``prompt + response`` left-aligned and right-padded, so every row
starts at position 0 (as in the sampler, which gives each row's first real token position
0) and causal attention never sees the padding. One forward pass scores the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def sequence_logprobs(
    model: nn.Module,
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each response token given its prompt and the preceding response tokens.

    Args:
        model: maps (B, T) int64 ids to (B, T, V) logits.
        prompts: B 1-D int arrays, each non-empty.
        responses: B 1-D int arrays (may be empty); padding is by length, not by value, so
            a response may contain ``pad_id`` as a real token.
        pad_id: id written into padding positions.

    Returns:
        logp: (B, T_resp) float32 tensor with grad, 0 at padding; T_resp = longest response.
        mask: (B, T_resp) float32, 1 for real response tokens, 0 for padding.
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need equally many prompts and responses, got {len(prompts)} and {len(responses)}")
    device = next(model.parameters()).device
    B = len(prompts)
    p_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)  # (B,)
    r_lens = torch.tensor([len(r) for r in responses], dtype=torch.long)  # (B,)
    if bool((p_lens == 0).any()):
        raise ValueError("every prompt needs at least one token")
    T = int((p_lens + r_lens).max())
    T_resp = max(int(r_lens.max()), 1)

    ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        row = np.concatenate([np.asarray(p), np.asarray(r)]).astype(np.int64)  # (P_b + R_b,)
        ids[b, : len(row)] = torch.from_numpy(row)
    ids = ids.to(device)  # (B, T)

    logits = model(ids)  # (B, T, V)
    # Response token j of row b sits at position p_len[b] + j and is predicted by the logits
    # at position p_len[b] + j - 1.
    j = torch.arange(T_resp)  # (T_resp,)
    mask = j[None, :] < r_lens[:, None]  # (B, T_resp) bool
    pred_pos = (p_lens[:, None] - 1 + j[None, :]).clamp(max=T - 1)  # (B, T_resp)
    target_pos = (pred_pos + 1).clamp(max=T - 1)  # (B, T_resp)
    pred_pos, target_pos, mask = pred_pos.to(device), target_pos.to(device), mask.to(device)

    V = logits.shape[-1]
    pred_logits = logits.gather(1, pred_pos[:, :, None].expand(B, T_resp, V))  # (B, T_resp, V)
    targets = ids.gather(1, target_pos)  # (B, T_resp)
    token_logits = pred_logits.gather(-1, targets[:, :, None]).squeeze(-1)  # (B, T_resp)
    logp = token_logits.float() - torch.logsumexp(pred_logits.float(), dim=-1)  # (B, T_resp)
    logp = logp.masked_fill(~mask, 0.0)  # (B, T_resp)
    return logp, mask.to(torch.float32)
