"""The launcher: ``python -m echo2.launch TOPOLOGY`` starts and supervises this host's processes.

``supervisor`` is the launcher itself; ``child`` is the entry point of each process it starts
(``python -m echo2.launch.child --topology RUN_DIR/topology.resolved.json --process NAME``);
``exits`` holds the exit codes both use.
"""

from echo2.launch.supervisor import Child, Launcher, main, select_processes

__all__ = ["Child", "Launcher", "main", "select_processes"]
