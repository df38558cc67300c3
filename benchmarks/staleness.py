"""The staleness study: each off-policy correction at S in {0, 1, 3, 6, 11}, on the same budget.

    python -m benchmarks.staleness [--staleness 0,1,3,6,11] [--losses ppo_is,...] [--steps 300]
                                   [--parallel 2] [--out benchmarks/results/staleness-DATE.json]
                                   [--partial FILE] [--timeout S] [--keep DIR]
    python -m benchmarks.staleness --report RESULTS.json      # table and plot again, no runs

Every run is the main job (``examples/topology.toml``: GRPO on the built-in tiny model and
3-digit reversed addition, 16 prompts x 8 samples per step, two samplers in their own
processes) launched as a subprocess with ``job.staleness = S``, ``actors.learner.config.loss
= LOSS`` (``echo2.rl.corrections``; each with the learner's default bands) and the same
budget: ``--steps`` learner steps with the job's linear learning-rate decay, one torch
thread per process, no evaluation inside the run but the warm-start one and the final
greedy pass@1 on 500 held-out prompts. Runs go ``--parallel`` at a time under ``nice``.

Staleness is real, not nominal: the learner publishes every ``kappa = max(1, S - 1)`` steps
(its default), so between two publications the samplers keep sampling with the last
published weights, and a batch trained at step ``v`` holds rollouts of version
``v - kappa .. v``; the PromptSource's window (``min(S + 1, 2)`` batches in flight) adds up to
one more. Each run reports the staleness it measured (max and mean over the groups it
trained, from ``summary.json``'s histogram) beside its budget S.

Per run: final reward (the mean training reward of the last ``REWARD_WINDOW`` steps),
held-out greedy pass@1 (warm start and final), the learner/sampler mismatch (the per-step
``approx_kl_sampler``, the mean |sampler - learner log-prob| per token over samplers,
``mismatch_by_sampler``, and the fraction of tokens a mask zeroed or a clip removed),
steps/s and the load average it ran under. Each finished run is appended to ``--partial``
(JSON lines) at once, and a rerun with the same ``--partial`` skips the cells it holds, so
an interrupted grid resumes. At the end: a table on stdout, the results as JSON (``--out``)
and a PNG beside it (reward, pass@1 and mismatch against S, one line per correction).

One seed per cell (``--seed`` runs the grid again with another): on this task two runs of the same cell have differed by tens of points of
pass@1 (``benchmarks/pipeline.py``'s docstring), so read single cells against that noise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.pipeline import REPO, _failure_context, _learner_steps, _wait

STALENESS = (0, 1, 3, 6, 11)
LOSSES = ("ppo_is", "tis_token_mask", "tis_sequence_mask", "geo_sequence_mask", "gspo", "cispo")
TOPOLOGY = REPO / "examples" / "topology.toml"
DEFAULT_STEPS = 300
REWARD_WINDOW = 50
"""Steps at the end of a run whose mean training reward is its final reward."""
NICE = 5
FLOOR_POINTS = 5.0
"""The issue's floor: some correction keeps S = 11 within this many points of S = 0."""


def run_command(staleness: int, loss: str, steps: int, run_dir: Path, *, deadline_s: float, seed: int = 0) -> list[str]:
    """The launcher command of one cell: the main job with S, the loss, the budget and the seed set."""
    learner = "actors.learner.config"
    overrides = [
        # A name per cell: the ipc directory derives from the run id (name and second), and two
        # runs started in the same second must not share it.
        f"run.name=staleness-S{staleness}-{loss}-seed{seed}",
        f"job.staleness={staleness}",
        f"job.seed={seed}",
        f"{learner}.loss={loss}",
        f"{learner}.max_steps={steps}",
        f"{learner}.eval_every=0",  # the warm-start and the final evaluation only
        f"{learner}.checkpoint_every=0",
        f"{learner}.log_every=50",
        "processes.learner.torch_threads=1",  # two runs share two cores
        "processes.sampler-{i}.torch_threads=1",
        f"run.deadline_s={deadline_s!r}",
    ]
    command = ["nice", "-n", str(NICE), sys.executable, "-m", "echo2.launch", str(TOPOLOGY)]
    for override in overrides:
        command += ["--set", override]
    return [*command, "--run-dir", str(run_dir)]


def run_cell(
    staleness: int, loss: str, steps: int, *, timeout_s: float, keep: Path | None, seed: int = 0
) -> dict[str, Any]:
    """Launch one run and read what it measured; ``ok`` False (with ``error``) when it failed."""
    result: dict[str, Any] = {"staleness": staleness, "loss": loss, "seed": seed, "steps_budget": steps, "ok": True}
    parent = Path(tempfile.mkdtemp(prefix=f"echo2-staleness-S{staleness}-{loss}-"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p)
    command = run_command(staleness, loss, steps, parent, deadline_s=max(timeout_s - 30.0, 10.0), seed=seed)
    result["load_before"] = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    try:
        with open(parent / "launcher.log", "wb") as out:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )
            rc = _wait(proc, timeout_s)
        result["process_wall_s"] = round(time.perf_counter() - started, 1)
        result["load_after"] = round(os.getloadavg()[0], 2)
        runs = sorted(p for p in parent.iterdir() if p.is_dir())
        run_dir = runs[-1] if runs else None
        summary_path = run_dir / "summary.json" if run_dir is not None else None
        if rc != 0:
            result["ok"], result["error"] = False, "timed out" if rc is None else f"launcher exited with code {rc}"
        if summary_path is None or not summary_path.is_file():
            result["ok"] = False
            result.setdefault("error", "no summary.json was written")
        else:
            assert run_dir is not None
            result.update(read_run(run_dir, json.loads(summary_path.read_text())))
            if result["steps"] < steps:
                result["ok"] = False
                result.setdefault("error", f"incomplete: {result['steps']} of {steps} steps")
        if not result["ok"]:
            result["failure_context"] = _failure_context(parent / "launcher.log", run_dir)[-40:]
    finally:
        if keep is not None:
            shutil.copytree(parent, keep / parent.name, dirs_exist_ok=True)
        shutil.rmtree(parent, ignore_errors=True)
    return result


def read_run(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """One run's figures from its ``summary.json`` and ``metrics/learner.jsonl``."""
    histogram = {int(k): int(v) for k, v in summary.get("staleness_histogram", {}).items()}
    groups = sum(histogram.values())
    steps = _learner_steps(run_dir)
    rewards = [float(s["reward_mean"]) for s in steps if "reward_mean" in s]
    mismatch = [statistics.fmean(m.values()) for s in steps if (m := s.get("mismatch_by_sampler"))]
    return {
        "steps": int(summary.get("steps", 0)),
        "kappa": summary.get("kappa"),
        "wall_s": summary.get("wall_s"),
        "steps_per_s": summary.get("steps_per_s"),
        "initial_pass_at_1": summary.get("initial_pass_at_1"),
        "final_pass_at_1": summary.get("final_pass_at_1"),
        "initial_reward": _mean(rewards[:REWARD_WINDOW]),
        "final_reward": _mean(rewards[-REWARD_WINDOW:]),
        "staleness_max": summary.get("staleness_max"),
        "staleness_mean": round(sum(k * v for k, v in histogram.items()) / groups, 3) if groups else None,
        "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "approx_kl_sampler_mean": _mean([float(s["approx_kl_sampler"]) for s in steps if "approx_kl_sampler" in s]),
        "mismatch_mean": _mean(mismatch),
        "mismatch_max": round(max(mismatch), 5) if mismatch else None,
        "is_masked_fraction_mean": _mean([float(s["is_masked_fraction"]) for s in steps if "is_masked_fraction" in s]),
        "clip_fraction_mean": _mean([float(s["clip_fraction"]) for s in steps if "clip_fraction" in s]),
        "rollouts_trained_twice": summary.get("rollouts_trained_twice"),
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 5) if values else None


# -- the grid ------------------------------------------------------------------------------


def load_partial(path: Path) -> list[dict[str, Any]]:
    """Runs already finished (``--partial``), last one per cell; failed runs are run again."""
    if not path.is_file():
        return []
    cells: dict[tuple[int, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            cells[(record["staleness"], record["loss"])] = record
    return [r for r in cells.values() if r.get("ok")]


def run_grid(
    cells: list[tuple[int, str]],
    steps: int,
    *,
    parallel: int,
    timeout_s: float,
    partial: Path,
    keep: Path | None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    done = {(r["staleness"], r["loss"]): r for r in load_partial(partial)}
    todo = [cell for cell in cells if cell not in done]
    if done:
        _say(f"{len(done)} cell(s) already in {partial}; {len(todo)} to run")
    lock = threading.Lock()

    def one(cell: tuple[int, str]) -> dict[str, Any]:
        staleness, loss = cell
        _say(f"start S={staleness} {loss}")
        result = run_cell(staleness, loss, steps, timeout_s=timeout_s, keep=keep, seed=seed)
        result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        with lock, open(partial, "a") as out:
            out.write(json.dumps(result) + "\n")
        _say(f"done  {describe(result)}")
        return result

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for result in pool.map(one, todo):
            done[(result["staleness"], result["loss"])] = result
    return [done[cell] for cell in cells if cell in done]


def describe(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"S={r['staleness']} {r['loss']}: FAILED ({r.get('error')})"
    return (
        f"S={r['staleness']} {r['loss']}: pass@1 {_fmt(r['initial_pass_at_1'], '.3f')} -> "
        f"{_fmt(r['final_pass_at_1'], '.3f')}, reward {_fmt(r['final_reward'], '.3f')}, "
        f"staleness max {r['staleness_max']} mean {_fmt(r['staleness_mean'], '.2f')}, "
        f"kl {_fmt(r['approx_kl_sampler_mean'], '.4f')}, {r['process_wall_s']:.0f} s, load {r['load_before']}"
    )


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _say(line: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", file=sys.stderr, flush=True)


# -- the report ----------------------------------------------------------------------------


def floor(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per correction: S = 11's final pass@1 minus S = 0's, in points; met if one is >= -5."""
    by_cell = {(r["staleness"], r["loss"]): r for r in runs if r.get("ok")}
    gaps: dict[str, float | None] = {}
    for loss in sorted({r["loss"] for r in runs}):
        sync, stale = by_cell.get((0, loss)), by_cell.get((max(STALENESS), loss))
        if sync and stale and sync["final_pass_at_1"] is not None and stale["final_pass_at_1"] is not None:
            gaps[loss] = round(100 * (stale["final_pass_at_1"] - sync["final_pass_at_1"]), 1)
        else:
            gaps[loss] = None
    measured = [g for g in gaps.values() if g is not None]
    return {
        "description": f"S = {max(STALENESS)} final pass@1 minus S = 0, points; met if some correction >= -{FLOOR_POINTS:g}",
        "gap_points_by_loss": gaps,
        "met": bool(measured) and max(measured) >= -FLOOR_POINTS,
    }


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'loss':<18} {'S':>3} {'kappa':>5} {'stale max':>9} {'mean':>5} {'pass@1 0':>8} {'final':>6} "
        f"{'reward':>6} {'kl(smp)':>8} {'|dlogp|':>8} {'masked':>6} {'clipped':>7} {'steps/s':>7} {'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(runs, key=lambda r: (LOSSES.index(r["loss"]) if r["loss"] in LOSSES else 99, r["staleness"])):
        if not r.get("ok"):
            lines.append(f"{r['loss']:<18} {r['staleness']:>3} FAILED: {r.get('error')}")
            continue
        lines.append(
            f"{r['loss']:<18} {r['staleness']:>3} {r['kappa']:>5} {r['staleness_max']:>9} "
            f"{_fmt(r['staleness_mean'], '.2f'):>5} {_fmt(r['initial_pass_at_1'], '.3f'):>8} "
            f"{_fmt(r['final_pass_at_1'], '.3f'):>6} {_fmt(r['final_reward'], '.3f'):>6} "
            f"{_fmt(r['approx_kl_sampler_mean'], '.4f'):>8} {_fmt(r['mismatch_mean'], '.4f'):>8} "
            f"{_fmt(r['is_masked_fraction_mean'], '.3f'):>6} {_fmt(r['clip_fraction_mean'], '.3f'):>7} "
            f"{_fmt(r['steps_per_s'], '.2f'):>7} {r['load_before']:>5}"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("final_pass_at_1", "held-out pass@1 (greedy, final)"),
        ("final_reward", f"training reward (last {REWARD_WINDOW} steps)"),
        ("approx_kl_sampler_mean", "learner/sampler KL per token (mean over steps)"),
        ("staleness_max", "measured max staleness"),
    )
    fig, grid = plt.subplots(2, 2, figsize=(11, 8.5))
    axes = list(grid.ravel())
    ok = [r for r in runs if r.get("ok")]
    for loss in [name for name in LOSSES if any(r["loss"] == name for r in ok)]:
        mine = sorted((r for r in ok if r["loss"] == loss), key=lambda r: r["staleness"])
        for ax, (key, _) in zip(axes, panels, strict=True):
            points = [(r["staleness"], r[key]) for r in mine if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=loss)
    initial = [r["initial_pass_at_1"] for r in ok if r.get("initial_pass_at_1") is not None]
    if initial:
        axes[0].axhline(statistics.fmean(initial), color="grey", linestyle=":", label="warm start")
    axes[-1].plot(STALENESS, STALENESS, color="grey", linestyle=":", label="S")
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_xlabel("staleness budget S")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(STALENESS)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    steps = {r["steps_budget"] for r in ok}
    fig.suptitle(f"echo2 staleness study: 3-digit addition, tiny model, {'/'.join(map(str, sorted(steps)))} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    results = {**meta, "floor": floor(runs), "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(runs, png)
    print(table(runs))
    print(f"floor: {json.dumps(results['floor'])}")
    print(f"results: {out}\nplot: {png}")


# -- command line --------------------------------------------------------------------------


def _csv(text: str, kind: type) -> list[Any]:
    return [kind(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", default=",".join(map(str, STALENESS)), help="comma-separated S values")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated corrections")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="learner steps per run (the budget)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (each takes about one core)")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds per run (default: 300 + 4 s per step)")
    today = datetime.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"staleness-{today}.json")
    parser.add_argument("--partial", type=Path, help="finished runs, JSON lines (default: --out with .partial.jsonl)")
    parser.add_argument("--keep", type=Path, help="copy every run directory into this directory")
    parser.add_argument(
        "--seed", type=int, default=0, help="job.seed of every run (a repeat of the grid: another seed)"
    )
    parser.add_argument("--report", type=Path, help="only print the table and draw the plot of a results JSON")
    args = parser.parse_args(argv)
    if args.report is not None:
        results = json.loads(args.report.read_text())
        print(table(results["runs"]))
        print(f"floor: {json.dumps(floor(results['runs']))}")
        plot(results["runs"], args.report.with_suffix(".png"))
        return 0
    staleness, losses = _csv(args.staleness, int), _csv(args.losses, str)
    unknown = sorted(set(losses) - set(LOSSES))
    if unknown:
        parser.error(f"--losses: unknown {', '.join(unknown)} (choose from {', '.join(LOSSES)})")
    if args.steps < REWARD_WINDOW or args.parallel < 1:
        parser.error(f"--steps must be >= {REWARD_WINDOW} and --parallel >= 1")
    timeout_s = args.timeout or 300.0 + 4.0 * args.steps
    partial = args.partial or args.out.with_suffix(".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    # One correction's sweep over S after another: its cells run close in time, under similar load.
    cells = [(s, loss) for loss in losses for s in staleness]
    started = time.time()
    runs = run_grid(
        cells, args.steps, parallel=args.parallel, timeout_s=timeout_s, partial=partial, keep=args.keep, seed=args.seed
    )
    meta = {
        "benchmark": "staleness",
        "date": today,
        "command": " ".join(["python -m benchmarks.staleness", *(argv if argv is not None else sys.argv[1:])]),
        "topology": str(TOPOLOGY.relative_to(REPO)),
        "steps_per_run": args.steps,
        "seed": args.seed,
        "parallel": args.parallel,
        "threads_per_process": 1,
        "nice": NICE,
        "cores": os.cpu_count(),
        "grid_wall_s": round(time.time() - started, 1),
        "note": "one seed per cell; loads are 1-minute averages at each run's start (other work shares the machine)",
    }
    report(runs, meta, args.out)
    return 0 if all(r.get("ok") for r in runs) and len(runs) == len(cells) else 1


if __name__ == "__main__":
    sys.exit(main())
