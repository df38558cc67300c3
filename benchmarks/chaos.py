"""Chaos: the main job while its processes are killed, a sampler is frozen and hostile frames
hit every bound socket; the same job without faults, in the same invocation, is the baseline.

    python -m benchmarks.chaos [--seconds 180] [--seed 1] [--kill-every 0] [--bad-frames 10000] [--json] [--quick]

One invocation runs, on the same topology (examples/topology.toml with samplers and the data
process restarted by the launcher on failure, a checkpoint every 10 steps) and for the same
wall-clock length:

1. a fault-free run (the baseline);
2. the chaos run: at random moments (seeded, one each in a random order, spread over the
   middle of the run) a sampler process gets SIGKILL (the launcher restarts it), the data
   process (PromptSource, Rewarder, Buffer) gets SIGKILL (restarted; it continues from its
   journals), the learner gets SIGKILL (the run stops; it is continued with ``--resume``
   for the rest of the time) and a sampler is frozen with SIGSTOP for ``--stop-s`` seconds;
   every ``--kill-every`` seconds (0: never) one more sampler is killed; and a flooder sends
   ``--bad-frames`` malformed messages, spread over the run, to every socket bound;
3. a transport check: a legitimate PUSH->PULL stream into one echo2 endpoint with and
   without a concurrent flood of bad frames into the same endpoint.

Reports, for each run: learner steps per minute (the final learner version over the time
from its first step to its last, resumes and restarts included: steps a killed learner
trained after its last checkpoint do not count), the audit (``echo2.audit``: lost,
unresolved, accepted twice, duplicated, late-accepted), the stale-dropped fraction (groups
dropped as stale on arrival, while stored, or refused at admission as ``stale_version``,
over groups accepted), lease re-issue latency after each sampler kill, crashes (processes
that died other than by our signals), decode errors, and the legitimate peer's throughput
ratio under flood.

Floors (issue 18): 0 lost, 0 unresolved, 0 duplicated, 0 accepted twice, 0 late-accepted;
stale-dropped <= 5% of accepted; steps/min >= 0.7x the fault-free run's; 0 crashes from bad
frames; legitimate throughput >= 0.9x.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from echo2.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "examples" / "topology.toml"
FAULTS = ("sampler_kill", "data_kill", "learner_kill", "sampler_stop")
"""The faults of a chaos run, one of each."""
CHECKPOINT_EVERY = 10
"""Learner steps between checkpoints: what a killed learner's resume trains again (and the
groups made by its lost steps' weights, dropped as stale)."""


def _launch(run_parent: Path, seconds: float, *extra: str) -> subprocess.Popen[str]:
    """The main job for ``seconds``, samplers restarted on failure; ``extra`` arguments
    (later ``--set``s of a path win) after."""
    command = [
        sys.executable, "-m", "echo2.launch", str(TOPOLOGY), "--run-dir", str(run_parent),
        "--set", f"run.deadline_s={seconds:.1f}",
        "--set", "actors.learner.config.max_steps=1000000",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.learner.config.eval_prompts=200",
        "--set", "actors.learner.config.checkpoint_every=0",
        "--set", "actors.prompt_source.config.lease_ttl_s=10.0",
        "--set", 'processes.sampler-{i}.restart="on-failure"',
        "--set", "processes.sampler-{i}.restart_backoff_s=0.5",
        "--set", "processes.sampler-{i}.max_restarts=1000",
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


DURABLE = (
    "--set", "actors.learner.config.eval_prompts=100",
    "--set", f"actors.learner.config.checkpoint_every={CHECKPOINT_EVERY}",
    "--set", 'processes.data.restart="on-failure"',
    "--set", "processes.data.restart_backoff_s=0.5",
    "--set", "processes.data.max_restarts=1000",
)  # fmt: skip
"""What the chaos runs (and their baseline) add: the data process restarted on failure,
checkpoints a learner resume continues from."""


def _run_dir(parent: Path, timeout_s: float = 60) -> RunDir:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in parent.iterdir():
            if RunDir(path).pids_path.exists():
                return RunDir(path)
        time.sleep(0.1)
    raise RuntimeError(f"no run started under {parent}")


def _bound_urls(run: RunDir) -> list[tuple[str, int]]:
    """(url, raw socket type to reach it) for every non-inproc bind of the data process."""
    resolved = json.loads(run.topology_path.read_text())
    out = []
    for process in resolved["processes"].values():
        for actor in process["actors"]:
            for port in actor["ports"].values():
                for url in port["bind"]:
                    if url.startswith(("ipc://", "tcp://")):
                        out.append(url.replace("tcp://*:", "tcp://127.0.0.1:"))
    kinds = []
    for url in out:
        # ROUTER ports take DEALER peers; PULL/SUB ports take PUSH; XPUB ignores data.
        name = url.rsplit("/", 1)[-1]
        kinds.append((url, zmq.DEALER if name.endswith((".tasks", ".batch", ".leases")) else zmq.PUSH))
    return kinds


def _flood(targets: list[tuple[str, int]], total: int, seconds: float, stop: threading.Event) -> int:
    """Send ``total`` malformed messages spread over ``seconds`` across ``targets``."""
    context = zmq.Context.instance()
    sockets = []
    for url, kind in targets:
        s = context.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.connect(url)
        sockets.append(s)
    rng = random.Random(0)
    sent = 0
    interval = seconds / max(total, 1)
    started = time.monotonic()
    try:
        while sent < total and not stop.is_set():
            frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
            if rng.random() < 0.3:
                frames[0] = b"\xe2\x01" + frames[0]  # passes the magic check, fails later
            try:
                sockets[sent % len(sockets)].send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                pass  # a peer that is restarting: the frame is simply not delivered
            sent += 1
            # Pace in bursts (a wake-up per ~50 ms, not per frame): the flooder's own CPU
            # must not be what slows the machine, only the frames it sends.
            ahead = started + sent * interval - time.monotonic()
            if ahead > 0.05:
                stop.wait(ahead)
    finally:
        for s in sockets:
            s.close(linger=0)
    return sent


def _steps_per_minute(run: RunDir) -> tuple[float, int]:
    """(learner steps per minute, final version): the final version over the wall time from
    the first step to the last, all segments of a resumed run together."""
    steps = run.metrics("learner", "step")
    if len(steps) < 2:
        return 0.0, steps[-1]["step"] if steps else 0
    span = steps[-1]["unix_s"] - steps[0]["unix_s"]
    progress = steps[-1]["step"] - steps[0]["step"]
    return 60.0 * progress / span, steps[-1]["step"]


def _reissue_latencies(run: RunDir, kills: list[float]) -> list[float]:
    events = read_jsonl(run.ledger_path("prompt_source")).records
    reissues = sorted(e["t"] for e in events if e["ev"] == "leased" and e.get("attempt", 0) > 0)
    out = []
    for t_kill in kills:
        later = [t for t in reissues if t >= t_kill]
        if later:
            out.append(later[0] - t_kill)
    return out


@dataclass
class Faults:
    """The chaos schedule: when (seconds after the start) each fault strikes."""

    at: list[tuple[float, str]]
    """(seconds after the learner's first step, fault)."""
    stop_s: float
    kill_every: float
    done: list[tuple[float, str, str]] = field(default_factory=list)
    """(unix time, fault, process) as applied."""

    @classmethod
    def draw(cls, seconds: float, seed: int, stop_s: float, kill_every: float) -> Faults:
        """One of each fault, in a random order, each at a random moment of its own slot of
        10% to 65% of the run's length after the learner's first step, so that each meets a
        system that trains."""
        rng = random.Random(seed)
        order = rng.sample(FAULTS, len(FAULTS))
        begin, width = 0.1 * seconds, 0.55 * seconds / len(order)
        at = [(begin + i * width + rng.uniform(0.1, 0.9) * width, fault) for i, fault in enumerate(order)]
        if kill_every > 0:
            t = kill_every
            while t < 0.7 * seconds:
                at.append((t, "sampler_kill"))
                t += kill_every
        return cls(at=sorted(at), stop_s=stop_s, kill_every=kill_every)


def _pids(run: RunDir) -> dict[str, int]:
    try:
        return json.loads(run.pids_path.read_text())["processes"]
    except (OSError, ValueError, KeyError):
        return {}


def _strike(run: RunDir, fault: str, rng: random.Random) -> tuple[str, int] | None:
    """Apply one fault now; (process, pid) it hit, None if there was nothing to hit."""
    pids = _pids(run)
    samplers = sorted(n for n in pids if n.startswith("sampler"))
    name = {"data_kill": "data", "learner_kill": "learner"}.get(fault) or (rng.choice(samplers) if samplers else "")
    if name not in pids:
        return None
    try:
        os.kill(pids[name], signal.SIGSTOP if fault == "sampler_stop" else signal.SIGKILL)
    except ProcessLookupError:
        return None  # it is being restarted right now
    return name, pids[name]


def run_case(seconds: float, *, faults: Faults | None, bad_frames: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="echo2-chaos-") as parent_name:
        parent = Path(parent_name)
        started = time.monotonic()
        launcher = _launch(parent, seconds, *DURABLE)
        outputs: list[str] = []
        exit_codes: list[int] = []
        stop = threading.Event()
        flooded = [0]
        flooder = None
        rng = random.Random(1)
        pending = list(faults.at) if faults is not None else []
        frozen: list[tuple[float, int]] = []  # (when to resume, pid)
        try:
            run = _run_dir(parent)
            if faults is not None and bad_frames:
                targets = _bound_urls(run)
                flooder = threading.Thread(
                    target=lambda: flooded.__setitem__(0, _flood(targets, bad_frames, seconds * 0.9, stop))
                )
                flooder.start()
            training_since: float | None = None  # the fault clock starts at the first step
            while True:
                if training_since is None and run.metrics_path("learner").exists() and run.metrics("learner", "step"):
                    training_since = time.monotonic()
                elapsed = time.monotonic() - training_since if training_since is not None else -1.0
                for when, pid in [f for f in frozen if f[0] <= elapsed]:
                    frozen.remove((when, pid))
                    with_signal(pid, signal.SIGCONT)
                while pending and pending[0][0] <= elapsed and launcher.poll() is None:
                    _, fault = pending.pop(0)
                    hit = _strike(run, fault, rng)
                    if hit is None:  # its target is being restarted: strike once it is back
                        bisect.insort(pending, (elapsed + 1.0, fault))
                    else:
                        assert faults is not None
                        faults.done.append((time.time(), fault, hit[0]))
                        if fault == "sampler_stop":
                            frozen.append((elapsed + faults.stop_s, hit[1]))
                if launcher.poll() is not None:
                    output, _ = launcher.communicate()
                    outputs.append(output)
                    exit_codes.append(launcher.returncode)
                    left = seconds - (time.monotonic() - started)
                    learner_killed = faults is not None and any(f == "learner_kill" for _, f, _ in faults.done)
                    if launcher.returncode == 1 and learner_killed and len(exit_codes) == 1 and left > 20:
                        # The learner's path: --resume, for the time that is left.
                        launcher = _launch(parent, left, *DURABLE, "--resume", str(run.root), "--allow-changes")
                        continue
                    break
                time.sleep(0.05)  # the fault schedule's clock, not a synchronisation
        finally:
            stop.set()
            for _, pid in frozen:
                with_signal(pid, signal.SIGCONT)
            if flooder is not None:
                flooder.join()
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        wall_s = time.monotonic() - started
        status = json.loads(run.status_path.read_text())
        audit = subprocess.run(
            [sys.executable, "-m", "echo2.audit", str(run.root), "--json"], capture_output=True, text=True, cwd=ROOT
        )
        report = json.loads(audit.stdout) if audit.stdout.strip().startswith("{") else {}
        spm, steps = _steps_per_minute(run)
        text = "".join(outputs)
        kills = [f for f in (faults.done if faults is not None else []) if f[1] != "sampler_stop"]
        deaths = sum(1 for line in text.splitlines() if "failed with" in line or "died with" in line)
        accepted = report.get("accepted", 0)
        rejected, dropped = report.get("rejected", {}), report.get("dropped", {})
        stale = rejected.get("dropped:stale", 0) + dropped.get("stale", 0) + rejected.get("rejected:stale_version", 0)
        sampler_kills = [t for t, f, _ in kills if f == "sampler_kill"]
        latencies = _reissue_latencies(run, sampler_kills)
        return {
            "case": "chaos" if faults is not None else "fault-free",
            "seconds": seconds,
            "wall_s": round(wall_s, 1),
            "exit_codes": exit_codes,
            "status": status["reason"],
            "faults": [[round(t - time.time() + wall_s, 1), f, p] for t, f, p in faults.done] if faults else [],
            "steps": steps,
            "steps_per_min": round(spm, 1),
            "resumed": len(exit_codes) > 1,
            "crashes_other_than_kills": max(0, deaths - len(kills)),
            "bad_frames_sent": flooded[0],
            "decode_error_log_lines": sum(1 for line in text.splitlines() if "dropped a malformed message" in line),
            "accepted": accepted,
            "trained": report.get("trained", 0),
            "stale_dropped": stale,
            "stale_fraction": round(stale / accepted, 4) if accepted else None,
            "lost": len(report.get("lost", [])),
            "unresolved": len(report.get("unresolved", [])),
            "accepted_twice": len(report.get("accepted_twice", [])),
            "duplicated": len(report.get("duplicated", [])),
            "late_accepted": len(report.get("late_accepted", [])),
            "outstanding_at_end": report.get("outstanding_at_end", 0),
            "voided_by_resume": report.get("voided_by_resume", 0),
            "rejected": rejected,
            "dropped": dropped,
            "audit_ok": report.get("ok", False),
            "reissue_latency_s_median": round(statistics.median(latencies), 2) if latencies else None,
            "reissue_latency_s_max": round(max(latencies), 2) if latencies else None,
        }


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # gone (the launcher stopped it)


FLOOD_RATE = 2000  # bad frames per second during the legitimate-throughput check


def _flood_process(url: str, stop) -> None:  # type: ignore[no-untyped-def]
    local = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), local.set()), daemon=True).start()
    _flood([(url, zmq.PUSH)], 10**9, 10**9 / FLOOD_RATE, local)


async def _legit_throughput(flood: bool, messages: int = 50000) -> float:
    import multiprocessing

    from echo2.messages import WorkRequest
    from echo2.transport import Transport

    async with Transport() as transport:
        rx = transport.pull(name="rx", bind=["tcp://127.0.0.1:0"], producers=1)
        tx = transport.push(name="tx", connect=rx.endpoints)
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        flooder = None
        if flood:  # another process, as a hostile peer would be
            flooder = context.Process(target=_flood_process, args=(rx.endpoints[0], stop))
            flooder.start()
            while rx.statistics().decode_errors == 0:  # the flood has reached the endpoint
                try:
                    await asyncio.wait_for(rx.recv(), 0.05)
                except TimeoutError:
                    continue
        try:
            message = WorkRequest(sampler_id="legit", credits=1)

            async def produce() -> None:
                for _ in range(messages):
                    await tx.send(message)
                await tx.send_eos("tx")

            started = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                group.create_task(produce())
                received = 0
                async for m in rx:
                    if isinstance(m, WorkRequest) and m.sampler_id == "legit":
                        received += 1
            elapsed = time.perf_counter() - started
        finally:
            stop.set()
            if flooder is not None:
                flooder.join(timeout=10)
        assert received == messages
        return messages / elapsed


def legit_ratio(repeats: int) -> dict:
    calm = [asyncio.run(_legit_throughput(False)) for _ in range(repeats)]
    flooded = [asyncio.run(_legit_throughput(True)) for _ in range(repeats)]
    return {
        "case": "legit-under-flood",
        "flood_bad_frames_per_s": FLOOD_RATE,
        "calm_msgs_per_s": round(statistics.median(calm)),
        "flooded_msgs_per_s": round(statistics.median(flooded)),
        "ratio": round(statistics.median(flooded) / statistics.median(calm), 3),
    }


def floors(bases: list[dict], chaoses: list[dict], legit: dict | None) -> tuple[dict[str, object], dict[str, bool]]:
    """The figures (steps/min: medians over the pairs; the audit and the stale fraction: the
    worst chaos run) and which floors they meet."""
    base_spm = statistics.median(r["steps_per_min"] for r in bases)
    chaos_spm = statistics.median(r["steps_per_min"] for r in chaoses)
    worst = {name: max(r[name] for r in chaoses) for name in ("lost", "unresolved", "accepted_twice", "duplicated")}
    worst_stale = max((r["stale_fraction"] or 0.0) for r in chaoses)
    figures: dict[str, object] = {
        "pairs": len(chaoses),
        "steps_per_min_fault_free_median": round(base_spm, 1),
        "steps_per_min_chaos_median": round(chaos_spm, 1),
        "steps_per_min_ratio": round(chaos_spm / base_spm, 3) if base_spm else None,
        "steps_per_min_ratio_by_pair": [
            round(c["steps_per_min"] / b["steps_per_min"], 3) if b["steps_per_min"] else None
            for b, c in zip(bases, chaoses, strict=True)
        ],
        "stale_fraction_worst": worst_stale,
        "stale_fraction_fault_free_worst": max((r["stale_fraction"] or 0.0) for r in bases),
        **{f"{name}_worst": n for name, n in worst.items()},
    }
    met = {
        "lost == 0": worst["lost"] == 0,
        "unresolved == 0": worst["unresolved"] == 0,
        "accepted twice == 0": worst["accepted_twice"] == 0,
        "duplicated == 0": worst["duplicated"] == 0,
        "late_accepted == 0": all(r["late_accepted"] == 0 for r in chaoses),
        "audit ok": all(r["audit_ok"] for r in chaoses),
        "every fault struck": all(len(r["faults"]) >= len(FAULTS) for r in chaoses),
        "stale-dropped <= 5% of accepted": worst_stale <= 0.05,
        "steps/min >= 0.7x fault-free": bool(base_spm) and chaos_spm >= 0.7 * base_spm,
        "0 crashes from bad frames": all(r["crashes_other_than_kills"] == 0 for r in chaoses),
    }
    if legit is not None:
        met["legit throughput >= 0.9x under flood"] = legit["ratio"] >= 0.9
    return figures, met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--pairs", type=int, default=1, help="fault-free/chaos pairs, interleaved (medians)")
    parser.add_argument("--seed", type=int, default=1, help="of the first chaos run's fault schedule (+1 per pair)")
    parser.add_argument("--stop-s", type=float, default=30.0, help="how long the sampler stays SIGSTOPped")
    parser.add_argument("--kill-every", type=float, default=0.0, help="one more sampler kill every N s (0: none)")
    parser.add_argument("--bad-frames", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5, help="legit-throughput repeats (median)")
    parser.add_argument("--no-legit", action="store_true", help="skip the transport check")
    parser.add_argument("--quick", action="store_true", help="60 s runs, 3 repeats, a 15 s stop")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats, args.stop_s = 60.0, 3, 15.0
    load = os.getloadavg()
    bases, chaoses = [], []
    for pair in range(args.pairs):
        bases.append(run_case(args.seconds, faults=None, bad_frames=0))
        schedule = Faults.draw(args.seconds, args.seed + pair, args.stop_s, args.kill_every)
        chaoses.append(run_case(args.seconds, faults=schedule, bad_frames=args.bad_frames))
    legit = None if args.no_legit else legit_ratio(args.repeats)
    figures, met = floors(bases, chaoses, legit)
    load_end = os.getloadavg()
    summary = {
        "case": "floors",
        **figures,
        "load_avg_1_5_15_start": [round(x, 2) for x in load],
        "load_avg_1_5_15_end": [round(x, 2) for x in load_end],
        **met,
    }
    results = [r for pair in zip(bases, chaoses, strict=True) for r in pair] + ([legit] if legit else [])
    if args.json:
        for r in [*results, summary]:
            print(json.dumps(r))
    else:
        for r in results:
            print(json.dumps(r, indent=None))
        print(json.dumps(figures))
        print(f"load average (1 min) {load[0]:.2f} at the start, {load_end[0]:.2f} at the end")
        for name, ok in met.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
