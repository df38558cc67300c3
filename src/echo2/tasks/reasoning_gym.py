"""reasoning-gym procedural tasks as echo2 tasks (extra ``echo2[reasoning]``; offline).

``task = "reasoning_gym"`` with ``task_kwargs = { dataset = "gsm_symbolic" }`` (or
``"countdown"``, ``"basic_arithmetic"``, ``"chain_sum"``, ... any reasoning-gym name, plus that
generator's own options in ``config``).

- Prompts: reasoning-gym generates questions deterministically from a seed; training stream
  ``seed`` draws chunks of ``chunk`` items from seeds derived from ``(seed, chunk index)``.
  A question is held out iff ``blake2b(question) mod 10 == 0``; training skips those, so
  held-out and training prompts are disjoint by construction.
- Reward: reasoning-gym's own checker (``dataset.score_answer``) on the extracted answer:
  the last ``<answer>...</answer>``, else the last ``\\boxed{}``, else the last line.
  The Rewarder rebuilds a Prompt from (task_id, text, answer) only, so ``Prompt.answer``
  carries the entry the checker needs as JSON (``{"answer", "metadata"}``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

from echo2.tasks.base import Prompt
from echo2.tasks.math_answer import last_boxed

DEFAULT_INSTRUCTION = "Think briefly, then give only the final answer inside <answer></answer>."
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _is_heldout(question: str) -> bool:
    return int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "little") % 10 == 0


def extract_tagged_answer(completion: str) -> str:
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class ReasoningGymTask:
    """One reasoning-gym dataset as a Task."""

    def __init__(
        self,
        dataset: str = "gsm_symbolic",
        config: dict[str, Any] | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        chunk: int = 256,
    ) -> None:
        try:
            import reasoning_gym
        except ImportError as exc:
            raise ImportError("reasoning-gym tasks need the 'reasoning' extra: pip install 'echo2[reasoning]'") from exc
        self._rg = reasoning_gym
        self.dataset = dataset
        self.config = dict(config or {})
        self.instruction = instruction
        self.chunk = chunk
        self.name = f"rg-{dataset}"
        self._checker = reasoning_gym.create_dataset(dataset, size=1, seed=0, **self.config)

    def _items(self, seed: int) -> Iterator[dict[str, Any]]:
        index = 0
        while True:
            derived = int.from_bytes(
                hashlib.blake2b(f"{self.name}-{seed}-{index}".encode(), digest_size=4).digest(), "little"
            )
            yield from self._rg.create_dataset(self.dataset, size=self.chunk, seed=derived, **self.config)
            index += 1

    def _stream(self, seed: int, heldout: bool, prefix: str) -> Iterator[Prompt]:
        n = 0
        for item in self._items(seed):
            question = item["question"]
            if _is_heldout(question) != heldout:
                continue
            entry = json.dumps({"answer": item["answer"], "metadata": item.get("metadata", {})}, default=str)
            text = f"{question}\n{self.instruction}".strip()
            yield Prompt(f"{prefix}-{n}", text, entry, {"question": question})
            n += 1

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return self._stream(seed, False, f"{self.name}-{seed}")

    def heldout(self, n: int) -> list[Prompt]:
        stream = self._stream(-1, True, f"{self.name}-heldout")
        return [next(stream) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        try:
            entry = json.loads(prompt.answer)
        except ValueError:
            entry = {"answer": prompt.answer, "metadata": {}}
        answer = extract_tagged_answer(completion)
        try:
            return float(self._checker.score_answer(answer=answer, entry=entry))
        except (KeyError, TypeError, ValueError):
            return 0.0

    def correct(self, prompt: Prompt, completion: str) -> bool:
        """Right means full marks: some checkers give partial credit (a near answer, a
        wrong format), which the reward keeps and correctness does not."""
        return self.reward(prompt, completion) >= 1.0
