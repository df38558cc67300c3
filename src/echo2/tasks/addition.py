"""Built-in task: add two d-digit numbers, answer written reversed.

``"123+456="`` -> ``"975"`` (579 least-significant digit first, no padding). Reversal makes
the carry causal: each answer digit depends only on input digits and digits already
written, so a tiny left-to-right model can learn it.

Operands are uniform over the d-digit numbers (100..999 for d=3), so every prompt has the
same length. A pair (a, b) is held out iff ``blake2b("a+b") mod 10 == 0``; training streams
skip those pairs, so held-out and training prompts are disjoint by construction (about 10%
of pairs are held out).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Annotated

from msgspec import Meta

from echo2.tasks.base import Prompt

HELDOUT_MODULUS = 10
_HELDOUT_STREAM_SEED = 0x5EED_4E1D


def is_heldout_pair(a: int, b: int) -> bool:
    """The deterministic held-out rule (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_MODULUS == 0


def reversed_sum(a: int, b: int) -> str:
    return str(a + b)[::-1]


class AdditionTask:
    """Reversed-answer addition of two ``digits``-digit numbers; reward 1 for exact match."""

    reward_range = (0.0, 1.0)

    def __init__(self, digits: Annotated[int, Meta(ge=1, le=9)] = 3) -> None:
        # The annotation is checked at topology load; this, for callers in Python.
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"digits must be an int in [1, 9], got {digits!r}")
        self.digits = digits
        self.name = f"add{digits}"
        self._low = 10 ** (digits - 1) if digits > 1 else 0
        self._high = 10**digits  # exclusive

    def _prompt(self, a: int, b: int, task_id: str) -> Prompt:
        return Prompt(task_id=task_id, text=f"{a}+{b}=", answer=reversed_sum(a, b), meta={"a": a, "b": b})

    def _pairs(self, rng: random.Random, heldout: bool) -> Iterator[tuple[int, int]]:
        while True:
            a = rng.randrange(self._low, self._high)
            b = rng.randrange(self._low, self._high)
            if is_heldout_pair(a, b) == heldout:
                yield a, b

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Infinite training stream for ``seed`` (pairs may repeat; held-out pairs never appear)."""
        rng = random.Random(f"{self.name}-train-{seed}")
        for index, (a, b) in enumerate(self._pairs(rng, heldout=False)):
            yield self._prompt(a, b, f"{self.name}-{seed}-{index}")

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` distinct held-out pairs of a fixed stream (heldout(k) is a prefix
        of heldout(n) for k <= n)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        limit = self._heldout_limit()
        if n > limit:
            raise ValueError(f"asked for {n} held-out prompts; {self.name} offers at most {limit}")
        rng = random.Random(f"{self.name}-heldout-{_HELDOUT_STREAM_SEED}")
        seen: set[tuple[int, int]] = set()
        out: list[Prompt] = []
        pairs = self._pairs(rng, heldout=True)
        while len(out) < n:
            pair = next(pairs)
            if pair not in seen:
                seen.add(pair)
                out.append(self._prompt(*pair, f"{self.name}-heldout-{len(out)}"))
        return out

    def _heldout_limit(self) -> int:
        """How many distinct held-out pairs ``heldout`` may return without stalling."""
        width = self._high - self._low
        if width <= 100:  # small space: count exactly
            values = range(self._low, self._high)
            return sum(is_heldout_pair(a, b) for a in values for b in values)
        return width * width // (2 * HELDOUT_MODULUS)  # about half of the expected count

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 iff ``completion`` (surrounding whitespace ignored) equals the reversed sum."""
        return 1.0 if completion.strip() == prompt.answer else 0.0

    def correct(self, prompt: Prompt, completion: str) -> bool:
        """The reward is binary: right means reward 1."""
        return self.reward(prompt, completion) == 1.0
