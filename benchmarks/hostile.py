"""Hostile sampler: the main job's honest throughput with and without an attacker beside it.

    python benchmarks/hostile.py [--steps 60] [--groups 10000] [--pairs 3] [--json]

Each pair runs examples/topology.toml for ``--steps`` learner steps twice, in alternating
order: once as it is (the baseline) and once with ``echo2.actors.hostile:HostileSampler``
in its own process, sending ``--groups`` hostile groups (forged answers, unpublished
versions, out-of-vocabulary ids, NaN log-probs, bad shapes, replays, duplicates, unleased
tasks). Reports, per run and as the median over pairs of attacked / baseline: honest
groups trained per second of the learner's wall time, learner steps per second, the
attacker's rejections by reason, whether it was quarantined, and the audit.
Floors (issue 14): audit clean, learner never crashes, honest throughput >= 0.9x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "examples" / "topology.toml"
ATTACKER = """
[processes.evil]
[actors.evil]
kind = "echo2.actors.hostile:HostileSampler"
process = "evil"
config = {{ groups = {groups}, credits = 8 }}
"""
BYSTANDER = """
[processes.evil]
[actors.evil]
kind = "idle"
process = "evil"
"""
"""The baseline's stand-in for the attacker: the same processes, so that the launcher
shares the cores out the same way (without it the attacked runs measured 1.46x faster)."""


def run_case(parent: Path, *, steps: int, groups: int) -> dict[str, Any]:
    """One launched run (with an attacker when ``groups`` > 0): its figures."""
    from echo2 import ledger
    from echo2.rundir import RunDir
    from echo2.tools.audit import audit

    parent.mkdir(parents=True)
    topology = parent / "topology.toml"
    topology.write_text(TOPOLOGY.read_text() + (ATTACKER.format(groups=groups) if groups else BYSTANDER))
    command = [
        sys.executable, "-m", "echo2.launch", str(topology), "--run-dir", str(parent / "runs"),
        "--set", f"actors.learner.config.max_steps={steps}",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.learner.config.eval_prompts=50",
        "--set", "actors.learner.config.checkpoint_every=0",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    (run,) = [p for p in (parent / "runs").iterdir() if p.is_dir() and not p.is_symlink()]
    summary = json.loads(RunDir(run).summary_path.read_text())
    report = audit([run])
    trained = [e for e in ledger.read([run]).events if isinstance(e, ledger.Trained)]
    honest = sum(1 for e in trained if e.sampler != "evil")
    return {
        "attacked": bool(groups),
        "exit_code": done.returncode,
        "steps": summary["steps"],
        "wall_s": summary["wall_s"],
        "steps_per_s": summary["steps_per_s"],
        "honest_groups_per_s": round(honest / summary["wall_s"], 3),
        "groups_trained_from_attacker": len(trained) - honest,
        "audit_ok": report.ok,
        "rejected": report.rejected_by_sampler.get("evil", {}),
        "quarantined": "evil" in report.quarantined,
        "run_dir": str(run),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--groups", type=int, default=10_000, help="hostile groups the attacker sends")
    parser.add_argument("--pairs", type=int, default=3, help="baseline/attacked pairs (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {"honest_groups_per_s": [], "steps_per_s": []}
    with tempfile.TemporaryDirectory(prefix="echo2-hostile-") as tmp:
        for pair in range(args.pairs):
            order = [0, args.groups] if pair % 2 == 0 else [args.groups, 0]  # alternate: no drift bias
            cases = {bool(g): run_case(Path(tmp) / f"{pair}-{g}", steps=args.steps, groups=g) for g in order}
            for case in cases.values():
                print(json.dumps(case) if args.json else case, flush=True)
            for key, values in ratios.items():
                values.append(cases[True][key] / cases[False][key])
    result = {f"{key}_ratio_median": round(statistics.median(v), 3) for key, v in ratios.items()}
    result |= {f"{key}_ratios": [round(r, 3) for r in v] for key, v in ratios.items()}
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
