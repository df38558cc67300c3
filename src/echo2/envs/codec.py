"""The model's tokenizer as episodes use it, loaded the way every trusted actor loads it."""

from __future__ import annotations

from echo2.envs.episode import EpisodeCodec
from echo2.job import PromptFormat
from echo2.models.hf_tokenizer import HFTokenizer
from echo2.models.identity import present_location
from echo2.models.location import load_prompt_tokenizer
from echo2.models.tokenizer import CharTokenizer


def episode_codec(tokenizer: CharTokenizer | HFTokenizer) -> EpisodeCodec:
    """Observations encoded as plain text (no BOS, no template), actions decoded up to EOS."""
    if isinstance(tokenizer, CharTokenizer):
        return EpisodeCodec(tokenizer.encode, tokenizer.decode, frozenset({tokenizer.eos_id}), tokenizer.vocab_size)
    hf = tokenizer.hf

    def encode(text: str) -> list[int]:
        return [int(t) for t in hf.encode(text, add_special_tokens=False)]

    return EpisodeCodec(encode, tokenizer.decode, frozenset(tokenizer.eos_ids), tokenizer.vocab_size)


def load_episode_codec(model: str, prompt_format: PromptFormat | None = None) -> EpisodeCodec:
    """The codec of the model ``model`` names (``job.model``; "" the built-in tiny one),
    from its tokenizer files only."""
    return episode_codec(load_prompt_tokenizer(present_location(model), prompt_format))
