"""The launcher: ``python -m echo2.launch TOPOLOGY`` starts and supervises this host's processes.

``supervisor`` is the launcher itself; ``child`` is the entry point of each process it starts
(``python -m echo2.launch.child --topology RUN_DIR/topology.resolved.json --process NAME``);
``exits`` holds the exit codes both use.

The names below are imported on first use (PEP 562): a child imports only what it runs, so
that it handles a stop request as early as possible in its start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echo2 import lazy_exports

_EXPORTS = {name: "echo2.launch.supervisor" for name in ("Child", "Launcher", "main", "select_processes")}


__getattr__ = lazy_exports("echo2.launch", _EXPORTS, globals())

if TYPE_CHECKING:
    from echo2.launch.supervisor import Child, Launcher, main, select_processes

__all__ = ["Child", "Launcher", "main", "select_processes"]
