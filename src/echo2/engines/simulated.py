"""An engine that costs wall-clock time but no compute: for scaling and scheduling tests.

It models a GPU that decodes the whole batch in parallel: one ``generate`` call sleeps
``seconds_per_token * params.max_new_tokens`` however many prompts and samples it gets
(``time.sleep`` releases the GIL, so other actors keep the CPU). Each completion is the
prompt's answer with probability ``success_rate`` and otherwise a wrong digit string, so
learning curves can be faked without a model. Token ids come from the CharTokenizer; the
log-probs are random but valid (negative, finite). ``install_weights`` accepts anything and
records the version.
"""

from __future__ import annotations

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
)
from echo2.models.tokenizer import CharTokenizer


class SimulatedEngine(Engine):
    """Fake engine; see the module docstring.

    Args:
        seconds_per_token: modelled decode time of one batched step, seconds.
        success_rate: probability in [0, 1] that a completion is the correct answer.
        response_tokens: length of a wrong (or answer-less) response in tokens, EOS included.
        seed: seed of the random stream (used when ``SamplingParams.seed`` is None).
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
        self.tokenizer = CharTokenizer()
        self._rng = np.random.default_rng(seed)
        self._sleep = sleep
        self._version = 0
        self._layout: TensorLayout = {}

    @property
    def version(self) -> int:
        return self._version

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode_prompt(text)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        *,
        answers: list[str] | None = None,
    ) -> list[list[Completion]]:
        """``n`` fake completions per prompt; correct with probability ``success_rate``
        when ``answers`` (one per prompt) is given, random digits otherwise."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if answers is not None and len(answers) != len(prompts):
            raise ValueError(f"got {len(answers)} answers for {len(prompts)} prompts")
        rng = self._rng if params.seed is None else np.random.default_rng(params.seed)
        out = [
            [self._complete(None if answers is None else answers[i], params, rng) for _ in range(n)]
            for i in range(len(prompts))
        ]
        self._sleep(self.seconds_per_token * params.max_new_tokens)
        return out

    def _complete(self, answer: str | None, params: SamplingParams, rng: np.random.Generator) -> Completion:
        if answer is not None and rng.random() < self.success_rate:
            text = answer
        else:
            text = self._wrong_text(answer, rng)
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

    def state_layout(self) -> TensorLayout:
        return dict(self._layout)

    def close(self) -> None:
        pass
