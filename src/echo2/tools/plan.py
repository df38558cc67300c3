"""``python -m echo2.plan topology.toml``: the capacity plan of a topology, before or after a run.

::

    python -m echo2.plan TOPOLOGY.toml [--set path=value]... [--run RUN_DIR]
                         [--t-train-s S] [--t-bcast-s S] [--mu NAME=ROLLOUTS_PER_S]...
                         [--bytes-per-version B] [--link-mbps M] [--json]

Inputs, each declared or measured (later ones win):

* ``R = groups_per_step * group_size`` and ``S`` from ``[job]``; ``kappa`` from the
  learner (``kappa``, else ``max(1, S - 1)``); gamma and the learner's price from the
  PromptSource config (``gamma``, ``learner_price_per_hour``).
* ``T_train``: the learner's ``simulated_train_s``, the PromptSource's ``t_train_s``, the
  measured mean of a run's learner steps (``--run``), or ``--t-train-s``.
* ``T_bcast``: the PromptSource's ``t_bcast_s`` (if >= 0), a run's last measurement, or
  ``--t-bcast-s``; else 0.
* Bytes per version: the median of a run's ``broadcast`` records (``--run``: what each
  version put on the wire, its delta payload when delta coding was on, beside its dense
  size), or ``--bytes-per-version``. With ``--link-mbps`` the plan predicts T_bcast from
  them (``capacity.model.t_bcast_for_bytes``: bytes / Bw), and also shows what dense
  versions would need, so delta coding's effect on workers and staleness is visible; for a
  LoRA run (the learner's ``lora`` record), what versions of the full model would need.
* The pool: every sampler's ``price_per_hour``; its ``mu_i`` from the simulated engine's
  speed (``group_size * min(credits, max_batch_groups)`` rollouts per
  ``seconds_per_token * max_new_tokens`` s), a run's measurement (``--run``: the
  scheduler's last ``mu_by_sampler``), or ``--mu NAME=VALUE``. A sampler with no figure is
  listed and left out.

Prints the active set the cost-aware rule picks (greedy by rho = c_i / mu_i up to
``gamma * mu_min``), mu_min, the predicted bubble ratio, the worst-case staleness and the
cost per step. Exit 2 for a bad topology or option (one line), 0 otherwise (also when the
target is out of reach: that is reported, not an error).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2.actors.learner import Learner
from echo2.actors.prompt_source import PromptSource
from echo2.actors.sampler import Sampler
from echo2.capacity.model import (
    Worker,
    cost_per_step,
    greedy_activation,
    mu_min,
    mu_target,
    predicted_bubble_ratio,
    staleness_bound,
    t_bcast_for_bytes,
)
from echo2.errors import ConfigError
from echo2.rundir import RunDir


@dataclass
class PlanInputs:
    R: int
    staleness: int
    kappa: int
    t_train_s: float | None
    t_bcast_s: float
    gamma: float
    learner_price_per_hour: float
    workers: list[Worker]
    unknown_mu: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)  # every sampler's $/h
    bytes_per_version: float | None = None
    """On the wire per version (delta payload or dense state), measured or declared."""
    dense_bytes_per_version: float | None = None
    model_bytes_per_version: float | None = None
    """A LoRA run's full model state (its versions carry the adapter): what a run without
    LoRA would put on the wire per version."""
    link_mbps: float | None = None


def inputs_from_topology(topology: Any) -> PlanInputs:
    """Declared figures of a validated ``Topology``."""
    job = topology.job
    learner = next((a for a in topology.actors.values() if issubclass(a.cls, Learner)), None)
    source = next((a for a in topology.actors.values() if issubclass(a.cls, PromptSource)), None)
    kappa = max(1, job.staleness - 1)
    t_train: float | None = None
    sources = {"kappa": "max(1, S - 1)", "t_bcast_s": "default 0"}
    if learner is not None:
        cfg = learner.config
        if getattr(cfg, "kappa", 0):
            kappa, sources["kappa"] = cfg.kappa, "learner config"
        if getattr(cfg, "simulated_train_s", 0.0) > 0:
            t_train, sources["t_train_s"] = cfg.simulated_train_s, "learner simulated_train_s"
    gamma, learner_price, t_bcast = 1.1, 0.0, 0.0
    if source is not None:
        cfg = source.config
        gamma = getattr(cfg, "gamma", gamma)
        learner_price = getattr(cfg, "learner_price_per_hour", 0.0)
        if getattr(cfg, "t_train_s", 0.0) > 0:
            t_train, sources["t_train_s"] = cfg.t_train_s, "prompt_source t_train_s"
        if getattr(cfg, "t_bcast_s", -1.0) >= 0:
            t_bcast, sources["t_bcast_s"] = cfg.t_bcast_s, "prompt_source t_bcast_s"
    workers, unknown, prices = [], [], {}
    for actor in topology.actors.values():
        if not issubclass(actor.cls, Sampler):
            continue
        cfg = actor.config
        prices[actor.name] = cfg.price_per_hour
        mu = _simulated_mu(cfg, job)
        if mu is None:
            unknown.append(actor.name)
            continue
        workers.append(Worker(actor.name, mu, cfg.price_per_hour))
    if workers:
        sources["mu"] = "simulated engine speed"
    return PlanInputs(
        R=job.groups_per_step * job.group_size,
        staleness=job.staleness,
        kappa=kappa,
        t_train_s=t_train,
        t_bcast_s=t_bcast,
        gamma=gamma,
        learner_price_per_hour=learner_price,
        workers=workers,
        unknown_mu=unknown,
        sources=sources,
        prices=prices,
    )


def _simulated_mu(cfg: Any, job: Any) -> float | None:
    if getattr(cfg, "engine", "") != "simulated":
        return None
    spt = float(cfg.engine_kwargs.get("seconds_per_token", 0.0))
    if spt <= 0:
        return None
    groups = max(1, min(cfg.credits, cfg.max_batch_groups))
    return job.group_size * groups / (spt * job.max_new_tokens)


def apply_run(inputs: PlanInputs, run_dir: Path) -> None:
    """Measured figures of a finished run: learner step times, the scheduler's last record."""
    prices = inputs.prices
    run = RunDir(run_dir)
    steps = run.metrics("learner", "step")
    if steps:
        train = [r["train_s"] for r in steps if "train_s" in r]
        if train:
            inputs.t_train_s, inputs.sources["t_train_s"] = sum(train) / len(train), f"measured ({run_dir.name})"
    bcasts = run.all_metrics("broadcast")
    wire = [float(r.get("wire_bytes", r.get("bytes", 0))) for r in bcasts if r.get("bytes")]
    if wire:
        inputs.bytes_per_version = statistics.median(wire)
        inputs.dense_bytes_per_version = statistics.median(
            float(r.get("dense_bytes", r["bytes"])) for r in bcasts if r.get("bytes")
        )
        inputs.sources["bytes_per_version"] = f"measured ({run_dir.name})"
    lora = run.metrics("learner", "lora")
    if lora:
        inputs.model_bytes_per_version = float(lora[-1]["model_bytes"])
    acts = [r for r in run.metrics("prompt_source", "activation") if r.get("mu_by_sampler")]
    if acts:
        last = acts[-1]
        if last.get("t_bcast_s") is not None:
            inputs.t_bcast_s, inputs.sources["t_bcast_s"] = float(last["t_bcast_s"]), f"measured ({run_dir.name})"
        measured = {k: float(v) for k, v in last["mu_by_sampler"].items() if v and v > 0}
        if measured:
            known = {w.worker_id: w for w in inputs.workers}
            for name, mu in measured.items():
                known[name] = Worker(name, mu, prices.get(name, known[name].price_per_hour if name in known else 0.0))
            inputs.workers = list(known.values())
            inputs.unknown_mu = [n for n in inputs.unknown_mu if n not in measured]
            inputs.sources["mu"] = f"measured ({run_dir.name})"


def make_plan(inputs: PlanInputs) -> dict[str, Any]:
    """The cost-aware plan as a flat dict (the CLI prints it)."""
    if inputs.t_train_s is None:
        raise ConfigError("T_train unknown: declare it (--t-train-s, learner simulated_train_s) or measure it (--run)")
    plan: dict[str, Any] = {
        "R": inputs.R,
        "staleness": inputs.staleness,
        "kappa": inputs.kappa,
        "t_train_s": round(inputs.t_train_s, 6),
        "t_bcast_s": round(inputs.t_bcast_s, 6),
        "gamma": inputs.gamma,
        "sources": inputs.sources,
        "pool_mu": round(sum(w.mu for w in inputs.workers), 6),
        "pool_size": len(inputs.workers),
        "unknown_mu": inputs.unknown_mu,
        "bytes_per_version": inputs.bytes_per_version,
        "dense_bytes_per_version": inputs.dense_bytes_per_version,
    }
    if inputs.link_mbps is not None and inputs.dense_bytes_per_version is not None:
        dense_t = t_bcast_for_bytes(inputs.dense_bytes_per_version, inputs.link_mbps)
        plan["t_bcast_dense_s"] = round(dense_t, 6)
        try:
            plan["mu_min_dense"] = round(mu_min(inputs.kappa, inputs.R, inputs.t_train_s, dense_t), 6)
        except ValueError:
            plan["mu_min_dense"] = None  # out of reach with dense versions
    if inputs.link_mbps is not None and inputs.model_bytes_per_version is not None:
        full_t = t_bcast_for_bytes(inputs.model_bytes_per_version, inputs.link_mbps)
        plan.update(model_bytes_per_version=inputs.model_bytes_per_version, t_bcast_full_model_s=round(full_t, 6))
        try:
            plan["mu_min_full_model"] = round(mu_min(inputs.kappa, inputs.R, inputs.t_train_s, full_t), 6)
        except ValueError:
            plan["mu_min_full_model"] = None  # out of reach with full-model versions
    try:
        minimum = mu_min(inputs.kappa, inputs.R, inputs.t_train_s, inputs.t_bcast_s)
    except ValueError as exc:
        plan.update(feasible=False, reason=str(exc))
        return plan
    target = mu_target(minimum, inputs.gamma)
    chosen = greedy_activation(inputs.workers, target)
    by_id = {w.worker_id: w for w in inputs.workers}
    mu_active = chosen.total_mu
    plan.update(
        feasible=chosen.met,
        mu_min=round(minimum, 6),
        target_mu=round(target, 6),
        active=list(chosen.active_ids),
        active_mu=round(mu_active, 6),
        active_cost_per_hour=round(chosen.cost_per_hour, 6),
        parked=sorted(set(by_id) - set(chosen.active_ids)),
        predicted_bubble_ratio=round(
            predicted_bubble_ratio(inputs.R, inputs.t_train_s, inputs.t_bcast_s, inputs.kappa, mu_active), 6
        ),
        staleness_bound=(
            staleness_bound(inputs.kappa, inputs.t_train_s, inputs.t_bcast_s, inputs.R, mu_active)
            if mu_active > 0
            else None
        ),
        cost_per_step=round(cost_per_step(chosen.cost_per_hour, inputs.learner_price_per_hour, inputs.t_train_s), 8),
        learner_price_per_hour=inputs.learner_price_per_hour,
        rho={w.worker_id: round(w.rho, 6) for w in sorted(inputs.workers, key=lambda w: (w.rho, w.worker_id))},
    )
    return plan


def render(plan: dict[str, Any]) -> str:
    lines = [
        f"R = {plan['R']} rollouts/step, S = {plan['staleness']}, kappa = {plan['kappa']}, "
        f"T_train = {plan['t_train_s']:.4g} s, T_bcast = {plan['t_bcast_s']:.4g} s, gamma = {plan['gamma']}",
        f"pool: {plan['pool_size']} samplers, {plan['pool_mu']:.4g} rollouts/s"
        + (f" (no mu for: {', '.join(plan['unknown_mu'])})" if plan["unknown_mu"] else ""),
        "sources: " + ", ".join(f"{k} = {v}" for k, v in plan["sources"].items()),
    ]
    if plan.get("bytes_per_version") is not None:
        lines.append(
            f"bytes per version: {plan['bytes_per_version'] / 2**20:.4g} MiB on the wire"
            + (
                f" (dense {plan['dense_bytes_per_version'] / 2**20:.4g} MiB)"
                if plan.get("dense_bytes_per_version")
                else ""
            )
        )
    if "t_bcast_dense_s" in plan:
        dense_mu = plan["mu_min_dense"]
        lines.append(
            f"dense versions would take T_bcast = {plan['t_bcast_dense_s']:.4g} s, mu_min = "
            + (f"{dense_mu:.4g} rollouts/s" if dense_mu is not None else "out of reach")
        )
    if "t_bcast_full_model_s" in plan:
        full_mu = plan["mu_min_full_model"]
        lines.append(
            f"LoRA: versions carry the adapter; the full model's ({plan['model_bytes_per_version'] / 2**20:.4g} MiB) "
            f"would take T_bcast = {plan['t_bcast_full_model_s']:.4g} s, mu_min = "
            + (f"{full_mu:.4g} rollouts/s" if full_mu is not None else "out of reach")
        )
    if "mu_min" not in plan:
        lines.append(f"infeasible: {plan['reason']}")
        return "\n".join(lines) + "\n"
    lines += [
        f"mu_min = {plan['mu_min']:.4g} rollouts/s, target = {plan['target_mu']:.4g} rollouts/s"
        + ("" if plan["feasible"] else "  (NOT MET: the whole pool is below the target)"),
        f"active set ({len(plan['active'])}): {', '.join(plan['active'])}",
        f"  {plan['active_mu']:.4g} rollouts/s, ${plan['active_cost_per_hour']:.4g}/h "
        f"+ learner ${plan['learner_price_per_hour']:.4g}/h",
        f"parked ({len(plan['parked'])}): {', '.join(plan['parked']) or '-'}",
        f"predicted bubble ratio = {plan['predicted_bubble_ratio']:.2%}",
        f"worst-case staleness = {plan['staleness_bound']} updates (budget S = {plan['staleness']})",
        f"cost per step = ${plan['cost_per_step']:.6g}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from echo2.topology import load_topology

    parser = argparse.ArgumentParser(prog="python -m echo2.plan", description="Capacity plan of a topology.")
    parser.add_argument("topology", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    parser.add_argument("--run", type=Path, help="run directory whose measurements to use")
    parser.add_argument("--t-train-s", type=float)
    parser.add_argument("--t-bcast-s", type=float)
    parser.add_argument("--mu", action="append", default=[], metavar="SAMPLER=ROLLOUTS_PER_S")
    parser.add_argument("--bytes-per-version", type=float, help="bytes a version puts on the wire")
    parser.add_argument("--link-mbps", type=float, help="per-link bandwidth: T_bcast = bytes per version / link")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        inputs = inputs_from_topology(load_topology(args.topology, args.overrides))
        if args.run is not None:
            if not args.run.is_dir():
                raise ConfigError(f"no run directory {args.run}", path="--run")
            apply_run(inputs, args.run)
        if args.t_train_s is not None:
            inputs.t_train_s, inputs.sources["t_train_s"] = args.t_train_s, "--t-train-s"
        if args.t_bcast_s is not None:
            inputs.t_bcast_s, inputs.sources["t_bcast_s"] = args.t_bcast_s, "--t-bcast-s"
        _apply_mu_overrides(inputs, args.mu)
        _apply_bytes(inputs, args.bytes_per_version, args.link_mbps)
        plan = make_plan(inputs)
    except (ConfigError, ValueError) as exc:
        print(f"{args.topology}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(plan, indent=2) + "\n" if args.json else render(plan))
    return 0


def _apply_bytes(inputs: PlanInputs, bytes_per_version: float | None, link_mbps: float | None) -> None:
    """Declared bytes per version, and T_bcast predicted from the bytes over ``link_mbps``."""
    if bytes_per_version is not None:
        if not math.isfinite(bytes_per_version) or bytes_per_version < 0:
            raise ConfigError(f"must be a finite number >= 0, got {bytes_per_version}", path="--bytes-per-version")
        inputs.bytes_per_version = bytes_per_version
        inputs.dense_bytes_per_version = inputs.dense_bytes_per_version or bytes_per_version
        inputs.sources["bytes_per_version"] = "--bytes-per-version"
    if link_mbps is None:
        return
    if not math.isfinite(link_mbps) or link_mbps <= 0:
        raise ConfigError(f"must be a finite number > 0, got {link_mbps}", path="--link-mbps")
    if inputs.bytes_per_version is None:
        raise ConfigError(
            "needs bytes per version (--bytes-per-version, or a run's broadcast records)", path="--link-mbps"
        )
    inputs.link_mbps = link_mbps
    inputs.t_bcast_s = t_bcast_for_bytes(inputs.bytes_per_version, link_mbps)
    inputs.sources["t_bcast_s"] = "bytes_per_version / link_mbps"


def _apply_mu_overrides(inputs: PlanInputs, overrides: Sequence[str]) -> None:
    known = {w.worker_id: w for w in inputs.workers}
    prices = inputs.prices
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"expected SAMPLER=ROLLOUTS_PER_S, got {item!r}", path="--mu")
        try:
            mu = float(value)
        except ValueError:
            raise ConfigError(f"not a number: {value!r}", path="--mu") from None
        if not math.isfinite(mu) or mu < 0:
            raise ConfigError(f"mu must be a finite number >= 0, got {value!r}", path="--mu")
        known[name] = Worker(name, mu, prices.get(name, 0.0))
        inputs.unknown_mu = [n for n in inputs.unknown_mu if n != name]
    inputs.workers = list(known.values())


if __name__ == "__main__":
    sys.exit(main())
