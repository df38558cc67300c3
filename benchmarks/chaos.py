"""Chaos: the main job while samplers are killed and hostile frames hit every bound socket.

    python benchmarks/chaos.py [--seconds 180] [--kill-every 10] [--bad-frames 10000] [--json] [--quick]

One invocation runs, on the same topology (examples/topology.toml, samplers restarted by
the launcher on failure) and for the same wall-clock length:

1. a fault-free run (the baseline);
2. the chaos run: every ``--kill-every`` seconds a random sampler process gets SIGKILL,
   while a flooder sends ``--bad-frames`` malformed messages, spread over the run, to every
   socket the data process binds;
3. a transport check: a legitimate PUSH->PULL stream into one echo2 endpoint with and
   without a concurrent flood of bad frames into the same endpoint.

Reports learner steps per minute (chaos / fault-free), lost, duplicated and late-accepted
rollouts (``echo2.audit`` of the chaos run), lease re-issue latency after each kill (kill
to the first re-issued lease), crashes (processes that died other than by our SIGKILL),
decode errors counted, and the legitimate peer's throughput ratio under flood.
Floors (issue): 0 lost, 0 duplicated, 0 late-accepted; steps/min >= 0.7x; 0 crashes from
bad frames; legitimate throughput >= 0.9x.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

import zmq

from echo2.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "examples" / "topology.toml"


def _launch(run_parent: Path, seconds: float) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "echo2.launch", str(TOPOLOGY), "--run-dir", str(run_parent),
        "--set", f"run.deadline_s={seconds}",
        "--set", "actors.learner.config.max_steps=1000000",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.learner.config.eval_prompts=200",
        "--set", "actors.learner.config.checkpoint_every=0",
        "--set", "actors.prompt_source.config.lease_ttl_s=10.0",
        "--set", 'processes.sampler-{i}.restart="on-failure"',
        "--set", "processes.sampler-{i}.restart_backoff_s=0.5",
        "--set", "processes.sampler-{i}.max_restarts=1000",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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
    steps = run.metrics("learner", "step")
    if len(steps) < 2:
        return 0.0, len(steps)
    span = steps[-1]["time_s"] - steps[0]["time_s"]
    return 60.0 * (len(steps) - 1) / span, len(steps)


def _reissue_latencies(run: RunDir, kills: list[tuple[float, str]]) -> list[float]:
    events = read_jsonl(run.ledger_path("prompt_source")).records
    reissues = sorted(e["t"] for e in events if e["ev"] == "leased" and e.get("attempt", 0) > 0)
    out = []
    for t_kill, _ in kills:
        later = [t for t in reissues if t >= t_kill]
        if later:
            out.append(later[0] - t_kill)
    return out


def run_case(seconds: float, *, chaos: bool, kill_every: float, bad_frames: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="echo2-chaos-") as parent_name:
        parent = Path(parent_name)
        launcher = _launch(parent, seconds)
        kills: list[tuple[float, str]] = []
        stop = threading.Event()
        flooded = [0]
        flooder = None
        try:
            run = _run_dir(parent)
            if chaos:
                targets = _bound_urls(run)
                flooder = threading.Thread(
                    target=lambda: flooded.__setitem__(0, _flood(targets, bad_frames, seconds * 0.9, stop))
                )
                flooder.start()
                rng = random.Random(1)
                end = time.monotonic() + seconds - kill_every
                while time.monotonic() < end and launcher.poll() is None:
                    time.sleep(kill_every)  # the fault schedule itself, not a synchronisation
                    pids = json.loads(run.pids_path.read_text())["processes"]
                    samplers = sorted(n for n in pids if n.startswith("sampler"))
                    victim = rng.choice(samplers)
                    try:
                        os.kill(pids[victim], signal.SIGKILL)
                        kills.append((time.time(), victim))
                    except ProcessLookupError:
                        pass  # it is being restarted right now
            output, _ = launcher.communicate(timeout=seconds + 120)
        finally:
            stop.set()
            if flooder is not None:
                flooder.join()
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        status = json.loads(run.status_path.read_text())
        summary = json.loads(run.summary_path.read_text()) if run.summary_path.exists() else {}
        audit = subprocess.run(
            [sys.executable, "-m", "echo2.audit", str(run.root), "--json"], capture_output=True, text=True, cwd=ROOT
        )
        report = json.loads(audit.stdout) if audit.stdout.strip().startswith("{") else {}
        spm, steps = _steps_per_minute(run)
        unexpected_deaths = sum(
            1 for line in output.splitlines() if "failed with" in line or "died with" in line
        ) - len(kills)
        decode_errors = sum(1 for line in output.splitlines() if "dropped a malformed message" in line)
        latencies = _reissue_latencies(run, kills) if chaos else []
        return {
            "case": "chaos" if chaos else "fault-free",
            "seconds": seconds,
            "exit_code": launcher.returncode,
            "status": status["reason"],
            "steps": steps,
            "steps_per_min": round(spm, 1),
            "final_accuracy": summary.get("final_accuracy"),
            "kills": len(kills),
            "crashes_other_than_kills": max(0, unexpected_deaths),
            "bad_frames_sent": flooded[0],
            "decode_error_log_lines": decode_errors,
            "lost": len(report.get("lost", [])),
            "duplicated": len(report.get("duplicated", [])),
            "late_accepted": len(report.get("late_accepted", [])),
            "rejected": report.get("rejected", {}),
            "audit_ok": report.get("ok", False),
            "reissue_latency_s_median": round(statistics.median(latencies), 2) if latencies else None,
            "reissue_latency_s_max": round(max(latencies), 2) if latencies else None,
        }


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--bad-frames", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5, help="legit-throughput repeats (median)")
    parser.add_argument("--quick", action="store_true", help="60 s runs, 3 repeats")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats = 60.0, 3
    results = [
        run_case(args.seconds, chaos=False, kill_every=args.kill_every, bad_frames=args.bad_frames),
        run_case(args.seconds, chaos=True, kill_every=args.kill_every, bad_frames=args.bad_frames),
        legit_ratio(args.repeats),
    ]
    base, chaos, legit = results
    floors = {
        "lost == 0": chaos["lost"] == 0,
        "duplicated == 0": chaos["duplicated"] == 0,
        "late_accepted == 0": chaos["late_accepted"] == 0,
        "steps/min >= 0.7x fault-free": chaos["steps_per_min"] >= 0.7 * base["steps_per_min"],
        "0 crashes from bad frames": chaos["crashes_other_than_kills"] == 0,
        "legit throughput >= 0.9x under flood": legit["ratio"] >= 0.9,
    }
    ratio = round(chaos["steps_per_min"] / base["steps_per_min"], 3) if base["steps_per_min"] else None
    if args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"case": "floors", "steps_per_min_ratio": ratio, **floors}))
    else:
        for r in results:
            print(json.dumps(r, indent=None))
        print(f"steps/min chaos / fault-free: {ratio}")
        for name, ok in floors.items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
