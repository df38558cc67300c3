"""The registry of kinds: the names a topology may use for actors, engines, tasks and rewards.

Each registry maps a name to an import path ``"package.module:attr"`` and imports the module
only when a name is resolved (importlib), so a process that runs a Buffer never imports
torch, and a kind whose module is broken or missing fails only the topologies that name it.
Actor kinds, tasks and rewards may also be written as import paths; engines only by name
(``EngineKind``), so an engine typo fails when the topology is decoded.

This module sits at the bottom of the layers: it imports nothing of echo2 but ``errors``.
It checks that a name resolves to an object; whether that object is the right kind (an
``Actor`` class, an ``Engine`` class, a task factory) is checked by the caller that owns
the type, through ``Registry.resolve(name, accept, expected)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, TypeVar

from echo2.errors import ResolveError, one_line

EngineKind = Literal["torch", "simulated", "hf", "vllm"]
"""``SamplerConfig.engine``: the engines ``ENGINES`` names (a test keeps the two equal)."""


Name = TypeVar("Name", bound=str)


class Registry(Generic[Name]):
    """Names of one kind of object, each mapped to an import path, resolved on use."""

    def __init__(self, what: str, entries: Mapping[Name, str], *, path_form: str | None) -> None:
        self.what = what
        """What a name names, for error messages: ``"kind"``, ``"engine"``, ``"task"``."""
        self.entries = dict(entries)
        self.path_form = path_form
        """How an import path in place of a name looks (``"package.module:Class"``), or
        None when only registered names are allowed."""

    def names(self) -> list[Name]:
        return sorted(self.entries)

    def target(self, name: Name) -> str:
        """The import path ``name`` stands for; ``ResolveError`` if it is neither a name nor a path."""
        target = self.entries.get(name)
        if target is not None:
            return target
        module, sep, attr = name.partition(":")
        if self.path_form is not None and sep and module and attr:
            return name
        known = ", ".join(self.names()) or "none"
        alternative = f"; or '{self.path_form}'" if self.path_form else ""
        raise ResolveError(f"unknown {self.what} {name!r} (known: {known}{alternative})")

    def resolve(self, name: Name, accept: Callable[[Any], bool], expected: str) -> Any:
        """Import the object ``name`` stands for and check it with ``accept``.

        Raises ``ResolveError`` (one line, without a field path: the caller adds it) when the
        name is unknown, the import fails, or ``accept`` rejects the object
        (``'<path>' is not <expected>``).
        """
        target = self.target(name)
        obj = import_object(target)
        if not accept(obj):
            raise ResolveError(f"{target!r} is not {expected}")
        return obj


def import_object(target: str) -> Any:
    """``"package.module:attr.sub"`` -> the object; ``ResolveError`` naming ``target`` if it fails."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # user code may fail to import in any way: report it in one line
        detail = one_line(exc)
        raise ResolveError(f"cannot import {target!r}: {type(exc).__name__}: {detail}") from exc
    return obj


ACTORS: Registry[str] = Registry(
    "kind",
    {
        # the RL pipeline
        "prompt_source": "echo2.actors.prompt_source:PromptSource",
        "sampler": "echo2.actors.sampler:Sampler",
        "rewarder": "echo2.actors.rewarder:Rewarder",
        "buffer": "echo2.actors.buffer:Buffer",
        "learner": "echo2.actors.learner:Learner",
        "distributed_learner": "echo2.actors.distributed_learner:DistributedLearner",
        "weight_publisher": "echo2.actors.weight_publisher:WeightPublisher",
        # small real actors for tests and examples/smoke.toml
        "counter_source": "echo2.actors.testing:CounterSource",
        "counter_sink": "echo2.actors.testing:CounterSink",
        "failing": "echo2.actors.testing:Failing",
        "idle": "echo2.actors.testing:Idle",
        "heartbeat_sink": "echo2.actors.testing:HeartbeatSink",
    },
    path_form="package.module:Class",
)
"""``[actors.NAME] kind``: a registered name or the import path of an ``Actor`` subclass."""

ENGINES: Registry[EngineKind] = Registry(
    "engine",
    {
        "torch": "echo2.engines.torch_engine:TorchEngine",
        "simulated": "echo2.engines.simulated:SimulatedEngine",
        "hf": "echo2.engines.hf_engine:HFTorchEngine",
        "vllm": "echo2.engines.vllm_engine:VLLMEngine",
    },
    path_form=None,
)
"""``SamplerConfig.engine``: registered names only (``EngineKind``)."""

TASKS: Registry[str] = Registry(
    "task",
    {
        "addition": "echo2.tasks.addition:AdditionTask",
        "math_answer": "echo2.tasks.math_answer:MathWordTask",
        "reasoning_gym": "echo2.tasks.reasoning_gym:ReasoningGymTask",
        "dataset": "echo2.tasks.dataset:DatasetTask",
    },
    path_form="package.module:factory",
)
"""``job.task``: a built-in task or the import path of a class or function returning a Task."""

ENVIRONMENTS: Registry[str] = Registry(
    "environment",
    {
        "chain_addition": "echo2.envs.chain_addition:ChainAddition",
        "openenv": "echo2.envs.openenv:OpenEnvEnvironment",
    },
    path_form="package.module:factory",
)
"""``job.episode.environment``: a built-in environment or the import path of a class or
function returning an ``echo2.envs.Environment`` (one per episode)."""

REWARDS: Registry[str] = Registry(
    "reward",
    {
        # binary (0 or 1), so a task may use one as its correctness predicate too
        "exact": "echo2.tasks.base:exact_match",
        "math_answer": "echo2.tasks.math_answer:math_reward",
        "math_verify": "echo2.tasks.math_verify:math_verify_reward",
        "code_tests": "echo2.tasks.code_execution:code_tests_reward",
    },
    path_form="package.module:function",
)
"""``job.reward`` and the dataset task's ``reward`` / ``correct``: a built-in reward or the
import path of a function ``(prompt, completion) -> float``."""


__all__ = ["ACTORS", "ENGINES", "ENVIRONMENTS", "REWARDS", "TASKS", "EngineKind", "Registry", "import_object"]
