"""echo2: distributed RL post-training with bounded staleness (the ECHO-2 design).

The public API, the seams users extend: the actor contract (``Actor``, ``ActorConfig``,
``ActorContext``, ``Port``, ``run_until_stopped``), the job (``JobConfig``), tasks and
rewards (``Task``, ``Prompt``, ``RewardFn``), engines (``Engine``, ``SamplingParams``,
``Completion``), topologies (``load_topology``), the embedding ``Pipeline`` and
``ProcessRuntime``, the six built-in actors with their configs, the message types a custom
actor reads and sends, the transport, and the error tree.

Every name is imported on first use (PEP 562), so ``import echo2`` is cheap, imports no
torch, and ``python -m echo2.<module>`` runs without the package having imported that
module first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # the actor contract and the job
    "Actor": "echo2.actor",
    "ActorConfig": "echo2.actor",
    "ActorContext": "echo2.actor",
    "Port": "echo2.actor",
    "PortAddresses": "echo2.actor",
    "run_until_stopped": "echo2.actor",
    "JobConfig": "echo2.job",
    # tasks, rewards, engines
    "Task": "echo2.tasks.base",
    "Prompt": "echo2.tasks.base",
    "RewardFn": "echo2.tasks.base",
    "Engine": "echo2.engines.base",
    "SamplingParams": "echo2.engines.base",
    "Completion": "echo2.engines.base",
    # topologies, embedding, runtime
    "load_topology": "echo2.topology",
    "Pipeline": "echo2.pipeline",
    "ProcessRuntime": "echo2.runtime",
    "Transport": "echo2.transport",
    # the built-in actors
    "Buffer": "echo2.actors.buffer",
    "BufferConfig": "echo2.actors.buffer",
    "Learner": "echo2.actors.learner",
    "LearnerConfig": "echo2.actors.learner",
    "PromptSource": "echo2.actors.prompt_source",
    "PromptSourceConfig": "echo2.actors.prompt_source",
    "Rewarder": "echo2.actors.rewarder",
    "RewarderConfig": "echo2.actors.rewarder",
    "Sampler": "echo2.actors.sampler",
    "SamplerConfig": "echo2.actors.sampler",
    "WeightPublisher": "echo2.actors.weight_publisher",
    "WeightPublisherConfig": "echo2.actors.weight_publisher",
    # messages a custom actor reads or sends
    "PROTOCOL_VERSION": "echo2.messages",
    "Message": "echo2.messages",
    "Heartbeat": "echo2.messages",
    "LearnerMetrics": "echo2.messages",
    "MetricsRecord": "echo2.messages",
    "TaskLease": "echo2.messages",
    "RolloutGroup": "echo2.messages",
    "ScoredGroup": "echo2.messages",
    "BatchRequest": "echo2.messages",
    "Batch": "echo2.messages",
    "Snapshot": "echo2.messages",
    "WeightsInstalled": "echo2.messages",
    # errors
    "ActorFailed": "echo2.errors",
    "ClosedError": "echo2.errors",
    "ConfigError": "echo2.errors",
    "DecodeError": "echo2.errors",
    "Echo2Error": "echo2.errors",
    "EndOfStream": "echo2.errors",
    "ProtocolMismatch": "echo2.errors",
    "TransportError": "echo2.errors",
}

__all__ = [
    "PROTOCOL_VERSION",
    "Actor",
    "ActorConfig",
    "ActorContext",
    "ActorFailed",
    "Batch",
    "BatchRequest",
    "Buffer",
    "BufferConfig",
    "ClosedError",
    "Completion",
    "ConfigError",
    "DecodeError",
    "Echo2Error",
    "EndOfStream",
    "Engine",
    "Heartbeat",
    "JobConfig",
    "Learner",
    "LearnerConfig",
    "LearnerMetrics",
    "Message",
    "MetricsRecord",
    "Pipeline",
    "Port",
    "PortAddresses",
    "ProcessRuntime",
    "Prompt",
    "PromptSource",
    "PromptSourceConfig",
    "ProtocolMismatch",
    "RewardFn",
    "Rewarder",
    "RewarderConfig",
    "RolloutGroup",
    "Sampler",
    "SamplerConfig",
    "SamplingParams",
    "ScoredGroup",
    "Snapshot",
    "Task",
    "TaskLease",
    "Transport",
    "TransportError",
    "WeightPublisher",
    "WeightPublisherConfig",
    "WeightsInstalled",
    "load_topology",
    "run_until_stopped",
]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` (PEP 562; also ``echo2.launch``'s): ``exports`` maps a name to its module.

    A resolved name is stored in ``namespace`` (the package's ``globals()``), so later
    lookups do not come back here.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__


__getattr__ = lazy_exports("echo2", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from echo2.actor import Actor, ActorConfig, ActorContext, Port, PortAddresses, run_until_stopped
    from echo2.actors.buffer import Buffer, BufferConfig
    from echo2.actors.learner import Learner, LearnerConfig
    from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
    from echo2.actors.rewarder import Rewarder, RewarderConfig
    from echo2.actors.sampler import Sampler, SamplerConfig
    from echo2.actors.weight_publisher import WeightPublisher, WeightPublisherConfig
    from echo2.engines.base import Completion, Engine, SamplingParams
    from echo2.errors import (
        ActorFailed,
        ClosedError,
        ConfigError,
        DecodeError,
        Echo2Error,
        EndOfStream,
        ProtocolMismatch,
        TransportError,
    )
    from echo2.job import JobConfig
    from echo2.messages import (
        PROTOCOL_VERSION,
        Batch,
        BatchRequest,
        Heartbeat,
        LearnerMetrics,
        Message,
        MetricsRecord,
        RolloutGroup,
        ScoredGroup,
        Snapshot,
        TaskLease,
        WeightsInstalled,
    )
    from echo2.pipeline import Pipeline
    from echo2.runtime import ProcessRuntime
    from echo2.tasks.base import Prompt, RewardFn, Task
    from echo2.topology import load_topology
    from echo2.transport import Transport
