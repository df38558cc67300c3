"""Character-level tokenizer for the built-in arithmetic tasks.

The vocabulary is tiny on purpose: the built-in model must learn in minutes on a CPU, and
a character vocabulary makes the answer format (one digit per token) trivially learnable.

Layout (ids are stable; checkpoints depend on them)::

    0 PAD   1 BOS   2 EOS   3..12 '0'..'9'   13 '+'   14 '='

Prompts for the tiny model start with BOS (see :meth:`CharTokenizer.encode_prompt`); the
model ends its answer with EOS.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "0123456789+="


class CharTokenizer:
    """Maps the characters of ``"0123456789+="`` to ids and back."""

    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __init__(self) -> None:
        self._char_to_id = {c: i + len(_SPECIALS) for i, c in enumerate(_CHARS)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(_CHARS)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no specials added).

        Raises ValueError naming the first character outside the vocabulary.
        """
        ids = []
        for pos, ch in enumerate(text):
            tok = self._char_to_id.get(ch)
            if tok is None:
                raise ValueError(f"character {ch!r} at position {pos} of {text!r} is not in the vocabulary {_CHARS!r}")
            ids.append(tok)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """``[BOS] + encode(text)``: the form the tiny model was trained on."""
        return [BOS_ID, *self.encode(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` up to (excluding) the first EOS; PAD and BOS are skipped.

        Raises ValueError for an id outside the vocabulary.
        """
        out = []
        for tok in ids:
            tok = int(tok)
            if tok == EOS_ID:
                break
            if tok in (PAD_ID, BOS_ID):
                continue
            ch = self._id_to_char.get(tok)
            if ch is None:
                raise ValueError(f"token id {tok} is outside the vocabulary (size {self.vocab_size})")
            out.append(ch)
        return "".join(out)
