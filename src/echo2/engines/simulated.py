"""An engine that costs wall-clock time but no compute: for scaling and scheduling tests.

It models a GPU that decodes the whole batch in parallel: one ``generate`` call sleeps
``seconds_per_token * params.max_new_tokens`` however many prompts and samples it gets
(``time.sleep`` releases the GIL, so other actors keep the CPU).

It simulates a policy with one skill, the built-in addition task's: a prompt ``"a+b="``
is answered with the reversed sum (:func:`simulated_answer`), so that task's own reward
scores it. Which completions are right is its own seeded rule: completion ``j`` of a
prompt is drawn from a generator seeded by ``(seed, prompt text, j)``, and is right iff
that generator's first uniform draw is below ``success_rate`` (``SamplingParams.seed``,
when set, replaces ``seed``). Each completion is a pure function of those three, so a
re-issued lease gets the same group whichever sampler serves it, and a batch's order or
size changes nothing. A prompt it cannot read is never answered right (reward 0, as
for a policy that has not learned the task). Wrong answers are random digit strings;
token ids come from the CharTokenizer; log-probs are random but valid (negative, finite).
``install_weights`` accepts anything and records the version.

No answer crosses the seam: the engine sees only token ids, like a real one.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping

import numpy as np

from echo2.engines.base import (
    FINISH_EOS,
    FINISH_LENGTH,
    Completion,
    Engine,
    SamplingParams,
    TensorLayout,
    check_generate_args,
)
from echo2.messages import LoraAdapter
from echo2.models.tokenizer import CharTokenizer

_ADDITION_PROMPT = re.compile(r"(\d+)\+(\d+)=")


def simulated_answer(prompt_text: str) -> str | None:
    """What the simulated policy answers when it is right; None for a prompt it cannot read.

    The built-in addition task's format (``"123+456="`` -> ``"975"``, the sum written
    least-significant digit first). A model's skill, not the task's grader: the test suite
    checks that the two agree."""
    match = _ADDITION_PROMPT.fullmatch(prompt_text)
    if match is None:
        return None
    return str(int(match[1]) + int(match[2]))[::-1]


class SimulatedEngine(Engine):
    """Fake engine; see the module docstring.

    Args:
        seconds_per_token: modelled decode time of one batched step, seconds.
        success_rate: probability in [0, 1] that a completion is the correct answer.
        response_tokens: length of a wrong (or answer-less) response in tokens, EOS included.
        seed: seed of the success rule and the fake tokens (``SamplingParams.seed`` overrides it).
        sleep: the sleep function (tests may inject a recorder).
    """

    def __init__(
        self,
        seconds_per_token: float,
        success_rate: float,
        response_tokens: int = 4,
        seed: int = 0,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if seconds_per_token < 0:
            raise ValueError(f"seconds_per_token must be >= 0, got {seconds_per_token}")
        if not 0.0 <= success_rate <= 1.0:
            raise ValueError(f"success_rate must be in [0, 1], got {success_rate}")
        if response_tokens < 1:
            raise ValueError(f"response_tokens must be >= 1, got {response_tokens}")
        self.seconds_per_token = seconds_per_token
        self.success_rate = success_rate
        self.response_tokens = response_tokens
        self.seed = seed
        self.tokenizer = CharTokenizer()
        self._sleep = sleep
        self._version = 0
        self._layout: TensorLayout = {}

    @property
    def version(self) -> int:
        return self._version

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` fake completions per prompt, each right per the seeded rule (module docstring)."""
        check_generate_args(prompts, n)
        seed = self.seed if params.seed is None else params.seed
        out = [self._group(self.tokenizer.decode(ids), n, seed, params) for ids in prompts]
        self._sleep(self.seconds_per_token * params.max_new_tokens)
        return out

    def _group(self, prompt_text: str, n: int, seed: int, params: SamplingParams) -> list[Completion]:
        answer = simulated_answer(prompt_text)
        digest = int.from_bytes(hashlib.blake2b(prompt_text.encode(), digest_size=8).digest(), "little")
        out = []
        for j in range(n):
            rng = np.random.default_rng([seed % 2**64, digest, j])  # completion j's own stream
            right = rng.random() < self.success_rate  # the rule: the stream's first draw
            text = answer if right and answer is not None else self._wrong_text(answer, rng)
            out.append(self._complete(text, params, rng))
        return out

    def _complete(self, text: str, params: SamplingParams, rng: np.random.Generator) -> Completion:
        ids = [*self.tokenizer.encode(text), self.tokenizer.eos_id]
        finish = FINISH_EOS
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], FINISH_LENGTH
        token_ids = np.asarray(ids, dtype=np.int32)  # (T,)
        logprobs = -rng.exponential(0.5, size=len(ids)).astype(np.float32) - np.float32(1e-3)  # (T,) < 0
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish,
            text=self.tokenizer.decode(token_ids),
        )

    def _wrong_text(self, answer: str | None, rng: np.random.Generator) -> str:
        length = max(1, self.response_tokens - 1)
        while True:
            text = "".join(str(d) for d in rng.integers(0, 10, size=length))
            if text != answer:
                return text

    def install_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self._version = version

    def install_adapter(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter, version: int) -> None:
        self._version = version

    def state_layout(self) -> TensorLayout:
        return dict(self._layout)

    def close(self) -> None:
        pass
