"""A clean start: the public API imports cheaply, and a launched run prints no warning or traceback.

Every process of a run used to print a RuntimeWarning (its entry point was a module the
package ``__init__`` had already imported). These tests run what users run, in fresh
interpreters, with every warning shown once (``PYTHONWARNINGS=default``, inherited by the
launcher's children), and read what the run leaves behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import echo2
from echo2.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = ("echo2.launch", "echo2.launch.child", "echo2.audit", "echo2.report", "echo2.plan", "echo2.keys")
"""The ``python -m`` commands the docs name."""


def _python(*args: str, warnings: str = "default", timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS=warnings)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
    )


def _alarming(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Warning" in line or "Traceback" in line]


def test_every_exported_name_resolves() -> None:
    assert len(set(echo2.__all__)) == len(echo2.__all__)
    for name in echo2.__all__:
        assert getattr(echo2, name) is not None, name
    assert set(echo2.__all__) <= set(dir(echo2))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = echo2.Nope  # type: ignore[attr-defined]


def test_import_echo2_imports_no_torch_and_no_runtime() -> None:
    probe = (
        "import json, sys; import echo2; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'echo2')))))"
    )
    done = _python("-W", "error", "-c", probe)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["echo2"]  # lazy: not even echo2.runtime, and no torch


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_points_print_help_without_a_warning(module: str) -> None:
    done = _python("-W", "error", "-m", module, "--help", warnings="error")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "usage:" in done.stdout
    assert _alarming(done.stdout) == []


@pytest.mark.timeout(240)
def test_a_launched_run_logs_no_warning_and_no_traceback(tmp_path: Path) -> None:
    # The main job, two steps: every actor kind, torch in the learner and the samplers.
    learner = "actors.learner.config"
    sets = [f"{learner}.max_steps=2", f"{learner}.eval_prompts=8", f"{learner}.checkpoint_every=0"]
    args = [f"--set={s}" for s in sets]
    done = _python(
        "-m", "echo2.launch", str(ROOT / "examples" / "topology.toml"), "--run-dir", str(tmp_path), *args, timeout=200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (root,) = tmp_path.iterdir()
    run = RunDir(root)
    processes = json.loads(run.topology_path.read_text())["processes"]
    logs = {path.stem: path.read_text() for path in run.log_paths()}
    assert sorted(logs) == sorted(processes) and all(logs.values())
    assert _alarming(done.stdout) == [] and _alarming(done.stderr) == []
    for process, text in logs.items():
        assert _alarming(text) == [], f"{run.log_path(process)}:\n{text[-3000:]}"
