"""The launcher: ``python -m echo2.launch TOPOLOGY`` starts and supervises this host's processes.

``supervisor`` is the launcher itself; ``child`` is the entry point of each process it starts
(``python -m echo2.launch.child --topology RUN_DIR/topology.resolved.json --process NAME``);
``exits`` holds the exit codes both use.

The names below are imported on first use (PEP 562): a child imports only what it runs, so
that it handles a stop request as early as possible in its start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {name: "echo2.launch.supervisor" for name in ("Child", "Launcher", "main", "select_processes")}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'echo2.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


if TYPE_CHECKING:
    from echo2.launch.supervisor import Child, Launcher, main, select_processes

__all__ = ["Child", "Launcher", "main", "select_processes"]
