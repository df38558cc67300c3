"""Record and replay: a recorded ``batch`` channel, replayed into a fresh Learner, gives the
recorded losses exactly (issue 19 item 5).

The short check builds the main job's one process as the launcher's child does (resolved
topology in a run directory, ``build_process``, ``ProcessRuntime`` with the run's recording
settings) so that it fits the default suite; the slow one runs the launcher and
``python -m echo2.replay`` as a user would, with ``--steps``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from echo2.launch.child import set_torch_threads
from echo2.launch.replay import replay
from echo2.rundir import RunDir
from echo2.runtime import ProcessRuntime
from echo2.topology import build_process, load_topology, resolve
from echo2.transport.recording import Recording

ROOT = Path(__file__).resolve().parents[1]
# The colocated main job, tiny: the built-in model and torch sampler, a few small steps.
TINY = [
    'run.record=["learner.batch"]',
    "processes.all.torch_threads=1",
    "job.groups_per_step=4",
    "actors.sampler.config.credits=4",
    "actors.sampler.config.max_batch_groups=4",
    "actors.learner.config.eval_prompts=4",
    "actors.learner.config.eval_every=0",
]


def _losses(run: RunDir | Path) -> list[float]:
    run = run if isinstance(run, RunDir) else RunDir(run)
    return [record["loss"] for record in run.metrics("learner", "step")]


@pytest.mark.timeout(120)
async def test_replaying_the_learners_batch_channel_reproduces_its_losses(tmp_path: Path) -> None:
    topology = load_topology(ROOT / "examples" / "colocated.toml", [*TINY, "actors.learner.config.max_steps=2"])
    run = RunDir.create(tmp_path, "recorded")
    resolved = resolve(topology, run.name, str(run.root))
    resolved.dump(run.topology_path)
    set_torch_threads(resolved.processes["all"].torch_threads)
    actors, addresses, telemetry = build_process(resolved, "all")
    await ProcessRuntime(
        actors, addresses, process="all", run_dir=run.root, telemetry_connect=telemetry, recording=resolved.recording
    ).run()
    recorded = _losses(run)
    assert len(recorded) == 2 and any(loss != 0.0 for loss in recorded), recorded  # a gradient to get wrong
    assert [m.direction for m in Recording.read(run.recording_path("learner", "batch")).messages][:2] == [
        "sent",
        "received",
    ]

    result = await replay(run.root, "learner", out_dir=tmp_path / "replayed")

    assert (result.ports, result.delivered) == (["batch"], {"batch": 2})
    assert _losses(tmp_path / "replayed") == recorded  # == on the floats as written
    assert result.matches, result.differences
    assert result.compared == 2
    summary = json.loads(RunDir(tmp_path / "replayed").summary_path.read_text())
    assert (summary["steps"], summary["stopped_by"]) == (2, "max_steps")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_launched_run_replays_from_the_command_line_for_its_first_steps(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "echo2.launch", str(ROOT / "examples" / "colocated.toml")]
    command += ["--run-dir", str(tmp_path / "runs")]
    for override in [*TINY, "actors.learner.config.max_steps=4"]:
        command += ["--set", override]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    out = tmp_path / "replayed"
    replayed = subprocess.run(
        [sys.executable, "-m", "echo2.replay", str(run_dir), "learner", "--steps", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-3000:]
    printed = json.loads(replayed.stdout)
    assert (printed["delivered"], printed["records_compared"], printed["matches"]) == ({"batch": 2}, 2, True)
    assert _losses(out) == _losses(run_dir)[:2]
    summary = json.loads(RunDir(out).summary_path.read_text())
    # Asked for a third batch the replay does not give: stopped after its second step.
    assert (summary["steps"], summary["stopped_by"]) == (2, "stop_request")
