"""The adapter over a Hugging Face tokenizer: the prompt format, decoding, special ids.

Torch-free (the data process tokenizes prompts and decodes completions with it without
loading a model); the caller passes a loaded ``transformers`` tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from echo2.job import PromptFormat

THINKING_SWITCH = "enable_thinking"
"""The chat-template variable reasoning templates (Qwen3 and others) read."""


class HFTokenizer:
    """A Hugging Face tokenizer rendering prompts as ``prompt_format`` says (``PromptFormat``).

    Raises ``ValueError`` naming the setting when the format asks for what the tokenizer
    cannot do (a chat template it lacks, a system prompt without a template, a thinking
    switch its template does not read).
    """

    def __init__(self, tokenizer: Any, *, prompt_format: PromptFormat | None = None, eos_ids: list[int] | None = None):
        self.hf = tokenizer
        self.prompt_format = prompt_format = prompt_format or PromptFormat()
        template = getattr(tokenizer, "chat_template", None) or ""
        if prompt_format.chat_template == "on" and not template:
            raise ValueError('prompt_format.chat_template = "on", but the model\'s tokenizer has no chat template')
        self.use_chat_template = (
            bool(template) if prompt_format.chat_template == "auto" else prompt_format.chat_template == "on"
        )
        if prompt_format.system_prompt and not self.use_chat_template:
            raise ValueError("prompt_format.system_prompt needs a chat template (the tokenizer has none, or it is off)")
        self._template_kwargs: dict[str, bool] = {}
        if prompt_format.thinking != "auto":
            if not self.use_chat_template or THINKING_SWITCH not in template:
                raise ValueError(
                    f"prompt_format.thinking = {prompt_format.thinking!r}, but the model's chat template has no "
                    f"thinking switch ({THINKING_SWITCH})"
                )
            self._template_kwargs[THINKING_SWITCH] = prompt_format.thinking == "on"
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token")
        self.eos_id = int(eos)
        self.eos_ids = sorted({self.eos_id, *(eos_ids or [])})
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(tokenizer)

    def encode_prompt(self, text: str) -> list[int]:
        """The ids the model sees for a prompt: rendered once, on the trusted side too, and
        never decoded and re-encoded (a round trip can change ids)."""
        if not self.use_chat_template:
            return [int(i) for i in self.hf.encode(text)]
        messages = [{"role": "user", "content": text}]
        if self.prompt_format.system_prompt:
            messages.insert(0, {"role": "system", "content": self.prompt_format.system_prompt})
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **self._template_kwargs)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Any) -> str:
        """Text of ``ids`` up to (excluding) the first EOS, special tokens skipped."""
        out = []
        for tok in ids:
            tok = int(tok)
            if tok in self.eos_ids:
                break
            out.append(tok)
        return self.hf.decode(out, skip_special_tokens=True)

    def describe(self) -> dict[str, Any]:
        """What decides the ids of a prompt beyond the vocabulary (for the model's identity)."""
        return {
            "chat_template": getattr(self.hf, "chat_template", None) if self.use_chat_template else None,
            "system_prompt": self.prompt_format.system_prompt,
            "template_kwargs": dict(self._template_kwargs),
        }
