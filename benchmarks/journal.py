"""Journal: what the data plane's write-ahead logs cost, per record and to the main job.

    python -m benchmarks.journal [--leases 20000] [--repeats 5] [--job-seconds 0] [--json]

Micro (in this process, a temporary directory on the same disk as a run directory would
be, ``--dir``; medians over ``--repeats``):

- the PromptSource's lease journal: two records per lease (``Issued`` before it is sent,
  ``Settled`` when it closes), per fsync policy, against the same loop without a journal;
- the Buffer's journal: per group one ``Stored`` record holding the group (``GroupCodec``,
  the wire format) and a share of one ``Handed`` record per batch of 16, for the main job's
  groups (8 completions of 5 tokens) and for large ones (16 of 1,024 tokens), against
  building the same records without writing them.

Each is reported in microseconds and as the share of one core at the main job's rates
(``--leases-per-s``, measured: ~370/s at 2,940 rollouts/s of groups of 8; one group per
lease).

With ``--job-seconds N``: the main job (examples/topology.toml, as ``benchmarks/chaos.py``
launches it) for N seconds with both journals on (the default, ``journal_fsync = "none"``),
off (``journal = false``: a restart then loses the data plane's state) and with
``"always"``; learner steps per minute of each and their ratios to "off", medians over
``--job-repeats`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.chaos import _launch, _run_dir, _steps_per_minute
from echo2.actors import buffer_journal as bwal
from echo2.actors import lease_journal as wal
from echo2.journal import FsyncPolicy, Journal
from echo2.messages import RolloutGroup, ScoredGroup

GROUPS_PER_STEP = 16


def _lease_loop(directory: Path | None, leases: int, fsync: FsyncPolicy) -> float:
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


def _group(n: int, completions: int, tokens: int) -> ScoredGroup:
    total = completions * tokens
    rng = np.random.default_rng(n)
    return ScoredGroup(
        group=RolloutGroup(
            lease_id=n,
            task_id=f"task-{n}",
            attempt=0,
            sampler_id="sampler-0",
            incarnation=0,
            version=n // GROUPS_PER_STEP,
            prompt="123+456=",
            prompt_token_ids=np.arange(8, dtype=np.int32),
            token_ids=rng.integers(0, 15, total, dtype=np.int32),
            logprobs=rng.standard_normal(total).astype(np.float32),
            offsets=np.arange(0, total + 1, tokens, dtype=np.int32),
            texts=["975"] * completions,
            finish_reasons=["eos"] * completions,
        ),
        rewards=np.ones(completions, dtype=np.float32),
        keep=np.ones(completions, dtype=bool),
    )


def _group_loop(directory: Path | None, groups: list[ScoredGroup], fsync: FsyncPolicy) -> float:
    """Seconds per group: its Stored record and 1/16 of a Handed record (built and, with a
    journal, written)."""
    codec = bwal.GroupCodec()
    journal = None
    if directory is not None:
        journal = Journal(directory, "buffer", bwal.Record, bwal.State, fsync=fsync)
        journal.open()
    started = time.perf_counter()
    for i, group in enumerate(groups):
        stored = bwal.Stored(group=codec.encode(group))
        if journal is not None:
            journal.append(stored)
        if i % GROUPS_PER_STEP == GROUPS_PER_STEP - 1:
            handed = bwal.Handed(
                request_version=i // GROUPS_PER_STEP,
                tasks=[g.group.task_id for g in groups[i + 1 - GROUPS_PER_STEP : i + 1]],
            )
            if journal is not None:
                journal.append(handed)
    elapsed = time.perf_counter() - started
    if journal is not None:
        journal.close()
    return elapsed / len(groups)


def _median(fn, repeats: int, directory_parent: Path | None, use_dir: bool) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(dir=directory_parent) as tmp:
            times.append(fn(Path(tmp) if use_dir else None))
    return statistics.median(times)


JOB_CASES: dict[str, tuple[str, ...]] = {
    "on": (),
    "off": (
        "--set", "actors.prompt_source.config.journal=false",
        "--set", "actors.buffer.config.journal=false",
    ),
    "always": (
        "--set", 'actors.prompt_source.config.journal_fsync="always"',
        "--set", 'actors.buffer.config.journal_fsync="always"',
    ),
}  # fmt: skip


def _job_steps_per_min(seconds: float, case: str) -> float:
    with tempfile.TemporaryDirectory(prefix="echo2-journal-") as parent:
        launcher = _launch(Path(parent), seconds, *JOB_CASES[case])
        launcher.communicate(timeout=seconds + 180)
        return _steps_per_minute(_run_dir(Path(parent)))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the journals go (default: a temporary dir)")
    parser.add_argument("--leases-per-s", type=float, default=370.0)
    parser.add_argument("--job-seconds", type=float, default=0.0, help="also run the main job this long per case")
    parser.add_argument("--job-repeats", type=int, default=1, help="interleaved rounds of the main-job cases")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rate = args.leases_per_s
    report: dict[str, object] = {"load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]}

    lease: dict[str, float] = {}
    for policy in ("baseline", "none", "always"):
        n = args.leases if policy != "always" else max(1, args.leases // 20)  # fsync is slow
        fsync: FsyncPolicy = "always" if policy == "always" else "none"
        lease[policy] = _median(
            lambda d, n=n, f=fsync: _lease_loop(d, n, f), args.repeats, args.dir, policy != "baseline"
        )
    report["lease_us"] = {k: round(v * 1e6, 2) for k, v in lease.items()}
    report["lease_core_share"] = {
        k: round((v - lease["baseline"]) * rate, 5) for k, v in lease.items() if k != "baseline"
    }

    for name, completions, tokens in (("main_job_group", 8, 5), ("large_group", 16, 1024)):
        groups = [_group(i, completions, tokens) for i in range(max(GROUPS_PER_STEP, args.leases // 10))]
        group: dict[str, float] = {}
        for policy in ("baseline", "none", "always"):
            chosen = groups if policy != "always" else groups[: max(GROUPS_PER_STEP, len(groups) // 20)]
            fsync = "always" if policy == "always" else "none"
            group[policy] = _median(
                lambda d, c=chosen, f=fsync: _group_loop(d, c, f), args.repeats, args.dir, policy != "baseline"
            )
        record_bytes = len(bwal.GroupCodec().encode(groups[0]))
        report[f"{name}_us"] = {k: round(v * 1e6, 2) for k, v in group.items()}
        report[f"{name}_record_bytes"] = record_bytes
        report[f"{name}_core_share"] = {k: round(v * rate, 5) for k, v in group.items()}

    if args.job_seconds:
        rounds: dict[str, list[float]] = {case: [] for case in JOB_CASES}
        for _ in range(args.job_repeats):
            for case in JOB_CASES:
                rounds[case].append(_job_steps_per_min(args.job_seconds, case))
        spm = {case: statistics.median(values) for case, values in rounds.items()}
        report["main_job_steps_per_min"] = {case: [round(v, 1) for v in values] for case, values in rounds.items()}
        report["main_job_ratio_to_off"] = {
            case: round(spm[case] / spm["off"], 3) if spm["off"] else None for case in JOB_CASES
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
