"""The task seam: where prompts come from and how completions are scored.

A task is any object with ``name``, ``prompts(seed)``, ``heldout(n)`` and
``reward(prompt, completion)`` (:class:`Task`). Users plug their own in by import path
(``load_task("my_pkg.tasks:make_task")``) and may swap only the reward
(``load_reward("my_pkg.rewards:exact")`` + :func:`with_reward`).

Held-out prompts must be disjoint from training prompts *by construction* (a deterministic
rule both sides apply), so an evaluation never measures memorisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from echo2.config import check_kwargs
from echo2.errors import ConfigError, ResolveError
from echo2.registry import REWARDS, TASKS

if TYPE_CHECKING:
    from echo2.job import JobConfig

RewardFn = Callable[["Prompt", str], float]


@dataclass(frozen=True)
class Prompt:
    """One prompt with its reference answer.

    ``task_id`` is unique and stable across runs (same seed -> same ids), so rollouts can be
    traced back to the prompt that produced them.
    """

    task_id: str
    text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Task(Protocol):
    name: str

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """Infinite, deterministic stream of training prompts for ``seed``."""
        ...

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` of a fixed held-out list, disjoint from every training stream."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Score of ``completion`` (the generated text after the prompt, without EOS)."""
        ...


def task_factory(spec: str) -> Callable[..., Task]:
    """The class or function a task spec names: a built-in name (``"addition"``) or ``"module:factory"``.

    Imports it without calling it. Raises ``ResolveError`` (a ValueError) naming ``spec``.
    """
    factory: Callable[..., Task] = TASKS.resolve(spec, callable, "a class or function")
    return factory


def load_task(spec: str, **kwargs: Any) -> Task:
    """A task from a built-in name (``"addition"``) or ``"module:factory"``.

    ``factory`` is a class or function called with ``kwargs``; the result must satisfy
    :class:`Task`. Raises ValueError naming ``spec`` when it cannot be resolved.
    """
    task = task_factory(spec)(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(
            f"task spec {spec!r} returned a {type(task).__name__}, which lacks the Task "
            "interface (name, prompts, heldout, reward)"
        )
    return task


def load_reward(spec: str) -> RewardFn:
    """A reward function ``(prompt, completion) -> float`` from ``"module:function"``.

    Raises ``ResolveError`` (a ValueError) naming ``spec``.
    """
    fn: RewardFn = REWARDS.resolve(spec, callable, "a function")
    return fn


class _RewardOverride:
    """A task whose prompts come from ``base`` and whose reward is ``reward_fn``."""

    def __init__(self, base: Task, reward_fn: RewardFn) -> None:
        self._base = base
        self._reward_fn = reward_fn
        self.name = base.name

    def prompts(self, seed: int) -> Iterator[Prompt]:
        return self._base.prompts(seed)

    def heldout(self, n: int) -> list[Prompt]:
        return self._base.heldout(n)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(self._reward_fn(prompt, completion))


def with_reward(task: Task, reward_fn: RewardFn | None) -> Task:
    """``task`` with its reward replaced by ``reward_fn`` (unchanged when None)."""
    return task if reward_fn is None else _RewardOverride(task, reward_fn)


def load_job_task(job: JobConfig) -> Task:
    """The job's task, with its reward replaced when ``job.reward`` names one."""
    task = load_task(job.task, **job.task_kwargs)
    return with_reward(task, load_reward(job.reward) if job.reward else None)


def check_job_task(job: JobConfig) -> None:
    """Check, without building the task, that ``load_job_task(job)`` can resolve what it names.

    The task and reward must import and be callable, and ``task_kwargs`` must fit the task
    factory's signature (names and annotated types). Raises ``ConfigError`` naming the field (``job.task: ...``).
    """
    try:
        factory = task_factory(job.task)
    except ResolveError as exc:
        raise ConfigError(str(exc), path="job.task") from None
    check_kwargs(factory, job.task_kwargs, "job.task_kwargs", name=repr(job.task))
    if job.reward:
        try:
            load_reward(job.reward)
        except ResolveError as exc:
            raise ConfigError(str(exc), path="job.reward") from None
