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
addition task; it needs no data download. ``problems = "sums"`` asks small sums in a few
phrasings instead ("What is 7 + 8?"), held out by operand pair: within a 135M chat model's
reach, so a short CPU run shows learning (examples/smollm2.toml). reasoning-gym tasks (``echo2.tasks.reasoning_gym``)
are the richer option.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from fractions import Fraction
from typing import Annotated, Literal

from msgspec import Meta

from echo2.tasks.addition import is_heldout_pair
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


_SUM_PHRASINGS = ("What is {a} + {b}?", "What is {a} plus {b}?", "What is the sum of {a} and {b}?", "Add {a} and {b}.")


class MathWordTask:
    """Two-step word problems ``x + k * m`` or ``x - k * m`` with a numeric answer, or, with
    ``problems = "sums"``, ``a + b`` for ``a, b`` in ``[0, max_value]`` asked in
    :data:`_SUM_PHRASINGS`.

    ``instruction`` is appended to each prompt (a chat model is told how to answer; ``""``:
    nothing). Word problems are held out by their text (a tenth); sums by operand pair (the
    addition task's rule), so no held-out pair is ever trained on in any phrasing.
    """

    reward_range = (0.0, 1.0)

    def __init__(
        self,
        max_value: Annotated[int, Meta(ge=5)] = 50,
        instruction: str = "Give the final answer as \\boxed{N}.",
        problems: Literal["words", "sums"] = "words",
    ) -> None:
        if max_value < 5:
            raise ValueError(f"max_value must be >= 5, got {max_value}")
        if problems not in ("words", "sums"):
            raise ValueError(f"problems must be 'words' or 'sums', got {problems!r}")
        self.max_value = max_value
        self.instruction = instruction
        self.problems = problems
        self.name = f"math_{problems}{max_value}"

    def _make(self, rng: random.Random) -> tuple[str, str, dict[str, int]]:
        if self.problems == "sums":
            a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
            return rng.choice(_SUM_PHRASINGS).format(a=a, b=b), str(a + b), {"a": a, "b": b}
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

    def _heldout(self, text: str, meta: dict[str, int]) -> bool:
        if self.problems == "sums":
            return is_heldout_pair(meta["a"], meta["b"])
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % 10 == 0

    def _stream(self, rng: random.Random, heldout: bool, prefix: str) -> Iterator[Prompt]:
        index = 0
        while True:
            text, answer, meta = self._make(rng)
            if self._heldout(text, meta) == heldout:
                yield Prompt(f"{prefix}-{index}", f"{text} {self.instruction}".strip(), answer, meta)
                index += 1

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return self._stream(random.Random(f"{self.name}-train-{seed}"), False, f"{self.name}-{seed}")

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` distinct held-out prompts of a fixed stream (a prefix of a longer
        request). Sums offer few: about a tenth of the operand pairs times the phrasings."""
        limit = self._heldout_limit()
        if not 0 <= n <= limit:
            raise ValueError(f"asked for {n} held-out prompts; {self.name} offers at most {limit}")
        stream = self._stream(random.Random(f"{self.name}-heldout"), True, f"{self.name}-heldout")
        seen: set[str] = set()
        out: list[Prompt] = []
        while len(out) < n:
            prompt = next(stream)
            if prompt.text not in seen:
                seen.add(prompt.text)
                out.append(Prompt(f"{self.name}-heldout-{len(out)}", prompt.text, prompt.answer, prompt.meta))
        return out

    def _heldout_limit(self) -> int:
        """How many distinct held-out prompts ``heldout`` may return without stalling."""
        if self.problems == "words":
            distinct = len(_NAMES) * len(_ITEMS) * 2 * 5 * 8 * self.max_value  # name, item, +/-, k, m, x
            return distinct // 20  # about half of the expected tenth held out
        values = range(self.max_value + 1)
        return len(_SUM_PHRASINGS) * sum(is_heldout_pair(a, b) for a in values for b in values)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return math_reward(prompt, completion)

    def correct(self, prompt: Prompt, completion: str) -> bool:
        """The reward is binary: right means the final answer matches."""
        return math_reward(prompt, completion) == 1.0
