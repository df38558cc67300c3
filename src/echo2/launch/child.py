"""The entry point of every process the launcher starts: one process group of a resolved topology.

    python -m echo2.launch.child --topology RUN_DIR/topology.resolved.json --process NAME

Sets logging and torch's thread count for this process, builds the group's actors and runs
them in a ``ProcessRuntime`` until they finish, fail or the launcher stops them. Exit code 1
when an actor failed, 74 when it failed because the run directory could not be written
(full, read-only: the last line names the path and the error; ``echo2.launch.exits``).
Once everything is closed it leaves without the interpreter's finalization
(``exits.exit_process``: native threads could abort a finished process there).

The launcher copies this process's output into ``logs/<process>.log``. If the launcher dies
without stopping us (SIGKILL), the kernel sends SIGHUP (``PR_SET_PDEATHSIG``; elsewhere a
1 s poll notices): the process drains as on any stop, and since nobody reads its pipe any
more, it first points its own stdout and stderr at its log, so what the drain says (the
learner's final summary line, a failure) is not lost. Its exit goes to
``status.orphaned.jsonl``, and the last process out writes ``status.json`` (exit code 137,
or 1 if one of them failed) in the launcher's stead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec

from echo2.actor import PortAddresses
from echo2.errors import ActorFailed
from echo2.launch import exits
from echo2.observe.http import ServeError
from echo2.observe.writers import open_writers
from echo2.rundir import RunDir, read_jsonl
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


def set_torch_threads(threads: int) -> None:
    """Torch intra-op threads of this process (0: leave torch alone), as the topology says."""
    if threads <= 0:
        return
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work started
        torch.set_num_interop_threads(1)


class StopSignals:
    """SIGINT, SIGTERM and exits.LAUNCHER_DIED, from the first line of ``main`` to the end.

    Building a process (imports, models) takes seconds; a stop requested then (the run's
    deadline, Ctrl-C) is remembered and drains once the runtime runs, so that a learner
    still writes its summary. Once handed over, a signal goes straight to the runtime (the
    runtime installs its own SIGINT and SIGTERM handlers when it starts running).
    """

    def __init__(self, watch: LauncherWatch) -> None:
        self.pending: str | None = None
        self._watch = watch
        self._forward: Callable[[str], None] | None = None
        for sig in (signal.SIGINT, signal.SIGTERM, exits.LAUNCHER_DIED):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: object) -> None:
        reason = signal.Signals(signum).name
        if signum == exits.LAUNCHER_DIED:
            self._watch.move_output_to_log()
            reason = "launcher exited"
        if self._forward is not None:
            self._forward(reason)
        elif self.pending is None:
            self.pending = reason

    def hand_over(self, runtime: ProcessRuntime, loop: asyncio.AbstractEventLoop) -> None:
        def stop(reason: str) -> None:
            if not runtime.stopping.is_set():  # a second request would cut the drain short
                runtime.request_stop(reason)

        def forward(reason: str) -> None:  # in a signal handler: only the thread-safe call
            with contextlib.suppress(RuntimeError):  # the loop closed: the process is exiting
                loop.call_soon_threadsafe(stop, reason)

        self._forward = forward
        if self.pending is not None:
            runtime.request_stop(f"{self.pending} during start-up")


class LauncherWatch:
    """Whether the launcher that started this process is still its parent; output after it."""

    def __init__(self, launcher_pid: int) -> None:
        self.launcher_pid = launcher_pid
        self.log_path: Path | None = None
        """This process's log, once the resolved topology has been read."""
        self._output_moved = False
        self._told = False

    @property
    def launcher_gone(self) -> bool:
        # Told by the kernel, or re-parented (which, while the launcher's last threads
        # exit, can come after the kernel's word).
        return self._told or os.getppid() != self.launcher_pid

    def move_output_to_log(self) -> None:
        """The launcher is gone: stdout and stderr append to this process's log from now on."""
        self._told = True
        if self._output_moved or self.log_path is None:
            return
        self._output_moved = True
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:  # said into the dead pipe: there is nowhere else to say it
            log.warning("launcher exited and %s cannot be opened (%s): output is lost", self.log_path, exc)
            return
        os.dup2(fd, sys.stdout.fileno())
        os.dup2(fd, sys.stderr.fileno())
        os.close(fd)
        log.warning("launcher (pid %d) exited; stopping; output continues here", self.launcher_pid)


def _remove_ipc_sockets(addresses: Mapping[str, Mapping[str, PortAddresses]], ipc_dir: str) -> None:
    """No launcher cleans up after us: remove the ipc sockets this process bound, and the
    run's ipc directory if that leaves it empty (the last process out removes it)."""
    for ports in addresses.values():
        for port in ports.values():
            for url in port.bind:
                if url.startswith("ipc://"):
                    with contextlib.suppress(OSError):
                        os.unlink(url.removeprefix("ipc://"))
    if ipc_dir:
        with contextlib.suppress(OSError):
            os.rmdir(ipc_dir)


def _watch_launcher(watch: LauncherWatch, signals: StopSignals) -> None:
    """Stop if the launcher disappears where the kernel does not say so (not Linux)."""

    def poll() -> None:
        while not watch.launcher_gone:
            time.sleep(1.0)
        watch.move_output_to_log()  # a race with the signal's handler at worst moves it once
        signals.handle(exits.LAUNCHER_DIED, None)

    threading.Thread(target=poll, name="launcher-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    launcher_pid = os.getppid()  # first: a launcher dead before this line killed us already
    watch = LauncherWatch(launcher_pid)
    signals = StopSignals(watch)
    from echo2.topology import ResolvedTopology, build_process

    parser = argparse.ArgumentParser(prog="python -m echo2.launch.child")
    parser.add_argument("--topology", required=True, type=Path, help="resolved topology JSON")
    parser.add_argument("--process", required=True, help="process group to run")
    args = parser.parse_args(argv)
    _configure_logging(args.process)
    resolved = ResolvedTopology.load(args.topology)
    watch.log_path = RunDir(Path(resolved.run_dir)).log_path(args.process)
    spec = resolved.processes[args.process]
    set_torch_threads(spec.torch_threads)
    actors, addresses, telemetry = build_process(resolved, args.process)
    run_dir = Path(resolved.run_dir)
    writers = None
    learners = [a for a in actors if a.completes_run and a.trusted]
    if resolved.run.metric_writers and learners:  # [run] metric_writers: the learner's metrics
        learner = spec.actors[actors.index(learners[0])]
        writers = open_writers(
            resolved.run.metric_writers,
            run_dir=run_dir,
            run_id=resolved.run_id,
            wandb_project=resolved.run.wandb_project,
            wandb_mode=resolved.run.wandb_mode,
            config={"job": msgspec.to_builtins(resolved.job), learner.name: learner.config},
        )

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
            metrics_port=spec.metrics_port,
            recording=resolved.recording,
            metric_writers=writers,
        )
        signals.hand_over(runtime, asyncio.get_running_loop())
        _watch_launcher(watch, signals)
        await runtime.run(install_signal_handlers=True)

    code = exits.OK
    try:
        _run_loop(amain())
    except ServeError as exc:  # [hosts.*] metrics_port: the port is taken
        log.error("%s: exiting: %s", args.process, exc.strerror)
        code = exits.FAILED
    except ActorFailed as exc:
        cause = _storage_error(exc.__cause__)
        if cause is not None:
            where = cause.filename if cause.filename is not None else resolved.run_dir
            log.error("%s: exiting: actor %r %s", args.process, exc.actor, exits.cannot_write(where, cause))
            code = exits.STORAGE
        else:
            log.error("%s: exiting: %s", args.process, exc)
            code = exits.FAILED
    finally:
        if watch.launcher_gone:
            _remove_ipc_sockets(addresses, resolved.ipc_dir)
    if watch.launcher_gone:
        write_orphaned_status(RunDir(run_dir), args.process, code)
    return code


def _storage_error(exc: BaseException | None) -> OSError | None:
    """The write error behind ``exc`` that says the run directory is full or read-only, if
    any: an actor's loops fail inside task groups, and a write may fail while another error
    is handled (a full disk fails the next write too)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in exits.STORAGE_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend((current.__cause__, current.__context__))
    return None


_ORPHAN_WAIT_S = 3.0
"""How long a process whose launcher died waits for its siblings' exits before it leaves the
status to the last of them."""
ORPHANED_FILE = "status.orphaned.jsonl"
"""Each process whose launcher died appends its exit here (``write_orphaned_status``)."""


def write_orphaned_status(run: RunDir, process: str, code: int) -> None:
    """The launcher died without writing ``status.json``: each of its processes adds its own
    exit, and the last one out (every other process of ``pids.json`` gone or recorded)
    writes ``status.json`` as the launcher would have (two finishing at once both write the
    same). A full disk loses this, as it loses the launcher's own status."""
    record = {"process": process, "exit_code": code}
    orphaned = run.root / ORPHANED_FILE
    try:
        with open(orphaned, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")  # one write: lines of several processes never mix
        pids = json.loads(run.pids_path.read_text())["processes"]
        # A process that finished just before the launcher died exits without a record: it
        # is waited for, a little (polled: its exit is announced to no one).
        give_up = time.monotonic() + _ORPHAN_WAIT_S
        while True:
            exited = {r["process"]: r["exit_code"] for r in read_jsonl(orphaned).records}
            running = [name for name, pid in pids.items() if name not in exited and _alive(pid)]
            if not running:
                break
            if time.monotonic() > give_up:
                return  # not the last one out: the last writes the status
            time.sleep(0.05)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("%s: cannot record its exit for the run's status: %s", process, exc)
        return
    failed = [name for name, c in exited.items() if c not in (exits.OK, exits.SIGNAL_BASE + signal.SIGHUP)]
    status = {
        "exit_code": exits.FAILED if failed else exits.LAUNCHER_KILLED,
        "reason": "the launcher died before the run ended; its processes stopped by themselves"
        + (f"; failed: {', '.join(sorted(failed))}" if failed else ""),
        "processes": {name: exited.get(name) for name in pids},
    }
    partial = run.status_path.with_name(run.status_path.name + ".partial")
    try:
        partial.write_text(json.dumps(status, indent=2) + "\n")
        os.replace(partial, run.status_path)
    except OSError as exc:
        log.warning("%s: status not written: %s", process, exits.cannot_write(run.status_path, exc))


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped by whoever adopted it, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust the signal
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


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
    exits.exit_process(main())
