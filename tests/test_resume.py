"""``--resume`` refuses a topology that differs from the one the run last ran with, records
what ``--allow-changes`` let through, and the report puts resumed segments on one time axis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from echo2.launch import main
from echo2.rundir import RunDir
from echo2.tools.report import RUN_TIME, load_run, place_on_run_clock
from echo2.topology import load_topology, resolve
from echo2.topology.changes import topology_changes

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "examples" / "smoke.toml"
COUNT = "actors.source.config.count"


def recorded_run(tmp_path: Path, *overrides: str) -> RunDir:
    """A run directory whose ``topology.resolved.json`` is what the launcher wrote for SMOKE."""
    run = RunDir.create(tmp_path, "smoke-20260101-000000")
    resolved = resolve(load_topology(SMOKE, list(overrides)), run.name, str(run.root))
    resolved.dump(run.topology_path)
    return run


def test_changes_are_listed_by_field_path_and_the_resume_flag_is_not_one(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    recorded = json.loads(run.topology_path.read_text())
    same = resolve(load_topology(SMOKE, []), run.name, str(run.root))
    same.resume = True
    assert topology_changes(recorded, same) == []

    changed = resolve(load_topology(SMOKE, [f"{COUNT}=500", "run.heartbeat_s=0.25"]), run.name, str(run.root))
    changes = topology_changes(recorded, changed)
    assert [(c.field, c.recorded, c.new) for c in changes] == [
        ("processes.source-0.actors[0].config.count", 1000, 500),
        ("processes.source-1.actors[0].config.count", 1000, 500),
        ("run.heartbeat_s", 0.5, 0.25),
    ]
    assert changes[2].describe() == "run.heartbeat_s: 0.5 -> 0.25"


def test_a_run_recorded_before_a_field_existed_resumes_unless_the_field_is_set(tmp_path: Path) -> None:
    run = recorded_run(tmp_path)
    recorded = json.loads(run.topology_path.read_text())
    del recorded["run"]["record_max_mb"]  # as written by an echo2 that predates the field
    same = resolve(load_topology(SMOKE, []), run.name, str(run.root))
    assert topology_changes(recorded, same) == []

    changed = resolve(load_topology(SMOKE, ["run.record_max_mb=8.0"]), run.name, str(run.root))
    assert [(c.field, c.recorded, c.new) for c in topology_changes(recorded, changed)] == [
        ("run.record_max_mb", 256.0, 8.0)
    ]


def test_a_resume_with_a_different_setting_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = recorded_run(tmp_path)
    before = run.topology_path.read_bytes()
    assert main([str(SMOKE), "--set", f"{COUNT}=500", "--resume", str(run.root)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "--resume: 2 field(s) differ from topology.resolved.json, which the run last ran with "
        "(pass --allow-changes to resume with them):",
        "--resume:   processes.source-0.actors[0].config.count: 1000 -> 500",
        "--resume:   processes.source-1.actors[0].config.count: 1000 -> 500",
    ]
    assert run.topology_path.read_bytes() == before  # nothing written, nothing started
    assert not run.resume_history_path.exists()
    assert not run.pids_path.exists()


def test_allow_changes_without_resume_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SMOKE), "--allow-changes"]) == 2
    assert capsys.readouterr().err == "python -m echo2.launch: --allow-changes: only with --resume\n"


def test_allowed_changes_are_recorded_and_the_next_resume_compares_with_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = recorded_run(tmp_path)
    original = run.topology_path.read_bytes()
    resumed = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(SMOKE), "--set", f"{COUNT}=500",
         "--resume", str(run.root), "--allow-changes"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "--resume: allowed change: processes.source-0.actors[0].config.count: 1000 -> 500" in resumed.stderr
    assert run.topology_path.read_bytes() == original  # the first launch's record stays
    (record,) = run.resume_history()
    assert record["resume"] == 1 and record["compared_with"] == "topology.resolved.json"
    assert [c["field"] for c in record["changes"]] == [
        "processes.source-0.actors[0].config.count",
        "processes.source-1.actors[0].config.count",
    ]
    current = run.current_topology_path()
    assert current == run.resume_topology_path(1)
    topology = json.loads(current.read_text())
    assert topology["resume"] is True
    assert topology["processes"]["source-0"]["actors"][0]["config"]["count"] == 500

    # Resumed again without the --set: that is a change from what the run last ran with.
    assert main([str(SMOKE), "--resume", str(run.root)]) == 2
    err = capsys.readouterr().err
    assert "differ from resumes/1.topology.resolved.json" in err
    assert "processes.source-0.actors[0].config.count: 500 -> 1000" in err
    assert len(run.resume_history()) == 1


def step(time_s: float, unix_s: float | None, number: int) -> dict[str, object]:
    record: dict[str, object] = {"kind": "step", "step": number, "time_s": time_s, "reward_mean": 0.5}
    if unix_s is not None:
        record["unix_s"] = unix_s
    return record


def test_resumed_segments_follow_each_other_on_the_run_clock() -> None:
    # First learner started at unix 1000, crashed after step 3 at 1012; the resumed one
    # started at 1100 and counts time_s from 0 again.
    records = [step(4.0, 1004.0, 1), step(8.0, 1008.0, 2), step(12.0, 1012.0, 3)]
    records += [step(5.0, 1105.0, 3), step(9.0, 1109.0, 4)]
    assert place_on_run_clock(records) == [105.0]
    assert [r[RUN_TIME] for r in records] == [4.0, 8.0, 12.0, 105.0, 109.0]

    # Without unix_s (older records) a segment starts where the previous one ended.
    older = [step(4.0, None, 1), step(8.0, None, 2), step(3.0, None, 3), step(6.0, None, 4)]
    assert place_on_run_clock(older) == [11.0]
    assert [r[RUN_TIME] for r in older] == [4.0, 8.0, 11.0, 14.0]

    # A resumed learner whose first step comes later than the last one before the crash.
    later = [step(2.0, 1002.0, 1), step(30.0, 1130.0, 2)]
    assert place_on_run_clock(later) == [130.0]


def test_the_report_reads_resumed_steps_on_one_axis(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "toy-20260101-000000")
    run.metrics_dir.mkdir(parents=True)
    records = [step(4.0, 1004.0, 1), step(8.0, 1008.0, 2), step(5.0, 1105.0, 2), step(9.0, 1109.0, 3)]
    run.metrics_path("learner").write_text("".join(json.dumps(r) + "\n" for r in records))
    change = {"field": "job.staleness", "recorded": 2, "new": 3}
    run.resume_history_path.write_text(json.dumps({"resume": 1, "unix_s": 1100.0, "changes": [change]}) + "\n")
    data = load_run(run.root)
    assert data.resumed_at == [105.0]
    assert [(r["step"], r[RUN_TIME]) for r in data.steps] == [(1, 4.0), (2, 8.0), (2, 105.0), (3, 109.0)]
    assert "Resume 1 ran with changes: job.staleness." in data.notes
