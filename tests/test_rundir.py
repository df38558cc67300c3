"""The run-directory layout users and scripts rely on, and the JSON-lines reader and writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from echo2 import ledger as ledger_events
from echo2.actor import ActorContext
from echo2.rundir import JsonLinesWriter, RunDir, new_run_id, read_jsonl, read_jsonl_files
from echo2.tools.audit import audit


def test_the_layout_is_the_documented_one(tmp_path: Path) -> None:
    # Spelled out literally: these paths are what users, scripts and old run dirs know.
    run = RunDir(tmp_path)
    assert run.topology_path == tmp_path / "topology.resolved.json"
    assert run.pids_path == tmp_path / "pids.json"
    assert run.status_path == tmp_path / "status.json"
    assert run.summary_path == tmp_path / "summary.json"
    assert run.log_path("learner") == tmp_path / "logs" / "learner.log"
    assert run.metrics_path("learner") == tmp_path / "metrics" / "learner.jsonl"
    assert run.ledger_path("buffer") == tmp_path / "ledger" / "buffer.jsonl"
    assert run.checkpoint_dir(20) == tmp_path / "checkpoints" / "step_000020"
    assert run.state_path("buffer", ".state") == tmp_path / "checkpoints" / "buffer.state"
    assert run.report_dir == tmp_path / "report"
    assert list(tmp_path.iterdir()) == []  # asking for a path creates nothing


def test_create_makes_a_fresh_directory_and_never_reuses_one(tmp_path: Path) -> None:
    run_id = new_run_id("toy", now=0.0)
    assert run_id.startswith("toy-") and len(run_id) == len("toy-YYYYmmdd-HHMMSS")
    first = RunDir.create(tmp_path / "runs", run_id)
    second = RunDir.create(tmp_path / "runs", run_id)
    assert first.name == run_id and second.name == f"{run_id}-1"
    assert first.logs_dir.is_dir() and second.logs_dir.is_dir()
    assert not first.is_run_dir()  # until the launcher writes the resolved topology
    first.topology_path.write_text("{}")
    assert first.is_run_dir()


def test_checkpoint_dirs_are_ordered_by_step(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.checkpoint_dirs() == []
    for step in (100, 20, 3):
        run.checkpoint_dir(step).mkdir(parents=True)
    run.state_path("buffer", ".state").write_text("")  # another actor's state: not a step
    (run.checkpoints_dir / "step_tmp").mkdir()
    assert [p.name for p in run.checkpoint_dirs()] == ["step_000003", "step_000020", "step_000100"]


def test_reader_skips_and_counts_what_is_not_one_json_object(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(
        b'{"kind": "step", "step": 1}\n'
        b"\n"
        b"[1, 2]\n"  # valid JSON, not an object
        b'{"kind": "st\n'  # a line cut mid-write, then more lines after it (a resumed writer)
        b'{"kind": "step", "step": 2, "note": "\xff"}\n'  # undecodable byte: replaced
        b'{"kind": "step", "step": 3'  # the last line, cut by SIGKILL
    )
    records, skipped, _ = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2]
    assert skipped == 3
    assert list(read_jsonl_files([path, path])) == records + records


def test_writer_ends_a_cut_line_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "ledger" / "learner.jsonl"
    path.parent.mkdir()
    path.write_text('{"ev": "trained", "task": "t0"}\n{"ev": "trained", "ta')  # SIGKILL mid-line
    writer = JsonLinesWriter(path)
    writer.write({"ev": "resumed", "value": np.float32(0.5), "ids": np.arange(2)})
    writer.close()
    records, skipped, _ = read_jsonl(path)
    assert records == [{"ev": "trained", "task": "t0"}, {"ev": "resumed", "value": 0.5, "ids": [0, 1]}]
    assert skipped == 1


def test_writer_makes_its_directory_on_first_write_only(tmp_path: Path) -> None:
    writer = JsonLinesWriter(tmp_path / "metrics" / "a.jsonl")
    writer.close()  # never written: nothing made
    assert not (tmp_path / "metrics").exists()
    writer.write({"kind": "x"})
    writer.close()
    writer.write({"kind": "y"})  # reopened after close, appends
    writer.close()
    assert [json.loads(line)["kind"] for line in (tmp_path / "metrics" / "a.jsonl").read_text().splitlines()] == [
        "x",
        "y",
    ]


def _context(run_dir: Path, name: str) -> ActorContext:
    import asyncio

    return ActorContext(
        actor_name=name,
        process="p",
        transport=None,  # type: ignore[arg-type]  # no endpoint is opened
        ports={},
        declared={},
        run_dir=run_dir,
        stopping=asyncio.Event(),
    )


def test_a_resumed_actor_appends_to_its_ledger_after_a_cut_line_and_the_audit_sees_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.topology_path.write_text(json.dumps({"job": {"staleness": 2}}))
    source = _context(tmp_path, "ps")
    source.ledger(ledger_events.Leased(task="t0", lease=0, attempt=0, sampler="s0"))
    source.close()
    buffer = _context(tmp_path, "buffer")
    buffer.ledger(ledger_events.Accepted(task="t0", lease=0, version=0, sampler="s0"))
    buffer.close()
    first = _context(tmp_path, "learner")
    first.ledger(ledger_events.Trained(task="t0", version=0, learner_version=1, incarnation=0))
    first.close()
    with open(run.ledger_path("learner"), "a") as ledger:  # killed while writing the next line
        ledger.write('{"t": 1.0, "ev": "trained", "task": "t1", "vers')
    # The resumed learner restarts from version 0: the training above died with the old one.
    resumed = _context(tmp_path, "learner")
    resumed.ledger(ledger_events.Resumed(incarnation=1, previous_incarnation=0, from_version=0))
    resumed.ledger(ledger_events.Trained(task="t0", version=0, learner_version=1, incarnation=1))
    resumed.close()
    report = audit([tmp_path])
    assert report.voided_by_resume == 1  # only seen if "resumed" survived the cut line
    assert report.ok and report.trained == 1 and report.duplicated == []


def test_metrics_of_an_actor_by_kind(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.metrics("learner") == [] and run.all_metrics("step") == []
    ctx = _context(tmp_path, "learner")
    ctx.record("step", step=1)
    ctx.record("eval", accuracy=0.5)
    ctx.close()
    other = _context(tmp_path, "trainer-2")
    other.record("step", step=7)
    other.close()
    assert [r["step"] for r in run.metrics("learner", "step")] == [1]
    assert [r["step"] for r in run.all_metrics("step")] == [1, 7]
    assert [p.name for p in run.metrics_paths()] == ["learner.jsonl", "trainer-2.jsonl"]
    assert all(isinstance(r["time_s"], float) for r in run.metrics("learner"))


@pytest.mark.parametrize("missing", ["metrics", "ledger", "logs", "checkpoints"])
def test_listing_a_directory_that_does_not_exist_is_empty(tmp_path: Path, missing: str) -> None:
    run = RunDir(tmp_path / "nothing")
    listing = {
        "metrics": run.metrics_paths,
        "ledger": run.ledger_paths,
        "logs": run.log_paths,
        "checkpoints": run.checkpoint_dirs,
    }[missing]
    assert listing() == []
