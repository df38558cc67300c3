"""Learner checkpoints that verify: digests, atomic writes, and the fallback on --resume.

A checkpoint damaged after it was written (a flipped byte, a cut file, a lost manifest) is
passed over with one line naming what is wrong, and the run continues from the one before;
a checkpoint of the previous format (``state.json``, no digests) still resumes; a learner's
process cannot be given ``restart = "on-failure"``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from echo2.actor import ActorContext
from echo2.actors.learner import Learner, LearnerConfig
from echo2.errors import ConfigError
from echo2.rundir import RunDir
from echo2.topology import load_topology
from echo2.training.checkpoint import (
    LEGACY_STATE_FILE,
    MANIFEST_FILE,
    TRAINED_TASKS_FILE,
    CheckpointState,
    newest_good_checkpoint,
    newest_incarnation,
    verify_checkpoint,
    write_checkpoint,
)
from echo2.training.trainer import OPTIMIZER_FILE, WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "examples" / "topology.toml"


def _fill(step: int) -> Callable[[Path], None]:
    """What a trainer and the learner write: weights, optimiser state, trained task ids."""

    def fill(directory: Path) -> None:
        save_file({"w": torch.full((64, 64), float(step))}, str(directory / WEIGHTS_FILE))
        torch.save({"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]}, directory / OPTIMIZER_FILE)
        (directory / TRAINED_TASKS_FILE).write_text(json.dumps([f"task-{step}"]))

    return fill


def _write(run: RunDir, step: int, incarnation: int = 0) -> Path:
    state = CheckpointState(step=step, version=step, incarnation=incarnation)
    return write_checkpoint(run.checkpoint_dir(step), state, _fill(step))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped byte": (lambda d: _flip_byte(d / WEIGHTS_FILE), "model.safetensors does not match its digest"),
    "truncated": (lambda d: _truncate(d / WEIGHTS_FILE), "model.safetensors has "),
    "manifest deleted": (lambda d: (d / MANIFEST_FILE).unlink(), "no manifest.json"),
    "file deleted": (lambda d: (d / OPTIMIZER_FILE).unlink(), "optimizer.pt is missing"),
    "manifest cut": (lambda d: _truncate(d / MANIFEST_FILE), "manifest.json unreadable"),
}


def test_a_written_checkpoint_verifies_and_leaves_nothing_staged(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    directory = _write(run, 10, incarnation=2)
    assert verify_checkpoint(directory) == CheckpointState(step=10, version=10, incarnation=2)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == [WEIGHTS_FILE, OPTIMIZER_FILE, TRAINED_TASKS_FILE]
    assert [p.name for p in run.checkpoints_dir.iterdir()] == ["step_000010"]


def test_rewriting_a_step_replaces_it_and_clears_a_killed_writers_leftovers(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _write(run, 10)
    _flip_byte(run.checkpoint_dir(10) / WEIGHTS_FILE)
    (run.checkpoints_dir / ".tmp-step_000010").mkdir()  # a writer killed before its rename
    (run.checkpoints_dir / ".tmp-step_000010" / WEIGHTS_FILE).write_bytes(b"partial")
    _write(run, 10, incarnation=1)
    assert verify_checkpoint(run.checkpoint_dir(10)).incarnation == 1
    assert [p.name for p in run.checkpoints_dir.iterdir()] == ["step_000010"]
    assert run.checkpoint_dirs() == [run.checkpoint_dir(10)]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    run = RunDir(tmp_path)
    for step in (10, 20):
        _write(run, step)
    harm, reason = DAMAGE[damage]
    harm(run.checkpoint_dir(20))
    warnings: list[str] = []
    found = newest_good_checkpoint(run.checkpoint_dirs(), warnings.append)
    assert found == (run.checkpoint_dir(10), CheckpointState(step=10, version=10, incarnation=0))
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("--resume: checkpoint step_000020 is damaged (")
    assert reason in warnings[0]


def test_no_good_checkpoint_is_none(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for step in (10, 20):
        _write(run, step)
        _flip_byte(run.checkpoint_dir(step) / WEIGHTS_FILE)
    warnings: list[str] = []
    assert newest_good_checkpoint(run.checkpoint_dirs(), warnings.append) is None
    assert [w.split(" is damaged")[0] for w in warnings] == [
        "--resume: checkpoint step_000020",
        "--resume: checkpoint step_000010",
    ]
    assert newest_good_checkpoint([], warnings.append) is None


def _write_legacy(run: RunDir, step: int, incarnation: int = 0) -> Path:
    """A checkpoint as echo2 wrote them before manifests: files, then state.json last."""
    directory = run.checkpoint_dir(step)
    directory.mkdir(parents=True)
    _fill(step)(directory)
    state = {"step": step, "version": step, "incarnation": incarnation}
    (directory / LEGACY_STATE_FILE).write_text(json.dumps(state))
    return directory


def test_a_checkpoint_of_the_previous_format_still_resumes_and_says_it_is_unverified(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _write_legacy(run, 10, incarnation=1)
    warnings: list[str] = []
    found = newest_good_checkpoint(run.checkpoint_dirs(), warnings.append)
    assert found == (run.checkpoint_dir(10), CheckpointState(step=10, version=10, incarnation=1))
    assert warnings == ["--resume: checkpoint step_000010 has no digests (previous format): its files read back"]


def test_an_unreadable_checkpoint_of_the_previous_format_is_passed_over(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    _write_legacy(run, 10)
    _truncate(_write_legacy(run, 20) / WEIGHTS_FILE)
    warnings: list[str] = []
    found = newest_good_checkpoint(run.checkpoint_dirs(), warnings.append)
    assert found is not None and found[0] == run.checkpoint_dir(10)
    assert warnings[0].startswith("--resume: checkpoint step_000020 is damaged (unreadable (SafetensorError: ")


def test_the_newest_incarnation_counts_damaged_checkpoints(tmp_path: Path) -> None:
    """A resume past a damaged checkpoint of incarnation 3 must not reuse 3 (or lower)."""
    run = RunDir(tmp_path)
    _write(run, 10, incarnation=0)
    _write(run, 20, incarnation=3)
    _flip_byte(run.checkpoint_dir(20) / WEIGHTS_FILE)
    _write_legacy(run, 5, incarnation=1)
    assert newest_incarnation(run.checkpoint_dirs()) == 3
    assert newest_incarnation([]) == 0


def test_restart_is_refused_for_the_learners_process() -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(TOPOLOGY, ['processes.learner.restart="on-failure"'])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("processes.learner.restart: 'learner' (learner) cannot be restarted within a run")
    load_topology(TOPOLOGY, ['processes.sampler-{i}.restart="on-failure"'])  # samplers may restart


def test_restart_of_the_learner_exits_2_with_one_line_at_dry_run() -> None:
    override = 'processes.learner.restart="on-failure"'
    result = subprocess.run(
        [sys.executable, "-m", "echo2.launch", str(TOPOLOGY), "--dry-run", "--set", override],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"{TOPOLOGY}: processes.learner.restart: ")


# -- one launched run: damage the newest checkpoint, --resume from the one before --------------


@pytest.mark.slow  # ~27 s of launched runs; the fallback's unit tests stay in the default suite
@pytest.mark.timeout(300)
def test_resume_passes_over_a_damaged_newest_checkpoint_and_the_audit_holds(tmp_path: Path) -> None:
    common = [
        "--run-dir", str(tmp_path),
        "--set", "actors.learner.config.eval_prompts=50",
        "--set", "actors.learner.config.eval_every=0",
        "--set", "actors.learner.config.checkpoint_every=5",
    ]  # fmt: skip
    launch = [sys.executable, "-m", "echo2.launch", str(TOPOLOGY), *common]
    first = subprocess.run(
        [*launch, "--set", "actors.learner.config.max_steps=10"], cwd=ROOT, capture_output=True, text=True, timeout=150
    )
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    (run_root,) = (p for p in tmp_path.iterdir() if p.is_dir())
    run = RunDir(run_root)
    assert [p.name for p in run.checkpoint_dirs()] == ["step_000005", "step_000010"]
    _flip_byte(run.checkpoint_dir(10) / WEIGHTS_FILE)

    steps = 15
    resumed = subprocess.run(
        [*launch, "--set", f"actors.learner.config.max_steps={steps}", "--resume", str(run.root), "--allow-changes"],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "checkpoint step_000010 is damaged (model.safetensors does not match its digest)" in output
    assert "resumed from step_000005: version 5, incarnation 1" in output
    assert "Traceback" not in output
    summary = json.loads(run.summary_path.read_text())
    assert summary["steps"] == steps
    assert summary["rollouts_trained_twice"] == 0
    assert verify_checkpoint(run.checkpoint_dir(10)).incarnation == 1  # the damaged one was rewritten
    audit = subprocess.run(
        [sys.executable, "-m", "echo2.audit", str(run.root), "--json"], capture_output=True, text=True, timeout=60
    )
    report = json.loads(audit.stdout)
    assert audit.returncode == 0, audit.stdout
    assert report["lost"] == [] and report["duplicated"] == []
    assert report["voided_by_resume"] > 0  # steps 5-10 of the first run were trained again


# -- the Learner's restore: what it continues from, and under which incarnation ---------------


def _learner(run: Path) -> Learner:
    learner = Learner("learner", LearnerConfig(eval_prompts=1, checkpoint_every=1))
    learner.ctx = ActorContext(
        actor_name="learner",
        process="main",
        transport=None,  # type: ignore[arg-type]  # restore opens no socket
        ports={},
        declared={},
        run_dir=run,
        stopping=asyncio.Event(),
    )
    learner._build()
    return learner


def test_the_learner_resumes_past_a_damaged_checkpoint_under_a_newer_incarnation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = _learner(tmp_path)
    for version, incarnation in ((3, 0), (6, 2)):
        writer.version, writer.incarnation = version, incarnation
        writer.account.trained_tasks = {f"task-{version}"}
        writer.save_checkpoint()
    writer.ctx.close()
    _flip_byte(RunDir(tmp_path).checkpoint_dir(6) / WEIGHTS_FILE)

    resumed = _learner(tmp_path)
    resumed._restore()
    resumed.ctx.close()
    assert (resumed.version, resumed.incarnation) == (3, 3)  # after incarnation 2, whose checkpoint was damaged
    assert resumed.account.trained_tasks == {"task-3"}
    assert "checkpoint step_000006 is damaged (model.safetensors does not match its digest)" in caplog.text

    _flip_byte(RunDir(tmp_path).checkpoint_dir(3) / WEIGHTS_FILE)  # now both are damaged
    fresh = _learner(tmp_path)
    fresh._restore()
    fresh.ctx.close()
    assert (fresh.version, fresh.incarnation) == (0, 3)  # the initial model, still a new incarnation
    assert "no checkpoint in" in caplog.text and "verifies; starting from the initial model" in caplog.text
