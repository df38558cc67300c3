"""The built-in tiny causal transformer (~0.8M parameters).

Why it exists: echo2's default job must learn something real in minutes on two CPU cores,
with no download. A character-level GPT on reversed-answer addition does (see
docs/models-and-engines.md). The architecture is a plain nanoGPT-style decoder:

- learned token and positional embeddings, pre-LayerNorm blocks, GELU MLP;
- the output head is tied to the token embedding (``logits = h @ tok_emb.weight.T``), so
  every parameter appears in ``state_dict`` exactly once and the weight-transfer layout
  (names -> shapes) has no aliases;
- attention is ``torch.nn.functional.scaled_dot_product_attention`` over all heads at once;
- an optional preallocated :class:`KVCache` makes incremental decoding O(T) per step.

Left-padded batches (prompts of different lengths decoded together) are supported with a
``key_padding_mask`` and explicit ``positions``; right-padded batches (the learner's padded
layout) need neither, since causal attention never looks at the padding after a real token.
Packed rows (several sequences per row, ``echo2.rl.packing``) pass ``positions`` restarting
at 0 per sequence and ``segment_ids``: attention is then causal *and* inside a segment.

Checkpoints are a directory holding ``model.safetensors`` and ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a :class:`TinyTransformer`. JSON-serialisable (all fields are ints)."""

    vocab_size: int = 15  # tokens, CharTokenizer().vocab_size
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads; d_model must be divisible by it
    d_ff: int = 512  # hidden width of each MLP
    max_seq_len: int = 32  # longest prompt + response in tokens (positional table size)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TinyConfig.{f.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"TinyConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TinyConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"TinyConfig JSON must be an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TinyConfig fields: {unknown}")
        return cls(**data)


class KVCache:
    """Preallocated keys and values of every layer, for incremental decoding.

    ``k`` and ``v`` have shape (n_layers, B, n_heads, max_len, head_dim); the first
    ``length`` positions are filled. The model's forward writes the new positions and then
    advances ``length``.
    """

    def __init__(
        self,
        config: TinyConfig,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        max_len = config.max_seq_len if max_len is None else max_len
        shape = (config.n_layers, batch_size, config.n_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, S, Dh)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, S, Dh)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache holding sequences ``rows`` (1-D int64 indices into the batch, repeats
        allowed): repeat each prompt n times after a shared prefill, or drop finished rows."""
        out = KVCache.__new__(KVCache)
        out.k = self.k.index_select(1, rows)  # (L, len(rows), H, S, Dh)
        out.v = self.v.index_select(1, rows)  # (L, len(rows), H, S, Dh)
        out.length = self.length
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        cache: KVCache | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, Dh)
        if cache is not None:
            start, end = cache.length, cache.length + T
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
            k = cache.k[layer, :, :, :end]  # (B, H, end, Dh)
            v = cache.v[layer, :, :, :end]  # (B, H, end, Dh)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)  # (B, H, T, Dh)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj(y)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
        )

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        cache: KVCache | None,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), layer, cache, attn_mask, is_causal)  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class TinyTransformer(nn.Module):
    """Causal LM: ``(B, T)`` token ids -> ``(B, T, vocab_size)`` logits."""

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TinyConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            # The two layers of each block that write into the residual stream (nanoGPT's
            # way to find them: by their state-dict names, which the checkpoints fix).
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=residual_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        positions: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position of ``ids``.

        Args:
            ids: (B, T) token ids, the new positions (after ``cache.length`` cached ones).
            cache: written with the new keys/values and advanced by T when given.
            positions: (B, T) position indices; default ``cache.length + arange(T)``. Pass
                them for left-padded rows so each row's first real token is position 0.
            key_padding_mask: (B, cache.length + T) bool, True for real tokens. Padding keys
                are never attended to (except by the padding query itself, which keeps
                every softmax row non-empty).
            segment_ids: (B, T) int, packed rows only (no cache, explicit ``positions``): a
                token attends to the earlier tokens of its own segment only.

        Returns:
            (B, T, vocab_size) float logits.
        """
        B, T = ids.shape
        past = cache.length if cache is not None else 0
        total = past + T
        limit = self.config.max_seq_len if cache is None else min(cache.max_len, self.config.max_seq_len)
        if segment_ids is not None:
            if cache is not None or key_padding_mask is not None or positions is None:
                raise ValueError("segment_ids (packed rows) need positions, and neither a cache nor a key_padding_mask")
            # a packed row may be wider than the positional table; each of its sequences may not
            longest = int(positions.max()) + 1 if positions.numel() else 0
            if longest > limit:
                raise ValueError(f"sequence of {longest} tokens exceeds the limit of {limit}")
            attn_mask: torch.Tensor | None = self._segment_mask(segment_ids)
            is_causal = False
        else:
            if total > limit:
                raise ValueError(f"sequence of {total} tokens exceeds the limit of {limit}")
            attn_mask, is_causal = self._attention_mask(B, T, past, key_padding_mask, ids.device)
        if positions is None:
            positions = torch.arange(past, total, device=ids.device).expand(B, T)  # (B, T)
        x = self.tok_emb(ids) + self.pos_emb(positions)  # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, layer, cache, attn_mask, is_causal)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        if cache is not None:
            cache.length = total
        return x @ self.tok_emb.weight.T  # (B, T, V)

    @staticmethod
    def _attention_mask(
        B: int, T: int, past: int, key_padding_mask: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """The cheapest mask SDPA needs: none, ``is_causal``, or an explicit (B, 1, T, S) one."""
        if key_padding_mask is None:
            if past == 0:
                return None, T > 1  # plain causal over the new tokens
            if T == 1:
                return None, False  # one new query may see every cached key
        total = past + T
        q_pos = torch.arange(past, total, device=device)[:, None]  # (T, 1)
        k_pos = torch.arange(total, device=device)[None, :]  # (1, S)
        mask = (k_pos <= q_pos).expand(B, 1, T, total)  # (B, 1, T, S)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, total):
                raise ValueError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected {(B, total)}")
            mask = mask & key_padding_mask[:, None, None, :]  # (B, 1, T, S)
            mask = mask | (k_pos == q_pos)  # (B, 1, T, S): a padding query sees itself
        return mask, False

    @staticmethod
    def _segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
        """Block-diagonal causal mask (B, 1, T, T) of packed rows: causal within a segment."""
        T = segment_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()  # (T, T)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
        return (same & causal)[:, None]  # (B, 1, T, T)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (created)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(self.config.to_json() + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> TinyTransformer:
        """Build the model from ``config.json`` and load ``model.safetensors`` strictly."""
        path = Path(directory)
        config = TinyConfig.from_json((path / CONFIG_FILE).read_text())
        model = cls(config)
        model.load_state_dict(load_file(str(path / WEIGHTS_FILE), device=str(device)), strict=True)
        return model.to(device)
