"""The identity of a model: what a worker must match before it may generate for a job.

``model_identity(spec)`` is the trusted side's (the PromptSource's) view of the configured
model, read from the model's files without loading weights; ``identity_of`` is the same
computation over a model already loaded (an engine's), so both sides agree exactly when the
tokenizer, the architecture and the vocabulary agree. Weights are not part of it: they
change every step and travel with their own digests (``echo2.weights.chunks``).

- tokenizer digest: BLAKE3 of the vocabulary (token -> id), the special ids (EOS, PAD) and
  the prompt format (chat template and whether it is used): what turns text into the ids on
  the wire, and back.
- architecture digest: BLAKE3 of the model's configuration (``config.json``) as canonical
  JSON, without the fields that do not change the function (private ``_*`` keys, the
  transformers version, the storage dtype: a bf16 worker serves the fp32 learner's model).
- vocab size: rows of the token embedding; every token id is below it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import blake3

from echo2.job import PromptFormat
from echo2.messages import ModelIdentity
from echo2.models.location import SMOLLM2, ModelLocation, load_prompt_tokenizer, locate_model
from echo2.models.tokenizer import _CHARS, _SPECIALS, CharTokenizer

TINY_MODEL_ID = "echo2-tiny"
_CONFIG_FILE = "config.json"
# Fields of config.json that describe how a model was saved, not what it computes.
_NOT_ARCHITECTURE = frozenset({"transformers_version", "torch_dtype", "dtype", "architectures"})


def identity_of(model_id: str, config: Mapping[str, Any], tokenizer: Any) -> ModelIdentity:
    """The identity of a model from its configuration and tokenizer adapter
    (``CharTokenizer`` or ``echo2.models.policy.HFTokenizer``)."""
    return ModelIdentity(
        model_id=model_id,
        tokenizer_digest=tokenizer_digest(tokenizer),
        architecture_digest=architecture_digest(config),
        vocab_size=int(config["vocab_size"]),
    )


def model_identity(spec: str, prompt_format: PromptFormat | None = None) -> ModelIdentity:
    """The identity of the model a job names (``JobConfig.model``, rendering prompts as
    ``JobConfig.prompt_format``), from its files.

    The built-in model and tiny-model checkpoints need neither torch nor transformers (the
    data process that asks may have neither loaded); a Hugging Face model needs its
    tokenizer (the ``hf`` extra), and SmolLM2 is converted first if it is not yet.
    """
    location = present_location(spec)
    tokenizer = load_prompt_tokenizer(location, prompt_format)
    label = TINY_MODEL_ID if location.kind == "tiny" else model_label(spec)
    return identity_of(label, read_config(location.directory), tokenizer)


def present_location(spec: str) -> ModelLocation:
    """``locate_model(spec)``, converting SmolLM2 first if it is not yet (torch is imported
    only then); ``ValueError`` if ``spec`` names no model."""
    location = locate_model(spec)
    if not location.present:
        from echo2.models.hf import smollm2_dir

        smollm2_dir()
        location = locate_model(spec)
    return location


def model_label(spec: str) -> str:
    """``ModelIdentity.model_id`` for a model spec: what a person recognises it by."""
    if not spec:
        return TINY_MODEL_ID
    if spec.lower() == SMOLLM2:
        return spec.lower()
    return Path(spec).expanduser().name


def read_config(directory: str | Path) -> dict[str, Any]:
    config = json.loads((Path(directory) / _CONFIG_FILE).read_text())
    if not isinstance(config, dict) or "vocab_size" not in config:
        raise ValueError(f"{directory}/{_CONFIG_FILE} has no vocab_size")
    return config


def architecture_digest(config: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k not in _NOT_ARCHITECTURE}
    return blake3.blake3(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    if isinstance(tokenizer, CharTokenizer):
        described: dict[str, Any] = {
            "vocab": [*_SPECIALS, *_CHARS],
            "eos": tokenizer.eos_id,
            "pad": tokenizer.pad_id,
            "bos_prompt": True,
        }
    else:  # HFTokenizer
        described = {
            "vocab": sorted(tokenizer.hf.get_vocab().items()),
            "eos": tokenizer.eos_id,
            "pad": tokenizer.pad_id,
            **tokenizer.describe(),  # chat template, system prompt, thinking switch
        }
    return blake3.blake3(json.dumps(described, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
