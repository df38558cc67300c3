"""The audit finds each kind of accounting violation in a ledger, and passes a clean one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.rundir import RunDir
from echo2.tools.audit import audit, main


def _write(run: Path, actor: str, events: list[dict]) -> None:
    path = RunDir(run).ledger_path(actor)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    RunDir(tmp_path).topology_path.write_text(json.dumps({"job": {"staleness": 2}}))
    _write(tmp_path, "ps", [{"ev": "leased", "task": f"t{i}", "lease": i} for i in range(6)])
    _write(
        tmp_path,
        "buf",
        [
            {"ev": "accepted", "task": "t0", "lease": 0, "version": 0},
            {"ev": "accepted", "task": "t1", "lease": 1, "version": 0},
            {"ev": "rejected", "task": "t2", "lease": 2, "version": 0, "reason": "late"},
            {"ev": "accepted", "task": "t3", "lease": 3, "version": 0},
            {"ev": "dropped", "task": "t3", "reason": "stale"},
            {"ev": "accepted", "task": "t4", "lease": 4, "version": 1},
            {"ev": "handed", "task": "t0", "request_version": 1},
            {"ev": "handed", "task": "t1", "request_version": 1},
            {"ev": "handed", "task": "t4", "request_version": 2},
            {"ev": "unconsumed", "task": "t9"},
        ],
    )
    _write(
        tmp_path,
        "learner",
        [
            {"ev": "trained", "task": "t0", "version": 0, "learner_version": 1},
            {"ev": "trained", "task": "t1", "version": 0, "learner_version": 1},
        ],
    )
    return tmp_path


def test_clean_ledger_passes_and_counts_in_flight_work(run: Path) -> None:
    report = audit([run])
    assert report.ok, report
    assert (report.accepted, report.trained, report.in_flight_at_end) == (4, 2, 1)
    assert report.rejected == {"late": 1} and report.dropped == {"stale": 1}
    assert main([str(run)]) == 0


@pytest.mark.parametrize(
    ("events", "violation"),
    [
        ([{"ev": "accepted", "task": "t5", "lease": 5, "version": 1}], "lost"),
        ([{"ev": "trained", "task": "t0", "version": 0, "learner_version": 2}], "duplicated"),
        ([{"ev": "trained", "task": "zz", "version": 1, "learner_version": 2}], "unexpected"),
        ([{"ev": "trained", "task": "t4", "version": 1, "learner_version": 4}], "stale_trained"),
        (
            [{"ev": "lease_expired", "task": "t1", "lease": 1}],
            "late_accepted",
        ),
    ],
)
def test_each_violation_is_found(run: Path, events: list[dict], violation: str) -> None:
    _write(run, "extra", events)
    report = audit([run])
    assert getattr(report, violation), report
    assert not report.ok
    assert main([str(run)]) == 1


def test_a_line_cut_by_sigkill_is_skipped_and_no_ledger_is_exit_2(run: Path, tmp_path_factory) -> None:
    with open(RunDir(run).ledger_path("learner"), "a") as f:
        f.write('{"ev": "trained", "task": "t4", "vers')
    assert audit([run]).ok
    assert main([str(tmp_path_factory.mktemp("empty"))]) == 2
