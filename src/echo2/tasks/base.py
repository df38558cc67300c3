"""The task seam: where prompts come from and how completions are scored.

A task is any object with ``name``, ``prompts(seed)``, ``heldout(n)`` and
``reward(prompt, completion)`` (:class:`Task`). Users plug their own in by import path
(``load_task("my_pkg.tasks:make_task")``) and may swap only the reward
(``load_reward("my_pkg.rewards:exact")`` + :func:`with_reward`). In one process (the
embedding API) the task and reward may be the objects themselves (``echo2.job.JobObjects``,
:func:`load_job_task`); a launched run names them by import string, since every process
it starts imports them.

Optional members a task may add (each has a fallback, see the functions named):

- ``correct(prompt, completion) -> bool``: the correctness predicate the held-out evaluation
  reports as pass@1 (:func:`correctness`). It is the task's *metric*, separate from the
  training reward: a reward override (:func:`with_reward`) keeps it. A task without one gets
  no pass@1, only its mean reward: echo2 cannot know whether a reward of 1.0 means "right".
- ``prompts(seed, start=k)``: the stream from its ``k``-th prompt, cheaply
  (:func:`prompt_stream`; otherwise the first ``k`` are generated and thrown away).
- ``every_prompt()``: every prompt a finite task holds (a dataset), which the launcher
  encodes with the model's tokenizer before anything starts (:func:`prompts_to_check`).
- ``reward_range = (low, high)``: the values its reward can take (:func:`reward_range`); the
  Rewarder counts any other value as ``out_of_range`` and keeps it out of training instead
  of training on a bug. Reward functions declare it with :func:`declares_reward_range`.

A reward function may also have ``check()``, called once when the reward is loaded
(:func:`load_reward`), which raises when this machine cannot run it (the code-execution
reward without a sandbox): the launch fails before any process starts.

Held-out prompts must be disjoint from training prompts *by construction* (a deterministic
rule both sides apply), so an evaluation never measures memorisation.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

from echo2.config import check_kwargs
from echo2.errors import ConfigError, ResolveError
from echo2.registry import REWARDS, TASKS

if TYPE_CHECKING:
    from echo2.job import JobConfig, JobObjects

RewardFn = Callable[["Prompt", str], float]
CorrectFn = Callable[["Prompt", str], bool]
_F = TypeVar("_F")


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


def load_reward(spec: str | RewardFn) -> RewardFn:
    """A reward function ``(prompt, completion) -> float``: a built-in name (``"exact"``,
    ``"math_answer"``; ``echo2.registry.REWARDS``), ``"module:function"``, or (in one
    process) the function itself. Its ``check()``, if any, runs either way.

    Raises ``ResolveError`` (a ValueError) naming ``spec``.
    """
    if not callable(spec) and not isinstance(spec, str):
        raise ResolveError(f"a reward is a name, 'module:function' or a function, not a {type(spec).__name__}")
    fn: RewardFn = spec if callable(spec) else REWARDS.resolve(spec, callable, "a function")
    check = getattr(fn, "check", None)
    if callable(check):
        try:
            check()
        except Exception as exc:  # user code: any failure means the reward cannot run here
            raise ResolveError(f"reward {_label(spec)} cannot run on this machine: {exc}") from exc
    return fn


def _label(spec: object) -> str:
    """How an error names a spec: the string quoted, an object by its qualified name."""
    return repr(spec) if isinstance(spec, str) else getattr(spec, "__qualname__", type(spec).__name__)


def declares_reward_range(low: float, high: float) -> Callable[[_F], _F]:
    """Decorator: the reward's values lie in ``[low, high]`` (see :func:`reward_range`)."""
    if not low <= high:
        raise ValueError(f"reward range needs low <= high, got ({low}, {high})")

    def declare(reward_fn: _F) -> _F:
        reward_fn.reward_range = (float(low), float(high))  # type: ignore[attr-defined]
        return reward_fn

    return declare


def reward_range(obj: object) -> tuple[float, float] | None:
    """The ``(low, high)`` a task or reward function declares (``reward_range``), or None."""
    declared = getattr(obj, "reward_range", None)
    if declared is None:
        return None
    low, high = (float(v) for v in declared)
    return low, high


@declares_reward_range(0.0, 1.0)
def exact_match(prompt: Prompt, completion: str) -> float:
    """1.0 iff ``completion`` equals ``prompt.answer``, surrounding whitespace ignored (``reward = "exact"``)."""
    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0


def correctness(task: Task) -> CorrectFn | None:
    """The correctness predicate ``task`` declares (its ``correct`` method), or None."""
    correct = getattr(task, "correct", None)
    return correct if callable(correct) else None


def prompt_stream(task: Task, seed: int, start: int = 0) -> Iterator[Prompt]:
    """``task.prompts(seed)`` from its ``start``-th prompt on.

    A task whose ``prompts`` takes ``start`` positions itself (a dataset: an index); any
    other stream is advanced by generating and dropping ``start`` prompts.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if start and _accepts_start(task.prompts):
        return task.prompts(seed, start=start)  # type: ignore[call-arg]  # checked: it takes start
    return itertools.islice(task.prompts(seed), start, None)


def _accepts_start(prompts: Callable[..., Iterator[Prompt]]) -> bool:
    try:
        return "start" in inspect.signature(prompts).parameters
    except (TypeError, ValueError):
        return False


def prompts_to_check(task: Task, n: int = 64) -> Iterable[Prompt]:
    """The prompts a launcher encodes before starting: all of them for a finite task
    (``every_prompt``), else the first ``n`` held-out and ``n`` training prompts."""
    every = getattr(task, "every_prompt", None)
    if callable(every):
        return cast("Iterable[Prompt]", every())
    return [*task.heldout(n), *itertools.islice(task.prompts(0), n)]


class _RewardOverride:
    """A task whose prompts come from ``base`` and whose reward is ``reward_fn``; the base's
    correctness predicate, stream position and prompt listing are kept."""

    def __init__(self, base: Task, reward_fn: RewardFn) -> None:
        self._base = base
        self._reward_fn = reward_fn
        self.name = base.name
        self.reward_range = reward_range(reward_fn)
        if (correct := correctness(base)) is not None:
            self.correct = correct
        if callable(every := getattr(base, "every_prompt", None)):
            self.every_prompt = every

    def prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        return prompt_stream(self._base, seed, start)

    def heldout(self, n: int) -> list[Prompt]:
        return self._base.heldout(n)

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(self._reward_fn(prompt, completion))


def with_reward(task: Task, reward_fn: RewardFn | None) -> Task:
    """``task`` with its reward replaced by ``reward_fn`` (unchanged when None)."""
    return task if reward_fn is None else _RewardOverride(task, reward_fn)


def load_job_task(job: JobConfig, given: JobObjects | None = None) -> Task:
    """The job's task, with its reward replaced when ``job.reward`` names one.

    ``given``: a task and/or reward passed as objects in this process (the embedding API),
    used instead of ``job.task`` / ``job.reward``. ``ConfigError`` naming the field when
    the two disagree or the object is not a task."""
    task_obj = given.task if given is not None else None
    reward_obj = given.reward if given is not None else None
    if task_obj is None:
        task = load_task(import_string(job.task, "job.task"), **job.task_kwargs)
    else:
        require_objects(task_obj, None)
        if job.task_kwargs:
            raise ConfigError(
                "apply to a task named by job.task, not to a task given as an object", path="job.task_kwargs"
            )
        task = task_obj
    if reward_obj is not None and job.reward:
        raise ConfigError(f"names {job.reward!r} and a reward object is given too: pick one", path="job.reward")
    reward_spec = (
        reward_obj if reward_obj is not None else import_string(job.reward, "job.reward") if job.reward else None
    )
    return with_reward(task, load_reward(reward_spec) if reward_spec is not None else None)


def require_objects(task: object, reward: object) -> None:
    """``ConfigError`` (field ``task`` or ``reward``) unless ``task`` is None or a :class:`Task`
    and ``reward`` None or a function: what the embedding API accepts as objects."""
    if task is not None and not isinstance(task, Task):
        raise ConfigError(
            f"a {type(task).__name__} lacks the Task interface (name, prompts, heldout, reward)", path="task"
        )
    if reward is not None and not callable(reward):
        raise ConfigError(
            f"a reward is a function (prompt, completion) -> float, not a {type(reward).__name__}", path="reward"
        )


def import_string(value: object, field: str) -> str:
    """``value`` if it is an import string; else ``ConfigError`` naming ``field`` and saying
    why a string is needed there and where an object goes instead."""
    if isinstance(value, str):
        return value
    raise ConfigError(
        f"a {type(value).__name__} object where an import string is needed (a built-in name or "
        "'module:attr'): a JobConfig travels to every process a launched run starts, and each imports "
        "its task and reward by name. To use an object in this process, pass it to "
        "echo2.Pipeline(actors, task=..., reward=...)",
        path=field,
    )


def check_job_task(job: JobConfig) -> None:
    """Check, without building the task, that ``load_job_task(job)`` can resolve what it names.

    The task and reward must import and be callable, and ``task_kwargs`` must fit the task
    factory's signature (names and annotated types). Raises ``ConfigError`` naming the field (``job.task: ...``).
    """
    try:
        factory = task_factory(import_string(job.task, "job.task"))
    except ResolveError as exc:
        raise ConfigError(str(exc), path="job.task") from None
    check_kwargs(factory, job.task_kwargs, "job.task_kwargs", name=repr(job.task))
    if job.reward:
        try:
            load_reward(import_string(job.reward, "job.reward"))
        except ResolveError as exc:
            raise ConfigError(str(exc), path="job.reward") from None
