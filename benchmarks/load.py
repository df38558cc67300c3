"""Load: the job with 32 to 256 simulated samplers, throughput and broadcast time against N.

    python -m benchmarks.load [--n 32 64 128 256] [--seconds 40] [--processes 4]
                              [--chain-at 256] [--json PATH] [--keep DIR] [--quick]

Every point is a real launch (``python -m echo2.launch``) of one generated topology, the
same job at every N: the data process (PromptSource, Rewarder, Buffer: the real data path,
the audit's ledgers), the learner process (a learner whose step sleeps ``--t-train`` on top
of packing its real batch, and the WeightPublisher: the real weight path, verified chunks
relayed through the samplers' inboxes, ZeroMQ over ipc on one host), and the N samplers, simulated engines (no
compute: one engine call sleeps ``seconds_per_token * max_new_tokens``) co-located
``N / --processes`` to a process so that 256 fit on 2 cores, interleaved: samplers
next to each other by name are in different processes, so that every relay hop crosses
processes (as it crosses machines in a real deployment). Per-sampler speed is the same
at every N: the pool offers more than the learner takes from N = 32 on, so what changes
with N is only what N costs (weight relay depth, membership, per-process threads), which is
what the floor is about.

The policy is a freshly initialised tiny transformer of about ``--payload-kb`` (made here,
in the run's temporary directory, never fetched), and the learner's step is ``--t-train``
(1 s: a short step for an LLM), so that what N remote machines would each do on their own
(receive, verify and relay every version; generate) fits on 2 shared cores at N = 256:
the benchmark measures what N costs the system, not how many samplers one machine can
simulate. A version is relayed in the publisher's default chunks unless ``--chunk-kb``.

Every sampler receives each chunk ``--latency-ms`` (20 ms) after it was sent
(``echo2.weights.link``: a one-way delay, pipelined, no CPU): remote samplers are that far
from each other and from the publisher at least, and a relay hop costs that latency
besides its CPU.

``--chain-at N`` adds one more point: N samplers in one relay chain (``relay_depth`` above
N), the plan before trees, for comparison in the same run.

Per N, measured after the first ``SKIP_S`` seconds of training (warm-up: every sampler
subscribed and holding work):

* trained rollouts/s: rollouts in the learner's steps over the window's wall time;
* T_bcast of every version published in the window (the WeightPublisher's ``broadcast``
  records: publication until ceil(N / 1.1) members installed it), median and p90, and how
  many versions never reached it (superseded first);
* CPU of every process over the window (``/proc``: user + system seconds / wall seconds),
  the data process's apart;
* the audit (``echo2.audit``): lost, duplicated, stale-trained, and whether it is OK.

Floor (issue 18 item 8): trained rollouts/s at N = 256 >= 0.8 x the N = 32 figure, same run.
The 1-minute load average before and after each point is recorded: on a shared machine a
busy neighbour moves every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from echo2.rundir import RunDir
from echo2.tools.audit import VIOLATIONS, audit
from echo2.weights.plan import MAX_DEPTH, relay_fanout, tree_depth

REPO = Path(__file__).resolve().parents[1]
SKIP_S = 10.0
"""Seconds of training before the measurement window opens (samplers subscribing, the
pipeline filling)."""
FLOOR = 0.8

G = 8  # completions per prompt
MAX_NEW_TOKENS = 5
STALENESS = 3


def make_model(directory: Path, payload_kb: int) -> Path:
    """A freshly initialised tiny transformer of about ``payload_kb`` KB of float32 weights."""
    import torch

    from echo2.models.tiny import TinyConfig, TinyTransformer

    torch.manual_seed(0)
    best = TinyConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)
    for d_model in (16, 32, 48, 64, 96, 128, 192, 256):
        for n_layers in (1, 2, 3, 4):
            config = TinyConfig(
                d_model=d_model, n_layers=n_layers, n_heads=4 if d_model % 4 == 0 else 2, d_ff=4 * d_model
            )
            params = sum(p.numel() for p in TinyTransformer(config).parameters())
            if params * 4 <= payload_kb * 1024:
                best = config
    TinyTransformer(best).save(directory)
    return directory


def topology_text(
    n: int,
    *,
    processes: int,
    model_dir: Path,
    seconds: float,
    t_train_s: float,
    groups_per_step: int,
    seconds_per_token: float,
    relay_depth: int,
    chunk_bytes: int,
    latency_ms: float,
) -> str:
    publisher = ['mode = "relay"']
    if relay_depth:
        publisher.append(f"relay_depth = {relay_depth}")
    if chunk_bytes:
        publisher.append(f"chunk_bytes = {chunk_bytes}")
    lines = [
        "[run]",
        'name = "load-bench"',
        "drain_timeout_s = 5.0",
        f"deadline_s = {seconds + 120.0}",
        "[job]",
        f'model = "{model_dir}"',
        f"staleness = {STALENESS}",
        f"group_size = {G}",
        f"groups_per_step = {groups_per_step}",
        f"max_new_tokens = {MAX_NEW_TOKENS}",
        "[actors.prompt_source]",
        'kind = "prompt_source"',
        'process = "data"',
        "[actors.rewarder]",
        'kind = "rewarder"',
        'process = "data"',
        "[actors.buffer]",
        'kind = "buffer"',
        'process = "data"',
        "[actors.learner]",
        'kind = "learner"',
        'process = "learner"',
        f"config = {{ max_steps = 1000000, max_wall_s = {seconds}, simulated_train_s = {t_train_s}, "
        "eval_every = 0, eval_prompts = 4, checkpoint_every = 0, log_every = 50 }",
        "[actors.weight_publisher]",
        'kind = "weight_publisher"',
        'process = "learner"',
        f"config = {{ {', '.join(publisher)} }}",
    ]
    # Sampler i lives in process i % processes: members next to each other by name (as
    # plans list them) sit in different processes, so that every relay hop crosses
    # processes, as it crosses machines in a real deployment.
    for i in range(n):
        lines += [
            f"[actors.s{i:03d}]",
            'kind = "sampler"',
            f'process = "samplers-{i % processes}"',
            f'config = {{ engine = "simulated", engine_kwargs = {{ seconds_per_token = {seconds_per_token}, '
            f"success_rate = 0.5 }}, credits = 2, max_batch_groups = 2, latency_ms = {latency_ms} }}",
        ]
    return "\n".join(lines) + "\n"


class CpuSampler:
    """CPU seconds of each of a run's processes, read from ``/proc`` once a second (a
    process that exited keeps its last reading)."""

    def __init__(self, run_parent: Path) -> None:
        self.run_parent = run_parent
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._procs: dict[str, psutil.Process] = {}

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _find(self) -> None:
        for path in self.run_parent.glob("*/pids.json"):
            try:
                pids = json.loads(path.read_text())["processes"]
            except (OSError, ValueError, KeyError):
                continue
            for name, pid in pids.items():
                if name not in self._procs and pid:
                    try:
                        self._procs[name] = psutil.Process(pid)
                    except psutil.Error:
                        continue

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._find()
            reading: dict[str, float] = {}
            for name, proc in self._procs.items():
                try:
                    t = proc.cpu_times()
                except psutil.Error:
                    continue
                reading[name] = t.user + t.system
            if reading:
                self.samples.append((time.time(), reading))

    def share(self, start_unix: float, end_unix: float) -> dict[str, float]:
        """CPU seconds per wall second of each process between the two instants."""
        inside = [(t, r) for t, r in self.samples if start_unix <= t <= end_unix]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {name: round((last[name] - first.get(name, 0.0)) / (t1 - t0), 3) for name in last if name in first}


def launch(text: str, workdir: Path, label: str, timeout_s: float) -> tuple[Path, CpuSampler]:
    path = workdir / f"{label}.toml"
    path.write_text(text)
    runs = workdir / f"runs-{label}"
    runs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ECHO2_LOG_LEVEL": "WARNING"}
    with CpuSampler(runs) as cpu:
        proc = subprocess.run(
            [sys.executable, "-m", "echo2.launch", str(path), "--run-dir", str(runs)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    made = [p for p in runs.iterdir() if p.is_dir()]
    if proc.returncode != 0 or len(made) != 1:
        raise RuntimeError(f"run {label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return made[0], cpu


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measure(run_dir: Path, cpu: CpuSampler) -> dict[str, Any]:
    run = RunDir(run_dir)
    steps = run.metrics("learner", "step")
    if not steps:
        raise RuntimeError(f"{run_dir}: the learner trained no step")
    first_start = steps[0]["unix_s"] - steps[0]["wait_s"] - steps[0]["train_s"]
    window = [r for r in steps if r["unix_s"] - r["wait_s"] - r["train_s"] >= first_start + SKIP_S]
    if len(window) < 2:
        raise RuntimeError(f"{run_dir}: only {len(window)} steps after the warm-up")
    start = window[0]["unix_s"] - window[0]["wait_s"] - window[0]["train_s"]
    end = window[-1]["unix_s"]
    rollouts = sum(r["rollouts"] for r in window)
    # A version is named by the learner step that published it.
    first_step, last_step = window[0]["step"], window[-1]["step"]
    bcasts = [r for r in run.metrics("weight_publisher", "broadcast") if first_step <= r["version"] <= last_step]
    t_bcast = [r["t_bcast_s"] for r in bcasts if r.get("t_bcast_s") is not None]
    report = audit([run_dir])
    shares = cpu.share(start, end)
    return {
        "run_dir": str(run_dir),
        "steps": len(window),
        "window_s": round(end - start, 2),
        "trained_rollouts_per_s": round(rollouts / (end - start), 1),
        "step_s_median": round(statistics.median(r["wait_s"] + r["train_s"] for r in window), 4),
        "wait_s_median": round(statistics.median(r["wait_s"] for r in window), 4),
        "versions": len(bcasts),
        "t_bcast_median_s": round(statistics.median(t_bcast), 4) if t_bcast else None,
        "t_bcast_p90_s": round(_percentile(t_bcast, 0.9) or 0.0, 4) if t_bcast else None,
        "versions_without_t_bcast": sum(1 for r in bcasts if r.get("t_bcast_s") is None),
        "data_cpu": shares.get("data"),
        "learner_cpu": shares.get("learner"),
        "samplers_cpu": round(sum(v for k, v in shares.items() if k.startswith("samplers-")), 3),
        "cpu_by_process": shares,
        "audit_ok": report.ok,
        "audit": {k: len(getattr(report, k)) for k in VIOLATIONS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[32, 64, 128, 256], help="sampler counts")
    parser.add_argument("--seconds", type=float, default=60.0, help="training seconds per point")
    parser.add_argument("--processes", type=int, default=4, help="sampler processes (samplers co-located in them)")
    parser.add_argument("--chain-at", type=int, default=256, help="also run this many samplers in one chain (0: no)")
    parser.add_argument("--t-train", type=float, default=1.0, help="simulated seconds per learner step")
    parser.add_argument("--groups-per-step", type=int, default=128)
    parser.add_argument("--seconds-per-token", type=float, default=0.04, help="simulated decode time per token")
    parser.add_argument("--payload-kb", type=int, default=512, help="size of a weight version, KB")
    parser.add_argument("--chunk-kb", type=int, default=0, help="weight chunk size, KB (0: the publisher's default)")
    parser.add_argument(
        "--latency-ms", type=float, default=20.0, help="emulated one-way latency of every chunk a sampler receives"
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--keep", type=Path, help="keep run directories under this directory")
    parser.add_argument("--quick", action="store_true", help="32 and 128 samplers, 30 s each, no chain point")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.seconds, args.chain_at = [32, 128], 30.0, 0
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "cores": os.cpu_count(),
        "job": {
            "group_size": G,
            "groups_per_step": args.groups_per_step,
            "t_train_s": args.t_train,
            "staleness": STALENESS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "seconds_per_token": args.seconds_per_token,
            "latency_ms": args.latency_ms,
            "learner_bound_rollouts_per_s": round(G * args.groups_per_step / args.t_train, 1),
        },
        "points": {},
    }
    with tempfile.TemporaryDirectory(prefix="echo2-load-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model_dir = make_model(workdir / "model", args.payload_kb)
        results["payload_bytes"] = (model_dir / "model.safetensors").stat().st_size
        runs = [(str(n), n, 0) for n in args.n]
        if args.chain_at:
            runs.append((f"{args.chain_at}-chain", args.chain_at, args.chain_at + 1))
        for label, n, relay_depth in runs:
            text = topology_text(
                n,
                processes=min(args.processes, n),
                model_dir=model_dir,
                seconds=args.seconds,
                t_train_s=args.t_train,
                groups_per_step=args.groups_per_step,
                seconds_per_token=args.seconds_per_token,
                relay_depth=relay_depth,
                chunk_bytes=args.chunk_kb * 1024,
                latency_ms=args.latency_ms,
            )
            load_before = os.getloadavg()[0]
            run_dir, cpu = launch(text, workdir, f"n{label}", timeout_s=args.seconds + 300)
            point = measure(run_dir, cpu)
            fanout = relay_fanout(n, relay_depth or MAX_DEPTH)
            point.update(samplers=n, relay_fanout=fanout, relay_depth=tree_depth(n, fanout))
            point["load_before"], point["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
            results["points"][label] = point
            log(
                f"N={label}: {point['trained_rollouts_per_s']} rollouts/s, T_bcast median {point['t_bcast_median_s']} "
                f"p90 {point['t_bcast_p90_s']} s (fan-out {fanout}, depth {point['relay_depth']}), CPU data {point['data_cpu']} learner "
                f"{point['learner_cpu']} samplers {point['samplers_cpu']}, "
                f"audit {'OK' if point['audit_ok'] else point['audit']}, load {point['load_before']}-{point['load_after']}"
            )
    points = results["points"]
    low, high = str(min(args.n)), str(max(args.n))
    base = points.get(low, {}).get("trained_rollouts_per_s")
    for point in points.values():
        point["ratio_to_min_n"] = round(point["trained_rollouts_per_s"] / base, 3) if base else None
    if low in points and high in points and points[low]["trained_rollouts_per_s"]:
        ratio = points[high]["trained_rollouts_per_s"] / points[low]["trained_rollouts_per_s"]
        results["ratio_max_to_min_n"] = round(ratio, 3)
        results["floor_ok"] = ratio >= FLOOR and all(p["audit_ok"] for p in points.values())
    results["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
