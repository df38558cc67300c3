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
from typing import Any, Protocol, cast, runtime_checkable

import msgspec

from echo2.config import check_kwargs
from echo2.errors import ConfigError, ResolveError
from echo2.job import JobConfig, JobObjects
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
    return checked_environment(spec, functools.partial(target, **kwargs))


def checked_environment(name: str, factory: EnvironmentFactory) -> EnvironmentSpec:
    """``factory``'s spec, once one environment it builds was checked (``reset`` and ``step``)
    and ``replayable`` read. ``ResolveError`` naming ``name`` when it cannot be built."""
    try:
        probe = factory()
    except Exception as exc:  # user code: any failure to build means the job cannot run
        raise ResolveError(f"environment {name!r} cannot be built: {type(exc).__name__}: {exc}") from exc
    try:
        if not isinstance(probe, Environment):
            raise ResolveError(f"environment {name!r} built a {type(probe).__name__}, which lacks reset and step")
        replayable = bool(getattr(probe, "replayable", True))
    finally:
        close_environment(probe)
    return EnvironmentSpec(name=name, factory=factory, replayable=replayable)


def environment_object(factory: object) -> EnvironmentSpec:
    """The spec of an environment given as an object (``echo2.Pipeline(environment=...)``):
    a class or function called with no arguments once per episode (``functools.partial``
    binds arguments). ``ConfigError`` (field ``environment``) for anything else, or when
    it cannot build an environment. Its name is its import path, for the run's records."""
    if isinstance(factory, Environment) and not isinstance(factory, type):
        raise ConfigError(
            f"a {type(factory).__name__} instance: pass its class or a function that builds one, since every "
            "episode gets a fresh environment",
            path="environment",
        )
    if not callable(factory):
        raise ConfigError(
            f"a {type(factory).__name__} is not an environment factory (a class or function building one "
            "Environment per episode)",
            path="environment",
        )
    try:
        return checked_environment(_object_name(factory), factory)
    except ResolveError as exc:
        raise ConfigError(str(exc), path="environment") from None


def _object_name(factory: Callable[..., Any]) -> str:
    target = factory.func if isinstance(factory, functools.partial) else factory
    module = getattr(target, "__module__", None) or type(target).__module__
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


def with_environment_object(job: JobConfig, spec: EnvironmentSpec) -> JobConfig:
    """``job`` made multi-turn in the environment given as an object: ``job.episode.environment``
    takes its name (the object itself reaches the actors through ``JobObjects``).
    ``ConfigError`` naming the field when the job names an environment or kwargs too."""
    episode = job.episode
    if episode.environment and episode.environment != spec.name:
        raise ConfigError(
            f"names {episode.environment!r} and an environment object is given too: pick one",
            path="job.episode.environment",
        )
    if episode.environment_kwargs:
        raise ConfigError(
            "apply to an environment named by job.episode.environment; bind an object's arguments with "
            "functools.partial",
            path="job.episode.environment_kwargs",
        )
    return msgspec.structs.replace(job, episode=msgspec.structs.replace(episode, environment=spec.name))


def load_job_environment(job: JobConfig, given: JobObjects | None = None) -> EnvironmentSpec:
    """The job's environment: the one given as an object in this process (``given``, the
    embedding API), else the one ``job.episode.environment`` names."""
    if given is not None and given.environment is not None:
        return cast("EnvironmentSpec", given.environment)
    return load_environment(job.episode.environment, job.episode.environment_kwargs)


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
