"""Reconcile a run's ledgers: was every rollout trained exactly once or dropped for a reason?

    python -m echo2.audit RUN_DIR [RUN_DIR ...] [--json]

Several run directories (one per host of a multi-host run) are merged. Reads
``ledger/*.jsonl`` (the events of ``echo2.ledger``, written by the actors through
``ActorContext.ledger``) and the budget ``S`` from ``topology.resolved.json``. Exit status 0 when the accounting holds, 1 on any
violation, 2 when a directory is no run directory. A run directory without a ledger (a
host whose actors never wrote an event, e.g. a sampler that never got work) is listed
under ``without_ledger`` and the others are audited.

Per task (one prompt's group), the Buffer decides exactly once: ``accepted`` or
``rejected`` (late, duplicate, stale on arrival, reward failure), or dropped by dynamic
sampling (``zero_variance``: all rewards equal, no gradient; counted apart, since it is a
choice, not a refusal: the task is settled and a new prompt takes its place). An accepted group then
ends as exactly one of: ``trained`` (by the Learner), ``dropped`` (stale while waiting,
overflow), ``unconsumed`` (still stored when the run ended) or handed to the learner in the
batch it had requested when the run ended (in flight at shutdown).

A resumed learner (``--resume``) logs where it restarted; trainings of any earlier
incarnation at or after that point are void (``voided_by_resume``) and must happen again
(a resume past a damaged checkpoint restarts before the newest one).

Every leased task reaches an end: accepted (and then one of the above), dropped on arrival
with a reason (stale, zero variance, a reward failure), abandoned after ``max_attempts``,
or outstanding when the run stopped (leased or queued for re-issue at the PromptSource's
end, ``outstanding``, and not leased again after it: a ``--resume`` takes it up). A lease
that expired, a group that arrived late, as a duplicate or failed admission, ends
nothing: the task was re-issued and its next lease must. This holds across restarts of
any process and across resumes.

Violations (each also counted per sampler in ``culprits``: the sampler the group was
accepted from, else the last one its task was leased to, else the one the learner names;
``named`` lists the tasks with that sampler):
  lost                accepted, and none of the above
  unresolved          leased, never accepted, and no end (the lease and its task vanished)
  accepted_twice      accepted more than once (two groups of one task stored)
  duplicated          trained more than once
  unexpected          trained, but never leased
  stale_trained       trained at learner version t from policy version v < t - S
  impossible_version  trained at learner version t from a version v > t (no learner
                      publishes a version before reaching it) or v < 0
  late_accepted       accepted on a lease the Buffer had already declared expired

"Trained" is the learner's ``trained`` event, written only after the step committed
(``echo2.training.accounting``): a step that crashed trains nothing. A run whose
``status.json`` says it failed (exit 1, or 74: storage) never audits OK (``run_failed``).
Rejections at admission (``rejected:<reason>``) are listed per sampler, and so are
quarantined samplers; neither is a violation (they are the defence working).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import assert_never

from echo2 import ledger
from echo2.messages import ZERO_VARIANCE
from echo2.rundir import RunDir

VIOLATIONS = (
    "lost",
    "unresolved",
    "accepted_twice",
    "duplicated",
    "unexpected",
    "stale_trained",
    "impossible_version",
    "late_accepted",
)
FAILED_EXIT_CODES = (1, 74)
"""``status.json`` exit codes of a run that failed (``echo2.launch.exits``: FAILED, STORAGE);
a deadline or a signal stops a run cleanly, and its accounting still has to hold."""


@dataclass
class AuditReport:
    leased_tasks: int = 0
    leases_issued: int = 0
    accepted: int = 0
    trained: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    unconsumed: int = 0
    in_flight_at_end: int = 0
    abandoned: int = 0
    outstanding_at_end: int = 0
    """Tasks leased or queued for re-issue when the run stopped (unfinished, not lost)."""
    zero_variance: int = 0
    """Groups dropped on arrival by dynamic sampling (all rewards equal): settled, not lost."""
    voided_by_resume: int = 0
    lost: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    accepted_twice: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    stale_trained: list[str] = field(default_factory=list)
    impossible_version: list[str] = field(default_factory=list)
    late_accepted: list[str] = field(default_factory=list)
    culprits: dict[str, dict[str, int]] = field(default_factory=dict)
    """violation -> sampler -> tasks (``?`` when no event names one)."""
    named: dict[str, dict[str, str]] = field(default_factory=dict)
    """violation -> task -> the sampler behind it (``?`` when no event names one)."""
    rejected_by_sampler: dict[str, dict[str, int]] = field(default_factory=dict)
    """Admission rejections, sampler -> reason -> groups."""
    quarantined: dict[str, str] = field(default_factory=dict)
    """Samplers given no more leases -> why."""
    run_failed: str = ""
    """Why ``status.json`` says the run failed ("" when it does not)."""
    staleness_budget: int | None = None
    identity_holds: bool = True
    unreadable_lines: list[str] = field(default_factory=list)
    """Complete lines that are no ledger event (``file:line: why``); reported, not counted."""
    without_ledger: list[str] = field(default_factory=list)
    """Run directories given that hold no ledger (nothing in them to reconcile)."""

    @property
    def ok(self) -> bool:
        return self.identity_holds and not self.run_failed and not any(getattr(self, name) for name in VIOLATIONS)


def _run_failed(run_dirs: Sequence[Path]) -> str:
    for run_dir in run_dirs:
        path = RunDir(run_dir).status_path
        if not path.exists():
            continue
        try:
            status = json.loads(path.read_text())
            code = int(status.get("exit_code", 0))
        except (ValueError, TypeError, AttributeError):
            return f"{path}: unreadable"
        if code in FAILED_EXIT_CODES:
            return f"{path}: exit {code}: {status.get('reason', '')}"
    return ""


def _budget(run_dirs: Sequence[Path]) -> int | None:
    for run_dir in run_dirs:
        path = RunDir(run_dir).current_topology_path()
        if path.exists():
            return int(json.loads(path.read_text())["job"]["staleness"])
    return None


def audit(run_dirs: Sequence[Path]) -> AuditReport:
    report = AuditReport(staleness_budget=_budget(run_dirs), run_failed=_run_failed(run_dirs))
    report.without_ledger = [str(d) for d in run_dirs if not RunDir(d).ledger_dir.is_dir()]
    contents = ledger.read(run_dirs)
    report.unreadable_lines = contents.unknown_lines
    leased: set[str] = set()
    accepted: dict[str, int] = {}  # task -> lease
    times_accepted: Counter[str] = Counter()
    ended_on_arrival: set[str] = set()  # dropped with a reason on arrival (a settled end)
    abandoned: set[str] = set()
    # The PromptSource's own order (one ledger file): an ``outstanding`` ends a task only if
    # it was not leased again after it (by a resume).
    last_leased_at: dict[str, int] = {}
    outstanding_at: dict[str, int] = {}
    sampler_of: dict[str, str] = {}  # task -> the sampler behind it (accepted from, else leased to)
    trained_by: dict[str, str] = {}  # task -> sampler the learner names
    expired_leases: set[int] = set()
    trained: Counter[str] = Counter()
    dropped: dict[str, str] = {}
    unconsumed: set[str] = set()
    handed: dict[str, int] = {}  # task -> request version
    last_trained_version = -1
    rejected: Counter[str] = Counter()
    drop_reasons: Counter[str] = Counter()
    accepted_order: list[tuple[str, int]] = []
    # A resumed learner restarts from a checkpoint: what any older incarnation trained at or
    # after that point is in no model any more (the Buffer requeues those groups), so it
    # does not count. Resumes as (incarnation, from_version).
    resumes = [(e.incarnation, e.from_version) for e in contents.events if isinstance(e, ledger.Resumed)]

    for position, e in enumerate(contents.events):
        match e:
            case ledger.Leased():
                leased.add(e.task)
                last_leased_at[e.task] = position
                if e.task not in accepted:
                    sampler_of[e.task] = e.sampler
                report.leases_issued += 1
            case ledger.Accepted():
                accepted[e.task] = e.lease
                times_accepted[e.task] += 1
                sampler_of[e.task] = e.sampler
                accepted_order.append((e.task, e.lease))
            case ledger.Rejected() if e.outcome == "dropped" and e.reason == ZERO_VARIANCE:
                report.zero_variance += 1
                ended_on_arrival.add(e.task)
            case ledger.Rejected():
                rejected[e.label] += 1
                if e.outcome == "dropped":
                    ended_on_arrival.add(e.task)
                if e.outcome == "rejected":
                    by_reason = report.rejected_by_sampler.setdefault(e.sampler or "?", {})
                    by_reason[e.reason] = by_reason.get(e.reason, 0) + 1
            case ledger.LeaseExpired():
                expired_leases.add(e.lease)
            case ledger.Dropped():
                dropped[e.task] = e.reason
                drop_reasons[e.reason] += 1
            case ledger.Unconsumed():
                unconsumed.add(e.task)
            case ledger.Handed():
                handed[e.task] = e.request_version
            case ledger.Trained():
                if any(e.incarnation < later and e.learner_version >= start for later, start in resumes):
                    report.voided_by_resume += 1
                    continue
                trained[e.task] += 1
                if e.sampler:
                    trained_by.setdefault(e.task, e.sampler)
                if e.version > e.learner_version or e.version < 0:
                    report.impossible_version.append(e.task)
                last_trained_version = max(last_trained_version, e.learner_version)
                budget = report.staleness_budget
                if budget is not None and e.learner_version - e.version > budget:
                    report.stale_trained.append(e.task)
            case ledger.TaskAbandoned():
                report.abandoned += 1
                abandoned.add(e.task)
            case ledger.Outstanding():
                outstanding_at[e.task] = position
            case ledger.Quarantined():
                report.quarantined[e.sampler] = e.reason
            case ledger.Submitted() | ledger.LeaseClosed() | ledger.Requeued() | ledger.Resumed():
                pass  # the trail around the decisions above; they settle the accounting
            case _:
                assert_never(e)  # a new event must be given a meaning here

    report.leased_tasks = len(leased)
    report.accepted = len(accepted)
    report.trained = sum(trained.values())
    report.rejected = dict(rejected)
    report.dropped = dict(drop_reasons)
    report.unconsumed = len(unconsumed - set(trained) - set(dropped))
    report.duplicated = sorted(t for t, n in trained.items() if n > 1)
    report.unexpected = sorted(t for t in trained if t not in leased)
    # The Buffer decides each lease once, so a lease both accepted and expired is a bug.
    report.late_accepted = sorted(t for t, lease in accepted_order if lease in expired_leases)
    # Each accepted task ends in one state; later ones win (a group left unconsumed at the
    # end of a run may be trained after --resume).
    for task in accepted:
        if task in trained or task in dropped or task in unconsumed:
            continue
        if task in handed and handed[task] > last_trained_version:
            report.in_flight_at_end += 1
            continue
        report.lost.append(task)
    report.lost.sort()
    report.accepted_twice = sorted(t for t, n in times_accepted.items() if n > 1)
    outstanding = {t for t, at in outstanding_at.items() if at > last_leased_at.get(t, -1)}
    report.outstanding_at_end = len(outstanding - set(accepted))
    ended = set(accepted) | ended_on_arrival | abandoned | outstanding | set(trained) | set(dropped)
    report.unresolved = sorted(leased - ended)
    # A group dropped must never have been trained as well.
    report.identity_holds = not (set(trained) & set(dropped))
    for name in VIOLATIONS:
        tasks = getattr(report, name)
        if tasks:
            behind = {t: sampler_of.get(t) or trained_by.get(t) or "?" for t in tasks}
            report.named[name] = behind
            report.culprits[name] = dict(sorted(Counter(behind.values()).items()))
    return report


def _summary_lines(report: AuditReport) -> list[str]:
    lines = [
        f"tasks leased {report.leased_tasks} ({report.leases_issued} leases), accepted {report.accepted}, "
        f"trained {report.trained}",
        f"rejected on arrival: {report.rejected or 'none'}",
        f"dropped after acceptance: {report.dropped or 'none'}",
        f"unconsumed at end {report.unconsumed}, in flight at end {report.in_flight_at_end}, "
        f"outstanding at end {report.outstanding_at_end}, abandoned tasks {report.abandoned}",
    ]
    if report.zero_variance:
        lines.append(f"dropped for zero reward variance (dynamic sampling, not lost): {report.zero_variance}")
    for name in VIOLATIONS:
        items = getattr(report, name)
        culprits = f" by sampler {report.culprits[name]}" if name in report.culprits else ""
        named = report.named.get(name, {})
        examples = ", ".join(f"{t} ({named.get(t, '?')})" for t in items[:5])
        lines.append(f"{name}: {len(items)}" + (f" (e.g. {examples}){culprits}" if items else ""))
    if report.rejected_by_sampler:
        lines.append(f"rejected at admission, by sampler: {report.rejected_by_sampler}")
    for sampler, why in sorted(report.quarantined.items()):
        lines.append(f"quarantined: {sampler}: {why}")
    if report.run_failed:
        lines.append(f"run failed: {report.run_failed}")
    if report.without_ledger:
        lines.append(f"run directories without a ledger: {', '.join(report.without_ledger)}")
    if report.unreadable_lines:
        lines.append(f"unreadable ledger lines: {len(report.unreadable_lines)} (e.g. {report.unreadable_lines[0]})")
    lines.append("accounting identity: " + ("holds" if report.identity_holds else "VIOLATED"))
    lines.append("audit: OK" if report.ok else "audit: FAILED")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo2.audit", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not RunDir(run_dir).ledger_dir.is_dir() and not RunDir(run_dir).is_run_dir():
            print(
                f"echo2.audit: {run_dir}: neither a ledger/ nor topology.resolved.json (not a run dir?)",
                file=sys.stderr,
            )
            return 2
    report = audit(args.run_dirs)
    if args.json:
        print(json.dumps(asdict(report) | {"ok": report.ok}, indent=2))
    else:
        print("\n".join(_summary_lines(report)))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
