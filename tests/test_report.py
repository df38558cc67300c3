"""The run report (echo2.report) on synthetic run directories: full, partial, missing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from echo2.rundir import RunDir
from echo2.tools.report import PLOT_NAMES, main, rolling_mean, rolling_sum, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 40
BUDGET = 3


def step_record(step: int) -> dict[str, object]:
    record: dict[str, object] = {
        "time_s": round(2.0 + 0.25 * step, 4),
        "kind": "step",
        "step": step,
        "wait_s": 0.1 if step == 1 else 0.001 * (step % 5),
        "train_s": 0.2,
        "loss": 0.01,
        "reward_mean": 0.2 + 0.005 * step,
        "rollouts": 128,
        "tokens": 600,
        "staleness_max": min(step - 1, BUDGET),
        "staleness_mean": min(step - 1, BUDGET) * 0.9,
        "grad_norm": 1.5,
        "clip_fraction": 0.0,
        "is_weight_mean": 1.0,
        "is_truncated_fraction": 0.0,
        "approx_kl_sampler": 0.001,
    }
    if step % 20 == 0:
        record["accuracy"] = 0.4 + step / 200
    return record


def make_run(root: Path, *, summary: bool = True, truncate_last: bool = True) -> Path:
    run_dir = root / "toy-20260101-000000"
    RunDir(run_dir).metrics_dir.mkdir(parents=True)
    lines = [json.dumps(step_record(step)) for step in range(1, STEPS + 1)]
    text = "\n".join(lines) + "\n"
    if truncate_last:
        text += json.dumps(step_record(STEPS + 1))[:37]  # killed mid-write
    RunDir(run_dir).metrics_path("learner").write_text(text)
    # another actor's metrics: no step records, must be ignored
    RunDir(run_dir).metrics_path("sink").write_text('{"time_s": 1.0, "kind": "received", "count": 3}\n')
    topology = {"run_id": run_dir.name, "run_dir": str(run_dir), "job": {"staleness": BUDGET}}
    RunDir(run_dir).topology_path.write_text(json.dumps(topology))
    if summary:
        data = {
            "steps": STEPS,
            "wall_s": 12.5,
            "staleness_budget": BUDGET,
            "initial_accuracy": 0.4,
            "final_accuracy": 0.6,
            "accuracy_by_step": [[0, 0.4], [20, 0.5], [STEPS, 0.6]],
            "staleness_max": BUDGET,
            "staleness_histogram": {"0": 16, "1": 16, "2": 300, "3": 290},
            "rollouts_trained": STEPS * 128,
            "rollouts_trained_twice": 0,
            "drops_by_reason": {"stale": 4},
            "learner_idle_fraction": 0.0123,
            "steps_per_s": 3.2,
            "rollouts_per_s": 409.6,
        }
        RunDir(run_dir).summary_path.write_text(json.dumps(data, indent=2))
    return run_dir


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_full_run_writes_every_plot_and_the_markdown(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    written = write_report(run_dir)
    report = RunDir(run_dir).report_dir
    assert written == [report / name for name in PLOT_NAMES] + [report / "report.md"]
    for name in PLOT_NAMES:
        assert_png(report / name)
    markdown = (report / "report.md").read_text()
    for name in PLOT_NAMES:
        assert f"]({name})" in markdown
    assert "| final_accuracy | 0.6 |" in markdown
    assert "| staleness_max | 3 (budget S = 3) |" in markdown
    assert "| learner_idle_fraction | 1.23% |" in markdown
    assert "| drops_by_reason | stale: 4 |" in markdown
    assert "1 line(s) of `metrics/learner.jsonl` did not parse" in markdown
    assert "metrics/learner.jsonl` (40 steps)" in markdown


def test_the_report_names_the_held_out_metric(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    summary = json.loads(RunDir(run_dir).summary_path.read_text())
    summary.update(
        eval_metric="pass@1",
        eval_decoding="greedy",
        eval_prompts=115,
        initial_pass_at_1=0.4,
        final_pass_at_1=0.6,
        pass_at_1_by_step=[[0, 0.4], [STEPS, 0.6]],
        initial_eval_mean_reward=0.45,
        final_eval_mean_reward=0.65,
    )
    RunDir(run_dir).summary_path.write_text(json.dumps(summary))
    markdown = (write_report(run_dir)[-1]).read_text()
    assert "| final_pass_at_1 | 0.6 (greedy, 115 held-out prompts) |" in markdown
    assert "| final_eval_mean_reward | 0.65 |" in markdown
    assert "final_accuracy" not in markdown  # the older name is not shown beside the new one
    assert "pass_at_k" not in markdown  # not sampled: not shown
    summary.update(
        eval_pass_at_k_metric="pass@4",
        eval_pass_at_k_decoding="8 samples per prompt at temperature 1, top_p 1; unbiased estimator (Chen et al. 2021)",
        initial_pass_at_k=0.7,
        final_pass_at_k=0.9,
    )
    RunDir(run_dir).summary_path.write_text(json.dumps(summary))
    markdown = (write_report(run_dir)[-1]).read_text()
    assert "| final_pass_at_k | 0.9 (pass@4: 8 samples per prompt at temperature 1, top_p 1; unbiased" in markdown
    summary.update(initial_pass_at_1=None, final_pass_at_1=None, pass_at_1_by_step=[[0, None]])
    RunDir(run_dir).summary_path.write_text(json.dumps(summary))
    markdown = (write_report(run_dir)[-1]).read_text()
    assert "| final_pass_at_1 | n/a (the task declares no correctness predicate) |" in markdown


def test_killed_run_with_one_truncated_line_and_no_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    RunDir(run_dir).metrics_dir.mkdir(parents=True)
    RunDir(run_dir).metrics_path("learner").write_text('{"time_s": 3.1, "kind": "step", "step": 1, "wait')
    written = write_report(run_dir)
    assert written == [RunDir(run_dir).report_dir / "report.md"]
    markdown = written[0].read_text()
    assert "No `summary.json`" in markdown and "No step records" in markdown
    assert markdown.count("_No data for this plot._") == len(PLOT_NAMES)


def test_no_summary_plots_from_the_step_records(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, summary=False)
    written = {path.name for path in write_report(run_dir)}
    assert written == {*PLOT_NAMES, "report.md"}  # accuracy from records, staleness from staleness_max
    markdown = (RunDir(run_dir).report_dir / "report.md").read_text()
    assert "| steps (from metrics) | 40 |" in markdown
    assert "| staleness_max (from metrics) | 3 (budget S = 3) |" in markdown


def test_empty_run_dir_and_stale_plots_are_removed(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    RunDir(run_dir).report_dir.mkdir()
    (RunDir(run_dir).report_dir / "reward.png").write_bytes(PNG_MAGIC)  # from an earlier report
    RunDir(run_dir).metrics_path("learner").write_text("")
    RunDir(run_dir).summary_path.write_text('{"steps": 4')  # cut mid-write
    RunDir(run_dir).topology_path.unlink()
    assert write_report(run_dir) == [RunDir(run_dir).report_dir / "report.md"]
    assert sorted(p.name for p in RunDir(run_dir).report_dir.iterdir()) == ["report.md"]
    assert "`summary.json` could not be read" in (RunDir(run_dir).report_dir / "report.md").read_text()


def test_rolling_helpers() -> None:
    values = np.array([1.0, 2.0, 3.0, 4.0])
    assert rolling_sum(values, 2).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert rolling_mean(values, 3).tolist() == [1.0, 1.5, 2.0, 3.0]


def test_main_prints_paths_and_rejects_a_missing_dir(  # one step: filterwarnings=error catches any warning
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err
    run_dir = tmp_path / "run"
    RunDir(run_dir).metrics_dir.mkdir(parents=True)
    RunDir(run_dir).metrics_path("learner").write_text(json.dumps(step_record(1)) + "\n")
    assert main([str(run_dir), "--window", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        str(RunDir(run_dir).report_dir / n) for n in ("reward.png", "staleness.png", "learner_idle.png", "report.md")
    ]


def test_every_versions_broadcast_and_the_publishers_remedy_are_in_the_report(tmp_path: Path) -> None:
    """Versions that never reached T_bcast (superseded, slow members) are reported with how
    many members installed them, and a broadcast-bound run says what would restore overlap."""
    run_dir = make_run(tmp_path)
    records = [
        {"kind": "broadcast", "incarnation": 0, "version": 2, "t_bcast_s": 1.5, "installed": 3, "active": 3},
        {"kind": "broadcast", "incarnation": 0, "version": 4, "t_bcast_s": None, "installed": 1, "active": 3},
        {"kind": "broadcast", "incarnation": 0, "version": 6, "t_bcast_s": 2.5, "installed": 3, "active": 3},
        {
            "kind": "publication", "t_bcast_s": 3.0, "t_bcast_lower_bound": True, "kappa": 2, "t_train_s": 0.5,
            "bytes_per_version": 8_000_000, "kappa_needed": 6, "staleness_needed": 7,
            "bytes_per_version_needed": 2_666_666, "held": 5, "skipped": 4,
        },
    ]  # fmt: skip
    RunDir(run_dir).metrics_path("weight_publisher").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(run_dir)
    markdown = (RunDir(run_dir).report_dir / "report.md").read_text()
    assert "3 versions broadcast; 2 reached T_bcast (median 2 s, max 2.5 s)" in markdown
    assert "1 never did (superseded, or members too slow): installed by a median of 1 of 3 active members" in markdown
    assert "T_bcast >3.0 s > kappa x T_train = 2 x 0.5 s; overlap needs kappa >= 6 (S >= 7)" in markdown
    assert "at most 2.67 MB per version (was 8 MB); 5 snapshots waited" in markdown
    assert_png(RunDir(run_dir).report_dir / "broadcast.png")
