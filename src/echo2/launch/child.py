"""The entry point of every process the launcher starts: one process group of a resolved topology.

    python -m echo2.launch.child --topology RUN_DIR/topology.resolved.json --process NAME

Sets logging and torch's thread count for this process, builds the group's actors and runs
them in a ``ProcessRuntime`` until they finish, fail or the launcher stops them (it also
stops if the launcher disappears). Exit code 1 when an actor failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from echo2.errors import ActorFailed
from echo2.runtime import ProcessRuntime
from echo2.transport.auth import CurveSettings

log = logging.getLogger("echo2.launch.child")


def _configure_logging(process: str) -> None:
    logging.basicConfig(
        level=os.environ.get("ECHO2_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {process} %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _set_torch_threads(threads: int) -> None:
    if threads <= 0:
        return
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work started
        torch.set_num_interop_threads(1)


def _watch_parent(parent_pid: int, runtime: ProcessRuntime, loop: asyncio.AbstractEventLoop) -> None:
    """Stop if the launcher disappears (a backup to PR_SET_PDEATHSIG on other platforms)."""

    def watch() -> None:
        while not runtime.stopping.is_set():
            if os.getppid() != parent_pid:
                loop.call_soon_threadsafe(runtime.request_stop, "launcher exited")
                return
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    from echo2.topology import ResolvedTopology, build_process

    parser = argparse.ArgumentParser(prog="python -m echo2.launch.child")
    parser.add_argument("--topology", required=True, type=Path, help="resolved topology JSON")
    parser.add_argument("--process", required=True, help="process group to run")
    args = parser.parse_args(argv)
    _configure_logging(args.process)
    resolved = ResolvedTopology.load(args.topology)
    spec = resolved.processes[args.process]
    _set_torch_threads(spec.torch_threads)
    actors, addresses, telemetry = build_process(resolved, args.process)
    run_dir = Path(resolved.run_dir)

    async def amain() -> None:
        curve = None
        if resolved.security.curve:
            curve = CurveSettings.load(resolved.security.keys_dir, spec.host, resolved.hosts, resolved.security.allowed)
        runtime = ProcessRuntime(
            actors,
            addresses,
            process=args.process,
            curve=curve,
            resume=resolved.resume,
            telemetry_curve_servers=spec.telemetry_curve_servers,
            run_dir=run_dir,
            drain_timeout_s=resolved.run.drain_timeout_s,
            heartbeat_s=resolved.run.heartbeat_s,
            telemetry_connect=telemetry,
        )
        _watch_parent(os.getppid(), runtime, asyncio.get_running_loop())
        await runtime.run(install_signal_handlers=True)

    try:
        _run_loop(amain())
    except ActorFailed as exc:
        log.error("%s: exiting: %s", args.process, exc)
        return 1
    return 0


def _run_loop(coro) -> None:
    """asyncio.Runner; uvloop (the ``fast`` extra) when ECHO2_UVLOOP=1 (never uvloop.install)."""
    loop_factory = None
    if os.environ.get("ECHO2_UVLOOP", "0") == "1":
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(coro)


if __name__ == "__main__":
    sys.exit(main())
