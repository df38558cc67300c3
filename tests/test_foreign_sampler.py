"""A stranger's sampler gets trained: the example of docs/protocol.md section 8 is the only
sampler of a launched job.

The example is taken from the document as it stands (pyzmq, msgpack, numpy and blake3; no
echo2 import) and run as its own program with the run's ``topology.resolved.json``, the
way the document says a worker on another machine joins: its sampler is declared on a host
of its own, which the launcher (``--host local``) does not start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.ports import port_bases

from echo2 import ledger
from echo2.rundir import RunDir
from echo2.tools.audit import audit

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = re.compile(r"<!-- example:begin -->\n```python\n(.*?)```\n<!-- example:end -->", re.S)
STEPS, S, GROUPS_PER_STEP = 6, 1, 4

# The stranger samples uniformly, so its (honest) log-probs are far from the learner's
# recomputation: the log-prob mismatch quarantine is turned off (0), or it would be
# quarantined after five steps. Everything else it sends is checked as for anyone.
TOPOLOGY = """
[run]
name = "foreign"
drain_timeout_s = 5.0
deadline_s = 90.0
[hosts.local]
address = "127.0.0.1"
port_base = {local_port}
[hosts.outside]
address = "127.0.0.1"
port_base = {outside_port}
[job]
staleness = {S}
task = "addition"
task_kwargs = {{ digits = 3 }}
group_size = 4
groups_per_step = {GROUPS_PER_STEP}
max_new_tokens = 5
[processes.data]
[processes.learner]
[processes.stranger]
host = "outside"
[actors.prompt_source]
kind = "prompt_source"
process = "data"
config = {{ quarantine_mismatch = 0.0 }}
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.stranger]
kind = "sampler"
process = "stranger"
config = {{ weights_data_plane = "zmq" }}
[actors.learner]
kind = "learner"
process = "learner"
config = {{ max_steps = {STEPS}, eval_every = 0, eval_prompts = 20, checkpoint_every = 0 }}
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
"""


def example_code() -> str:
    found = EXAMPLE.search((ROOT / "docs" / "protocol.md").read_text())
    assert found, "docs/protocol.md lost its example block"
    return found.group(1)


def _wait_for(path_glob: Path, pattern: str, launcher: subprocess.Popen[str], timeout_s: float) -> Path:
    """The launcher writes the resolved topology before it starts a process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(path_glob.glob(pattern))
        if found:
            return found[0]
        assert launcher.poll() is None, launcher.communicate()[0]
        time.sleep(0.05)  # polling for a file the launcher writes, not a handshake
    raise AssertionError(f"no {pattern} in {path_glob} after {timeout_s} s")


@pytest.mark.timeout(150)
def test_a_sampler_written_from_the_protocol_document_is_trained(tmp_path: Path) -> None:
    sampler_py = tmp_path / "sampler.py"
    sampler_py.write_text(example_code())
    topology = tmp_path / "topology.toml"
    local_port, outside_port = port_bases(2)
    topology.write_text(
        TOPOLOGY.format(
            local_port=local_port, outside_port=outside_port, S=S, STEPS=STEPS, GROUPS_PER_STEP=GROUPS_PER_STEP
        )
    )
    runs = tmp_path / "runs"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "echo2.launch", str(topology), "--host", "local", "--run-dir", str(runs)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    stranger: subprocess.Popen[str] | None = None
    try:
        resolved = _wait_for(runs, "*/topology.resolved.json", launcher, 30)
        stranger = subprocess.Popen(
            [sys.executable, str(sampler_py), str(resolved), "stranger"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        launched_out, _ = launcher.communicate(timeout=120)
        # The end of the run is not announced: the stranger stops by itself once `tasks`
        # has been down for a while (section 2), with exit status 0.
        stranger_out, _ = stranger.communicate(timeout=30)
    finally:
        for process in (launcher, stranger):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()
    assert launcher.returncode == 0, launched_out
    assert stranger.returncode == 0, stranger_out

    run = resolved.parent
    summary = json.loads(RunDir(run).summary_path.read_text())
    assert summary["steps"] == STEPS, summary
    events = ledger.read([run]).events
    trained = [e for e in events if isinstance(e, ledger.Trained)]
    assert len(trained) == STEPS * GROUPS_PER_STEP
    assert {e.sampler for e in trained} == {"stranger"}
    # Trained from versions past S: the stranger installed new weights as they were published.
    assert max(e.version for e in trained) > S, sorted({e.version for e in trained})
    report = audit([run])
    assert report.ok, report
    assert report.rejected_by_sampler == {}  # nothing it sent failed admission
    assert "stranger" not in report.quarantined
