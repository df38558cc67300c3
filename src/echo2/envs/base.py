"""The environment seam: multi-turn episodes beside single-turn tasks.

A job whose ``[job.episode] environment`` names an environment turns every rollout into an
episode. The task still says which prompts there are (``job.task``: a dataset, a built-in
stream) and which are held out; the environment says what happens after the model
answers:

    context = prompt ids (+ the reset's observation)
    repeat:  action      = the model's completion of the context       (trained)
             observation = environment.step(action)                     (never trained)
             context    += action + observation ids
    until the environment says done, ``max_turns`` actions, or ``max_episode_tokens``.

Contract of an :class:`Environment` (one instance per episode, built by the factory
``job.episode.environment`` names, called with ``environment_kwargs``):

- ``reset(prompt, seed)`` starts the episode from a prompt (a dataset row: ``prompt.text``
  and ``prompt.meta``) and the lease's seed; it may return a first observation (text or
  token ids, appended after the prompt) or None.
- ``step(action)`` receives the model's :class:`Action` (its token ids; ``text`` decoded by
  the model's tokenizer, for environments that read text) and returns a
  :class:`StepResult`: the observation to append (text, encoded with the model's tokenizer
  without special tokens, or token ids), this turn's reward, and whether the episode is
  over. The episode's reward is the sum of its turns' rewards.
- Optional members: ``succeeded() -> bool`` at the end of an episode, the correctness
  predicate of held-out evaluation (pass@1 = greedy episodes that succeeded; without it no
  pass@1 is reported); ``close()``; ``replayable`` (default True, see below).
- The constructor must be cheap (connect to services in ``reset``): one is built per
  episode, and one when the job is checked.

Trust. Samplers may be anyone's machines, so the trusted side replays each episode
(``echo2.envs.replay``): a fresh environment, reset from the trusted record of the prompt
and the lease's seed, is stepped with the model's actions as they were sent; every
observation must come out token for token as the sampler appended it, and the reward is
the replay's. So an environment must be **deterministic**: its observations and ``done``
may depend only on the prompt text, the lease fields (``job.episode.lease_fields``: the
metadata sent to samplers), the seed and the actions. Its rewards may read more (the
reference answer, all metadata): only the trusted side's count. An environment that cannot
be replayed (an external service, a live sandbox) says ``replayable = False``; its
episodes, rewards included, are then accepted only from samplers named in
``job.episode.trusted_samplers``, since nothing else can check them.

Failures. An environment that raises, or whose ``reset``/``step`` runs past
``job.episode.turn_timeout_s``, fails the episode and with it the lease: on a sampler it
is reported failed (``EpisodeFailed``), in the trusted replay the group is refused; either
way the lease is re-issued and counted by reason, never a reward of 0.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from echo2.config import check_kwargs
from echo2.errors import ConfigError, ResolveError
from echo2.registry import ENVIRONMENTS
from echo2.tasks.base import Prompt

Observation = str | Sequence[int] | None
"""What an environment appends: text (encoded with the model's tokenizer, no special
tokens), token ids of the model's vocabulary, or None / "" for nothing."""


@dataclass(frozen=True)
class Action:
    """The model's turn: the ids it sampled (EOS included when it stopped on EOS)."""

    token_ids: tuple[int, ...]
    text: str
    """The ids decoded by the model's tokenizer, without EOS and special tokens."""
    finished: bool
    """True when the model ended its turn with EOS; False when it hit the turn's token budget."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to an action."""

    observation: Observation = None
    reward: float = 0.0
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self, prompt: Prompt, seed: int) -> Observation:
        """Start an episode from ``prompt``; optionally return a first observation."""
        ...

    def step(self, action: Action) -> StepResult:
        """Answer the model's action."""
        ...


EnvironmentFactory = Callable[[], Environment]


@dataclass(frozen=True)
class EnvironmentSpec:
    """The job's environment: a factory of fresh environments and what is known of it."""

    name: str
    factory: EnvironmentFactory
    replayable: bool
    """False: the trusted side cannot replay its episodes (see the module docstring)."""


def environment_factory(spec: str) -> Callable[..., Any]:
    """The class or function ``spec`` names (a built-in or ``module:factory``), not called."""
    factory: Callable[..., Any] = ENVIRONMENTS.resolve(spec, callable, "a class or function")
    return factory


def load_environment(spec: str, kwargs: dict[str, Any] | None = None) -> EnvironmentSpec:
    """The environment ``spec`` names, with its factory bound to ``kwargs``.

    Builds one instance to check it has ``reset`` and ``step`` and to read ``replayable``.
    ``ResolveError`` (a ValueError) naming ``spec`` when it cannot be resolved or built.
    """
    kwargs = dict(kwargs or {})
    target = environment_factory(spec)
    factory = functools.partial(target, **kwargs)
    try:
        probe = factory()
    except Exception as exc:  # user code: any failure to build means the job cannot run
        raise ResolveError(f"environment {spec!r} cannot be built: {type(exc).__name__}: {exc}") from exc
    try:
        if not isinstance(probe, Environment):
            raise ResolveError(f"environment {spec!r} built a {type(probe).__name__}, which lacks reset and step")
        replayable = bool(getattr(probe, "replayable", True))
    finally:
        close_environment(probe)
    return EnvironmentSpec(name=spec, factory=factory, replayable=replayable)


def close_environment(env: object) -> None:
    """Call ``env.close()`` when it has one."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def succeeded(env: object) -> bool | None:
    """The environment's verdict on its finished episode (``succeeded()``), or None."""
    verdict = getattr(env, "succeeded", None)
    return bool(verdict()) if callable(verdict) else None


def episode_seed(job_seed: int, task_id: str) -> int:
    """The seed every episode of a task resets its environment with (``TaskLease.episode_seed``):
    the same for every re-issue of the task and every run with this ``job.seed``, different
    per task."""
    digest = hashlib.blake2b(f"{job_seed}:{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits msgpack's signed 64-bit ints


def check_job_environment(environment: str, kwargs: dict[str, Any]) -> None:
    """Check, without building it, that ``job.episode.environment`` imports and its kwargs
    fit the factory's signature. ``ConfigError`` naming the field."""
    try:
        target = environment_factory(environment)
    except ResolveError as exc:
        raise ConfigError(str(exc), path="job.episode.environment") from None
    check_kwargs(target, kwargs, "job.episode.environment_kwargs", name=repr(environment))
