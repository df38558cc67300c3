"""An environment that fails on purpose, for the fault tests: ``chain_addition`` whose
``step`` raises on ``raise_rate`` of its calls and hangs past any turn timeout on
``hang_rate`` of them, at random (not from the seed: a re-issued lease or a replay meets
other faults, as with a flaky service)."""

from __future__ import annotations

import random
import time

from echo2.envs.base import Action, StepResult
from echo2.envs.chain_addition import ChainAddition

_RANDOM = random.SystemRandom()


class FaultyChain(ChainAddition):
    def __init__(self, raise_rate: float = 0.05, hang_rate: float = 0.05, hang_s: float = 5.0) -> None:
        super().__init__()
        self.raise_rate, self.hang_rate, self.hang_s = raise_rate, hang_rate, hang_s

    def step(self, action: Action) -> StepResult:
        draw = _RANDOM.random()
        if draw < self.raise_rate:
            raise RuntimeError("the environment failed (injected)")
        if draw < self.raise_rate + self.hang_rate:
            time.sleep(self.hang_s)  # past the turn timeout: the caller gives up on it
        return super().step(action)
