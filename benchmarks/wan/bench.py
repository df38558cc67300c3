"""``python -m benchmarks.wan``: the main job across 4 hosts under WAN conditions, side by side.

    python -m benchmarks.wan [--seconds 60] [--conditions NAME...] [--no-validate] [--json PATH]
                             [--set KEY=VALUE ...]

Needs root (network namespaces). Hosts and addresses come from ``examples/multihost.toml``:
the learner host and three edges with one sampler each. The learner's link is never
shaped; each edge's link gets the condition's rate cap, one-way delay (so an edge's RTT to
the learner is twice its delay; edge to edge, four times) and loss (per frame, each
direction). Conditions (the issue 13 floors refer to them):

  unshaped      no cap, no delay, no loss
  wan50         100 Mbit/s, 50 ms RTT, 0.1% loss, reno (loss-based like cubic)
  wan200-reno   100 Mbit/s, 200 ms RTT, 1% loss, reno
  wan200-bbr    the same with bbr
  *-25mb        unshaped, wan50, wan200-reno, wan200-bbr with 25 MB versions (``large_model_dir``)
  outage        wan50 with edge-b's link down for 12 s, from 30% of --seconds after the first step
  kill          wan50 with edge-c's sampler process killed (SIGKILL) at 30%; its launcher restarts it

Every condition trains for ``--seconds`` (the learner's ``max_wall_s``). Before them, the
emulator is validated per link shape (UDP RTT and loss, TCP goodput under the cap). Per
condition it reports: learner idle fraction and what the capacity model predicts for the
measured T_bcast; versions installed per sampler against those published; each edge's
weight goodput (version bytes over publication to complete and verified at the edge,
median; ``arrival_goodput``: from the manifest's arrival) and link bytes;
relay drops; repair counters (the publisher's repair bytes against the bytes missing when
first requested, summed over samplers); every launcher's exit code and seconds after the
learner finished (its ``summary.json`` written; None: had not exited ``exit_grace_s`` after
the learner host's launcher, then SIGTERM); the outage's recovery (seconds from the link's
return, or from the kill, to the edge's first group accepted by the Buffer and first
trained); the audit. Results go to ``benchmarks/results/wan-<date>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import struct
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks.wan.job import JobResult, Outage, median, run_job
from benchmarks.wan.netbed import REPO_ROOT, Bed, LinkShape, available
from benchmarks.wan.probe import validate
from echo2.capacity.model import predicted_bubble_ratio
from echo2.rundir import RunDir

TOPOLOGY = REPO_ROOT / "examples" / "multihost.toml"
LEARNER_HOST = "learner"
_WAN50 = LinkShape(rate_mbit=100, delay_ms=25, loss=0.001)
_WAN200 = LinkShape(rate_mbit=100, delay_ms=100, loss=0.01)


LARGE_MODEL_BYTES = 25_000_000
"""Bytes per version of the large-model conditions (``large_model_dir``)."""


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    edge: LinkShape
    congestion_control: str = ""
    outage: Outage | None = None
    large_model: bool = False
    """Versions of at least ``LARGE_MODEL_BYTES`` (``large_model_dir``) instead of 3.2 MB."""


CONDITIONS = {
    c.name: c
    for c in (
        Condition("unshaped", LinkShape()),
        Condition("wan50", _WAN50, "reno"),
        Condition("wan200-reno", _WAN200, "reno"),
        Condition("wan200-bbr", _WAN200, "bbr"),
        Condition("unshaped-25mb", LinkShape(), large_model=True),
        Condition("wan50-25mb", _WAN50, "reno", large_model=True),
        Condition("wan200-reno-25mb", _WAN200, "reno", large_model=True),
        Condition("wan200-bbr-25mb", _WAN200, "bbr", large_model=True),
        Condition("outage", _WAN50, "reno", Outage("edge-b", after_s=0.3, duration_s=12.0)),
        Condition("kill", _WAN50, "reno", Outage("edge-c", after_s=0.3, kind="kill")),
    )
}


def large_model_dir(work: Path) -> Path:
    """The warm-started tiny model with its position table extended until a version is
    ``LARGE_MODEL_BYTES`` (made once per benchmark run, read by every host).

    Two cores cannot train a 25 MB transformer fast enough for a minute's run to publish
    more than a handful of versions; this model trains exactly like the tiny one (the extra
    positions are never looked up, so a step costs the same and the task still learns),
    while every version carries 25 MB that all change each step (AdamW's weight decay
    moves every parameter), as a larger model's would."""
    directory = work / "model-25mb"
    if not (directory / "config.json").exists():
        import torch

        from echo2.models import default_checkpoint_dir
        from echo2.models.tiny import TinyTransformer

        base = TinyTransformer.load(default_checkpoint_dir())
        others = sum(p.numel() for name, p in base.named_parameters() if name != "pos_emb.weight")
        rows = -(-(LARGE_MODEL_BYTES // 4 - others) // base.config.d_model)
        large = TinyTransformer(dataclasses.replace(base.config, max_seq_len=max(rows, base.config.max_seq_len)))
        with torch.no_grad():
            state = base.state_dict()
            table = large.pos_emb.weight
            table.zero_()
            table[: base.config.max_seq_len] = state.pop("pos_emb.weight")
            large.load_state_dict({**state, "pos_emb.weight": table}, strict=True)
        large.save(directory)
    return directory


def bed_hosts(topology: Path, edge: LinkShape, names: list[str] | None = None) -> dict[str, tuple[str, LinkShape]]:
    """The topology's hosts (``names`` of them, default all) with their addresses and links."""
    hosts = tomllib.loads(topology.read_text())["hosts"]
    return {
        name: (hosts[name]["address"], LinkShape() if name == LEARNER_HOST else edge) for name in (names or list(hosts))
    }


def job_overrides(seconds: float) -> list[str]:
    return [
        "actors.learner.config.max_steps=1000000",
        f"actors.learner.config.max_wall_s={seconds}",
        "actors.learner.config.eval_every=0",
        "actors.learner.config.eval_prompts=100",
        "actors.learner.config.checkpoint_every=0",
        f"run.deadline_s={seconds + 120}",
    ]


def _version_bytes(result: JobResult) -> int:
    """Bytes of one weight version: the tensors of the learner's final checkpoint."""
    for checkpoint in reversed(RunDir(result.run_dirs[LEARNER_HOST]).checkpoint_dirs()):
        path = checkpoint / "model.safetensors"
        if path.exists():
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            return sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return max((int(b["bytes"]) for b in result.broadcasts), default=0)


def analyse(result: JobResult) -> dict[str, Any]:
    s = result.summary
    kappa = int(s.get("kappa", 1) or 1)
    steps = int(s.get("steps", 0))
    published = list(range(kappa, steps + 1, kappa))
    version_bytes = _version_bytes(result)
    per_sampler = {}
    for sampler, versions in sorted(result.installs.items()):
        latencies = [
            t - result.step_unix_s[v] for v, t in result.install_times.get(sampler, []) if v in result.step_unix_s
        ]
        arrivals = [(v, r, c) for v, r, c in result.arrivals.get(sampler, []) if v in result.step_unix_s and c > 0]
        # Publication (the learner's step) to the version complete and verified at the edge:
        # its whole weight path, without the wait for the sampler's generation batch to end.
        complete = [c - result.step_unix_s[v] for v, _, c in arrivals]
        installed = sorted({v for v in versions if v > 0})
        per_sampler[sampler] = {
            "installed": len(installed),
            "installed_fraction": round(len(installed) / len(published), 3) if published else None,
            "install_latency_s_median": _round(median(latencies)),
            "complete_latency_s_median": _round(median(complete)),
            "weight_goodput_mbit_median": _round(median([version_bytes * 8 / t / 1e6 for t in complete if t > 0])),
            # From the version's manifest reaching the edge to complete: the transfer alone.
            "arrival_goodput_mbit_median": _round(
                median([version_bytes * 8 / r / 1e6 for _, r, _ in arrivals if r > 0])
            ),
        }
    t_bcast = [float(b["t_bcast_s"]) for b in result.broadcasts if b.get("t_bcast_s") is not None]
    t_train = float(s.get("train_s_mean", 0.0))
    # The pool's capacity: each sampler's rollouts per second of generating (the scheduler's
    # mu_i), summed; rollouts delivered per second of the run would only measure demand.
    mu_pool = sum(
        float(st["samples_generated"]) / float(st["generate_s"])
        for st in result.stats.values()
        if st.get("type") == "SamplerStats" and float(st.get("generate_s", 0.0)) > 0
    )
    predicted = None
    if t_bcast and t_train > 0 and mu_pool > 0:
        predicted = predicted_bubble_ratio(
            R=_group_size() * _groups_per_step(),
            T_train_s=t_train,
            T_bcast_s=median(t_bcast) or 0.0,
            kappa=kappa,
            mu_pool=mu_pool,
        )
    publisher = result.stats.get("weight_publisher", {})
    samplers = [st for st in result.stats.values() if st.get("type") == "SamplerStats"]
    missing = sum(int(st.get("weight_missing_bytes", 0)) for st in samplers)
    repaired = int(publisher.get("repair_bytes_sent", 0))
    requested_received = sum(int(st.get("weight_requested_bytes_received", 0)) for st in samplers)
    return {
        "steps": steps,
        "stopped_by": s.get("stopped_by"),
        "learner_idle_fraction": s.get("learner_idle_fraction"),
        "predicted_idle_fraction": _round(predicted),
        "t_train_s_mean": t_train,
        "t_bcast_s_median": _round(median(t_bcast)),
        "t_bcast_recorded_versions": len(t_bcast),
        "versions_published": len(published),
        "version_bytes": version_bytes,
        "mu_pool_rollouts_per_s": round(mu_pool, 1),
        "samplers": per_sampler,
        "link_mbytes": {h: {k: round(v / 1e6, 2) for k, v in b.items()} for h, b in result.link_bytes.items()},
        "link_rx_mbit_mean": {
            h: round(b["rx_bytes"] * 8 / result.wall_s / 1e6, 2) for h, b in result.link_bytes.items()
        },
        "relay_drops": {h: {k: v for k, v in c.items() if k.endswith("drops") and v} for h, c in result.relay.items()},
        # The emulator's own cost, on the cores the job runs on (real-time: it preempts the job).
        "relay_cpu_s": result.relay_cpu_s,
        "relay_realtime": result.relay_realtime,
        "weight_path": {a: _weight_counters(st) for a, st in sorted(result.stats.items())},
        "repair_mbytes_sent": round(int(publisher.get("repair_bytes_sent", 0)) / 1e6, 2),
        # The floor (issue 13): repair bytes <= 1.2x the bytes missing when first requested.
        "missing_mbytes": round(missing / 1e6, 2),
        "repair_over_missing": round(repaired / missing, 3) if missing else None,
        # Bytes that reached the samplers, by any path, for chunks they had requested: above
        # the repair bytes when a predecessor's stream delivered a requested chunk too.
        "requested_mbytes_received": round(requested_received / 1e6, 2),
        "exit_codes": result.exit_codes,
        "exit_after_learner_s": result.exit_after_learner_s,
        "outage": _recovery(result),
        "audit_exit": result.audit["exit_code"],
        "audit_lost": len(result.audit["report"].get("lost", [])),
        "audit_duplicated": len(result.audit["report"].get("duplicated", [])),
        "audit_without_ledger": result.audit["without_ledger"],
        "wall_s": result.wall_s,
    }


_COUNTERS = (
    "installs", "weight_repair_requests", "weight_chunks_forwarded", "published", "superseded",
    "repair_requests", "repair_chunks_sent", "send_failures", "members_expired", "stream_bytes",
    "weight_missing_bytes", "weight_repair_bytes_requested", "weight_requested_bytes_received", "weight_stream_bytes",
    "weight_forward_failures", "weight_versions_finished", "weight_versions_abandoned",
    "repair_bytes_sent", "repair_duplicates_dropped", "dialed_streams", "max_streams",
)  # fmt: skip


def _weight_counters(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: stats[k] for k in _COUNTERS if k in stats}


def _recovery(result: JobResult) -> dict[str, Any] | None:
    """For an outage or a kill: when the edge's sampler delivered and got trained again after it."""
    if result.outage is None:
        return None
    host, up = str(result.outage["host"]), float(result.outage["up_unix_s"])
    sampler = f"sampler-{host.removeprefix('edge-')}"
    after = sorted(float(e["t"]) for e in result.accepted if e.get("sampler") == sampler and float(e["t"]) > up)
    tasks = {e["task"] for e in result.accepted if e.get("sampler") == sampler and float(e["t"]) > up}
    trained = sorted(float(e["t"]) for e in result.trained if e["task"] in tasks)
    return {
        "host": host,
        "kind": result.outage["kind"],
        "sampler": sampler,
        "down_s": round(up - float(result.outage["down_unix_s"]), 1),
        "first_accepted_after_up_s": _round(after[0] - up) if after else None,
        "first_trained_after_up_s": _round(trained[0] - up) if trained else None,
        "groups_accepted_after_up": len(after),
    }


def _job_value(key: str) -> int:
    return int(tomllib.loads(TOPOLOGY.read_text())["job"][key])


def _group_size() -> int:
    return _job_value("group_size")


def _groups_per_step() -> int:
    return _job_value("groups_per_step")


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def run_condition(
    condition: Condition, seconds: float, out_dir: Path, *, probe: bool, extra: list[str] | None = None
) -> dict[str, Any]:
    hosts = bed_hosts(TOPOLOGY, condition.edge)
    overrides = [*job_overrides(seconds), *(extra or [])]
    if condition.large_model:
        overrides.append(f'job.model="{large_model_dir(out_dir)}"')
    outage = condition.outage
    if outage is not None:  # after_s is a fraction of the training time here
        outage = dataclasses.replace(outage, after_s=outage.after_s * seconds)
    with Bed(hosts, congestion_control=condition.congestion_control, seed=len(condition.name)) as bed:
        validation = validate(bed, LEARNER_HOST, "edge-a", pings=2000, gap_ms=1.0) if probe else None
        result = run_job(
            bed,
            TOPOLOGY,
            out_dir / condition.name,
            learner_host=LEARNER_HOST,
            overrides=overrides,
            outage=outage,
            timeout_s=seconds + 240,
        )
    return {"condition": dataclasses.asdict(condition), "validation": validation, "result": result}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'condition':<16} {'steps':>5} {'idle':>6} {'pred':>6} {'T_bcast':>7} {'pub':>4} "
        f"{'installed a/b/c':>16} {'back acc/trained s':>18} {'goodput Mbit/s a/b/c':>22} {'exit after learner s':>24} {'audit':>5} {'repair/missing MB':>17}"
    ]
    for name, r in rows.items():
        samplers = r["samplers"]
        inst = "/".join(str(samplers.get(f"sampler-{e}", {}).get("installed", 0)) for e in "abc")
        good = "/".join(_fmt(samplers.get(f"sampler-{e}", {}).get("weight_goodput_mbit_median")) for e in "abc")
        exits = "/".join(
            f"{r['exit_codes'].get(h)}@{_fmt(r['exit_after_learner_s'].get(h))}"
            for h in ("learner", "edge-a", "edge-b", "edge-c")
        )
        back = "-"
        if r["outage"]:
            back = f"{_fmt(r['outage']['first_accepted_after_up_s'])}/{_fmt(r['outage']['first_trained_after_up_s'])}"
        lines.append(
            f"{name:<16} {r['steps']:>5} {_fmt(r['learner_idle_fraction']):>6} {_fmt(r['predicted_idle_fraction']):>6} "
            f"{_fmt(r['t_bcast_s_median']):>7} {r['versions_published']:>4} {inst:>16} {back:>18} {good:>22} {exits:>24} {r['audit_exit']:>5} "
            f"{_fmt(r['repair_mbytes_sent']) + '/' + _fmt(r['missing_mbytes']):>17}"
        )
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training seconds per condition")
    parser.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=list(CONDITIONS))
    parser.add_argument("--no-validate", action="store_true", help="skip the emulator's RTT/loss/goodput probes")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/wan-<date>.json)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/echo2-wan"), help="run directories")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a topology override for every condition (as echo2.launch --set), e.g. actors.weight_publisher.config.mode='\"star\"'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if (why := available()) is not None:
        print(f"benchmarks.wan: {why}", file=sys.stderr)
        return 2
    work = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    raw: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in args.conditions:
        print(f"benchmarks.wan: {name} ...", file=sys.stderr, flush=True)
        load_before = os.getloadavg()
        raw[name] = run_condition(CONDITIONS[name], args.seconds, work, probe=not args.no_validate, extra=args.set)
        rows[name] = analyse(raw[name]["result"])
        # The machine is shared: what else ran beside the condition (1-minute averages).
        rows[name]["load_average_1m"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
        if raw[name]["validation"] is not None:
            print(f"  emulator: {json.dumps(raw[name]['validation'])}", file=sys.stderr)
        print(f"  {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    print(table(rows))
    out = args.json or REPO_ROOT / "benchmarks" / "results" / f"wan-{time.strftime('%Y-%m-%d')}.json"
    document = {
        "seconds": args.seconds,
        "overrides": args.set,
        "work_dir": str(work),
        "conditions": {
            name: {"condition": raw[name]["condition"], "validation": raw[name]["validation"], **rows[name]}
            for name in rows
        },
    }
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"benchmarks.wan: results in {out}", file=sys.stderr)
    return 0
