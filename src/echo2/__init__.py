"""echo2: distributed RL post-training with bounded staleness (the ECHO-2 design).

The public API: the actor contract and runtime, the six built-in actors with their
configs, the embedding ``Pipeline``, the transport, and the error tree. Importing echo2
does not import torch; the actors that need it load it in ``setup``.
"""

from echo2.actor import Actor, ActorConfig, ActorContext, JobConfig, Port, PortAddresses
from echo2.actors.buffer import Buffer, BufferConfig
from echo2.actors.common import run_until_stopped
from echo2.actors.learner import Learner, LearnerConfig
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.rewarder import Rewarder, RewarderConfig
from echo2.actors.sampler import Sampler, SamplerConfig
from echo2.actors.weight_publisher import WeightPublisher, WeightPublisherConfig
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
from echo2.messages import PROTOCOL_VERSION
from echo2.pipeline import Pipeline
from echo2.runtime import ProcessRuntime
from echo2.transport import Transport

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "Actor",
    "ActorConfig",
    "ActorContext",
    "ActorFailed",
    "Buffer",
    "BufferConfig",
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "Echo2Error",
    "EndOfStream",
    "JobConfig",
    "Learner",
    "LearnerConfig",
    "Pipeline",
    "Port",
    "PortAddresses",
    "ProcessRuntime",
    "PromptSource",
    "PromptSourceConfig",
    "ProtocolMismatch",
    "Rewarder",
    "RewarderConfig",
    "Sampler",
    "SamplerConfig",
    "Transport",
    "TransportError",
    "WeightPublisher",
    "WeightPublisherConfig",
    "run_until_stopped",
]
