"""Run one echo2 topology across the bed: one ``python -m echo2.launch --host`` per namespace.

``run_job`` copies the topology into the job's directory with one more actor on the
learner's host (``observer.WanObserver``, which records sampler installs and weight-path
counters that only telemetry carries), starts every host's launcher in its namespace
(each with its own ``--run-dir`` and run name, as on separate machines), optionally takes one host's
link down for a while once training has started, waits for the learner's launcher, gives
the others ``exit_grace_s`` to follow (then SIGTERM: the bed measures, it does not wait
for ``run.deadline_s``), and returns a ``JobResult``: every launcher's exit code and how
long after the learner finished (its ``summary.json`` written) it exited, the learner's summary, installs per sampler, per-link
bytes, the relay's drop counters and the audit of all hosts' ledgers together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from benchmarks.wan.netbed import Bed, wait_for
from echo2 import ledger
from echo2.rundir import RunDir, read_jsonl_files

OBSERVER = "wan_observer"
_ACCEPTED = str(ledger.Accepted.__struct_config__.tag)
_TRAINED = str(ledger.Trained.__struct_config__.tag)
OBSERVER_TABLE = f"""

# Added by benchmarks/wan: records sampler installs and weight-path counters (telemetry only).
[actors.{OBSERVER}]
kind = "benchmarks.wan.observer:WanObserver"
process = "{{process}}"
"""


@dataclasses.dataclass(frozen=True)
class Outage:
    """``after_s`` after the learner's first step: ``host``'s link down for ``duration_s``
    (``kind = "link"``), or SIGKILL to the process holding ``host``'s sampler (``"kill"``;
    its launcher restarts it if its process says ``restart = "on-failure"``)."""

    host: str
    after_s: float
    duration_s: float = 0.0
    kind: Literal["link", "kill"] = "link"


@dataclasses.dataclass
class JobResult:
    exit_codes: dict[str, int | None]
    exit_after_learner_s: dict[str, float | None]
    """Seconds from the learner finishing (``summary.json`` written) to each launcher's
    exit, the learner host's included; None: still running ``exit_grace_s`` after the
    learner host's launcher exited."""
    run_dirs: dict[str, Path]
    summary: dict[str, Any]
    installs: dict[str, list[int]]
    """Sampler -> versions it installed, in order."""
    install_times: dict[str, list[tuple[int, float]]]
    """Sampler -> (version, unix seconds it was installed), in order."""
    arrivals: dict[str, list[tuple[int, float, float]]]
    """Sampler -> (version, seconds from its manifest to complete, unix seconds it was
    complete), in order; zeros where the sampler did not measure."""
    published: list[int]
    """Versions the publisher broadcast (its ``broadcast`` records), in order."""
    broadcasts: list[dict[str, Any]]
    step_unix_s: dict[int, float]
    accepted: list[dict[str, Any]]
    """The Buffer's ``accepted`` ledger events (task, sampler, version, t)."""
    trained: list[dict[str, Any]]
    link_bytes: dict[str, dict[str, int]]
    relay: dict[str, dict[str, int]]
    relay_cpu_s: float
    """CPU seconds the emulator's relay spent during the job (``realtime``: under SCHED_RR)."""
    relay_realtime: bool
    stats: dict[str, dict[str, Any]]
    """Last statistics record of each sampler and publisher (the observer's)."""
    outage: dict[str, Any] | None
    audit: dict[str, Any]
    wall_s: float


def run_job(
    bed: Bed,
    topology: Path,
    job_dir: Path,
    *,
    learner_host: str,
    overrides: Sequence[str] = (),
    observer_process: str = "data",
    outage: Outage | None = None,
    exit_grace_s: float = 20.0,
    timeout_s: float = 300.0,
) -> JobResult:
    job_dir.mkdir(parents=True, exist_ok=True)
    derived = job_dir / "topology.toml"
    derived.write_text(topology.read_text() + OBSERVER_TABLE.format(process=observer_process))
    hosts = [learner_host, *(h for h in bed.hosts if h != learner_host)]
    procs: dict[str, subprocess.Popen[Any]] = {}
    outputs = {}
    before = bed.link_bytes()
    relay_before = bed.relay_counters()
    relay_cpu_before = float(bed.relay_cpu.get("cpu_s", 0.0))
    started = time.monotonic()
    run_name = tomllib.loads(topology.read_text()).get("run", {}).get("name", "echo2")
    for host in hosts:
        outputs[host] = open(job_dir / f"{host}.out", "w")  # closed below
        argv = [sys.executable, "-m", "echo2.launch", str(derived), "--host", host, "--run-dir", str(job_dir / host)]
        # The namespaces share one /tmp, and a run's ipc directory is /tmp/echo2-<run id>,
        # which a launcher removes when its processes are gone: launchers started in the
        # same second would share it. A name per host keeps them apart, as separate
        # machines are (nothing across hosts depends on the run's name).
        argv += ["--set", f'run.name="{run_name}-{host}"']
        for override in overrides:
            argv += ["--set", override]
        procs[host] = bed.popen(host, argv, stdout=outputs[host], stderr=subprocess.STDOUT)
    learner = procs[learner_host]
    exits = _ExitTimes(procs)
    stopped: set[str] = set()  # launchers the bed had to stop
    outage_times: dict[str, Any] | None = None
    try:
        if outage is not None:
            outage_times = _outage(bed, job_dir, learner_host, learner, outage, timeout_s)
        learner.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        learner_exit = time.monotonic()
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, exit_grace_s - (time.monotonic() - learner_exit)))
    finally:
        for host, proc in procs.items():
            if proc.poll() is None:
                stopped.add(host)
                _stop(proc)
        for out in outputs.values():
            out.close()
    wall_s = time.monotonic() - started
    after = bed.link_bytes()
    relay_after = bed.relay_counters()
    run_dirs = {host: _only_run_dir(job_dir / host) for host in hosts}
    summary = RunDir(run_dirs[learner_host]).summary_path
    finished = summary.stat().st_mtime if summary.exists() else None  # the learner's last act
    exited = exits.wall_times()
    exit_after = {
        host: None if host in stopped or finished is None else round(exited[host] - finished, 2) for host in hosts
    }
    return _collect(
        run_dirs,
        learner_host,
        exit_codes={host: proc.returncode for host, proc in procs.items()},
        exit_after=exit_after,
        link_bytes={h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after},
        relay={h: {k: relay_after[h][k] - relay_before[h][k] for k in relay_after[h]} for h in relay_after},
        relay_cpu_s=round(float(bed.relay_cpu.get("cpu_s", 0.0)) - relay_cpu_before, 2),
        relay_realtime=bool(bed.relay_cpu.get("realtime", False)),
        outage=outage_times,
        wall_s=wall_s,
    )


class _ExitTimes:
    """When each launcher exited (wall clock, as ``summary.json``'s mtime): one waiting
    thread per launcher, so an edge that exits while the bed is busy elsewhere (an outage's
    schedule) is timed when it exits, not when the bed looks."""

    def __init__(self, procs: dict[str, subprocess.Popen[Any]]) -> None:
        self._at: dict[str, float] = {}
        self._threads = [
            threading.Thread(target=self._wait, args=(host, proc), name=f"exit:{host}", daemon=True)
            for host, proc in procs.items()
        ]
        for thread in self._threads:
            thread.start()

    def _wait(self, host: str, proc: subprocess.Popen[Any]) -> None:
        proc.wait()
        self._at[host] = time.time()

    def wall_times(self) -> dict[str, float]:
        """Once every launcher has exited (the bed stops those that do not)."""
        for thread in self._threads:
            thread.join()
        return dict(self._at)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the launcher drains its children and exits 143
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _only_run_dir(parent: Path) -> Path:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    if len(dirs) != 1:
        raise RuntimeError(f"expected one run directory under {parent}, found {len(dirs)}")
    return dirs[0]


def _outage(
    bed: Bed, job_dir: Path, learner_host: str, learner: subprocess.Popen[Any], outage: Outage, timeout_s: float
) -> dict[str, Any]:
    """Wait for the learner's first step, then take the link down and up again, or kill."""
    learner_runs = job_dir / learner_host

    def first_step() -> float | None:
        for record in read_jsonl_files(learner_runs.glob("*/metrics/learner.jsonl")):
            if record.get("kind") == "step":
                return float(record["unix_s"])
        return None

    if not wait_for(lambda: first_step() is not None or learner.poll() is not None, timeout_s, interval_s=0.5):
        raise RuntimeError("the learner trained no step before the outage was due")
    first = first_step()
    if first is None:
        raise RuntimeError("the learner exited before its first step")
    time.sleep(max(0.0, first + outage.after_s - time.time()))  # wall-clock schedule, not a handshake
    down = time.time()
    if outage.kind == "kill":
        pids = json.loads(RunDir(_only_run_dir(job_dir / outage.host)).pids_path.read_text())["processes"]
        (pid,) = (pid for name, pid in pids.items() if name.startswith("sampler"))
        os.kill(pid, signal.SIGKILL)  # a PID its launcher started and recorded
    else:
        bed.set_link(outage.host, up=False)
        time.sleep(outage.duration_s)
        bed.set_link(outage.host, up=True)
    return {"host": outage.host, "kind": outage.kind, "down_unix_s": down, "up_unix_s": time.time()}


def _collect(
    run_dirs: dict[str, Path],
    learner_host: str,
    *,
    exit_codes: dict[str, int | None],
    exit_after: dict[str, float | None],
    link_bytes: dict[str, dict[str, int]],
    relay: dict[str, dict[str, int]],
    relay_cpu_s: float,
    relay_realtime: bool,
    outage: dict[str, Any] | None,
    wall_s: float,
) -> JobResult:
    learner_run = RunDir(run_dirs[learner_host])
    summary_path = learner_run.summary_path
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    installs: dict[str, list[int]] = {}
    install_times: dict[str, list[tuple[int, float]]] = {}
    arrivals: dict[str, list[tuple[int, float, float]]] = {}
    stats: dict[str, dict[str, Any]] = {}
    for record in learner_run.metrics(OBSERVER):
        if record["kind"] == "install":
            installs.setdefault(record["sampler"], []).append(int(record["version"]))
            install_times.setdefault(record["sampler"], []).append((int(record["version"]), float(record["unix_s"])))
            arrival = (
                int(record["version"]),
                float(record.get("received_s", 0.0)),
                float(record.get("complete_unix_s", 0.0)),
            )
            arrivals.setdefault(record["sampler"], []).append(arrival)
        elif record["kind"] == "stats":
            stats[record["actor"]] = record
    broadcasts = [r for run in run_dirs.values() for r in RunDir(run).all_metrics("broadcast")]
    steps = learner_run.metrics("learner", "step")
    events = list(read_jsonl_files(learner_run.ledger_paths()))
    accepted = [e for e in events if e.get("ev") == _ACCEPTED]
    trained = [e for e in events if e.get("ev") == _TRAINED]
    return JobResult(
        exit_codes=exit_codes,
        exit_after_learner_s=exit_after,
        run_dirs=run_dirs,
        summary=summary,
        installs=installs,
        install_times=install_times,
        arrivals=arrivals,
        published=[int(b["version"]) for b in broadcasts],
        broadcasts=broadcasts,
        step_unix_s={int(r["step"]): float(r["unix_s"]) for r in steps},
        accepted=accepted,
        trained=trained,
        link_bytes=link_bytes,
        relay=relay,
        relay_cpu_s=relay_cpu_s,
        relay_realtime=relay_realtime,
        stats=stats,
        outage=outage,
        audit=_audit(list(run_dirs.values())),
        wall_s=round(wall_s, 1),
    )


def _audit(run_dirs: list[Path]) -> dict[str, Any]:
    """``python -m echo2.audit`` over every host's run directory (one without a ledger is
    listed in its report)."""
    done = subprocess.run(
        [sys.executable, "-m", "echo2.audit", "--json", *map(str, run_dirs)], capture_output=True, text=True
    )
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"error": (done.stdout + done.stderr).strip()[-500:]}
    return {"exit_code": done.returncode, "without_ledger": report.get("without_ledger", []), "report": report}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
