"""The built-in actors, and ``load_actor_class``: a topology's ``kind = "..."`` -> its class.

Nothing is imported here eagerly: the names live in ``echo2.registry.ACTORS`` and a kind's
module is imported only when a topology uses it, so a process that runs a Buffer never
imports torch, and a kind whose module is broken or missing fails only the topologies that
name it (with ``actors.NAME.kind: ...``).
"""

from __future__ import annotations

from typing import Any

from echo2.actor import Actor
from echo2.registry import ACTORS

ACTOR_KINDS = ACTORS.entries
"""Registered kind name -> ``"module:Class"`` (``echo2.registry.ACTORS``)."""


def load_actor_class(kind: str) -> type[Actor]:
    """The class of a registered kind or a ``"package.module:Class"`` path.

    Raises ``ResolveError`` (one line, without a field path: the caller adds it) when the
    name is unknown, the import fails, or the object is not an ``Actor`` subclass.
    """

    def is_actor_class(obj: Any) -> bool:
        return isinstance(obj, type) and issubclass(obj, Actor)

    cls: type[Actor] = ACTORS.resolve(kind, is_actor_class, "an echo2 Actor class")
    return cls


__all__ = ["ACTOR_KINDS", "load_actor_class"]
