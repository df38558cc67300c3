"""Actor kinds: the registry that maps a topology's ``kind = "..."`` to a class.

Nothing is imported here eagerly: a kind's module is imported only when a topology uses
it, so a process that runs a Buffer never imports torch, and a kind whose module is broken
or missing fails only the topologies that name it (with ``actors.NAME.kind: ...``).

A kind is a registry name below or an import path ``"package.module:Class"``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from echo2.errors import ConfigError

if TYPE_CHECKING:
    from echo2.actor import Actor

ACTOR_KINDS: dict[str, str] = {
    # the RL pipeline
    "prompt_source": "echo2.actors.prompt_source:PromptSource",
    "sampler": "echo2.actors.sampler:Sampler",
    "rewarder": "echo2.actors.rewarder:Rewarder",
    "buffer": "echo2.actors.buffer:Buffer",
    "learner": "echo2.actors.learner:Learner",
    "weight_publisher": "echo2.actors.weight_publisher:WeightPublisher",
    # small real actors for tests and examples/smoke.toml
    "counter_source": "echo2.actors.testing:CounterSource",
    "counter_sink": "echo2.actors.testing:CounterSink",
    "failing": "echo2.actors.testing:Failing",
    "idle": "echo2.actors.testing:Idle",
    "heartbeat_sink": "echo2.actors.testing:HeartbeatSink",
}


def load_actor_class(kind: str) -> type[Actor]:
    """Import the class of a registry name or ``"module:Class"`` path.

    Raises ``ConfigError`` (one line, without a field path: the caller adds it) when the
    name is unknown, the import fails, or the object is not an ``Actor`` subclass.
    """
    from echo2.actor import Actor

    target = ACTOR_KINDS.get(kind, kind)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(ACTOR_KINDS))
        raise ConfigError(f"unknown kind {kind!r} (known: {known}; or 'package.module:Class')")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except Exception as exc:  # user code may fail to import in any way; report it in one line
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"cannot import {target!r}: {type(exc).__name__}: {detail}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ConfigError(f"{target!r} is not an echo2 Actor class")
    return cls


__all__ = ["ACTOR_KINDS", "load_actor_class"]
