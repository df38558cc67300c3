"""``python -m echo2.launch TOPOLOGY --emit slurm|k8s --out DIR``: what starts the same run on a cluster.

One topology, one launcher per ``[hosts]`` entry, as on machines of one's own (``--host
NAME``); what changes is who starts each launcher and how hosts find each other:

* **Slurm** (``DIR/echo2.sbatch``): one job step per host, each on its own node (hosts
  share nodes, round robin, when the job gets fewer), started with ``srun``; the step of
  the host that completes the run (the learner's; its launcher starts a distributed
  learner under torchrun) decides the job's exit status, and the other steps are stopped
  (SIGTERM, which drains them) once it ends. Each host's address is its node's name, set
  by the script at run time (``address = "env:ECHO2_ADDRESS_<HOST>"``). No shared
  filesystem: the topology travels inside the script and ``sbcast`` puts it on each node's
  local disk; every host writes its own run directory on its node.
* **Kubernetes** (``DIR/<name>.k8s.yaml``): the topology in a ConfigMap; per host one
  ``Job`` (its launcher runs to the end of the run: 0 when it completed) and one headless
  ``Service`` whose DNS name is the host's address (``publishNotReadyAddresses``: peers
  connect while it starts). The pod learns which host it is from its own annotation
  ``echo2/host`` (the downward API, ``ECHO2_HOST``); readiness and liveness probes are the launcher's ``/health/ready`` and
  ``/health/live`` (``docs/metrics.md``), on the host's ``metrics_port`` (set to
  ``K8S_METRICS_PORT`` where the topology has none: each pod has its own network).

Addresses are resolved where each launcher starts (``env:`` from its environment, DNS
names when connecting), never fixed IPs. ``--set`` values given with ``--emit`` are passed
to every launcher with the address ones.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from echo2.errors import ConfigError
from echo2.topology import ProcessSpec, Topology
from echo2.topology.addresses import topology_addresses
from echo2.topology.preflight import check_relations

EmitKind = Literal["slurm", "k8s"]
EMIT_KINDS: tuple[str, ...] = get_args(EmitKind)
K8S_METRICS_PORT = 9400
"""Port of each host pod's launcher ``/health`` (and its processes' after it) when the
topology sets no ``metrics_port``: the probes need one."""
K8S_TOPOLOGY_DIR = "/etc/echo2"
K8S_RUN_DIR = "/var/lib/echo2/runs"
_RENDEZVOUS_PORT = 29500
"""torchrun's usual rendezvous port, for a learner spanning nodes whose topology names none."""
_STOP_MARGIN_S = 120.0
"""Seconds past ``run.deadline_s`` and the drain (start-up, the launcher's kill grace) a
cluster gives the run before it kills it."""


@dataclass(frozen=True)
class HostPlan:
    """One host of the topology as a cluster runs it."""

    name: str
    index: int
    """Its place: 0 is the host that completes the run (the learner's), then by name."""
    processes: tuple[str, ...]
    completes_run: bool
    address_var: str
    """``ECHO2_ADDRESS_<HOST>``: the variable its address is read from (Slurm)."""
    tcp_ports: tuple[int, ...]
    """Ports its launcher's processes bind for peers on other hosts (join port included)."""
    metrics_port: int
    gpus: int = 0
    """GPUs its node must have: the most any of its processes lists (``gpus``)."""


@dataclass(frozen=True)
class Ranks:
    """A process's torchrun settings (``[processes.NAME]`` ``nproc_per_node``, ``nnodes``,
    ``node_hosts``, ``rdzv_endpoint``, ``gpus``: the launcher starts a distributed learner
    under torchrun); one rank on its host, no GPU, for a topology without them."""

    nnodes: int
    node_hosts: tuple[str, ...]
    rdzv_endpoint: str
    gpus: int
    """GPUs the process's node sees: one past the highest index it lists."""


def ranks_of(spec: ProcessSpec) -> Ranks:
    """``spec``'s torchrun settings: the emitted steps only start each host's launcher,
    which runs the ranks itself; what a cluster must add is the rendezvous address of a
    learner spanning nodes and the GPUs to request."""
    return Ranks(
        nnodes=spec.nnodes,
        node_hosts=tuple(spec.node_hosts) or (spec.host,),
        rdzv_endpoint=spec.rdzv_endpoint,
        gpus=max(spec.gpus) + 1 if spec.gpus else 0,
    )


def rendezvous_sets(topology: Topology, address_of: Mapping[str, str]) -> list[str]:
    """``--set``s that point each learner spanning nodes at its node 0's address as the
    cluster names it (``address_of[host]``), keeping the port the topology gave (29500 if
    none): no fixed IP."""
    sets = []
    for name, spec in topology.processes.items():
        ranks = ranks_of(spec)
        if ranks.nnodes > 1:
            port = ranks.rdzv_endpoint.rpartition(":")[2] or str(_RENDEZVOUS_PORT)
            sets.append(f'processes.{name}.rdzv_endpoint="{address_of[spec.host]}:{port}"')
    return sets


def plan_hosts(topology: Topology) -> list[HostPlan]:
    """The hosts that hold processes, the one completing the run first."""
    addresses = topology_addresses(topology, "emit")
    holding: dict[str, list[str]] = {}
    for process, placed in topology.processes.items():
        holding.setdefault(placed.host, []).append(process)
        for node_host in ranks_of(placed).node_hosts[1:]:  # a torchrun node of its own there
            holding.setdefault(node_host, []).append(process)
    completes = {  # where the learner's actors run: node 0 of a learner spanning nodes
        placed.host
        for process, placed in topology.processes.items()
        if any(a.cls.completes_run and a.cls.trusted for a in topology.actors_in(process))
    }
    order = sorted(holding, key=lambda host: (host not in completes, host))
    variables: dict[str, str] = {}
    plans = []
    for index, host in enumerate(order):
        var = "ECHO2_ADDRESS_" + re.sub(r"[^A-Z0-9]", "_", host.upper())
        if var in variables:
            raise ConfigError(f"hosts {variables[var]!r} and {host!r} map to one variable {var}; rename one")
        variables[var] = host
        spec = topology.hosts[host]
        bound = sorted(
            {
                port
                for (actor, _), port in addresses.tcp_ports.items()
                if topology.actors[actor].process in holding[host]
            }
            | ({spec.join_port} if spec.join_port else set())
        )
        plans.append(
            HostPlan(
                name=host,
                index=index,
                processes=tuple(holding[host]),
                completes_run=host in completes,
                address_var=var,
                tcp_ports=tuple(bound),
                metrics_port=spec.metrics_port,
                gpus=max((ranks_of(topology.processes[p]).gpus for p in holding[host]), default=0),
            )
        )
    if not any(plan.completes_run for plan in plans):
        raise ConfigError("no host holds an actor that completes the run (a learner): nothing would end the job")
    return plans


def check_for_emit(topology: Topology) -> list[HostPlan]:
    """What can be checked away from the cluster: relations between tables and addresses
    (machine-local checks, of models, keys and ports, are each launcher's at start)."""
    check_relations(topology)
    return plan_hosts(topology)


def emit(
    topology: Topology,
    *,
    kind: EmitKind,
    source: Path,
    overrides: Sequence[str],
    out: Path,
    image: str = "echo2:latest",
) -> list[Path]:
    """Write the files that start ``topology`` on a cluster of ``kind`` into ``out``."""
    hosts = check_for_emit(topology)
    text = source.read_text(encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    if kind == "slurm":
        path = out / "echo2.sbatch"
        path.write_text(slurm_script(topology, hosts, text, overrides, source_name=source.name))
        path.chmod(0o755)
        return [path]
    path = out / f"{_dns_label(topology.run.name)}.k8s.yaml"
    documents = k8s_manifests(topology, hosts, text, overrides, image=image)
    path.write_text(_yaml_documents(documents))
    return [path]


# -- Slurm ---------------------------------------------------------------------------------


def slurm_script(
    topology: Topology, hosts: Sequence[HostPlan], text: str, overrides: Sequence[str], *, source_name: str
) -> str:
    """An sbatch script: one ``srun`` step per host (see the module docstring)."""
    run = topology.run
    marker = "ECHO2_TOPOLOGY_EOF"
    if marker in text:
        raise ConfigError(f"the topology contains the line marker {marker}; it cannot be embedded")
    sets = [f'hosts.{host.name}.address="env:{host.address_var}"' for host in hosts]
    sets += list(overrides)
    # Set in the script: node 0's name is known once the job runs.
    by_node = rendezvous_sets(topology, {h.name: f"${{{h.address_var}}}" for h in hosts})
    header = [
        "#!/bin/bash",
        f"# The echo2 run {run.name!r} ({source_name}) on Slurm: one job step per [hosts] entry,",
        "# each `python -m echo2.launch TOPOLOGY --host NAME` on a node of its own (hosts share",
        "# nodes, round robin, when the job has fewer). Written by `python -m echo2.launch",
        f"# {source_name} --emit slurm`; submit with `sbatch echo2.sbatch`.",
        "#",
        "# No shared filesystem: the topology travels in this script and sbcast copies it to",
        "# each node's local disk; each host writes its own run directory on its node",
        "# (`python -m echo2.audit DIR...` merges them once copied to one place).",
        "# Environment: ECHO2_PYTHON (a python with echo2 installed on every node, default",
        "# python3), ECHO2_WORKDIR (where the topology's relative paths resolve, on every node;",
        "# default the submit directory), ECHO2_RUN_DIR (parent of run directories, default runs).",
        f"#SBATCH --job-name={_slurm_name(run.name)}",
        f"#SBATCH --nodes={len(hosts)}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --output=echo2-%x-%j.out",
    ]
    if gpus := max(host.gpus for host in hosts):
        header.append(f"#SBATCH --gpus-per-node={gpus}")
    if run.deadline_s > 0:
        minutes = math.ceil((run.deadline_s + run.drain_timeout_s + _STOP_MARGIN_S) / 60)
        header.append(f"#SBATCH --time={minutes}")
    body = [
        "set -uo pipefail",
        'PYTHON="${ECHO2_PYTHON:-python3}"',
        'WORKDIR="${ECHO2_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}"',
        'RUN_DIR="${ECHO2_RUN_DIR:-runs}"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "# Each host's address is the name of the node it runs on (read by its launcher: env:).",
        *(f'export {h.address_var}="${{NODES[{h.index} % ${{#NODES[@]}}]}}"' for h in hosts),
        'TOPOLOGY="${TMPDIR:-/tmp}/echo2-${SLURM_JOB_ID}.toml"',
        'STAGED="$(mktemp)"',
        f"cat > \"$STAGED\" <<'{marker}'",
        text.rstrip("\n"),
        marker,
        'sbcast --force "$STAGED" "$TOPOLOGY" || { echo "echo2: sbcast failed" >&2; exit 1; }',
        'rm -f "$STAGED"',
        "SETS=(" + " ".join(f"--set {shlex.quote(value)}" for value in sets) + ")",
        *(f"SETS+=(--set {_double_quoted(value)})" for value in by_node),
        "step() {  # HOST NODE: that host's launcher, on that node, in the background",
        '  srun --overlap --nodes=1 --ntasks=1 --nodelist="$2" --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \\',
        '    --chdir="$WORKDIR" "$PYTHON" -m echo2.launch "$TOPOLOGY" --host "$1" --run-dir "$RUN_DIR" "${SETS[@]}" &',
        "}",
        "OTHERS=()",
    ]
    for host in hosts:
        body.append(f'step {shlex.quote(host.name)} "${host.address_var}"')
        body.append("PRIMARY=$!" if host.index == 0 else "OTHERS+=($!)")
    body += [
        'wait "$PRIMARY"',
        "STATUS=$?",
        "# The run is over (or its learner's host failed): hosts of samplers stop by themselves",
        "# (the PromptSource says so); SIGTERM drains any other.",
        'if ((${#OTHERS[@]})); then kill -TERM "${OTHERS[@]}" 2>/dev/null; fi',
        "wait",
        'exit "$STATUS"',
    ]
    return "\n".join([*header, "", *body]) + "\n"


def _double_quoted(text: str) -> str:
    """``text`` in bash double quotes: ``${VAR}`` expands, nothing else does."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'


def _slurm_name(name: str) -> str:
    return "echo2-" + re.sub(r"[^A-Za-z0-9_.-]", "-", name)


# -- Kubernetes ----------------------------------------------------------------------------


def k8s_manifests(
    topology: Topology, hosts: Sequence[HostPlan], text: str, overrides: Sequence[str], *, image: str
) -> list[dict[str, Any]]:
    """The ConfigMap, and per host a headless Service and a Job (see the module docstring)."""
    run = topology.run
    prefix = _dns_label(f"echo2-{run.name}")
    service = {host.name: _dns_label(f"{prefix}-{host.name}") for host in hosts}
    sets = [f'hosts.{host.name}.address="{service[host.name]}"' for host in hosts]
    sets += [f"hosts.{h.name}.metrics_port={K8S_METRICS_PORT}" for h in hosts if not h.metrics_port]
    sets += list(overrides)
    sets += rendezvous_sets(topology, service)
    labels = {"app.kubernetes.io/name": "echo2", "echo2/run": _dns_label(run.name)}
    config_map = f"{prefix}-topology"
    documents: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map, "labels": labels},
            "data": {"topology.toml": text},
        }
    ]
    grace = int(run.drain_timeout_s) + 10
    for host in hosts:
        metrics = host.metrics_port or K8S_METRICS_PORT
        ports = [(f"t{port}", port) for port in host.tcp_ports]
        ports.append(("health", metrics))
        ports += [(f"m{metrics + n}", metrics + n) for n in range(1, len(host.processes) + 1)]
        host_labels = {**labels, "echo2/host": _dns_label(host.name)}
        documents.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": service[host.name], "labels": host_labels},
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,
                    "selector": host_labels,
                    "ports": [{"name": name, "port": port, "targetPort": port} for name, port in ports],
                },
            }
        )
        args = [
            "-m", "echo2.launch", f"{K8S_TOPOLOGY_DIR}/topology.toml",
            "--host", "$(ECHO2_HOST)", "--run-dir", K8S_RUN_DIR,
        ]  # fmt: skip
        for value in sets:
            args += ["--set", value]
        container: dict[str, Any] = {
            "name": "echo2",
            "image": image,
            "command": ["python"],
            "args": args,
            "env": [
                {"name": "ECHO2_HOST", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['echo2/host']"}}}
            ],
            "ports": [{"name": name, "containerPort": port} for name, port in ports],
            "readinessProbe": {
                "httpGet": {"path": "/health/ready", "port": metrics},
                "periodSeconds": max(1, math.ceil(run.heartbeat_s)),
                "failureThreshold": 3,
            },
            "livenessProbe": {
                "httpGet": {"path": "/health/live", "port": metrics},
                "initialDelaySeconds": 30,
                "periodSeconds": 10,
                "failureThreshold": 6,
            },
            "volumeMounts": [
                {"name": "topology", "mountPath": K8S_TOPOLOGY_DIR, "readOnly": True},
                {"name": "runs", "mountPath": K8S_RUN_DIR},
            ],
        }
        cores = topology.hosts[host.name].cores
        if cores:
            container["resources"] = {"requests": {"cpu": str(cores)}}
        if host.gpus:
            container.setdefault("resources", {})["limits"] = {"nvidia.com/gpu": str(host.gpus)}
        job: dict[str, Any] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": service[host.name], "labels": host_labels},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": host_labels, "annotations": {"echo2/host": host.name}},
                    "spec": {
                        "restartPolicy": "Never",
                        "hostname": _dns_label(host.name),
                        "subdomain": service[host.name],
                        "terminationGracePeriodSeconds": grace,
                        "containers": [container],
                        "volumes": [
                            {"name": "topology", "configMap": {"name": config_map}},
                            {"name": "runs", "emptyDir": {}},
                        ],
                    },
                },
            },
        }
        if run.deadline_s > 0:
            job["spec"]["activeDeadlineSeconds"] = int(run.deadline_s + grace + _STOP_MARGIN_S)
        documents.append(job)
    return documents


def _dns_label(name: str) -> str:
    """A Kubernetes name (RFC 1123 label): lower case, digits and '-', at most 63 characters."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].strip("-")
    return label or "echo2"


def _yaml_documents(documents: Sequence[dict[str, Any]]) -> str:
    """YAML documents; each written in JSON's syntax, which YAML reads as it is (no YAML
    library needed, and strings need no YAML quoting rules)."""
    return "".join(f"---\n{json.dumps(document, indent=2)}\n" for document in documents)


__all__ = ["EMIT_KINDS", "K8S_METRICS_PORT", "EmitKind", "HostPlan", "check_for_emit", "emit", "plan_hosts"]
