"""The audit finds each kind of accounting violation in a ledger, and passes a clean one.

Ledgers are written through ``ActorContext.ledger``, the writer every actor uses, with the
records of ``echo2.ledger``, the vocabulary the audit reads.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from echo2 import ledger
from echo2.actor import ActorContext
from echo2.rundir import RunDir
from echo2.tools.audit import audit, main


def _context(run: Path, actor: str) -> ActorContext:
    return ActorContext(
        actor_name=actor,
        process="main",
        transport=None,  # type: ignore[arg-type]  # the ledger needs no sockets
        ports={},
        declared={},
        run_dir=run,
        stopping=asyncio.Event(),
    )


def _write(run: Path, actor: str, events: list[ledger.LedgerEvent]) -> None:
    ctx = _context(run, actor)
    for event in events:
        ctx.ledger(event)
    ctx.close()


def _trained(task: str, version: int, learner_version: int, incarnation: int = 0) -> ledger.Trained:
    return ledger.Trained(task=task, version=version, learner_version=learner_version, incarnation=incarnation)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    RunDir(tmp_path).topology_path.write_text(json.dumps({"job": {"staleness": 2}}))
    leases = [ledger.Leased(task=f"t{i}", lease=i, attempt=0, sampler="s0") for i in range(6)]
    # t2's group came late: its lease had expired, and the run stopped before its re-issue.
    _write(tmp_path, "ps", [*leases, ledger.Outstanding(task="t2", attempt=1)])
    _write(
        tmp_path,
        "buf",
        [
            ledger.Accepted(task="t0", lease=0, version=0, sampler="s0"),
            ledger.Accepted(task="t1", lease=1, version=0, sampler="s0"),
            ledger.Rejected(task="t2", lease=2, version=0, outcome="late"),
            ledger.Accepted(task="t3", lease=3, version=0, sampler="s0"),
            ledger.Dropped(task="t3", reason="stale", version=0),
            ledger.Accepted(task="t4", lease=4, version=1, sampler="s0"),
            ledger.Rejected(task="t5", lease=5, version=0, outcome="dropped", reason="reward_failed"),
            ledger.Handed(task="t0", version=0, request_version=1),
            ledger.Handed(task="t1", version=0, request_version=1),
            ledger.Handed(task="t4", version=1, request_version=2),
            ledger.Unconsumed(task="t9", version=0),
        ],
    )
    _write(tmp_path, "learner", [_trained("t0", 0, 1), _trained("t1", 0, 1)])
    return tmp_path


def test_clean_ledger_passes_and_counts_in_flight_work(run: Path) -> None:
    report = audit([run])
    assert report.ok, report
    assert (report.accepted, report.trained, report.in_flight_at_end) == (4, 2, 1)
    assert report.rejected == {"late": 1, "dropped:reward_failed": 1} and report.dropped == {"stale": 1}
    assert report.unreadable_lines == []
    assert main([str(run)]) == 0


@pytest.mark.parametrize(
    ("events", "violation"),
    [
        ([ledger.Accepted(task="t5", lease=5, version=1, sampler="s0")], "lost"),
        ([ledger.Leased(task="t7", lease=7, attempt=0, sampler="s1")], "unresolved"),
        ([ledger.Accepted(task="t0", lease=10, version=0, sampler="s0")], "accepted_twice"),
        ([_trained("t0", 0, 2)], "duplicated"),
        ([_trained("zz", 1, 2)], "unexpected"),
        ([_trained("t4", 1, 4)], "stale_trained"),
        ([ledger.LeaseExpired(task="t1", lease=1)], "late_accepted"),
    ],
)
def test_each_violation_is_found(run: Path, events: list[ledger.LedgerEvent], violation: str) -> None:
    _write(run, "extra", events)
    report = audit([run])
    assert getattr(report, violation), report
    assert not report.ok
    assert main([str(run)]) == 1


def test_a_line_cut_by_sigkill_is_skipped_and_no_ledger_is_exit_2(run: Path, tmp_path_factory) -> None:
    with open(RunDir(run).ledger_path("learner"), "a") as f:
        f.write('{"ev": "trained", "task": "t4", "vers')
    report = audit([run])
    assert report.ok and report.unreadable_lines == []
    assert main([str(tmp_path_factory.mktemp("empty"))]) == 2


def test_a_host_whose_run_directory_has_no_ledger_is_reported_not_refused(run: Path, tmp_path_factory, capsys) -> None:
    """An edge host whose sampler never got work writes no ledger: the audit of all hosts
    lists it and reconciles the others (before: exit 2, and no audit at all)."""
    edge = tmp_path_factory.mktemp("edge")
    RunDir(edge).topology_path.write_text("{}")
    report = audit([run, edge])
    assert report.ok and report.without_ledger == [str(edge)] and report.accepted == 4
    assert main([str(run), str(edge)]) == 0
    assert f"run directories without a ledger: {edge}" in capsys.readouterr().out


def test_a_resumed_learner_voids_what_its_predecessor_trained_after_the_checkpoint(run: Path) -> None:
    _write(
        run,
        "learner",
        [
            _trained("t4", 1, 2),  # incarnation 0 at learner version 2: after the checkpoint at 2
            ledger.Resumed(incarnation=1, previous_incarnation=0, from_version=2),
            _trained("t4", 1, 2, incarnation=1),  # trained again by the resumed learner
        ],
    )
    report = audit([run])
    assert report.ok, report
    assert report.voided_by_resume == 1 and report.trained == 3 and not report.duplicated


def test_a_resume_past_a_damaged_checkpoint_voids_every_older_incarnations_later_steps(run: Path) -> None:
    _write(
        run,
        "learner",
        [
            _trained("t4", 1, 2),  # incarnation 0 at learner version 2
            ledger.Resumed(incarnation=1, previous_incarnation=0, from_version=4),  # t4 is in checkpoint 4
            # checkpoint 4 (and incarnation 1's later ones) damaged: back to checkpoint 2,
            # which incarnation 0 wrote before it trained t4
            ledger.Resumed(incarnation=2, previous_incarnation=1, from_version=2),
            _trained("t4", 1, 2, incarnation=2),
        ],
    )
    report = audit([run])
    assert report.ok, report
    assert report.voided_by_resume == 1 and report.trained == 3 and not report.duplicated


def test_a_misspelt_event_fails_where_it_is_written(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "learner")
    with pytest.raises(TypeError):
        ctx.ledger("trained", task="t0")  # type: ignore[call-arg]  # the string API is gone
    with pytest.raises(TypeError):
        ledger.Trained(task="t0", verison=0, learner_version=1, incarnation=0)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        ledger.Trainde  # type: ignore[attr-defined]  # noqa: B018
    ctx.close()
    assert not (tmp_path / "ledger").exists(), "nothing was written"


def test_a_line_of_no_known_event_is_reported_not_silently_skipped(run: Path) -> None:
    with open(run / "ledger" / "learner.jsonl", "a") as f:
        f.write(json.dumps({"t": 1.0, "ev": "trainedd", "task": "t4", "version": 1, "learner_version": 2}) + "\n")
    report = audit([run])
    assert len(report.unreadable_lines) == 1 and "learner.jsonl:3" in report.unreadable_lines[0]
    assert report.trained == 2  # not counted as a training


def test_the_line_format_is_plain_json_with_time_and_event_name_first() -> None:
    """What ``benchmarks/chaos.py`` and any other reader of ``ledger/*.jsonl`` parse."""
    line = ledger.encode_line(ledger.Leased(task="t1", lease=3, attempt=1, sampler="s0"), 12.34567)
    assert line.endswith("\n")
    assert json.loads(line) == {"t": 12.3457, "ev": "leased", "task": "t1", "lease": 3, "attempt": 1, "sampler": "s0"}
    assert list(json.loads(line))[:2] == ["t", "ev"]


def test_a_version_the_learner_had_not_reached_is_impossible_and_its_sampler_named(run: Path) -> None:
    _write(
        run,
        "more",
        [
            ledger.Leased(task="t7", lease=7, attempt=0, sampler="evil"),
            ledger.Accepted(task="t7", lease=7, version=1_000_000, sampler="evil"),
            ledger.Trained(task="t7", version=1_000_000, learner_version=1, incarnation=0, sampler="evil"),
        ],
    )
    report = audit([run])
    assert report.impossible_version == ["t7"] and not report.stale_trained
    assert report.culprits == {"impossible_version": {"evil": 1}}
    assert not report.ok


def test_every_violation_names_its_sampler(run: Path) -> None:
    _write(run, "extra", [_trained("t0", 0, 2), _trained("zz", 1, 2)])
    _write(run, "more", [ledger.Trained(task="yy", version=1, learner_version=2, incarnation=0, sampler="s9")])
    report = audit([run])
    # (t4, handed at version 2, is lost now that steps at 2 trained without it)
    assert report.culprits == {"lost": {"s0": 1}, "duplicated": {"s0": 1}, "unexpected": {"?": 1, "s9": 1}}


def test_a_failed_run_never_audits_ok(run: Path) -> None:
    status = RunDir(run).status_path
    status.write_text(json.dumps({"exit_code": 124, "reason": "deadline"}))
    assert audit([run]).ok  # a deadline stops a run cleanly
    status.write_text(json.dumps({"exit_code": 1, "reason": "process 'learner' failed"}))
    report = audit([run])
    assert not report.ok and "learner" in report.run_failed
    assert main([str(run)]) == 1


def test_admission_rejections_and_quarantine_are_listed_by_sampler(run: Path) -> None:
    _write(
        run,
        "more",
        [
            ledger.Rejected(
                task="t5", lease=5, version=0, outcome="rejected", reason="bad_logprobs", sampler="evil", holder=True
            ),
            ledger.Rejected(task="t5", lease=5, version=0, outcome="rejected", reason="wrong_token", sampler="s0"),
            ledger.Quarantined(sampler="evil", reason="8 rejected groups in 60 s"),
        ],
    )
    report = audit([run])
    assert report.ok  # the defence working is no violation
    assert report.rejected_by_sampler == {"evil": {"bad_logprobs": 1}, "s0": {"wrong_token": 1}}
    assert report.quarantined == {"evil": "8 rejected groups in 60 s"}


def test_the_report_lists_quarantined_samplers_and_refusals(run: Path) -> None:
    from echo2.tools.report import admission_notes

    assert admission_notes(run) == []
    _write(
        run,
        "more",
        [
            ledger.Rejected(
                task="t5", lease=5, version=0, outcome="rejected", reason="too_long", sampler="evil", holder=True
            ),
            ledger.Rejected(
                task="t5", lease=5, version=0, outcome="rejected", reason="too_long", sampler="evil", holder=True
            ),
            ledger.Quarantined(sampler="evil", reason="8 rejected groups in 60 s"),
        ],
    )
    assert admission_notes(run) == [
        "quarantined `evil`: 8 rejected groups in 60 s",
        "refused from `evil`: 2 groups (too_long 2)",
    ]


def test_a_lost_task_and_a_task_accepted_twice_are_named_with_their_samplers(run: Path, capsys) -> None:
    _write(
        run,
        "ps2",
        [
            # Leased, its lease expired, never re-issued: the task vanished.
            ledger.Leased(task="t7", lease=7, attempt=0, sampler="s1"),
            ledger.LeaseClosed(task="t7", lease=7, outcome="expired"),
            # A second group of t1 stored on a re-issued lease.
            ledger.Leased(task="t1", lease=11, attempt=1, sampler="s2"),
        ],
    )
    _write(run, "buf2", [ledger.Accepted(task="t1", lease=11, version=0, sampler="s2")])
    report = audit([run])
    assert report.unresolved == ["t7"] and report.named["unresolved"] == {"t7": "s1"}
    assert report.accepted_twice == ["t1"] and report.named["accepted_twice"] == {"t1": "s2"}
    assert main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "unresolved: 1 (e.g. t7 (s1))" in out and "accepted_twice: 1 (e.g. t1 (s2))" in out


def test_a_task_outstanding_at_a_stop_must_end_after_the_resume_that_leases_it_again(run: Path) -> None:
    # t2 was queued for re-issue when the first segment stopped (the fixture's ledger); the
    # resumed run leased it again and stopped while it was still leased: outstanding, fine.
    _write(
        run,
        "ps",
        [
            ledger.Leased(task="t2", lease=20, attempt=1, sampler="s3"),
            ledger.Outstanding(task="t2", lease=20, attempt=1),
        ],
    )
    assert audit([run]).ok
    # Leased once more after that, and nothing after it: the task has no end.
    _write(run, "ps", [ledger.Leased(task="t2", lease=21, attempt=2, sampler="s4")])
    report = audit([run])
    assert report.unresolved == ["t2"] and report.named["unresolved"] == {"t2": "s4"}
