"""LoRA adapters on a frozen base model: what the learner trains and what engines install.

With ``[actors.learner.config] lora = {rank, alpha, target_modules, dropout}`` the learner
trains low-rank adapters (PEFT's LoRA layers, injected into the policy's linear modules; the
base weights stay frozen) and publishes only them: a version is the adapter's tensors,
``<module>.lora_A.weight`` (rank x in) and ``<module>.lora_B.weight`` (out x rank) for
each adapted module, with a ``LoraAdapter`` (rank, alpha) in its manifest. Every member
already serves the base model (the job's ``model``, checked at the handshake), so the
adapter is all that travels: bytes per version = the adapter's size, plus the manifest.

Engines install an adapter by *adapter forward*, never by merging: the adapted modules
compute ``base(x) + alpha / rank * B(A(x))`` with the base weights untouched, and an install
copies only A and B into place (:class:`AdapterSlot`), so its cost does not grow with the
base model. The vLLM engine loads each version as a ``LoRARequest`` instead
(``echo2.engines.vllm_engine``), from a directory in PEFT's format (:func:`save_peft`).

PEFT (``pip install 'echo2[lora]'``) is imported only when adapters are used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from echo2.messages import LoraAdapter

if TYPE_CHECKING:
    import torch
    from torch import nn

TINY_TARGETS = ("qkv", "proj", "mlp.0", "mlp.2")
"""The built-in tiny model's linear modules (attention in and out, the MLP's two layers)."""
HF_TARGETS = "all-linear"
"""PEFT's every linear module but the output head, for Hugging Face models."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""How PEFT (and vLLM's LoRA loader) name a module of the base model in a saved adapter."""
_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[actors.learner.config] lora``: train LoRA adapters on the frozen base model
    instead of every weight, and publish only the adapters."""

    rank: Annotated[int, Meta(ge=1, le=1024)] = 16
    """r, the adapters' rank (A is r x in, B is out x r)."""
    alpha: Annotated[float, Meta(gt=0)] = 32.0
    """Scale numerator: an adapted module adds ``alpha / rank * B(A(x))``."""
    target_modules: list[str] = []
    """Names (or name suffixes) of the linear modules to adapt; empty: every linear layer
    of the blocks (the tiny model: qkv, proj, mlp.0, mlp.2; Hugging Face models: every
    linear module but the output head)."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input while training (0: none)."""

    @property
    def adapter(self) -> LoraAdapter:
        return LoraAdapter(rank=self.rank, alpha=float(self.alpha))


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError("LoRA adapters need PEFT: pip install 'echo2[lora]'") from exc
    return peft


def inject(model: nn.Module, adapter: LoraAdapter, targets: list[str] | str, dropout: float = 0.0) -> None:
    """Put LoRA layers (A random, B zero: the model's function is unchanged) on ``model``'s
    ``targets`` in place; every other parameter is frozen. ``ValueError`` naming the
    targets when none of them is a module of ``model``."""
    peft = _peft()
    config = peft.LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha, target_modules=targets, lora_dropout=dropout, bias="none"
    )
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise ValueError(f"LoRA target_modules {targets!r}: {exc}") from None


def check_targets(model_spec: str, lora: LoraConfig) -> None:
    """``ValueError`` naming the targets of ``lora`` that match no linear module of the job's
    model (PEFT's rule: a module's name, or its last dotted parts), found on a skeleton of
    the model built without weights."""
    if not lora.target_modules:
        return
    import torch

    from echo2.models.location import locate_model

    location = locate_model(model_spec)
    with torch.device("meta"):
        if location.kind == "tiny":
            from echo2.models.tiny import TinyConfig, TinyTransformer

            config_file = Path(location.directory) / "config.json"
            model: nn.Module = TinyTransformer(TinyConfig.from_json(config_file.read_text()))
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(location.directory))
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    unknown = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in linear)]
    if unknown:
        raise ValueError(f"{unknown} name no linear module of the model (it has e.g. {linear[:4]})")


def default_targets(kind: str) -> list[str] | str:
    """The modules adapted when ``target_modules`` is empty, for a policy of ``kind``."""
    return list(TINY_TARGETS) if kind == "tiny" else HF_TARGETS


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors of ``model`` by wire name (``<module>.lora_A.weight``, ...)."""
    return dict(_peft().get_peft_model_state_dict(model))


def adapted_modules(names: list[str] | Mapping[str, Any]) -> list[str]:
    """The modules an adapter's tensor names adapt, in order; ``ValueError`` unless every
    name is ``<module>.lora_A.weight`` or ``<module>.lora_B.weight`` and each module has both."""
    parts: dict[str, set[str]] = {}
    for name in names:
        found = _NAME.match(name)
        if found is None:
            raise ValueError(f"{name!r} is not a LoRA adapter tensor (<module>.lora_A.weight or .lora_B.weight)")
        parts.setdefault(found["module"], set()).add(found["part"])
    unpaired = sorted(m for m, p in parts.items() if p != {"A", "B"})
    if unpaired:
        raise ValueError(f"LoRA modules without both A and B: {unpaired}")
    return list(parts)


class AdapterSlot:
    """An engine's LoRA adapter: injected into ``model`` at the first install (the layout
    of the adapter then fixed), loaded in place by each install after. Not thread-safe:
    the engine calls it under its generate lock."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapter: LoraAdapter | None = None
        self._params: dict[str, torch.Tensor] = {}

    def install(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter) -> None:
        """Make ``tensors`` (wire form) the served adapter; ``ValueError`` (nothing changed)
        if they do not fit this model or the adapter installed before."""
        import torch

        from echo2.models.hf import from_wire

        modules = adapted_modules(tensors)
        for name, array in tensors.items():
            rows, cols = array.shape if array.ndim == 2 else (0, 0)
            rank = rows if name.endswith("lora_A.weight") else cols
            if array.ndim != 2 or rank != adapter.rank or array.dtype.kind not in "fu":
                raise ValueError(
                    f"adapter tensor {name!r} is {array.dtype}{list(array.shape)}: not rank {adapter.rank}"
                )
        if self.adapter is None:
            named = dict(self.model.named_modules())
            missing = [m for m in modules if not isinstance(named.get(m), torch.nn.Linear)]
            if missing:
                raise ValueError(f"the adapter adapts modules this model has no linear layer at: {missing[:4]}")
            inject(self.model, adapter, modules)
            self.model.eval()
            self._params = adapter_state_params(self.model)
            self.adapter = adapter
        elif adapter != self.adapter or set(tensors) != set(self._params):
            raise ValueError(f"this engine serves {self.adapter} on {len(self._params)} tensors; got {adapter}")
        for name, array in tensors.items():
            if tuple(array.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"adapter tensor {name!r} is {list(array.shape)}, the model's is {list(self._params[name].shape)}"
                )
        sources = {name: from_wire(array, self._params[name].dtype) for name, array in tensors.items()}
        with torch.no_grad():
            for name, source in sources.items():
                self._params[name].copy_(source)


def adapter_state_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live adapter parameters of ``model`` by wire name (what ``AdapterSlot`` writes)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        found = re.match(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.default\.weight$", name)
        if found is not None:
            out[f"{found['module']}.lora_{found['part']}.weight"] = param
    return out


def save_peft(directory: str | Path, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter) -> Path:
    """``tensors`` (wire form) as an adapter directory in PEFT's format (what vLLM's
    ``LoRARequest`` and ``peft`` load): ``adapter_config.json`` and
    ``adapter_model.safetensors`` with PEFT's module prefix."""
    import torch
    from safetensors.torch import save_file

    from echo2.models.hf import from_wire

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    modules = adapted_modules(tensors)
    weights = {}
    for name, array in tensors.items():
        tensor = from_wire(array, torch.bfloat16 if array.dtype == np.uint16 else torch.float32)
        weights[PEFT_PREFIX + name] = tensor.contiguous()
    save_file(weights, str(directory / ADAPTER_WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def load_peft(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoraAdapter]:
    """What ``save_peft`` (or PEFT's ``save_pretrained``) wrote: tensors by wire name, and
    the adapter's rank and alpha."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    weights = load_file(str(directory / ADAPTER_WEIGHTS_FILE))
    tensors = {name.removeprefix(PEFT_PREFIX): value for name, value in weights.items()}
    return tensors, LoraAdapter(rank=int(config["r"]), alpha=float(config["lora_alpha"]))
