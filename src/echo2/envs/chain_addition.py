"""Built-in environment: multi-step addition, the next operand revealed after each answer.

The episode opens on an addition prompt (``task = "addition"``: ``"123+456="``). The model
answers the sum written reversed, as in the addition task (``"975"``). The environment
reads the answer: if it is the running total (exactly, as the addition task's reward reads it), it states the total back in plain order
followed by the next operand, ``"579+321="``, drawn from the lease's seed; the model
answers again, and so on until ``operands`` numbers were added. A wrong or unreadable
answer ends the episode. Each right answer earns ``1 / (operands - 1)``; the episode
succeeded when every answer was right (return 1).

Every token stays in the tiny model's alphabet (``0123456789+=``), so the built-in model
can learn it on a CPU (``examples/multiturn.toml``). Deterministic in (prompt, seed,
actions): the trusted side replays it.
"""

from __future__ import annotations

import random
import re
from typing import Annotated

from msgspec import Meta

from echo2.envs.base import Action, Observation, StepResult
from echo2.tasks.base import Prompt

_PROMPT = re.compile(r"(\d+)\+(\d+)=")


class ChainAddition:
    """``operands`` numbers added one turn at a time; revealed operands have ``digits`` digits."""

    replayable = True

    def __init__(self, operands: Annotated[int, Meta(ge=3, le=16)] = 3, digits: Annotated[int, Meta(ge=1, le=9)] = 3):
        if not 3 <= operands <= 16 or not 1 <= digits <= 9:
            raise ValueError(f"operands must lie in [3, 16] and digits in [1, 9], got {operands} and {digits}")
        self.operands, self.digits = operands, digits
        self._total = 0
        self._pending: list[int] = []
        self._right = 0

    def reset(self, prompt: Prompt, seed: int) -> Observation:
        match = _PROMPT.fullmatch(prompt.text.strip())
        if match is None:
            raise ValueError(f"chain_addition opens on a prompt 'a+b=', got {prompt.text!r}")
        self._total = int(match[1]) + int(match[2])
        rng = random.Random(seed)
        low = 10 ** (self.digits - 1) if self.digits > 1 else 0
        self._pending = [rng.randrange(low, 10**self.digits) for _ in range(self.operands - 2)]
        self._right = 0
        return None

    def step(self, action: Action) -> StepResult:
        if action.text.strip() != str(self._total)[::-1]:  # exactly the addition task's answer
            return StepResult(done=True)
        self._right += 1
        reward = 1.0 / (self.operands - 1)
        if not self._pending:
            return StepResult(reward=reward, done=True)
        operand = self._pending.pop(0)
        observation = f"{self._total}+{operand}="
        self._total += operand
        return StepResult(observation=observation, reward=reward)

    def succeeded(self) -> bool:
        """Every answer was right."""
        return self._right == self.operands - 1
