"""A math-answer reward and a small procedural word-problem task, for real (chat) models.

Reward: 1.0 if the completion's *final answer* is numerically equal to the reference, else
0.0. The final answer is, in order of preference:

1. the content of the last ``\\boxed{...}`` (nested braces allowed);
2. the text after the last "answer is" / "answer:" / "####";
3. the last number in the completion.

Numbers are compared exactly as fractions after normalisation: thousands separators
(``1,234``), a leading ``$``, a trailing ``%`` or ``.``, ``\\frac{a}{b}`` / ``\\dfrac``, ``a/b``
and decimals (``0.50 == 1/2``). A non-numeric reference is compared as normalised text.

:class:`MathWordTask` (``task = "math_answer"``) makes two-step word problems
("Ann has 12 apples, buys 3 bags of 5, ...") with the same disjoint held-out rule as the
addition task; it needs no data download. reasoning-gym tasks (``echo2.tasks.reasoning_gym``)
are the richer option.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from fractions import Fraction
from typing import Annotated

from msgspec import Meta

from echo2.tasks.base import Prompt, declares_reward_range

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\$?\.\d+")
_ANSWER_IS = re.compile(r"(?:answer\s*(?:is|:|=)|####)\s*(.+)", re.IGNORECASE)
_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of ``completion`` as text (see the module docstring), or None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    matches = list(_ANSWER_IS.finditer(completion))
    if matches:
        tail = matches[-1].group(1).strip()
        numbers = _NUMBER.findall(tail)
        return numbers[0] if numbers else tail.split("\n")[0].strip().rstrip(".")
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None if it is not one."""
    s = text.strip().strip("$ ").replace("\\$", "").replace("\\!", "")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = s.replace("\\%", "").rstrip("%").rstrip(".").replace(" ", "")
    s = s.replace("(", "").replace(")", "").replace("{", "").replace("}", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b

    def norm(s: str) -> str:
        return re.sub(r"\s+", " ", s.strip().lower().rstrip("."))

    return norm(predicted) == norm(reference)


@declares_reward_range(0.0, 1.0)
def math_reward(prompt: Prompt, completion: str) -> float:
    """1.0 if the completion's final answer equals ``prompt.answer`` (numerically), else 0.0."""
    return 1.0 if answers_match(extract_answer(completion), prompt.answer) else 0.0


_NAMES = ("Ann", "Ben", "Chloe", "Dev", "Eva", "Farid", "Gus", "Hana")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books")


class MathWordTask:
    """Two-step word problems ``x + k * m`` or ``x - k * m`` with a numeric answer.

    ``instruction`` is appended to each prompt (a chat model is told how to answer).
    """

    reward_range = (0.0, 1.0)

    def __init__(
        self, max_value: Annotated[int, Meta(ge=5)] = 50, instruction: str = "Give the final answer as \\boxed{N}."
    ) -> None:
        if max_value < 5:
            raise ValueError(f"max_value must be >= 5, got {max_value}")
        self.max_value = max_value
        self.instruction = instruction
        self.name = f"math_words{max_value}"

    def _make(self, rng: random.Random) -> tuple[str, str, dict[str, int]]:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        k, m = rng.randint(2, 6), rng.randint(2, 9)
        x = rng.randint(k * m + 1, self.max_value + k * m)
        if rng.random() < 0.5:
            text = (
                f"{name} has {x} {item} and buys {k} bags with {m} {item} each. How many {item} does {name} have now?"
            )
            answer = x + k * m
        else:
            text = f"{name} has {x} {item} and gives away {k} bags with {m} {item} each. How many {item} are left?"
            answer = x - k * m
        return text, str(answer), {"x": x, "k": k, "m": m}

    @staticmethod
    def _heldout(text: str) -> bool:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 10 == 0

    def _stream(self, rng: random.Random, heldout: bool, prefix: str) -> Iterator[Prompt]:
        index = 0
        while True:
            text, answer, meta = self._make(rng)
            if self._heldout(text) == heldout:
                yield Prompt(f"{prefix}-{index}", f"{text} {self.instruction}".strip(), answer, meta)
                index += 1

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return self._stream(random.Random(f"{self.name}-train-{seed}"), False, f"{self.name}-{seed}")

    def heldout(self, n: int) -> list[Prompt]:
        stream = self._stream(random.Random(f"{self.name}-heldout"), True, f"{self.name}-heldout")
        return [next(stream) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return math_reward(prompt, completion)

    def correct(self, prompt: Prompt, completion: str) -> bool:
        """The reward is binary: right means the final answer matches."""
        return math_reward(prompt, completion) == 1.0
