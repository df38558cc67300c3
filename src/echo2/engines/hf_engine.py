"""Pure-torch engine for Hugging Face causal LMs (CPU or CUDA), registered as ``"hf"``.

Same contract and sampling rule as :mod:`echo2.engines.torch_engine` (it reuses its
``sample_next``): one ``generate`` call decodes every prompt x sample together:

1. prompts are left-padded, with an attention mask and explicit position ids so every row's
   first real token is position 0, and prefilled once per prompt;
2. the HF KV cache (``past_key_values``) and the last logits are repeated ``n`` times;
3. each step samples from softmax(logits / T) restricted to the top-p nucleus, records the
   log-prob under that same distribution, and stops a row at any EOS id; finished rows are
   dropped from the running batch (cache included) once they are a quarter of it.

Weights arrive in wire form (bf16 as raw uint16, see :mod:`echo2.models.hf`); any float
wire dtype is accepted and cast to the engine's dtype, so an fp32 learner can feed a bf16
sampler. ``install_weights`` converts everything before it copies, under the generate lock.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from echo2.engines.base import (
    FINISH_EOS,
    FINISH_LENGTH,
    Completion,
    Engine,
    SamplingParams,
    TensorLayout,
    check_generate_args,
    check_no_adapter,
)
from echo2.engines.torch_engine import sample_next
from echo2.job import PromptFormat
from echo2.messages import LoraAdapter, ModelIdentity
from echo2.models.policy import Policy, load_policy

if TYPE_CHECKING:
    from echo2.models.adapters import AdapterSlot

_WIRE_FLOATS = {"float32", "float16", "uint16"}


def _cache_kwarg(model: Any) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older): the KV-cache argument."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_decode_batch(
    model: Any,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    *,
    eos_ids: list[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Like ``torch_engine.decode_batch`` for an HF model; same outputs (prompt-major rows).

    ``should_stop`` is polled once per decode step; when it returns True decoding ends early
    (rows end as "length"): a closing engine does not keep its process alive for a long
    generation whose result nobody will read.
    """
    check_generate_args(prompts, n)
    device = next(model.parameters()).device
    P = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)  # (P,)
    width = int(lens.max())
    max_new = params.max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and width + max_new > limit:
        raise ValueError(f"longest prompt ({width}) + max_new_tokens ({max_new}) exceeds {limit} positions")
    ids_np = np.full((P, width), pad_id, dtype=np.int64)  # (P, W)
    for i, p in enumerate(prompts):
        ids_np[i, width - len(p) :] = p
    vocab = model.get_input_embeddings().num_embeddings
    if ids_np.min() < 0 or ids_np.max() >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    ids = torch.from_numpy(ids_np).to(device)  # (P, W)
    attn = (torch.arange(width, device=device)[None, :] >= (width - lens)[:, None]).long()  # (P, W)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (P, W)
    cache_arg = _cache_kwarg(model)
    import inspect

    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, **last_only)
    cache = getattr(out, cache_arg)
    logits = out.logits[:, -1]  # (P, V)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)  # (A, V)
        attn = attn.repeat_interleave(n, dim=0)  # (A, W)
    next_pos = lens.repeat_interleave(n)  # (A,)
    eos = torch.tensor(eos_ids, device=device)

    B = P * n
    rows = torch.arange(B, device=device)  # (A,) output row of each running row
    tokens = torch.full((B, max_new), pad_id, dtype=torch.long, device=device)  # (B, S)
    logprobs = torch.zeros((B, max_new), dtype=torch.float32, device=device)  # (B, S)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=device)  # (B,)
    hit_eos = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (A,)
    steps = 0
    for t in range(max_new):
        tok, lp = sample_next(logits, params.temperature, params.top_p, generator)  # (A,), (A,)
        live = ~done
        tokens[rows[live], t] = tok[live]
        logprobs[rows[live], t] = lp[live]
        hit = torch.isin(tok, eos) & live  # (A,)
        lengths[rows[hit]] = t + 1
        hit_eos[rows[hit]] = True
        done |= hit
        steps = t + 1
        n_done = int(done.sum())
        if t == max_new - 1 or n_done == len(rows) or (should_stop is not None and should_stop()):
            break
        if n_done * 4 >= len(rows) and hasattr(cache, "batch_select_indices"):
            keep = (~done).nonzero().squeeze(1)  # (A',)
            cache.batch_select_indices(keep)
            rows, tok, next_pos, done, attn = rows[keep], tok[keep], next_pos[keep], done[keep], attn[keep]
        step_ids = tok.masked_fill(done, pad_id)[:, None]  # (A, 1)
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)  # (A, W + t + 1)
        out = model(
            input_ids=step_ids,
            attention_mask=attn,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{cache_arg: cache},
        )
        cache = getattr(out, cache_arg)
        logits = out.logits[:, -1]  # (A, V)
        next_pos = next_pos + 1
    return (
        tokens[:, :steps].to(torch.int32).cpu().numpy(),
        logprobs[:, :steps].cpu().numpy(),
        lengths.clamp(max=steps).cpu().numpy(),
        hit_eos.cpu().numpy(),
    )


class HFTorchEngine(Engine):
    """Engine over a Hugging Face causal LM.

    Args:
        model_dir: model spec for :func:`echo2.models.policy.load_policy` (an HF directory
            or ``"smollm2"``).
        policy: use this loaded policy as-is (not copied: ``install_weights`` writes into
            it; the learner's evaluation engine). Mutually exclusive with ``model_dir``.
        seed, device, version: as for ``TorchEngine``.
        dtype: "float32" | "bfloat16" | "float16" (for ``model_dir``).
        prompt_format: how prompts become ids (``JobConfig.prompt_format``; the Sampler
            passes the job's, which the trusted side renders by too).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        policy: Policy | None = None,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        version: int = 0,
        prompt_format: PromptFormat | None = None,
    ) -> None:
        if (policy is None) == (model_dir is None):
            raise ValueError("pass exactly one of model_dir or policy")
        if policy is None:
            policy = load_policy(str(model_dir), dtype=dtype, device=device, prompt_format=prompt_format)
        if policy.kind != "hf":
            raise ValueError(f"HFTorchEngine needs a Hugging Face model, got a {policy.kind} model")
        self.policy = policy
        self._hf = policy.core
        self.tokenizer = policy.tokenizer
        self._device = next(self._hf.parameters()).device
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._version = version
        self._lock = threading.Lock()
        self._layout: TensorLayout = policy.wire_layout()
        self._adapter: AdapterSlot | None = None  # a LoRA run's (install_adapter)
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
    ) -> list[list[Completion]]:
        self._check_open()
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        with self._lock:
            was_training = self._hf.training
            self._hf.eval()
            try:
                tokens, logprobs, lengths, hit_eos = hf_decode_batch(
                    self._hf,
                    prompts,
                    n,
                    params,
                    eos_ids=self.tokenizer.eos_ids,
                    pad_id=self.tokenizer.pad_id,
                    generator=generator,
                    should_stop=lambda: self._closed,
                )
            finally:
                self._hf.train(was_training)
        out: list[list[Completion]] = []
        for i in range(len(prompts)):
            row = []
            for j in range(i * n, (i + 1) * n):
                length = int(lengths[j])
                ids = tokens[j, :length].copy()
                row.append(
                    Completion(
                        token_ids=ids,
                        logprobs=logprobs[j, :length].copy(),
                        finish_reason=FINISH_EOS if hit_eos[j] else FINISH_LENGTH,
                        text=self.tokenizer.decode(ids),
                    )
                )
            out.append(row)
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int = 8) -> list[Completion]:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        return [row[0] for row in self.generate(prompts, 1, params)]

    def install_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self._check_open()
        check_no_adapter(self._adapter)
        validate_wire(tensors, self._layout)
        with self._lock:
            self.policy.install_wire(tensors)
            self._version = version

    def install_adapter(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter, version: int) -> None:
        self._check_open()
        with self._lock:
            if self._adapter is None:
                from echo2.models.adapters import AdapterSlot

                self._adapter = AdapterSlot(self._hf)
            self._adapter.install(tensors, adapter)  # raises before anything changes
            self._version = version

    def model_identity(self) -> ModelIdentity:
        from echo2.models.identity import identity_of, model_label, read_config

        if self.policy.directory is None:
            raise ValueError("this engine's policy has no directory to read its configuration from")
        return identity_of(model_label(self.policy.spec), read_config(self.policy.directory), self.tokenizer)

    def state_layout(self) -> TensorLayout:
        return dict(self._layout)

    def close(self) -> None:
        """Idempotent; a ``generate`` running in another thread stops at its next step."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HFTorchEngine is closed")


def validate_wire(tensors: Mapping[str, np.ndarray], layout: TensorLayout) -> None:
    """Names and shapes exactly as ``layout``; dtypes any float wire form (cast on install)."""
    missing = sorted(set(layout) - set(tensors))
    unexpected = sorted(set(tensors) - set(layout))
    if missing or unexpected:
        raise ValueError(f"weight names do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, (shape, _dtype) in layout.items():
        array = tensors[name]
        if tuple(array.shape) != shape or str(array.dtype) not in _WIRE_FLOATS:
            raise ValueError(
                f"weight {name!r} is {array.dtype}{list(array.shape)}, the model expects "
                f"one of {sorted(_WIRE_FLOATS)} {list(shape)}"
            )
