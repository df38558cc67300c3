"""The engine seam: token ids in, sampled completions with log-probs out.

Samplers talk only to :class:`Engine`; the built-in implementations are the pure-torch
engine for the tiny model (:mod:`echo2.engines.torch_engine`) and a simulated one that
models GPU time without compute (:mod:`echo2.engines.simulated`); a vLLM engine implements
the same contract later.

Contract:

- ``generate`` is synchronous (a Sampler runs it in a worker thread) and returns ``n``
  completions per prompt, in prompt order.
- ``Completion.logprobs[t]`` is the log-probability of ``token_ids[t]`` under the
  distribution the engine *actually sampled from* (after temperature and top-p
  renormalisation). That is what importance ratios against the learner need. With
  ``temperature == 0`` (greedy) the distribution is a point mass and every log-prob is 0.
- ``token_ids`` include the final EOS when ``finish_reason == "eos"``; ``text`` does not.
- ``install_weights`` is atomic: after it returns the engine serves the new version, and
  when it raises (ValueError for a layout mismatch) nothing changed. It may be called from
  another thread; it then waits for a running ``generate`` to finish. ``install_adapter``
  is the same for a version that is a LoRA adapter on the base model (a LoRA run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from echo2.messages import LoraAdapter, ModelIdentity
from echo2.registry import ENGINES, EngineKind

FINISH_EOS = "eos"
FINISH_LENGTH = "length"

TensorLayout = dict[str, tuple[tuple[int, ...], str]]


def check_generate_args(prompts: list[list[int]], n: int) -> None:
    """The argument checks every real engine's ``generate`` starts with."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    max_new_tokens: int = 8  # response length limit, EOS included
    seed: int | None = None  # None: continue the engine's own random stream

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    token_ids: np.ndarray  # (T,) int32, sampled tokens (EOS included if finished by EOS)
    logprobs: np.ndarray  # (T,) float32, log p(token) under the distribution sampled from
    finish_reason: str  # "eos" | "length"
    text: str  # decoded tokens, without EOS


def validate_weights(tensors: Mapping[str, np.ndarray], layout: TensorLayout) -> None:
    """Raise ValueError unless ``tensors`` matches ``layout`` exactly (names, shapes, dtypes)."""
    missing = sorted(set(layout) - set(tensors))
    unexpected = sorted(set(tensors) - set(layout))
    if missing or unexpected:
        raise ValueError(f"weight names do not match the model: missing {missing}, unexpected {unexpected}")
    for name, (shape, dtype) in layout.items():
        array = tensors[name]
        got_shape = tuple(array.shape)
        got_dtype = str(array.dtype)
        if got_shape != shape or got_dtype != dtype:
            raise ValueError(f"weight {name!r} is {got_dtype}{list(got_shape)}, the model expects {dtype}{list(shape)}")


def check_no_adapter(adapter: object | None) -> None:
    """``install_weights`` of an engine that serves a LoRA adapter: a full state does not fit
    its adapted modules (a run publishes adapters or full states, never both)."""
    if adapter is not None:
        raise ValueError("this engine serves LoRA adapters (install_adapter); a full state cannot be installed")


class Engine(ABC):
    """A policy that generates completions; see the module docstring for the contract."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version currently installed (the one the next ``generate`` uses)."""

    @abstractmethod
    def encode_prompt(self, text: str) -> list[int]:
        """Prompt text -> token ids in this engine's vocabulary, in the model's prompt format.

        Lets a Sampler stay engine-agnostic (the tiny model wants BOS first; a chat model
        wants its template).
        """

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions for each prompt (outer list in prompt order)."""

    @abstractmethod
    def install_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        """Atomically replace all weights and set ``version``; ValueError leaves both unchanged."""

    def install_adapter(self, tensors: Mapping[str, np.ndarray], adapter: LoraAdapter, version: int) -> None:
        """Atomically make the LoRA adapter ``tensors`` (``echo2.models.adapters``) the one
        served on the base model and set ``version``; ValueError leaves both unchanged.
        Its cost must not grow with the base model (no merge)."""
        raise ValueError(f"the {type(self).__name__} does not serve LoRA adapters")

    @abstractmethod
    def state_layout(self) -> TensorLayout:
        """Name -> (shape, numpy dtype string) of every tensor ``install_weights`` expects."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; idempotent."""

    def model_identity(self) -> ModelIdentity | None:
        """The identity of the model this engine serves (``echo2.models.identity``), which
        a Sampler checks against the one in ``Welcome``; None: no real model (simulated)."""
        return None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


T = TypeVar("T")


class EngineThread:
    """Where one engine's blocking calls run: a thread of its own, off the event loop.

    An engine's calls are serial anyway (``install_weights`` waits for ``generate``), so one
    thread per engine is what lets N engines in one process (simulated samplers, or one
    process driving several GPUs) run N calls at once: asyncio's shared default pool holds
    ``cpu_count + 4`` threads, and a 65th sampler in a process would wait for a free one.
    Threads that compute (torch) are bounded by the process's torch thread share, not here.
    """

    def __init__(self, name: str) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"engine-{name}")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Let the running call finish; start no other."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def make_engine(kind: EngineKind, **kwargs: Any) -> Engine:
    """Build an engine by its ``echo2.registry.ENGINES`` name, importing its module only now.

    Raises ``ResolveError`` (a ``ValueError``) for an unknown kind.
    """
    cls: type[Engine] = ENGINES.resolve(kind, _is_engine_class, "an echo2 Engine class")
    return cls(**kwargs)


def _is_engine_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, Engine)
