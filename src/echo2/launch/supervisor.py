"""``python -m echo2.launch topology.toml``: spawn one OS process per process group, supervise, stop.

::

    python -m echo2.launch TOPOLOGY.toml [--set path=value]... [--run-dir DIR] [--host NAME] [--dry-run]
                           [--resume RUN_DIR [--allow-changes]]
    python -m echo2.launch TOPOLOGY.toml --emit slurm|k8s --out DIR [--set path=value]... [--image IMAGE]

* ``--emit slurm|k8s --out DIR`` starts nothing: it writes what starts the same run on a
  cluster, an sbatch script or Kubernetes manifests (``echo2.launch.emit``).
* A bad topology or option prints one line, ``TOPOLOGY.toml: <field path>: <problem>``, and
  exits 2.
* The run directory ``<run_dir>/<run.name>-<YYYYmmdd-HHMMSS>`` gets ``topology.resolved.json``
  (what every process reads), ``logs/<process>.log``, ``pids.json`` (launcher and children)
  and, at the end, ``status.json``. ``--run-dir`` replaces ``run.run_dir`` (the parent).
* ``--resume RUN_DIR`` continues a run from its checkpoints with the settings it last ran
  with: a topology that resolves differently (a ``--set`` forgotten or added) is refused,
  exit 2, one line per differing field, unless ``--allow-changes``. Each resume appends a
  line to ``resumes.jsonl`` (its time and the changes allowed) and writes its topology to
  ``resumes/N.topology.resolved.json``; the first launch's ``topology.resolved.json`` is
  never rewritten.
* With ``[hosts.NAME] join_port = P`` the launcher of that host answers ``python -m
  echo2.join`` on P (``echo2.launch.join_server``): samplers outside the topology join.
* ``address = "env:VAR"`` in ``[hosts]`` is read from this launcher's environment as it
  starts (``--emit`` leaves it as written, for the cluster to fill in).
* With ``[hosts.NAME] metrics_port = P`` the launcher serves its host's ``/health`` and
  ``/metrics`` on P, from probing each of its processes' own (on P+1.., name order), so a
  process that is stopped or stuck, and cannot answer for itself, is reported not ready
  within one heartbeat timeout (``echo2.observe``, ``docs/metrics.md``).
* Each process of this host runs ``python -m echo2.launch.child --topology ... --process NAME`` in
  its own session (one holding a distributed actor runs under torchrun instead: ``python -m
  torch.distributed.run ... -m echo2.launch.torchrun ...``, ``nproc_per_node`` ranks, node rank
  = this host's place in ``node_hosts``; ``echo2.launch.torchrun``), with
  ``CUDA_VISIBLE_DEVICES`` set from its ``gpus`` (``echo2.topology.devices``; GPUs asked for and
  absent are a bad topology) (a terminal's Ctrl-C reaches only the launcher, which decides), dies with
  the launcher (``PR_SET_PDEATHSIG`` on Linux), and has its output prefixed ``[NAME] `` here.
* Exit codes (``echo2.launch.exits``): 0 when the run completed (a ``completes_run`` actor's
  process exited 0, or every process exited 0); 1 when a process failed or the run directory
  could not be written (full disk, read-only: the line names the path and the error; a
  child that cannot write exits 74 and is not restarted); 2 for a bad
  topology; 124 when ``run.deadline_s`` passed before the run completed (as ``timeout(1)``),
  or when the learner's own budget (``max_wall_s``) ran out before it trained one step;
  128 + the signal's number when stopped by one: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (a
  closed terminal; not handled when the launcher was started with SIGHUP ignored, as
  ``nohup`` does). The last line says which, and ``status.json`` records it.
* Shutdown, whatever its cause (a signal, the deadline, a failure, the disk): SIGTERM to every
  live child (its runtime drains: a learner writes its final checkpoint and summary),
  SIGKILL to those still alive ``run.drain_timeout_s + 5`` s later; their output is copied
  to the logs until it ends, then ``status.json`` is written and the ipc directory removed.
  A second signal kills at once. The launcher only ever signals the PIDs it started. A
  launcher killed with SIGKILL cannot do this: each child then gets SIGHUP from the kernel
  (``PR_SET_PDEATHSIG``), drains, writes its remaining output to its log itself, and the
  last one out removes the ipc directory; no ``status.json`` is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import msgspec

from echo2.errors import ConfigError, TransportError, one_line
from echo2.launch import exits
from echo2.launch.emit import EMIT_KINDS, emit
from echo2.launch.join_server import JoinServer
from echo2.launch.torchrun import torchrun_args
from echo2.observe.health import ProcessWatch, health_routes
from echo2.observe.http import ServeError, serve
from echo2.observe.metrics import exposition, launcher_families
from echo2.rundir import RunDir, new_run_id
from echo2.topology import (
    ResolvedTopology,
    Topology,
    is_local_address,
    load_topology,
    resolve,
)
from echo2.topology.changes import topology_changes
from echo2.topology.devices import VISIBLE_ENV, HostGPUs, probe_host_gpus
from echo2.topology.preflight import check_before_launch
from echo2.topology.schema import resolve_env_addresses
from echo2.transport import Transport
from echo2.transport.auth import CurveSettings

KILL_GRACE_S = 5.0
"""Seconds past ``run.drain_timeout_s`` before children still alive get SIGKILL."""
_PR_SET_PDEATHSIG = 1
_READ_CHUNK = 65536
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop the run gracefully (a second one kills)."""


# -- command line --------------------------------------------------------------------------


def _parser() -> exits.OneLineParser:
    parser = exits.OneLineParser(
        prog="python -m echo2.launch",
        description="Run an echo2 topology: one OS process per process group of this host.",
    )
    parser.add_argument("topology", type=Path, help="topology TOML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a topology value before validation, e.g. job.staleness=0 (repeatable)",
    )
    parser.add_argument("--run-dir", type=Path, help="parent directory of the run directory")
    parser.add_argument("--host", help="start only this host's processes")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a stopped or crashed run in RUN_DIR from its last checkpoints",
    )
    parser.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: run even if the topology differs from the one the run last ran with",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and print the resolved topology; start nothing",
    )
    parser.add_argument(
        "--emit",
        choices=EMIT_KINDS,
        help="write what starts this run on a cluster (an sbatch script, Kubernetes manifests) into --out; start nothing",
    )
    parser.add_argument("--out", type=Path, help="with --emit: the directory to write into")
    parser.add_argument(
        "--image", default="echo2:latest", help="with --emit k8s: the container image with echo2 installed"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Launch a topology; returns the exit code (see the module docstring)."""
    logging.basicConfig(format="echo2: %(message)s", level=logging.WARNING)  # no-op if configured
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except exits.UsageError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return exits.BAD_CONFIG
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    if args.allow_changes and args.resume is None:
        print(f"{parser.prog}: --allow-changes: only with --resume", file=sys.stderr)
        return exits.BAD_CONFIG
    if args.emit is not None:
        return _emit(parser.prog, args)
    if args.out is not None:
        print(f"{parser.prog}: --out: only with --emit", file=sys.stderr)
        return exits.BAD_CONFIG
    source = args.topology
    try:
        topology = load_topology(source, args.overrides)
        if args.run_dir is not None:
            topology = dataclasses.replace(topology, run=_replace_struct(topology.run, run_dir=str(args.run_dir)))
        topology = resolve_env_addresses(topology, os.environ)
        names = select_processes(topology, args.host)
        ranks = node_ranks(topology, args.host)
        host_gpus = _host_gpus(topology, names)
        followers = [name for name in names if ranks.get(name, 0) > 0]
        notes = check_before_launch(topology, names, followers=followers, host_gpus=host_gpus)
    except ConfigError as exc:
        print(f"{source}: {one_line(exc)}", file=sys.stderr)  # one line, whatever it quotes
        return exits.BAD_CONFIG
    for note in notes:
        print(f"{source}: note: {note}", file=sys.stderr)

    if args.dry_run:
        run_id = new_run_id(topology.run.name)
        resolved = resolve(topology, run_id, str(Path(topology.run.run_dir).absolute() / run_id))
        sys.stdout.write(_banner(resolved, names, {}, ranks))
        sys.stdout.write(_to_json(resolved) + "\n")
        return 0

    if args.resume is not None:
        run = RunDir(args.resume.absolute())
        if not run.is_run_dir():
            print(f"--resume: {run.root} is not a run directory (no {run.topology_path.name})", file=sys.stderr)
            return exits.BAD_CONFIG
        try:
            run.logs_dir.mkdir(exist_ok=True)
        except OSError as exc:
            print(f"echo2: {exits.cannot_write(run.logs_dir, exc)}; nothing started", file=sys.stderr)
            return exits.FAILED
    else:
        try:
            run = RunDir.create(Path(topology.run.run_dir), new_run_id(topology.run.name))
        except OSError as exc:  # every fresh name taken, or the parent is not writable
            print(f"{source}: run.run_dir: {exc}", file=sys.stderr)
            return exits.BAD_CONFIG
    run_dir = run.root
    resolved = resolve(topology, run.name, str(run_dir))
    resolved_path = run.topology_path
    if args.resume is not None:
        resolved.resume = True
        try:
            resolved_path = _record_resume(run, resolved, allow_changes=args.allow_changes)
        except _ResumeRefused as exc:
            for line in exc.lines:
                print(f"--resume: {line}", file=sys.stderr)
            return exits.BAD_CONFIG
        except OSError as exc:  # a full disk or a read-only run directory: nothing started yet
            print(f"echo2: {exits.cannot_write(Path(exc.filename or run.root), exc)}; nothing started", file=sys.stderr)
            return exits.FAILED
    else:
        try:
            resolved.dump(resolved_path)
        except OSError as exc:  # a full disk or a read-only run directory: nothing started yet
            print(f"echo2: {exits.cannot_write(resolved_path, exc)}; nothing started", file=sys.stderr)
            return exits.FAILED
    completes = {name: any(a.cls.completes_run for a in topology.actors_in(name)) for name in names}
    # The report is about the trusted side's records (steps, activation, broadcast): a host
    # of workers only has none, and its launcher exits with its samplers instead of after
    # seconds of plotting nothing.
    reported = any(a.cls.trusted for name in names for a in topology.actors_in(name))
    launcher = Launcher(resolved, resolved_path, names, completes, node_ranks=ranks, host_gpus=host_gpus)
    try:
        return asyncio.run(launcher.run())
    except KeyboardInterrupt:  # Ctrl-C before the handlers were installed: nothing started yet
        return exits.SIGINT
    finally:  # best-effort plots + report.md in run_dir/report; never changes the exit code
        try:
            if reported:
                from echo2.tools.report import write_report

                write_report(run_dir)
        except Exception as exc:
            logging.getLogger(__name__).warning("run report not written for %s: %s", run_dir, exc)


def _emit(prog: str, args: argparse.Namespace) -> int:
    """``--emit``: check what can be checked away from the cluster, write the files."""
    conflicting = [
        flag
        for flag, given in (
            ("--host", args.host),
            ("--resume", args.resume),
            ("--dry-run", args.dry_run),
            ("--run-dir", args.run_dir),
        )
        if given
    ]
    if conflicting or args.out is None:
        problem = f"{conflicting[0]}: not with --emit" if conflicting else "--emit needs --out DIR"
        print(f"{prog}: {problem}", file=sys.stderr)
        return exits.BAD_CONFIG
    try:
        topology = load_topology(args.topology, args.overrides)
        written = emit(
            topology, kind=args.emit, source=args.topology, overrides=args.overrides, out=args.out, image=args.image
        )
    except ConfigError as exc:
        print(f"{args.topology}: {one_line(exc)}", file=sys.stderr)
        return exits.BAD_CONFIG
    except OSError as exc:
        print(f"{prog}: --out: {exits.cannot_write(Path(exc.filename or args.out), exc)}", file=sys.stderr)
        return exits.FAILED
    for path in written:
        print(f"echo2: wrote {path}")
    return exits.OK


class _ResumeRefused(Exception):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(lines[0])
        self.lines = lines


def _record_resume(run: RunDir, resolved: ResolvedTopology, *, allow_changes: bool) -> Path:
    """Compare with the topology the run last ran with; record this resume; the path its processes read.

    Raises ``_ResumeRefused`` (nothing written) when fields differ and changes are not allowed."""
    recorded_path = run.current_topology_path()
    try:
        recorded = json.loads(recorded_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _ResumeRefused([f"cannot read {recorded_path}: {one_line(exc)}"]) from exc
    changes = topology_changes(recorded, resolved)
    if changes and not allow_changes:
        raise _ResumeRefused(
            [
                f"{len(changes)} field(s) differ from {recorded_path.relative_to(run.root)}, "
                "which the run last ran with (pass --allow-changes to resume with them):",
                *(f"  {change.describe()}" for change in changes),
            ]
        )
    resume = 1 + max((r["resume"] for r in run.resume_history() if isinstance(r.get("resume"), int)), default=0)
    path = run.resume_topology_path(resume)
    path.parent.mkdir(exist_ok=True)
    resolved.dump(path)
    record = {
        "resume": resume,
        "unix_s": round(time.time(), 3),
        "topology": str(path.relative_to(run.root)),
        "compared_with": str(recorded_path.relative_to(run.root)),
        "changes": msgspec.to_builtins(changes),
    }
    with open(run.resume_history_path, "a", encoding="utf-8") as history:
        history.write(json.dumps(record) + "\n")
    for change in changes:
        print(f"--resume: allowed change: {change.describe()}", file=sys.stderr)
    return path


def select_processes(topology: Topology, host: str | None) -> list[str]:
    """Processes this launcher starts: ``--host``'s, else those of hosts that are this machine
    (a multi-node process on each host of its ``node_hosts``)."""
    hosts = served_hosts(topology, host)
    names = [name for name, spec in topology.processes.items() if spec.host in hosts or hosts & set(spec.node_hosts)]
    if not names:
        raise ConfigError(f"no process is placed on host {', '.join(sorted(hosts))}", path="--host")
    return names


def node_ranks(topology: Topology, host: str | None) -> dict[str, int]:
    """The node rank this launcher starts of each multi-node process it runs (others: 0).

    ``ConfigError`` when it serves two nodes of one process (two hosts on one machine): each
    node needs its own launcher, ``--host``."""
    hosts = served_hosts(topology, host)
    ranks: dict[str, int] = {}
    for name, spec in topology.processes.items():
        mine = [rank for rank, node in enumerate(spec.node_hosts) if node in hosts]
        if len(mine) > 1:
            both = ", ".join(spec.node_hosts[r] for r in mine)
            raise ConfigError(
                f"hosts {both} are nodes of one process and all this launcher's; start one launcher per node "
                "with --host",
                path=f"processes.{name}.node_hosts",
            )
        if mine:
            ranks[name] = mine[0]
    return ranks


def served_hosts(topology: Topology, host: str | None) -> set[str]:
    """The hosts this launcher runs: ``--host``, the only one, or those that are this machine."""
    if host is not None:
        if host not in topology.hosts:
            known = ", ".join(sorted(topology.hosts))
            raise ConfigError(f"unknown host {host!r} (hosts: {known})", path="--host")
        hosts = {host}
    elif len(topology.hosts) == 1:
        hosts = set(topology.hosts)
    else:
        hosts = {name for name, spec in topology.hosts.items() if is_local_address(spec.address)}
        if not hosts:
            raise ConfigError("no host of the topology is this machine; choose one", path="--host")
    return hosts


def _host_gpus(topology: Topology, names: Sequence[str]) -> HostGPUs | None:
    """This machine's GPUs when a process it starts asks for some (``nvidia-smi`` takes a while)."""
    if not any(topology.processes[name].gpus for name in names):
        return None
    try:
        return probe_host_gpus()
    except ValueError as exc:
        raise ConfigError(str(exc), path="gpus") from None


def _replace_struct(struct: Any, **changes: Any) -> Any:
    return msgspec.structs.replace(struct, **changes)


def _to_json(resolved: ResolvedTopology) -> str:
    return msgspec.json.format(msgspec.json.encode(resolved), indent=2).decode()


def _banner(
    resolved: ResolvedTopology, names: Sequence[str], pids: dict[str, int], ranks: Mapping[str, int] | None = None
) -> str:
    lines = [f"echo2: run {resolved.run_id} in {resolved.run_dir}"]
    width = max((len(n) for n in names), default=0)
    for name in names:
        spec = resolved.processes[name]
        threads = str(spec.torch_threads) if spec.torch_threads else "-"
        pid = f"pid {pids[name]:<7} " if name in pids else ""
        actors = ", ".join(f"{a.name} ({a.kind})" for a in spec.actors)
        placement = f"host {spec.host}"
        if spec.torchrun:
            node = (ranks or {}).get(name, 0)
            placement = f"host {spec.node_hosts[node] if spec.node_hosts else spec.host}  torchrun {spec.nproc_per_node} rank(s)"
            if spec.nnodes > 1:
                placement += f" x {spec.nnodes} nodes (node {node})"
        if spec.gpus:
            placement += f"  gpus {','.join(map(str, spec.gpus))}"
        lines.append(f"echo2:   {name:<{width}}  {pid}{placement}  torch threads {threads}  actors: {actors}")
    return "".join(f"{line}\n" for line in lines)


# -- supervision ---------------------------------------------------------------------------


_MAX_RESTART_BACKOFF_S = 30.0


@dataclasses.dataclass(eq=False)
class Child:
    """One started process group."""

    name: str
    actors: list[str]
    completes_run: bool
    torch_threads: int
    log: TextIO | None
    """``logs/<name>.log``; None once it cannot be written (the output still reaches the terminal)."""
    critical: bool = False
    """Holds the learner: the critical path, whose OpenMP threads may spin."""
    proc: asyncio.subprocess.Process | None = None
    returncode: int | None = None
    restarts: int = 0
    restart_pending: bool = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.returncode is None

    def describe(self) -> str:
        return f"process {self.name!r} (actors {', '.join(self.actors)})"


class Launcher:
    """Starts the children, waits for exits, signals and the deadline, and shuts down."""

    def __init__(
        self,
        resolved: ResolvedTopology,
        resolved_path: Path,
        names: Sequence[str],
        completes_run: dict[str, bool],
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        node_ranks: Mapping[str, int] | None = None,
        host_gpus: HostGPUs | None = None,
    ) -> None:
        self.resolved = resolved
        self.resolved_path = resolved_path
        self.run_dir = Path(resolved.run_dir)
        self.layout = RunDir(self.run_dir)
        self.names = list(names)
        self.completes_run = completes_run
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.node_ranks = dict(node_ranks or {})
        """Node rank of each multi-node process this launcher starts (others: 0)."""
        self.host_gpus = host_gpus
        """This machine's GPUs, probed when a process asks for some (``_host_gpus``)."""
        self.status = 0
        self.reason = "all processes finished"
        self._started_at = time.time()
        self.shutting_down = False
        self.children: list[Child] = []
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._timers: list[asyncio.TimerHandle] = []
        self._prctl = _load_prctl()
        self._storage_errors: set[str] = set()
        self._lost_streams: set[TextIO] = set()

    def say(self, message: str, *, error: bool = False) -> None:
        self._to_terminal(self.err if error else self.out, f"echo2: {message}\n")

    def _to_terminal(self, stream: TextIO, text: str) -> None:
        """Write to our stdout or stderr; a terminal that went away (SIGHUP) stops nothing."""
        if stream in self._lost_streams:
            return
        try:
            stream.write(text)
            stream.flush()
        except OSError:  # EIO from a closed terminal, EPIPE from a closed pipe
            self._lost_streams.add(stream)
            _discard_output(stream)  # else Python's own flush at exit fails and exits 120

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        handled = self._install_signal_handlers(loop)
        try:
            async with asyncio.TaskGroup() as group, contextlib.AsyncExitStack() as servers:
                watchers = await self._serve_health(group, servers)
                watchers += self._serve_joins(group, servers)
                pumps = await self._start_all(group)
                if self.resolved.run.deadline_s > 0 and not self.shutting_down:
                    deadline = loop.call_later(
                        self.resolved.run.deadline_s,
                        self._events.put_nowait,
                        ("deadline", None),
                    )
                    self._timers.append(deadline)
                while any(child.alive or child.restart_pending for child in self.children):
                    kind, payload = await self._events.get()
                    self._handle(kind, payload)
                # Output ends when the pipes close; a grandchild holding one must not hang us.
                _, pending = await asyncio.wait(pumps, timeout=2.0) if pumps else (set(), set())
                for task in [*pending, *watchers]:
                    task.cancel()
        finally:
            for timer in self._timers:
                timer.cancel()
            for sig in handled:
                loop.remove_signal_handler(sig)
            for child in self.children:
                if child.alive:  # only reached if we were cancelled: never leave children behind
                    _signal(child, signal.SIGKILL)
            for child in self.children:
                self._close_log(child)
            self._finish()
        return self.status

    # -- health ----------------------------------------------------------------------
    #
    # A process cannot say it is stopped or stuck: the launcher of its host probes it and
    # serves the host's /health and /metrics ([hosts.NAME] metrics_port; echo2.observe.health).

    async def _serve_health(
        self, group: asyncio.TaskGroup, servers: contextlib.AsyncExitStack
    ) -> list[asyncio.Task[None]]:
        watchers: list[asyncio.Task[None]] = []
        hosts = sorted({self.resolved.processes[name].host for name in self.names})
        for host in hosts:
            port = self.resolved.hosts[host].metrics_port
            if not port:
                continue
            watch = ProcessWatch(
                {
                    n: self.resolved.processes[n].metrics_port
                    for n in self.names
                    if self.resolved.processes[n].host == host
                },
                self.resolved.run.heartbeat_s,
                self._live_pids,
                lambda: {c.name: c.restarts for c in self.children},
                host=host,
            )
            routes = {"/metrics": lambda watch=watch: exposition(launcher_families(watch.health()))}
            try:
                server = await serve(port, {**routes, **health_routes(watch.health)})
            except ServeError as exc:
                self.say(f"hosts.{host}.metrics_port: {exc.strerror}", error=True)
                self._begin_shutdown(f"hosts.{host}.metrics_port: {exc.strerror}", exits.FAILED)
                break
            servers.push_async_callback(_close_server, server)
            watchers.append(group.create_task(watch.run(), name=f"health:{host}"))
        return watchers

    def _serve_joins(self, group: asyncio.TaskGroup, servers: contextlib.AsyncExitStack) -> list[asyncio.Task[None]]:
        """Answer ``python -m echo2.join`` when this launcher's host has the join port."""
        joined = self.resolved.joined
        if (
            joined is None
            or self.shutting_down
            or joined.host not in {self.resolved.processes[n].host for n in self.names}
        ):
            return []
        where = f"hosts.{joined.host}.join_port"
        security = self.resolved.security
        try:
            curve = (
                CurveSettings.load(security.keys_dir, joined.host, self.resolved.hosts, security.allowed)
                if security.curve
                else None
            )
            server = JoinServer(self.resolved, curve=curve, stopping=lambda: self.shutting_down)
            transport = Transport()
            servers.callback(transport.close)
            endpoint = server.open(transport)
        except (ConfigError, TransportError) as exc:
            self.say(f"{where}: {one_line(exc)}", error=True)
            self._begin_shutdown(f"{where}: cannot answer joins", exits.FAILED)
            return []
        address = self.resolved.hosts[joined.host].address
        self.say(f"samplers join this run with: python -m echo2.join {address}:{server.port}")
        return [group.create_task(server.serve(endpoint), name="join")]

    def _live_pids(self) -> dict[str, int | None]:
        return {c.name: c.proc.pid if c.alive and c.proc is not None else None for c in self.children}

    # -- starting ------------------------------------------------------------------------

    async def _start_all(self, group: asyncio.TaskGroup) -> list[asyncio.Task[None]]:
        pumps: list[asyncio.Task[None]] = []
        pids: dict[str, int] = {}
        for name in self.names:
            if self.shutting_down:  # e.g. Ctrl-C or a failure while starting
                break
            spec = self.resolved.processes[name]
            child = Child(
                name=name,
                actors=[a.name for a in spec.actors],
                completes_run=self.completes_run.get(name, False),
                torch_threads=spec.torch_threads,
                critical=self.completes_run.get(name, False),  # the learner's process
                log=self._open_log(name),
            )
            if self.shutting_down:  # its log could not be opened
                self._close_log(child)
                break
            self.children.append(child)
            if not await self._spawn(child, group, pumps):
                break
            assert child.proc is not None  # _spawn set it
            pids[name] = child.proc.pid
        self._write_pids()
        started = [c.name for c in self.children if c.proc]
        self._to_terminal(self.out, _banner(self.resolved, started, pids, self.node_ranks))
        self.say(
            f"started {len(pids)} process(es); logs in {self.layout.logs_dir}; Ctrl-C stops, a second Ctrl-C kills"
        )
        return pumps

    async def _spawn(self, child: Child, group: asyncio.TaskGroup, pumps: list[asyncio.Task[None]]) -> bool:
        """Start (or restart) one child; False if the OS refused."""
        self._group, self._pumps = group, pumps
        name = child.name
        child.returncode = None
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *self._command(child),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._child_env(child) | self._placement_env(child),
                start_new_session=True,
                preexec_fn=self._child_preexec(),
            )
        except OSError as exc:
            self.say(f"cannot start {child.describe()}: {exc}", error=True)
            self._begin_shutdown(f"process {name!r} could not start", exits.FAILED)
            return False
        pumps.append(group.create_task(self._pump(child), name=f"output:{name}"))
        group.create_task(self._wait_exit(child), name=f"wait:{name}")
        return True

    def _write_pids(self) -> None:
        pids = {c.name: c.proc.pid for c in self.children if c.proc is not None}
        try:
            _write_atomically(self.layout.pids_path, json.dumps({"launcher": os.getpid(), "processes": pids}, indent=2))
        except OSError as exc:
            self._storage_failed(self.layout.pids_path, exc)

    # -- the run directory -----------------------------------------------------------
    #
    # A full disk or a read-only run directory stops the run like any failure: one line
    # naming the path, the children drained (their output still reaches the terminal),
    # the status written if it can be. The launcher itself never fails on a write.

    def _open_log(self, name: str) -> TextIO | None:
        path = self.layout.log_path(name)
        try:
            return open(path, "a", encoding="utf-8", buffering=1)
        except OSError as exc:
            self._storage_failed(path, exc)
            return None

    def _write_log(self, child: Child, text: str) -> None:
        if child.log is None:
            return
        try:
            child.log.write(text)
        except OSError as exc:
            self._storage_failed(self.layout.log_path(child.name), exc)
            self._close_log(child)

    def _close_log(self, child: Child) -> None:
        log, child.log = child.log, None
        if log is not None:
            with contextlib.suppress(OSError):  # already reported; what it still buffered is lost
                log.close()

    def _storage_failed(self, path: Path, exc: OSError) -> None:
        message = exits.cannot_write(path, exc)
        if message in self._storage_errors:
            return
        self._storage_errors.add(message)
        self.say(message, error=True)
        self._begin_shutdown(message, exits.FAILED)

    def _command(self, child: Child) -> list[str]:
        """The child's command line: ``echo2.launch.child``, or torchrun's agent for its ranks."""
        spec = self.resolved.processes[child.name]
        entry = ["-m", "echo2.launch.child"]
        if spec.torchrun:
            log_dir = self.layout.logs_dir / f"{child.name}.torchrun"
            entry = torchrun_args(spec, node_rank=self.node_ranks.get(child.name, 0), log_dir=log_dir)
        return [sys.executable, *entry, "--topology", str(self.resolved_path), "--process", child.name]

    def _placement_env(self, child: Child) -> dict[str, str]:
        """What the child's place in the topology adds to its environment: its GPUs, torchrun's."""
        env = {}
        spec = self.resolved.processes[child.name]
        if spec.gpus:
            assert self.host_gpus is not None  # probed and checked at load (main)
            env[VISIBLE_ENV] = self.host_gpus.visible(spec.gpus)
        if spec.torchrun:
            # The agent forwards our SIGTERM to the ranks and kills them after this long, no
            # sooner than we would kill it (torch versions that lack it wait a fixed 30 s).
            env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(math.ceil(self.resolved.run.drain_timeout_s + KILL_GRACE_S))
        return env

    def _child_env(self, child: Child) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if child.torch_threads > 0:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(child.torch_threads)
        # Idle OpenMP threads sleep instead of spinning: with more torch processes than
        # cores (a learner and samplers on a laptop), a spinning pool steals the core a
        # busy neighbour needs, and small ops get 10-100x slower. The learner is the
        # exception: it is the critical path, its steps are chains of small parallel
        # regions that each pay a futex wake-up when its threads sleep (its step took
        # ~0.18 s instead of ~0.155 s in benchmarks/pipeline.py), and what its spinning
        # takes from samplers the staleness budget absorbs.
        env.setdefault("OMP_WAIT_POLICY", "ACTIVE" if child.critical else "PASSIVE")
        return env

    def _child_preexec(self) -> Any:
        prctl, parent = self._prctl, os.getpid()
        if prctl is None:
            return None

        def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
            prctl(_PR_SET_PDEATHSIG, int(exits.LAUNCHER_DIED), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os._exit(1)

        return preexec

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        handled: list[int] = []
        for sig in _STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: the user asked the run to outlive the terminal
            try:
                loop.add_signal_handler(sig, self._events.put_nowait, ("signal", sig))
            except (
                ValueError,
                RuntimeError,
                NotImplementedError,
            ):  # not the main thread
                continue
            handled.append(sig)
        return handled

    # -- watching ------------------------------------------------------------------------

    async def _pump(self, child: Child) -> None:
        """Copy the child's output to our stdout (prefixed) and its log file, line by line."""
        assert child.proc is not None and child.proc.stdout is not None
        reader, prefix, partial = child.proc.stdout, f"[{child.name}] ", b""
        while chunk := await reader.read(_READ_CHUNK):
            *lines, partial = (partial + chunk).split(b"\n")
            self._emit(child, prefix, lines)
        if partial:
            self._emit(child, prefix, [partial])

    def _emit(self, child: Child, prefix: str, lines: list[bytes]) -> None:
        if not lines:
            return
        text = [line.decode("utf-8", "replace").rstrip("\r") for line in lines]
        self._write_log(child, "".join(f"{line}\n" for line in text))
        self._to_terminal(self.out, "".join(f"{prefix}{line}\n" for line in text))

    async def _wait_exit(self, child: Child) -> None:
        assert child.proc is not None
        code = await child.proc.wait()
        self._events.put_nowait(("exit", (child, code)))

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "exit":
            child, code = payload
            child.returncode = code
            self._on_exit(child, code)
        elif kind == "signal":
            name = signal.Signals(payload).name
            code = exits.SIGNAL_BASE + payload
            if not self.shutting_down:
                self._begin_shutdown(f"{name} received", code)
            else:
                if self.status not in (exits.FAILED, exits.DEADLINE):  # the first cause stays
                    self.status, self.reason = code, f"{self.reason}; forced by {name}"
                self._kill_all(f"second signal ({name})")
        elif kind == "deadline":
            reason = f"deadline of {self.resolved.run.deadline_s:g} s reached before the run completed"
            self._begin_shutdown(reason, exits.DEADLINE)
        elif kind == "restart":
            child = payload
            if self.shutting_down:
                child.restart_pending = False
            else:
                self._group.create_task(self._respawn(child), name=f"restart:{child.name}")
        elif kind == "kill":
            grace = self.resolved.run.drain_timeout_s + KILL_GRACE_S
            self._kill_all(f"still running {grace:g} s after SIGTERM")

    async def _respawn(self, child: Child) -> None:
        try:
            if await self._spawn(child, self._group, self._pumps):
                self._write_pids()
                assert child.proc is not None
                self.say(f"restarted {child.describe()} as pid {child.proc.pid} (restart {child.restarts})")
        finally:
            child.restart_pending = False

    def _maybe_restart(self, child: Child, what: str) -> bool:
        """Schedule a restart with back-off if the process asks for it; True if scheduled."""
        spec = self.resolved.processes[child.name]
        if spec.restart != "on-failure" or child.restarts >= spec.max_restarts:
            return False
        delay = min(spec.restart_backoff_s * 2**child.restarts, _MAX_RESTART_BACKOFF_S)
        child.restarts += 1
        child.restart_pending = True
        self.say(
            f"{child.describe()} died with {what}; restarting in {delay:g} s",
            error=True,
        )
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(delay, self._events.put_nowait, ("restart", child)))
        return True

    def _on_exit(self, child: Child, code: int) -> None:
        if code != 0:
            what = f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
            storage = code == exits.STORAGE  # a restart would fail the same way
            if storage:
                what += ": it could not write the run directory (its last line says where)"
            if self.shutting_down:
                self.say(f"{child.describe()} exited with {what} during shutdown")
            elif not storage and self._maybe_restart(child, what):
                return
            else:
                self.say(f"{child.describe()} failed with {what}", error=True)
                failed = "could not write the run directory" if storage else "failed"
                self._begin_shutdown(f"process {child.name!r} {failed}", exits.FAILED)
        elif child.completes_run and not self.shutting_down:
            self.say(f"{child.describe()} completed the run")
            summary = self._summary()
            if summary.get("steps") == 0 and summary.get("stopped_by") not in (None, "max_steps"):
                # Its own budget (max_wall_s) ran out before any batch came: nothing trained
                # is no success, whatever stopped it.
                why = f"process {child.name!r} stopped ({summary['stopped_by']}) before training any step"
                self._begin_shutdown(why, exits.DEADLINE)
            else:
                self._begin_shutdown(f"process {child.name!r} completed the run", 0)
        else:
            self.say(f"{child.describe()} exited")

    # -- stopping ------------------------------------------------------------------------

    def _begin_shutdown(self, reason: str, status: int) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        self.status, self.reason = status, reason
        live = [c for c in self.children if c.alive]
        if live:
            self.say(f"stopping ({reason}): SIGTERM to {', '.join(c.name for c in live)}")
        for child in live:
            _signal(child, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        delay = self.resolved.run.drain_timeout_s + KILL_GRACE_S
        self._timers.append(loop.call_later(delay, self._events.put_nowait, ("kill", None)))

    def _kill_all(self, why: str) -> None:
        live = [c for c in self.children if c.alive]
        if live:
            self.say(f"killing {', '.join(c.name for c in live)}: {why}", error=True)
        for child in live:
            _signal(child, signal.SIGKILL)

    def _finish(self) -> None:
        if self.status != 0 and (steps := self._steps_trained()) is not None:  # how far it got
            self.reason += f" ({steps} steps trained)"
        codes = {c.name: c.returncode for c in self.children}
        status = {"exit_code": self.status, "reason": self.reason, "processes": codes}
        try:
            _write_atomically(self.layout.status_path, json.dumps(status, indent=2))
        except OSError as exc:
            self.say(f"status not written: {exits.cannot_write(self.layout.status_path, exc)}", error=True)
        ipc_dir = self.resolved.ipc_dir
        if ipc_dir.startswith("/tmp/echo2-") and not any(c.alive for c in self.children):
            shutil.rmtree(ipc_dir, ignore_errors=True)
        self.say(
            f"run {self.resolved.run_id} {exits.outcome(self.status)}: {self.reason} (exit {self.status}); "
            f"run dir {self.run_dir}"
        )

    def _steps_trained(self) -> int | None:
        """Steps in the summary the learner of this host wrote during this launch, if it did."""
        steps = self._summary().get("steps")
        return steps if isinstance(steps, int) else None

    def _summary(self) -> dict[str, Any]:
        """The summary the learner of this host wrote during this launch ({} if none)."""
        path = self.layout.summary_path
        try:
            if path.stat().st_mtime < self._started_at:  # a previous launch's (before --resume)
                return {}
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return summary if isinstance(summary, dict) else {}


async def _close_server(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


def _discard_output(stream: TextIO) -> None:
    """Point a lost stdout or stderr at /dev/null, so what it still buffers can be flushed."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's StringIO)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` and a newline to ``path`` whole or not at all (a full disk leaves no torn file)."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text + "\n")
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _signal(child: Child, sig: int) -> None:
    """Signal one child by the PID we started (never a group, never by name)."""
    assert child.proc is not None
    with contextlib.suppress(ProcessLookupError):
        child.proc.send_signal(sig)


def _load_prctl() -> Any:
    """libc's prctl, loaded before any fork (nothing is loaded in the child)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
