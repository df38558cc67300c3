"""Cluster specs from one topology (issue 19 item 2): ``python -m echo2.launch TOPOLOGY --emit slurm|k8s``.

What can be checked here is checked for real: the Kubernetes manifests against the API
schema (``kubernetes-validate``, the dev extra: the Kubernetes OpenAPI schemas as JSON
Schema, shipped in the package), the sbatch script by bash and, behind ``-m slow``, by a
single-node Slurm (Debian's slurm-wlm, which ``scripts/slurm_single_node.sh`` installs and
starts; root only) that runs it to the end. Not checked here: a real Kubernetes cluster
(scheduling, DNS, probes answered), Slurm across several nodes, GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.ports import port_bases

from echo2.errors import ConfigError
from echo2.launch import main
from echo2.launch.emit import K8S_METRICS_PORT, k8s_manifests, plan_hosts, slurm_script
from echo2.rundir import RunDir
from echo2.tools.audit import audit
from echo2.topology import ProcessSpec, Topology, load_topology
from echo2.topology.schema import resolve_env_addresses

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / "examples" / "topology.toml"
MULTIHOST = ROOT / "examples" / "multihost.toml"
K8S_VERSIONS = ("1.29.0", "1.37.0")
"""Kubernetes API versions the manifests are validated against (an old supported one, the newest)."""


def _documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of an emitted file (each in JSON's syntax, which YAML reads as is)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the emitted YAML back")
    return list(yaml.safe_load_all(path.read_text()))


def _emit(tmp_path: Path, topology: Path, kind: str, *extra: str) -> Path:
    out = tmp_path / kind
    assert main([str(topology), "--emit", kind, "--out", str(out), *extra]) == 0
    (written,) = out.iterdir()
    return written


# -- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("topology", [MAIN_JOB, MULTIHOST], ids=["main-job", "multihost"])
def test_k8s_manifests_validate_against_the_api_schema(tmp_path: Path, topology: Path) -> None:
    validator = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the dev extra) validates the manifests"
    )
    joins = ["--set", "hosts.learner.join_port=29000"] if topology == MULTIHOST else []
    documents = _documents(_emit(tmp_path, topology, "k8s", *joins))
    for document in documents:
        for version in K8S_VERSIONS:
            validator.validate(document, version, strict=True)  # raises on any unknown or mistyped field
    # The validator does refuse what the API refuses (else the loop above proves nothing).
    job = next(d for d in documents if d["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(validator.ValidationError):
        validator.validate(job, K8S_VERSIONS[-1], strict=True)


def test_k8s_manifests_one_job_and_service_per_host_the_topology_in_a_config_map(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="PyYAML reads the emitted YAML back")
    documents = _emit(tmp_path, MULTIHOST, "k8s", "--set", "hosts.learner.join_port=29000", "--image", "me/echo2:1")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for document in _documents(documents):
        by_kind.setdefault(document["kind"], []).append(document)
    (config_map,) = by_kind["ConfigMap"]
    assert config_map["data"]["topology.toml"] == MULTIHOST.read_text()
    hosts = plan_hosts(load_topology(MULTIHOST))
    assert [job["metadata"]["name"] for job in by_kind["Job"]] == [f"echo2-multihost-{h.name}" for h in hosts]
    assert hosts[0].name == "learner"  # the host that completes the run comes first
    for host, job, service in zip(hosts, by_kind["Job"], by_kind["Service"], strict=True):
        pod = job["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        assert container["image"] == "me/echo2:1"
        # The pod says which host it is; the launcher is told at start.
        assert pod["metadata"]["annotations"]["echo2/host"] == host.name
        assert container["args"][container["args"].index("--host") + 1] == "$(ECHO2_HOST)"
        (env,) = container["env"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['echo2/host']"
        # Every host's address is its Service's DNS name; probes at the launcher's /health.
        sets = [container["args"][i + 1] for i, a in enumerate(container["args"]) if a == "--set"]
        assert {f'hosts.{h.name}.address="echo2-multihost-{h.name}"' for h in hosts} <= set(sets)
        assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": K8S_METRICS_PORT}
        assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert service["spec"]["selector"] == pod["metadata"]["labels"]
        ports = {p["port"] for p in service["spec"]["ports"]}
        assert set(host.tcp_ports) <= ports and K8S_METRICS_PORT in ports
    assert 29000 in {p["port"] for p in by_kind["Service"][0]["spec"]["ports"]}  # the learner host's join port


# -- Slurm ---------------------------------------------------------------------------------


def test_the_sbatch_script_has_one_step_per_host_the_learners_first(tmp_path: Path) -> None:
    script = _emit(tmp_path, MULTIHOST, "slurm", "--set", "actors.learner.config.max_steps=5")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    assert "#SBATCH --nodes=4" in text and "#SBATCH --time=" in text
    steps = [line.split()[1] for line in text.splitlines() if line.startswith("step ")]
    assert steps == ["learner", "edge-a", "edge-b", "edge-c"]
    # Addresses are the nodes' names, read by each launcher from its environment.
    assert 'export ECHO2_ADDRESS_EDGE_A="${NODES[1 % ${#NODES[@]}]}"' in text
    assert "--set 'hosts.edge-a.address=\"env:ECHO2_ADDRESS_EDGE_A\"'" in text
    assert "--set actors.learner.config.max_steps=5" in text
    # The topology travels in the script (no shared filesystem), byte for byte.
    start = text.index("<<'ECHO2_TOPOLOGY_EOF'\n") + len("<<'ECHO2_TOPOLOGY_EOF'\n")
    assert text[start : text.index("\nECHO2_TOPOLOGY_EOF\n")] + "\n" == MULTIHOST.read_text()


def _two_node_learner() -> Topology:
    topology = load_topology(MULTIHOST)
    learner = ProcessSpec(
        host="learner",
        nproc_per_node=2,
        nnodes=2,
        node_hosts=["learner", "edge-a"],
        rdzv_endpoint="10.77.0.1:29400",
        gpus=[0, 1],
    )
    return dataclasses.replace(topology, processes={**topology.processes, "learner": learner})


def test_a_learner_spanning_nodes_meets_at_its_first_nodes_name_with_its_gpus(tmp_path: Path) -> None:
    """The emitted steps start each host's launcher, which runs the ranks; the cluster adds
    the rendezvous address (node 0's name, not the topology's IP) and the GPUs."""
    topology = _two_node_learner()
    hosts = plan_hosts(topology)
    assert [(h.name, h.gpus) for h in hosts][:2] == [("learner", 2), ("edge-a", 2)]  # edge-a runs node 1
    script = tmp_path / "echo2.sbatch"
    script.write_text(slurm_script(topology, hosts, MULTIHOST.read_text(), [], source_name="multihost.toml"))
    text = script.read_text()
    assert "#SBATCH --gpus-per-node=2" in text
    (line,) = [line for line in text.splitlines() if line.startswith("SETS+=")]
    expanded = subprocess.run(
        ["bash", "-c", f'SETS=(); {line}; printf "%s\\n" "${{SETS[@]}}"'],
        env={"ECHO2_ADDRESS_LEARNER": "node-7", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert expanded == ["--set", 'processes.learner.rdzv_endpoint="node-7:29400"']
    documents = k8s_manifests(topology, hosts, MULTIHOST.read_text(), [], image="echo2")
    learner_job = next(
        d for d in documents if d["kind"] == "Job" and d["metadata"]["name"] == "echo2-multihost-learner"
    )
    (container,) = learner_job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert 'processes.learner.rdzv_endpoint="echo2-multihost-learner:29400"' in container["args"]
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra)")
    validator.validate(learner_job, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--emit", "slurm"], "--emit needs --out DIR"),
        (["--emit", "k8s", "--out", "x", "--host", "learner"], "--host: not with --emit"),
        (["--emit", "nomad", "--out", "x"], "invalid choice"),
        (["--out", "x"], "--out: only with --emit"),
        (["--emit", "slurm", "--out", "x", "--set", "job.staleness=-1"], "job.staleness"),
    ],
)
def test_bad_emit_options_exit_2_with_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(MULTIHOST), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


def test_env_addresses_are_read_where_the_launcher_starts() -> None:
    topology = load_topology(MULTIHOST, ['hosts.edge-a.address="env:EDGE_A_NODE"'])
    assert topology.hosts["edge-a"].address == "env:EDGE_A_NODE"  # as written until a launcher starts
    resolved = resolve_env_addresses(topology, {"EDGE_A_NODE": "node-17"})
    assert resolved.hosts["edge-a"].address == "node-17" and resolved.hosts["learner"].address == "10.77.0.1"
    with pytest.raises(ConfigError, match=r"hosts\.edge-a\.address: .*EDGE_A_NODE is not set"):
        resolve_env_addresses(topology, {})


# -- a real single-node Slurm --------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A single-node Slurm on this machine for the module's tests (installed if absent)."""
    if os.geteuid() != 0:
        pytest.skip("a single-node Slurm needs root (apt-get install slurm-wlm munge; its daemons)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        pytest.skip("no apt-get to install Debian's slurm-wlm, and no Slurm installed")
    state = tmp_path_factory.mktemp("slurm")
    script = ROOT / "scripts" / "slurm_single_node.sh"
    started = subprocess.run(["bash", str(script), "start", str(state)], capture_output=True, text=True, timeout=600)
    try:
        if started.returncode != 0:
            pytest.skip(f"single-node Slurm not available: {started.stderr.strip()[-300:]}")
        yield state
    finally:
        subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, timeout=60)


def _sbatch(script: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        ECHO2_PYTHON=sys.executable,
        ECHO2_WORKDIR=str(ROOT),
        ECHO2_RUN_DIR=str(workdir / "runs"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
    )
    return subprocess.run(
        ["sbatch", "--wait", "--nodes=1", f"--output={workdir}/slurm-%j.out", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=workdir,
    )


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_emitted_sbatch_script_runs_the_main_job_on_slurm(slurm: Path, tmp_path: Path) -> None:
    """The main job, short (60 steps), through sbatch on a single-node Slurm: exit 0, the
    learner's summary, a clean audit."""
    script = _emit(
        tmp_path,
        MAIN_JOB,
        "slurm",
        "--set", "actors.learner.config.max_steps=60",
        "--set", "actors.learner.config.eval_every=30",
        "--set", "actors.learner.config.eval_prompts=32",
        "--set", "actors.learner.config.checkpoint_every=0",
    )  # fmt: skip
    done = _sbatch(script, tmp_path)
    (output,) = tmp_path.glob("slurm-*.out")
    assert done.returncode == 0, done.stderr + output.read_text()[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads(RunDir(run_dir).summary_path.read_text())
    assert summary["steps"] == 60
    assert json.loads(RunDir(run_dir).status_path.read_text())["exit_code"] == 0
    report = audit([run_dir])
    assert report.ok and not report.lost and not report.duplicated, report


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_emitted_sbatch_script_runs_a_four_host_job_across_node_addresses(slurm: Path, tmp_path: Path) -> None:
    """examples/multihost.toml (four hosts), short: four steps on the one node, each host
    reaching the others at the node's name (env:), port ranges moved apart as hosts that
    share a machine need. The learner's host completes the run; the edges stop with it."""
    bases = port_bases(4)
    sets = [
        f"hosts.{host}.port_base={base}"
        for host, base in zip(("learner", "edge-a", "edge-b", "edge-c"), bases, strict=True)
    ]
    sets += [
        "actors.learner.config.max_steps=30",
        "actors.learner.config.eval_every=0",
        "actors.learner.config.eval_prompts=16",
        "actors.learner.config.checkpoint_every=0",
        "processes.learner.torch_threads=1",
    ]
    script = _emit(tmp_path, MULTIHOST, "slurm", *(arg for value in sets for arg in ("--set", value)))
    done = _sbatch(script, tmp_path)
    (output,) = tmp_path.glob("slurm-*.out")
    log = output.read_text()
    assert done.returncode == 0, done.stderr + log[-4000:]
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 4  # one per host, each launcher its own
    summaries = [d for d in run_dirs if RunDir(d).summary_path.exists()]
    (learner_dir,) = summaries
    assert json.loads(RunDir(learner_dir).summary_path.read_text())["steps"] == 30
    report = audit(run_dirs)
    assert report.ok and not report.lost and not report.duplicated, report
