"""Pure-torch engine for the built-in tiny model: batched KV-cache sampling on CPU (or GPU).

One ``generate`` call decodes every prompt x sample at once:

1. prompts are left-padded to a common length and prefilled once (per prompt, not per
   sample);
2. the KV cache and the last logits are repeated ``n`` times;
3. each step samples one token for every sequence from softmax(logits / temperature),
   restricted to the top-p nucleus and renormalised, and records its log-prob under that
   same distribution; a sequence stops at EOS (later steps feed PAD and are discarded).

Equal-length prompts (the addition task) take a mask-free fast path. The engine does not
set torch's thread count: the process runtime owns it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from echo2.engines.base import (
    FINISH_EOS,
    FINISH_LENGTH,
    Completion,
    Engine,
    SamplingParams,
    TensorLayout,
    check_generate_args,
    check_no_adapter,
    validate_weights,
)
from echo2.messages import LoraAdapter, ModelIdentity
from echo2.models import CharTokenizer, KVCache, TinyTransformer, default_checkpoint_dir

if TYPE_CHECKING:
    from echo2.models.adapters import AdapterSlot


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.float32 -> "float32", numpy's spelling


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return its log-prob under the distribution used.

    Args:
        logits: (B, V) raw next-token logits.

    Returns:
        tokens (B,) int64 and logprobs (B,) float32. Greedy (temperature 0) gives log-prob 0.
    """
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)  # (B,)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    scaled = logits.float() / temperature  # (B, V)
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (B, V), (B, V)
        sorted_probs = sorted_logits.softmax(dim=-1)  # (B, V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))  # (B, V)
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)  # (B, V)
    logp_all = F.log_softmax(scaled, dim=-1)  # (B, V)
    tokens = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)  # (B,)
    logprobs = logp_all.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
    return tokens, logprobs


@torch.inference_mode()
def decode_batch(
    model: TinyTransformer,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    *,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sample ``n`` continuations of every prompt with a shared KV cache.

    Rows that hit EOS are dropped from the running batch (cache included) once they make up
    an eighth of it, so a few long samples do not keep the whole batch decoding.

    Returns numpy arrays for the P*n sequences (prompt-major: rows i*n .. i*n+n-1 belong
    to prompt i): tokens (P*n, S) int32 (PAD after the end), logprobs (P*n, S) float32
    (0 after the end), lengths (P*n,) int64 (tokens up to and including EOS), hit_eos
    (P*n,) bool. S <= params.max_new_tokens.
    """
    check_generate_args(prompts, n)
    device = next(model.parameters()).device
    P = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)  # (P,)
    width = int(prompt_lens.max())
    max_new = params.max_new_tokens
    if width + max_new > model.config.max_seq_len:
        raise ValueError(
            f"longest prompt ({width} tokens) + max_new_tokens ({max_new}) exceeds the "
            f"model's max_seq_len ({model.config.max_seq_len})"
        )
    ragged = bool((prompt_lens != width).any())

    ids_np = np.full((P, width), pad_id, dtype=np.int64)  # (P, W)
    for i, p in enumerate(prompts):
        ids_np[i, width - len(p) :] = p
    if ids_np.min() < 0 or ids_np.max() >= model.config.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {model.config.vocab_size})")
    ids = torch.from_numpy(ids_np).to(device)  # (P, W)
    cache = KVCache(model.config, P, width + max_new - 1, device=device)  # the last token is never fed
    key_mask = None
    if ragged:
        # Real tokens are right-aligned; each row's first real token is position 0.
        key_mask = torch.ones((P, cache.max_len), dtype=torch.bool, device=device)  # (P, S_max)
        offset = (width - prompt_lens)[:, None]  # (P, 1) padding before each prompt
        key_mask[:, :width] = torch.arange(width, device=device) >= offset
        positions = (torch.arange(width, device=device) - offset).clamp(min=0)  # (P, W)
        logits = model(ids, cache, positions=positions, key_padding_mask=key_mask[:, :width])[:, -1]  # (P, V)
    else:
        logits = model(ids, cache)[:, -1]  # (P, V)

    # Running batch: row r of the cache/logits is output sequence rows[r].
    rows = torch.arange(P * n, device=device)  # (A,)
    expand = torch.arange(P, device=device).repeat_interleave(n)  # (A,) prompt of each row
    cache = cache.select(expand)
    logits = logits[expand]  # (A, V)
    next_pos = prompt_lens[expand]  # (A,)
    if key_mask is not None:
        key_mask = key_mask[expand]  # (A, S_max)

    B = P * n
    tokens = torch.full((B, max_new), pad_id, dtype=torch.long, device=device)  # (B, S)
    logprobs = torch.zeros((B, max_new), dtype=torch.float32, device=device)  # (B, S)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=device)  # (B,)
    hit_eos = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (A,) finished rows still in the batch
    steps = 0
    for t in range(max_new):
        tok, lp = sample_next(logits, params.temperature, params.top_p, generator)  # (A,), (A,)
        live = ~done  # (A,)
        tokens[rows[live], t] = tok[live]
        logprobs[rows[live], t] = lp[live]
        hit = (tok == eos_id) & live  # (A,)
        lengths[rows[hit]] = t + 1
        hit_eos[rows[hit]] = True
        done |= hit
        steps = t + 1
        n_done = int(done.sum())
        if t == max_new - 1 or n_done == len(rows):
            break
        if n_done * 8 >= len(rows):  # drop finished rows from the running batch
            keep = (~done).nonzero().squeeze(1)  # (A',)
            cache = cache.select(keep)
            rows, tok, next_pos, done = rows[keep], tok[keep], next_pos[keep], done[keep]
            if key_mask is not None:
                key_mask = key_mask[keep]
        step_ids = tok.masked_fill(done, pad_id)[:, None]  # (A, 1)
        if key_mask is not None:
            logits = model(
                step_ids,
                cache,
                positions=next_pos[:, None],
                key_padding_mask=key_mask[:, : cache.length + 1],
            )[:, -1]  # (A, V)
        else:
            logits = model(step_ids, cache)[:, -1]  # (A, V)
        next_pos += 1
    return (
        tokens[:, :steps].to(torch.int32).cpu().numpy(),
        logprobs[:, :steps].cpu().numpy(),
        lengths.cpu().numpy(),
        hit_eos.cpu().numpy(),
    )


class TorchEngine(Engine):
    """Engine over a :class:`TinyTransformer`.

    Args:
        model_dir: checkpoint directory (``model.safetensors`` + ``config.json``); default
            the shipped warm-started tiny-addition checkpoint.
        model: use this model instance as-is instead (not copied: ``install_weights``
            writes into it). Mutually exclusive with ``model_dir``.
        seed: seed of the engine's random stream (used when ``SamplingParams.seed`` is None).
        device: torch device to load ``model_dir`` onto (a given ``model`` stays where it is).
        version: policy version of the initial weights.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        model: TinyTransformer | None = None,
        seed: int = 0,
        device: str = "cpu",
        version: int = 0,
    ) -> None:
        if model is not None and model_dir is not None:
            raise ValueError("pass either model_dir or model, not both")
        if model is None:
            model = TinyTransformer.load(model_dir or default_checkpoint_dir(), device=device)
        self._model = model.eval()
        self._device = next(model.parameters()).device
        self.tokenizer = CharTokenizer()
        if model.config.vocab_size != self.tokenizer.vocab_size:
            raise ValueError(
                f"model vocab_size {model.config.vocab_size} != tokenizer vocab_size {self.tokenizer.vocab_size}"
            )
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._version = version
        self._lock = threading.Lock()  # serialises generate and install_weights
        self._adapter: AdapterSlot | None = None  # a LoRA run's (install_adapter)
        self._layout: TensorLayout = {
            name: (tuple(t.shape), _dtype_name(t.dtype)) for name, t in model.state_dict().items()
        }
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> TinyTransformer:
        return self._model

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
    ) -> list[list[Completion]]:
        """See :meth:`Engine.generate`."""
        self._check_open()
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        with self._lock:
            tokens, logprobs, lengths, hit_eos = decode_batch(
                self._model,
                prompts,
                n,
                params,
                eos_id=self.tokenizer.eos_id,
                pad_id=self.tokenizer.pad_id,
                generator=generator,
            )
        out: list[list[Completion]] = []
        for i in range(len(prompts)):
            row: list[Completion] = []
            for j in range(i * n, (i + 1) * n):
                length = int(lengths[j])
                ids = tokens[j, :length].copy()  # (T,) int32
                row.append(
                    Completion(
                        token_ids=ids,
                        logprobs=logprobs[j, :length].copy(),  # (T,) float32
                        finish_reason=FINISH_EOS if hit_eos[j] else FINISH_LENGTH,
                        text=self.tokenizer.decode(ids),
                    )
                )
            out.append(row)
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int = 8) -> list[Completion]:
        """One temperature-0 completion per prompt (evaluation)."""
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        return [row[0] for row in self.generate(prompts, 1, params)]

    def install_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self._check_open()
        check_no_adapter(self._adapter)
        validate_weights(tensors, self._layout)  # raises before anything changes
        sources = {
            # from_numpy shares memory; a read-only buffer (e.g. a received frame) is copied
            # first because torch cannot wrap it without a warning.
            name: torch.from_numpy(arr if arr.flags.writeable else np.array(arr, copy=True))
            for name, arr in tensors.items()
        }
        with self._lock, torch.no_grad():
            for name, target in self._model.state_dict().items():
                target.copy_(sources[name])
            self._version = version

    def install_adapter(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter, version: int) -> None:
        self._check_open()
        with self._lock:
            if self._adapter is None:
                from echo2.models.adapters import AdapterSlot

                self._adapter = AdapterSlot(self._model)
            self._adapter.install(tensors, adapter)  # raises before anything changes
            self._version = version

    def model_identity(self) -> ModelIdentity:
        from echo2.models.identity import TINY_MODEL_ID, identity_of

        return identity_of(TINY_MODEL_ID, dataclasses.asdict(self._model.config), self.tokenizer)

    def state_layout(self) -> TensorLayout:
        return dict(self._layout)

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TorchEngine is closed")
