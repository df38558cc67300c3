"""Capacity model against measurement, and cost-aware against random activation.

    python benchmarks/capacity.py [--quick] [--json OUT.json]

Every run is a real launch (``python -m echo2.launch``) of a generated topology: simulated
samplers (no compute: one group of G completions per engine call, which sleeps
``seconds_per_token * max_new_tokens``), four to a process, and a learner whose step
sleeps ``T_train`` (``simulated_train_s``), so 16-32 samplers fit on 2 cores.

(a) Knee. For S in {1, 3}: a run with an ample pool (22 samplers) measures T_train, T_bcast
    (the WeightPublisher's, star mode) and mu_i (the PromptSource's scheduler records
    them); then pools around the prediction measure the bubble ratio. The measured knee is
    the smallest pool whose bubble stays within ``KNEE_RISE`` of the ample pool's (and for
    every larger pool); the predicted knee is the smallest pool whose model bubble
    (``predicted_bubble_ratio``) is within ``KNEE_RISE`` of the model's ample-pool bubble
    (0): one rule for both. ``ceil(mu_min / mean mu_i)``, where the model's bubble is exactly
    0, is reported beside it. Bubble ratios are measured after ``SKIP_STEPS`` warm-up steps.
(b) Mixed pool (prices and speeds like RTX 5090, RTX 4090 and A10 rentals): the same pool
    under ``activation = "cost_aware"`` and ``"random"``: dollars per step (samplers active
    + learner, integrated over the measurement window) and bubble ratios.

Floors: bubble <= 5% with the pool >= 1.1 mu_min; knee within one sampler (or 15%) of the
prediction; cost-aware dollars/step <= 0.9x random's, both with bubble <= 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
SKIP_STEPS = 6
BUBBLE_FLOOR = 0.05
KNEE_RISE = 0.05
"""The knee: the smallest pool whose bubble stays within 5 points of the ample pool's (and
below 5% anyway). With S = 1 the learner idles ~4-6% even with an ample pool (each step
waits for the new version), so a bare 5% threshold would sit on that plateau's noise."""
PER_PROCESS = 4  # samplers per process (each engine call runs on its own thread: echo2.engines.base)

G = 4  # group size
MAX_NEW_TOKENS = 5
LEARNER_PRICE = 1.5  # dollars/h
# (groups per step, T_train): full R = 128 per 2 s step; quick R = 64 per 1 s step. Both
# need about 64 rollouts/s, i.e. 16 samplers of 4/s; the longer step of the full run makes
# the broadcast (~0.3 s for 3.2 MB to 24 samplers on 2 busy cores) a smaller share of it.
FULL = (32, 2.0)
QUICK = (16, 1.0)
GROUPS_PER_STEP, T_TRAIN_S = FULL


@dataclass(frozen=True)
class SamplerKind:
    name: str
    seconds_per_token: float
    price_per_hour: float

    @property
    def mu(self) -> float:
        """Nominal rollouts/s: G per engine call of seconds_per_token * max_new_tokens."""
        return G / (self.seconds_per_token * MAX_NEW_TOKENS)


UNIFORM = SamplerKind("gpu", 0.2, 0.35)  # 4 rollouts/s
MIXED = (  # like rentals: 5090 fastest, 4090 cheapest per rollout, A10 slow and dear per rollout
    SamplerKind("rtx5090", 0.1, 0.69),  # 8.0 rollouts/s, rho 0.086
    SamplerKind("rtx4090", 0.15, 0.34),  # 5.3 rollouts/s, rho 0.064
    SamplerKind("a10", 0.3, 0.60),  # 2.7 rollouts/s, rho 0.225
)


def topology_text(
    pool: list[tuple[SamplerKind, int]], *, staleness: int, steps: int, activation: str, seed: int = 0
) -> str:
    lines = [
        "[run]",
        'name = "capacity-bench"',
        "drain_timeout_s = 3.0",
        "deadline_s = 400.0",
        "[job]",
        f"staleness = {staleness}",
        f"group_size = {G}",
        f"groups_per_step = {GROUPS_PER_STEP}",
        f"max_new_tokens = {MAX_NEW_TOKENS}",
        "[actors.prompt_source]",
        'kind = "prompt_source"',
        'process = "data"',
        f'config = {{ activation = "{activation}", learner_price_per_hour = {LEARNER_PRICE}, '
        f"warmup_s = 6.0, activation_seed = {seed} }}",
        "[actors.rewarder]",
        'kind = "rewarder"',
        'process = "data"',
        "[actors.buffer]",
        'kind = "buffer"',
        'process = "data"',
        "[actors.learner]",
        'kind = "learner"',
        'process = "learner"',
        f"config = {{ max_steps = {steps}, simulated_train_s = {T_TRAIN_S}, eval_every = 0, "
        "eval_prompts = 4, checkpoint_every = 0, log_every = 10 }",
        "[actors.weight_publisher]",
        'kind = "weight_publisher"',
        'process = "learner"',
        # star: on one host a relay chain only adds per-hop latency (benchmarks/broadcast.py)
        'config = { mode = "star" }',
    ]
    names = [kind for kind, n in pool for _ in range(n)]
    for p in range(math.ceil(len(names) / PER_PROCESS)):
        chunk = names[p * PER_PROCESS : (p + 1) * PER_PROCESS]
        for kind in sorted(set(chunk), key=lambda k: k.name):
            count = sum(1 for k in chunk if k is kind)
            lines += [
                f"[actors.{kind.name}_p{p}]",
                'kind = "sampler"',
                f"replicas = {count}" if count > 1 else "",
                f'process = "samplers-{p}"',
                f'config = {{ engine = "simulated", engine_kwargs = {{ seconds_per_token = {kind.seconds_per_token}, '
                f"success_rate = 0.5 }}, credits = 1, max_batch_groups = 1, price_per_hour = {kind.price_per_hour} }}",
            ]
    return "\n".join(line for line in lines if line) + "\n"


def launch(text: str, workdir: Path, label: str) -> Path:
    path = workdir / f"{label}.toml"
    path.write_text(text)
    runs = workdir / "runs"
    before = set(runs.glob("*")) if runs.exists() else set()
    env = {**os.environ, "ECHO2_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(path), "--run-dir", str(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    after = set(runs.glob("*")) - before
    if proc.returncode != 0 or len(after) != 1:
        raise RuntimeError(f"run {label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return after.pop()


def measure(run_dir: Path) -> dict[str, Any]:
    """Bubble ratio and dollars per step after warm-up; the scheduler's last figures."""
    run = RunDir(run_dir)
    steps = run.metrics("learner", "step")
    window = steps[SKIP_STEPS:]
    wait = sum(r["wait_s"] for r in window)
    train = sum(r["train_s"] for r in window)
    records = run.metrics("prompt_source")
    acts = [r for r in records if r.get("kind") == "activation" and r.get("t_train_s")]
    summary = next((r for r in records if r.get("kind") == "activation_summary"), None)
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": len(steps),
        "bubble_ratio": round(wait / (wait + train), 4) if wait + train > 0 else None,
        "staleness_max": max((r.get("staleness_max", 0) for r in steps), default=0),
    }
    if acts:
        last = acts[-1]
        mus = [v for v in last["mu_by_sampler"].values() if v > 0]
        out.update(
            t_train_s=last["t_train_s"],
            t_bcast_s=last["t_bcast_s"],
            t_first_install_s=last.get("t_first_install_s"),
            kappa=last["kappa"],
            mu_min=last["mu_min"],
            target_mu=last["target_mu"],
            mu_mean=round(sum(mus) / len(mus), 4) if mus else None,
            pool_mu=round(sum(mus), 3),
            n_active=last["n_active"],
            active_mu=last["active_mu"],
            active_cost_per_hour=last["active_cost_per_hour"],
        )
    # dollars per step over the window: from the first state record at/after the window start
    if window and summary is not None:
        start_unix = window[0]["unix_s"] - window[0]["wait_s"] - window[0]["train_s"]
        marks = [r for r in records if r.get("kind") == "activation" and r.get("unix_s", 0) >= start_unix]
        if marks and summary["steps"] > marks[0]["steps"]:
            first = marks[0]
            out["dollars_per_step"] = round(
                (summary["dollars_total"] - first["dollars_total"]) / (summary["steps"] - first["steps"]), 6
            )
    return out


def _predicted_bubble(probe: dict[str, Any], pool_mu: float) -> float | None:
    from echo2.capacity.model import predicted_bubble_ratio

    try:
        return round(
            predicted_bubble_ratio(
                G * GROUPS_PER_STEP, probe["t_train_s"], probe["t_bcast_s"], probe["kappa"], pool_mu
            ),
            4,
        )
    except (KeyError, TypeError, ValueError):
        return None


def predicted_knee(probe: dict[str, Any], mu_mean: float, max_samplers: int = 64) -> int | None:
    """The model's knee by the measured knee's own rule: the smallest pool whose predicted
    bubble is at most ``KNEE_RISE`` (the model's ample-pool plateau is 0). ``mu_min`` itself
    is the pool at which the predicted bubble reaches exactly 0, a stricter point than the
    one measured; comparing the two would hold the model to a different criterion."""
    for n in range(1, max_samplers + 1):
        bubble = _predicted_bubble(probe, n * mu_mean)
        if bubble is None:
            return None
        if bubble <= KNEE_RISE:
            return n
    return None


def knee_sweep(workdir: Path, staleness: int, steps: int, quick: bool, log) -> dict[str, Any]:
    probe_n = 24 if quick else 22
    probe = measure(
        launch(
            topology_text([(UNIFORM, probe_n)], staleness=staleness, steps=steps, activation="all"),
            workdir,
            f"knee-S{staleness}-n{probe_n}",
        )
    )
    log(f"S={staleness} probe n={probe_n}: {probe}")
    mu_min_v, mu_mean = probe.get("mu_min"), probe.get("mu_mean")
    zero_bubble = math.ceil(mu_min_v / mu_mean) if mu_min_v and mu_mean else None
    predicted = predicted_knee(probe, mu_mean) if mu_mean else None
    points = {probe_n: probe}
    if predicted is None:  # mu_min unreachable or unmeasured: sweep below the probe anyway
        sizes = [probe_n - 6] if quick else [probe_n - 10, probe_n - 6, probe_n - 4, probe_n - 2]
    else:
        # the model is pessimistic (module docstring): look mostly below the prediction
        sizes = [predicted - 2] if quick else [predicted + d for d in (-5, -3, -2, -1, 0)]
    for n in sorted({min(max(1, s), 32) for s in sizes} - set(points)):
        m = measure(
            launch(
                topology_text([(UNIFORM, n)], staleness=staleness, steps=steps, activation="all"),
                workdir,
                f"knee-S{staleness}-n{n}",
            )
        )
        log(f"S={staleness} n={n}: bubble {m['bubble_ratio']} (pool {m.get('pool_mu')}/s vs mu_min {m.get('mu_min')})")
        points[n] = m
    ordered = sorted(points)
    plateau = probe["bubble_ratio"] if probe["bubble_ratio"] is not None else 0.0
    threshold = max(BUBBLE_FLOOR, plateau + KNEE_RISE)
    measured = None
    for i, n in enumerate(ordered):
        if all((points[k]["bubble_ratio"] or 1.0) <= threshold for k in ordered[i:]):
            measured = n
            break
    ample = [n for n in ordered if predicted and n * mu_mean >= 1.1 * mu_min_v]
    ok_knee = (
        measured is not None
        and predicted is not None
        and (abs(measured - predicted) <= 1 or abs(measured - predicted) <= 0.15 * predicted)
    )
    if quick:
        ok_knee = None  # two points do not locate a knee: the floor is checked by the full run
    return {
        "staleness": staleness,
        "kappa": probe.get("kappa"),
        "t_train_s": probe.get("t_train_s"),
        "t_bcast_s": probe.get("t_bcast_s"),
        "t_first_install_s": probe.get("t_first_install_s"),
        "mu_per_sampler": mu_mean,
        "mu_min": mu_min_v,
        "predicted_knee": predicted,
        "samplers_for_mu_min": zero_bubble,
        "measured_knee": measured,
        "knee_threshold": round(threshold, 4),
        "bubble_by_samplers": {str(n): points[n]["bubble_ratio"] for n in ordered},
        "predicted_bubble_by_samplers": {
            str(n): _predicted_bubble(probe, n * mu_mean) if mu_mean else None for n in ordered
        },
        "floor_knee_ok": ok_knee,
        "floor_bubble_ok_at_1_1_mu_min": all(points[n]["bubble_ratio"] <= BUBBLE_FLOOR for n in ample),
    }


def mixed_pool(workdir: Path, steps: int, log) -> dict[str, Any]:
    pool = [(kind, 8) for kind in MIXED]
    out: dict[str, Any] = {
        "pool": {k.name: {"count": 8, "mu": k.mu, "price_per_hour": k.price_per_hour} for k in MIXED},
        "learner_price_per_hour": LEARNER_PRICE,
    }
    for policy in ("cost_aware", "random"):
        m = measure(
            launch(topology_text(pool, staleness=3, steps=steps, activation=policy), workdir, f"mixed-{policy}")
        )
        log(f"mixed {policy}: {m}")
        out[policy] = m
    ca, rnd = out["cost_aware"], out["random"]
    if ca.get("dollars_per_step") and rnd.get("dollars_per_step"):
        out["cost_ratio"] = round(ca["dollars_per_step"] / rnd["dollars_per_step"], 4)
        out["floor_cost_ok"] = out["cost_ratio"] <= 0.9
    out["floor_bubble_ok"] = all((x["bubble_ratio"] or 1.0) <= BUBBLE_FLOOR for x in (ca, rnd))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 3 knee bracket + mixed pool, <= 3 min")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--keep", type=Path, help="keep run directories under this directory")
    args = parser.parse_args(argv)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="echo2-capacity-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        global GROUPS_PER_STEP, T_TRAIN_S
        GROUPS_PER_STEP, T_TRAIN_S = QUICK if args.quick else FULL
        results: dict[str, Any] = {"quick": args.quick, "t_train_s": T_TRAIN_S, "R": G * GROUPS_PER_STEP}
        knee_steps, mixed_steps = (18, 24) if args.quick else (18, 30)
        results["knee"] = [
            knee_sweep(workdir, s, knee_steps, args.quick, log) for s in ((3,) if args.quick else (1, 3))
        ]
        results["mixed"] = mixed_pool(workdir, mixed_steps, log)
        results["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
