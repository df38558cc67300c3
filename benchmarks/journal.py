"""Journal: what the PromptSource's write-ahead log costs per lease, by fsync policy.

    python -m benchmarks.journal [--leases 20000] [--repeats 5] [--job-seconds 0] [--json]

Each lease costs the PromptSource two records (``Issued`` before it is sent, ``Settled``
when it closes). This appends that pair ``--leases`` times to a journal in a temporary
directory on the same disk as the run directory would be (``--dir``), once per fsync
policy, and the same loop without a journal (the baseline, taken in the same run). It
reports the median over ``--repeats`` of each as seconds per lease and as a ratio to the
baseline, and the share of one PromptSource core the journal would take at the lease rate
of the main job (``--leases-per-s``, measured: ~370/s at 2,940 rollouts/s of groups of 8).

With ``--job-seconds N`` it also runs the main job (examples/topology.toml, as
``benchmarks/chaos.py`` launches it) for N seconds with ``journal_fsync = "none"`` (the
default) and with ``"always"``, and reports learner steps per minute of each and their
ratio: an upper bound on what the default journal costs the main job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.chaos import ROOT, TOPOLOGY, _steps_per_minute
from echo2.actors import lease_journal as wal
from echo2.journal import FsyncPolicy, Journal
from echo2.rundir import RunDir


def _run(directory: Path | None, leases: int, fsync: FsyncPolicy) -> float:
    task = wal.Task(task_id="gsm8k-000123", text="What is 12 * 7 + 3? " * 8, answer="87")
    journal = None
    if directory is not None:
        journal = Journal(directory, "ps", wal.Record, wal.State, fsync=fsync)
        journal.open()
    started = time.perf_counter()
    for n in range(1, leases + 1):
        issued = wal.Issued(
            lease_id=wal.lease_id(1, n), task=task, attempt=0, sampler=b"s/abc", token=b"t" * 16, fresh=True
        )
        settled = wal.Settled(lease_id=issued.lease_id, stored=True)
        if journal is not None:
            journal.append(issued)
            journal.append(settled)
    elapsed = time.perf_counter() - started
    if journal is not None:
        journal.close()
    return elapsed / leases


def _job_steps_per_min(seconds: float, fsync: FsyncPolicy) -> float:
    with tempfile.TemporaryDirectory(prefix="echo2-journal-") as parent:
        command = [
            sys.executable, "-m", "echo2.launch", str(TOPOLOGY), "--run-dir", parent,
            "--set", f"run.deadline_s={seconds}",
            "--set", "actors.learner.config.max_steps=1000000",
            "--set", "actors.learner.config.eval_every=0",
            "--set", "actors.learner.config.checkpoint_every=0",
            "--set", f'actors.prompt_source.config.journal_fsync="{fsync}"',
        ]  # fmt: skip
        subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 180)
        [run] = [RunDir(p) for p in Path(parent).iterdir() if RunDir(p).topology_path.exists()]
        return _steps_per_minute(run)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leases", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the journals go (default: a temporary dir)")
    parser.add_argument("--leases-per-s", type=float, default=370.0)
    parser.add_argument("--job-seconds", type=float, default=0.0, help="also run the main job this long per policy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, float] = {}
    for policy in ("baseline", "none", "always"):
        times = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                directory = None if policy == "baseline" else Path(tmp)
                leases = args.leases if policy != "always" else max(1, args.leases // 20)  # fsync is slow
                times.append(_run(directory, leases, "always" if policy == "always" else "none"))
        results[policy] = statistics.median(times)
    report = {
        "s_per_lease": results,
        "ratio_to_baseline": {k: v / results["baseline"] for k, v in results.items()},
        "core_share_at_main_job_rate": {k: v * args.leases_per_s for k, v in results.items() if k != "baseline"},
    }
    if args.job_seconds:
        spm = {policy: _job_steps_per_min(args.job_seconds, policy) for policy in ("none", "always")}
        report["main_job_steps_per_min"] = spm
        report["main_job_ratio_always_to_none"] = spm["always"] / spm["none"] if spm["none"] else None
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for policy, seconds in results.items():
        share = report["core_share_at_main_job_rate"].get(policy)
        extra = f"  {share:.2%} of a core at {args.leases_per_s:g} leases/s" if share is not None else ""
        print(f"{policy:>8}: {seconds * 1e6:9.2f} us/lease{extra}")
    if "main_job_steps_per_min" in report:
        print(
            f"main job steps/min: {report['main_job_steps_per_min']}; always/none {report['main_job_ratio_always_to_none']}"
        )


if __name__ == "__main__":
    main()
