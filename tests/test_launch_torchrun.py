"""The launcher runs a distributed learner under torchrun, with GPUs assigned per process.

Launched as users launch it (``python -m echo2.launch``): a process holding a
``distributed_learner`` becomes a torchrun agent with ``nproc_per_node`` gloo ranks, sees
``CUDA_VISIBLE_DEVICES`` from its ``gpus`` (checked at load against the machine's GPUs, or
against ``ECHO2_ASSUME_GPUS`` on this CPU machine), completes the run, and is stopped,
killed or orphaned without leaving a rank behind. Two launchers on one machine stand in for
two nodes of one learner. Synchronisation is on the launcher's output and process exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tests.ports import port_bases

from echo2.launch import main
from echo2.launch.torchrun import torchrun_args
from echo2.rundir import RunDir
from echo2.tools.audit import audit
from echo2.topology import ResolvedProcess, load_topology

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(180)]

TOPOLOGY = """
[run]
name = "ranks"
drain_timeout_s = 10.0
deadline_s = 150.0
{hosts}
[job]
staleness = 2
group_size = 2
groups_per_step = 4
max_new_tokens = 5
[processes.data]
{data_host}
[processes.sampler]
{data_host}
[processes.learner]
torch_threads = 1
{learner}
[actors.prompt_source]
kind = "prompt_source"
process = "data"
[actors.rewarder]
kind = "rewarder"
process = "data"
[actors.buffer]
kind = "buffer"
process = "data"
[actors.sampler]
kind = "sampler"
process = "sampler"
config = {{ engine = "simulated", engine_kwargs = {{ seconds_per_token = {token_s}, success_rate = 0.5 }}, credits = 4 }}
[actors.learner]
kind = "distributed_learner"
process = "learner"
config = {{ max_steps = {steps}, eval_every = 0, eval_prompts = 4, checkpoint_every = 0, warmup_steps = 1, log_every = 5 }}
[actors.weight_publisher]
kind = "weight_publisher"
process = "learner"
"""


def topology(
    tmp_path: Path,
    *,
    learner: str = "nproc_per_node = 2\ngpus = [0, 1]",
    steps: int = 5,
    token_s: float = 0.0,
    hosts: str = "",
    data_host: str = "",
) -> Path:
    path = tmp_path / "ranks.toml"
    text = TOPOLOGY.format(learner=learner, steps=steps, token_s=token_s, hosts=hosts, data_host=data_host)
    path.write_text(textwrap.dedent(text))
    return path


def env(**extra: str) -> dict[str, str]:
    """The launcher's environment: this checkout first, gloo ranks, two GPUs taken as given."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return dict(
        os.environ, PYTHONPATH=path, ECHO2_DIST_BACKEND="gloo", OMP_NUM_THREADS="1", ECHO2_ASSUME_GPUS="2", **extra
    )


def start(path: Path, run_dir: Path, *args: str, environ: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.launch", str(path), "--run-dir", str(run_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=environ or env(),
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # a test run under nohup
    )


def read_until(proc: subprocess.Popen[str], text: str, seen: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"output ended before {text!r}:\n" + "".join(seen))


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux procfs): the torchrun agent's ranks included."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += children - found
            found |= children
    return found


def alive(pids: set[int]) -> set[int]:
    running = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            running.add(pid)
    return running


def wait_gone(pids: set[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"still running after {timeout_s} s: {alive(pids)}"


def the_run(parent: Path) -> RunDir:
    (run_dir,) = parent.iterdir()
    return RunDir(run_dir)


# -- the command -----------------------------------------------------------------------------


def test_torchrun_args_one_node_and_a_node_of_several() -> None:
    one = torchrun_args(ResolvedProcess(host="a", torch_threads=1, actors=[], torchrun=True, nproc_per_node=4))
    assert one[:3] == ["-m", "echo2.launch.torchrun", "agent"]
    assert one[-2:] == ["-m", "echo2.launch.torchrun"]
    assert "--standalone" in one and one[one.index("--nproc-per-node") + 1] == "4"
    assert one[one.index("--max-restarts") + 1] == "0"
    node = ResolvedProcess(
        host="a",
        torch_threads=1,
        actors=[],
        torchrun=True,
        nproc_per_node=8,
        nnodes=2,
        node_hosts=["a", "b"],
        rdzv_endpoint="10.0.0.1:29500",
    )
    args = torchrun_args(node, node_rank=1, log_dir=Path("/run/logs/learner.torchrun"))
    assert "--standalone" not in args
    for option, value in (
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--rdzv-backend", "static"),
        ("--rdzv-endpoint", "10.0.0.1:29500"),
        ("--log-dir", "/run/logs/learner.torchrun"),
    ):
        assert args[args.index(option) + 1] == value


# -- GPUs checked at load --------------------------------------------------------------------


def test_a_dry_run_shows_ranks_and_gpus_checked_against_assumed_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO2_ASSUME_GPUS", "2")
    assert main([str(topology(tmp_path)), "--dry-run", "--run-dir", str(tmp_path / "runs")]) == 0
    out, err = capsys.readouterr()
    assert "torchrun 2 rank(s)  gpus 0,1" in out
    assert "note: gpus: checked against ECHO2_ASSUME_GPUS=2, not against this machine's devices" in err
    resolved = json.loads(out[out.index("{") :])["processes"]["learner"]
    assert resolved["torchrun"] and resolved["nproc_per_node"] == 2 and resolved["gpus"] == [0, 1]


def test_gpus_beyond_the_machines_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO2_ASSUME_GPUS", "1")
    path = topology(tmp_path)
    assert main([str(path), "--dry-run", "--run-dir", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"{path}: processes.learner.gpus: GPU 1 is not among the 1 this machine's launcher sees")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: it may have GPUs")
def test_gpus_on_a_machine_without_any_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ECHO2_ASSUME_GPUS", raising=False)
    path = topology(tmp_path)
    assert main([str(path), "--dry-run", "--run-dir", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"{path}: processes.learner.gpus: asks for GPU(s) 0, 1 but this machine has none (nvidia-smi is not on PATH)"
    )
    assert "ECHO2_ASSUME_GPUS=N" in err
    assert not (tmp_path / "runs").exists()


def test_gpus_of_another_hosts_process_are_not_checked_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO2_ASSUME_GPUS", "0")  # this machine: none
    hosts = '[hosts.cpu]\naddress = "10.1.2.2"\n[hosts.gpu]\naddress = "10.1.2.3"'
    path = topology(tmp_path, hosts=hosts, data_host='host = "cpu"', learner='host = "gpu"\ngpus = [0]')
    assert main([str(path), "--dry-run", "--host", "cpu", "--run-dir", str(tmp_path / "runs")]) == 0
    assert main([str(path), "--dry-run", "--host", "gpu", "--run-dir", str(tmp_path / "runs")]) == 2
    assert "processes.learner.gpus: asks for GPU(s) 0 but this machine has none" in capsys.readouterr().err


def test_one_launcher_for_two_nodes_of_a_process_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = '[hosts.a]\naddress = "127.0.0.1"\n[hosts.b]\naddress = "127.0.0.1"\nport_base = 28300'
    learner = 'host = "a"\nnnodes = 2\nnode_hosts = ["a", "b"]\nrdzv_endpoint = "127.0.0.1:29400"'
    path = topology(tmp_path, hosts=hosts, data_host='host = "a"', learner=learner)
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "processes.learner.node_hosts: hosts a, b are nodes of one process and all this launcher's" in err


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("gpu*.toml")), ids=lambda p: p.name)
def test_the_gpu_recipes_dry_run_on_this_machine(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked here for the 8-GPU machines they are written for (ECHO2_ASSUME_GPUS says so),
    a tiny local HF model standing in for their model directory; each host as its launcher."""
    pytest.importorskip("transformers", reason="the recipes' HF model needs the 'hf' extra")
    from tests.test_hf_models import make_tiny_llama

    model = f"job.model={make_tiny_llama(tmp_path / 'model')}"
    monkeypatch.setenv("ECHO2_ASSUME_GPUS", "8")
    topology = load_topology(path, [model])
    learner = topology.processes["learner"]
    assert learner.gpus and all(topology.processes[p].gpus for p in topology.processes if p.startswith("sampler"))
    hosts = list(topology.hosts)
    for host_args in [[]] if len(hosts) == 1 else [["--host", host] for host in hosts]:
        assert main([str(path), "--dry-run", "--set", model, *host_args]) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert "note: gpus: checked against ECHO2_ASSUME_GPUS=8" in err
        resolved = json.loads(out[out.index("{") :])["processes"]["learner"]
        assert resolved["gpus"] == learner.gpus and resolved["nproc_per_node"] == learner.nproc_per_node
        if learner.nproc_per_node > 1 or learner.nnodes > 1:
            assert resolved["torchrun"] and f"torchrun {learner.nproc_per_node} rank(s)" in out, out


# -- launched ------------------------------------------------------------------------------


def test_the_launcher_runs_a_two_rank_learner_under_torchrun(tmp_path: Path) -> None:
    """~15 s: the agent and two gloo ranks start, see their GPUs, train, complete the run."""
    with start(topology(tmp_path), tmp_path / "runs") as proc:
        out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    run = the_run(tmp_path / "runs")
    assert "learner  pid" in out and "torchrun 2 rank(s)  gpus 0,1" in out, out
    log = run.log_path("learner").read_text()
    for rank in (0, 1):  # each rank sees the process's GPUs (its CUDA device i is gpus[i])
        assert f"rank {rank} of 2 (node 0, local rank {rank}): gloo, CUDA_VISIBLE_DEVICES=0,1" in log, log
    summary = json.loads(run.summary_path.read_text())
    assert summary["steps"] == 5 and summary["groups_trained"] == 5 * 4
    report = audit([run.root])
    assert report.ok and report.trained == 5 * 4 and not report.lost and not report.duplicated, report
    assert json.loads(run.status_path.read_text())["processes"]["learner"] == 0
    assert (run.logs_dir / "learner.torchrun").is_dir()  # torchrun's files stay in the run


def _stoppable(tmp_path: Path) -> tuple[subprocess.Popen[str], list[str], set[int]]:
    """A launched run with a 2-rank learner that trains until stopped; its processes once training."""
    proc = start(topology(tmp_path, steps=100000, token_s=0.001), tmp_path / "runs")
    seen: list[str] = []
    read_until(proc, "step 10 |", seen)
    processes = descendants(proc.pid)
    agent = json.loads(the_run(tmp_path / "runs").pids_path.read_text())["processes"]["learner"]
    assert len(descendants(agent)) == 2, seen  # the two ranks
    return proc, seen, processes


@pytest.mark.slow  # ~20 s
def test_sigterm_drains_every_rank_and_leaves_nothing_behind(tmp_path: Path) -> None:
    proc, seen, processes = _stoppable(tmp_path)
    with proc:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, "".join(seen) + out
    assert "cancelling actors" not in out and "killing" not in out and "Traceback" not in out, out
    assert "agent stopped by SIGTERM; its ranks have exited" in out
    run = the_run(tmp_path / "runs")
    summary = json.loads(run.summary_path.read_text())  # rank 0 drained: its final checkpoint and summary
    assert summary["stopped_by"] == "stop_request" and summary["steps"] >= 10
    assert run.checkpoint_dirs()
    assert json.loads(run.status_path.read_text())["processes"]["learner"] == 143
    wait_gone(processes, 10)


@pytest.mark.slow  # ~20 s
def test_a_second_signal_kills_the_agent_and_its_ranks_at_once(tmp_path: Path) -> None:
    proc, seen, processes = _stoppable(tmp_path)
    with proc:
        proc.send_signal(signal.SIGTERM)
        read_until(proc, "stopping (SIGTERM received)", seen)  # two pending signals would be one
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, "".join(seen) + out
    assert "killing data, sampler, learner: second signal (SIGTERM)" in out, out
    wait_gone(processes, 10)  # the ranks die with their agent (PR_SET_PDEATHSIG)


@pytest.mark.slow  # ~20 s
def test_ranks_of_a_killed_launcher_drain_into_the_log(tmp_path: Path) -> None:
    proc, _, processes = _stoppable(tmp_path)
    with proc:
        proc.kill()
        proc.wait()
    run = the_run(tmp_path / "runs")
    wait_gone(processes, 30)
    log = run.log_path("learner").read_text()
    assert "second stop request" not in log and "cancelling actors" not in log, log
    assert "echo2.launch.torchrun: agent stopped by SIGHUP; its ranks have exited" in log, log
    assert json.loads(run.summary_path.read_text())["stopped_by"] == "stop_request"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow  # ~25 s
def test_two_launchers_run_the_two_nodes_of_one_learner(tmp_path: Path) -> None:
    """Hosts a and b on this machine: a's launcher runs the data, the sampler and node 0 of
    the learner (rank 0, the actors); b's runs node 1 (rank 1), which follows rank 0."""
    port_a, port_b = port_bases(2)
    hosts = f'[hosts.a]\naddress = "127.0.0.1"\nport_base = {port_a}\n[hosts.b]\naddress = "127.0.0.1"\nport_base = {port_b}'
    learner = f'host = "a"\nnnodes = 2\nnode_hosts = ["a", "b"]\nrdzv_endpoint = "127.0.0.1:{_free_port()}"'
    path = topology(tmp_path, hosts=hosts, data_host='host = "a"', learner=learner)
    node_1 = start(path, tmp_path / "b", "--host", "b")
    node_0 = start(path, tmp_path / "a", "--host", "a")
    with node_0, node_1:
        out_0, _ = node_0.communicate(timeout=150)
        out_1, _ = node_1.communicate(timeout=30)
    assert node_0.returncode == 0, out_0 + out_1
    assert node_1.returncode == 0, out_1
    assert "torchrun 1 rank(s) x 2 nodes (node 1)" in out_1 and "echo2:   data" not in out_1, out_1
    assert "rank 1 of 2 (node 1, local rank 0)" in out_1
    assert "rank 0 of 2 (node 0, local rank 0)" in out_0
    run = the_run(tmp_path / "a")
    assert json.loads(run.summary_path.read_text())["steps"] == 5
    report = audit([run.root])
    assert report.ok and report.trained == 5 * 4, report


@pytest.mark.slow  # ~100 s on two busy cores
def test_gpu_check_runs_its_packing_and_fsdp_checks_on_cpu(tmp_path: Path) -> None:
    """scripts/gpu_check.py's packing and FSDP checks, run here on CPU (gloo ranks, a tiny
    random Llama): the script itself works; what it measures on a GPU only a GPU can say."""
    pytest.importorskip("transformers", reason="gpu_check needs the 'hf' extra")
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--checks", "packing,fsdp"]
    command += ["--ranks", "2", "--prompts", "4", "--group-size", "4", "--max-new-tokens", "24", "--repeats", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env(), check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["failed"] == []
    assert report["packing"]["loss_relative_difference"] <= 1e-4 and report["packing"]["ok"]
    fsdp = report["fsdp"]
    assert fsdp["ranks"] == 2 and fsdp["ok"]
    assert fsdp["plain"]["losses"] == pytest.approx(fsdp["activation_checkpointing"]["losses"], rel=1e-5)
    assert max(fsdp["first_loss_relative_difference"].values()) <= 1e-4


def test_gpu_check_without_a_gpu_exits_2_with_one_line() -> None:
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has nvidia-smi: it may have a GPU")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--checks", "fsdp"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env(),
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("gpu_check: no CUDA device visible") and done.stderr.count("\n") == 1, done.stderr
