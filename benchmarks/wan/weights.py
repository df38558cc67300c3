"""The weight path alone across the WAN test bed: a publisher and three members, no training.

    python -m benchmarks.wan.weights [--seconds 40] [--mbytes 25] [--interval 2] [--mode relay]
                                     [--conditions NAME...] [--json PATH]

The job (``python -m benchmarks.wan``) measures the weight path with a learner and three
samplers competing for the machine's cores; this measures what the path itself does on
the same links, with nothing else running: ``WeightBroadcaster`` in the learner's
namespace publishes a version of ``--mbytes`` (random bytes, every byte new each time)
every ``--interval`` seconds, and a ``WeightReceiver`` in each edge's namespace reports
every version it completes. Per condition and edge: versions completed of those
published, weight goodput (version bytes over publication to complete and verified, median;
and over its manifest's arrival to complete), bytes received on the link against the
versions' bytes, repair bytes against the bytes missing, the stream counts the lanes
settled on, and the relay's CPU seconds. Conditions are ``benchmarks.wan``'s link shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.wan.bench import CONDITIONS, LEARNER_HOST, TOPOLOGY, bed_hosts
from benchmarks.wan.netbed import Bed, available

PORT = 28190  # the publisher's control channel (learner host); members' inboxes at 28290


def _cpu() -> dict[str, float]:
    """This process's CPU seconds, and seconds it was runnable but waited for a core
    (/proc/self/schedstat): how much the machine's other work held it back."""
    try:
        run_ns, wait_ns, _ = (int(x) for x in Path("/proc/self/schedstat").read_text().split())
    except (OSError, ValueError):
        return {"cpu_s": round(time.process_time(), 2)}
    return {"cpu_s": round(run_ns / 1e9, 2), "waited_for_cpu_s": round(wait_ns / 1e9, 2)}


def _snapshot(version: int, nbytes: int) -> Any:
    from echo2.messages import Snapshot
    from echo2.weights.chunks import flatten_tensors

    rng = np.random.default_rng(version)
    specs, flat = flatten_tensors({"w": rng.integers(0, 255, nbytes, dtype=np.uint8)})
    return Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=time.time())


async def publisher(address: str, members: int, seconds: float, interval: float, nbytes: int, mode: str) -> None:
    from echo2.transport import Transport
    from echo2.weights import WeightBroadcaster

    transport = Transport()
    router = transport.router(name="pub.weights", bind=[f"tcp://*:{PORT}"])
    broadcaster = WeightBroadcaster(transport, router, mode=mode, member_ttl_s=10.0)
    published = []
    try:
        async with asyncio.TaskGroup() as group:
            task = group.create_task(broadcaster.run())
            await broadcaster.wait_members(members)
            started = time.monotonic()
            version = 0
            while time.monotonic() - started < seconds:
                version += 1
                snapshot = _snapshot(version, nbytes)
                prepared, manifest = await asyncio.to_thread(broadcaster.prepare, snapshot)
                broadcaster.publish_nowait(prepared, manifest)
                published.append({"version": version, "unix_s": time.time(), "chunk_bytes": manifest.chunk_bytes})
                await asyncio.sleep(max(0.0, started + version * interval - time.monotonic()))
            await asyncio.sleep(interval)  # the last version's stragglers
            print(json.dumps({"published": published, "stats": broadcaster.statistics(), "cpu": _cpu(),
                              "streams": {n: broadcaster.streams_to(n) for n in broadcaster.members()}}),
                  flush=True)  # fmt: skip
            task.cancel()
    finally:
        broadcaster.close()
        transport.close()


async def member(name: str, publisher_host: str, host: str, seconds: float) -> None:
    from echo2.transport import Transport
    from echo2.weights import WeightReceiver

    transport = Transport()
    control = transport.dealer(
        name=f"{name}.weights", connect=[f"tcp://{publisher_host}:{PORT}"], identity=name.encode()
    )
    completed: list[dict[str, Any]] = []

    def done(assembler: Any) -> None:
        completed.append({"version": assembler.key.version})
        asyncio.get_running_loop().create_task(report(assembler.key))

    async def report(key: Any) -> None:
        message = await receiver.report_installed(key, 0.0)
        completed[-1].update(received_s=message.received_s, complete_unix_s=message.complete_time_s)

    receiver = WeightReceiver(
        transport, control, name=name, on_complete=done, finish_within=3, relay_bind="tcp://*:28290",
        relay_announce=f"tcp://{host}:28290",
    )  # fmt: skip
    receiver.open()
    try:
        async with asyncio.TaskGroup() as group:
            task = group.create_task(receiver.run())
            await asyncio.sleep(seconds)
            print(json.dumps({"completed": completed, "stats": receiver.statistics(), "cpu": _cpu()}), flush=True)
            task.cancel()
    finally:
        receiver.close()
        transport.close()


def run_condition(
    name: str, seconds: float, interval: float, nbytes: int, mode: str, sysctls: dict[str, str] | None = None
) -> dict[str, Any]:
    condition = CONDITIONS[name]
    hosts = bed_hosts(TOPOLOGY, condition.edge)
    edges = [h for h in hosts if h != LEARNER_HOST]
    with Bed(hosts, congestion_control=condition.congestion_control, seed=len(name), sysctls=sysctls) as bed:
        link_before = bed.link_bytes()
        bed.relay_counters()
        cpu_before = float(bed.relay_cpu.get("cpu_s", 0.0))
        here = [sys.executable, "-m", "benchmarks.wan.weights"]
        pub_host = bed.hosts[LEARNER_HOST].address
        procs = {LEARNER_HOST: bed.popen(LEARNER_HOST, [*here, "publisher", pub_host, str(len(edges)), str(seconds),
                                                        str(interval), str(nbytes), mode], stdout=subprocess.PIPE, text=True)}  # fmt: skip
        for edge in edges:
            member_s = seconds + 30.0
            procs[edge] = bed.popen(edge, [*here, "member", f"sampler-{edge.removeprefix('edge-')}", pub_host,
                                           bed.hosts[edge].address, str(member_s)], stdout=subprocess.PIPE, text=True)  # fmt: skip
        outputs = {
            host: json.loads(proc.communicate(timeout=seconds + 120)[0].splitlines()[-1])
            for host, proc in procs.items()
        }
        link_after = bed.link_bytes()
        bed.relay_counters()
        relay_cpu_s = float(bed.relay_cpu.get("cpu_s", 0.0)) - cpu_before
    published = {p["version"]: p["unix_s"] for p in outputs[LEARNER_HOST]["published"]}
    rows = {}
    for edge in edges:
        out = outputs[edge]
        done = [c for c in out["completed"] if c["version"] in published and c.get("complete_unix_s")]
        latency = [c["complete_unix_s"] - published[c["version"]] for c in done]
        stats = out["stats"]
        rows[edge] = {
            "completed": len(done),
            "completed_fraction": round(len(done) / len(published), 3),
            "goodput_mbit_median": _round(statistics.median([nbytes * 8 / t / 1e6 for t in latency if t > 0]) if latency else None),
            "arrival_goodput_mbit_median": _round(statistics.median([nbytes * 8 / c["received_s"] / 1e6 for c in done if c.get("received_s")]) if done else None),
            "complete_latency_s_median": _round(statistics.median(latency) if latency else None),
            "link_rx_over_version_bytes": round((link_after[edge]["rx_bytes"] - link_before[edge]["rx_bytes"]) / (nbytes * len(published)), 3),
            "missing_mbytes": round(stats["repair_missing_bytes"] / 1e6, 2),
            "versions_finished": stats["versions_finished"],
            "versions_abandoned": stats["versions_abandoned"],
        }  # fmt: skip
    pub = outputs[LEARNER_HOST]["stats"]
    missing = sum(outputs[e]["stats"]["repair_missing_bytes"] for e in edges)
    return {
        "published": len(published),
        "chunk_bytes": sorted({p["chunk_bytes"] for p in outputs[LEARNER_HOST]["published"]}),
        "members": rows,
        "streams": outputs[LEARNER_HOST]["streams"],
        "repair_over_missing": round(pub["repair_bytes_sent"] / missing, 3) if missing else None,
        "repair_mbytes_sent": round(pub["repair_bytes_sent"] / 1e6, 2),
        "relay_cpu_s": round(relay_cpu_s, 2),
        "cpu": {host: out["cpu"] for host, out in outputs.items()},
        "publisher_counters": {k: v for k, v in pub.items() if isinstance(v, int | float) and v},
        "member_counters": {e: {k: v for k, v in outputs[e]["stats"].items() if v} for e in edges},
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["publisher"]:
        host, members, seconds, interval, nbytes, mode = args[1:]
        asyncio.run(publisher(host, int(members), float(seconds), float(interval), int(nbytes), mode))
        return 0
    if args[:1] == ["member"]:
        name, publisher_host, host, seconds = args[1:]
        asyncio.run(member(name, publisher_host, host, float(seconds)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.weights", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="seconds of publication per condition")
    parser.add_argument("--mbytes", type=float, default=25.0, help="megabytes (10^6) per version")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two publications")
    parser.add_argument("--mode", default="relay", help="relay plan: star, relay or striped")
    parser.add_argument("--conditions", nargs="+", default=["wan50", "wan200-reno", "wan200-bbr"])
    parser.add_argument("--json", type=Path, help="results file (default: print only)")
    parser.add_argument(
        "--sysctl", action="append", default=[], metavar="KEY=VALUE",
        help="set in every host namespace, e.g. net.ipv4.tcp_slow_start_after_idle=0 (the hosts' tuning)",
    )  # fmt: skip
    parsed = parser.parse_args(args)
    if (why := available()) is not None:
        print(f"benchmarks.wan.weights: {why}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    results = {}
    for name in parsed.conditions:
        print(f"benchmarks.wan.weights: {name} ...", file=sys.stderr, flush=True)
        sysctls = dict(item.split("=", 1) for item in parsed.sysctl)
        results[name] = run_condition(
            name, parsed.seconds, parsed.interval, int(parsed.mbytes * 1e6), parsed.mode, sysctls
        )
        print(json.dumps({name: results[name]}), flush=True)
    document = {"seconds": parsed.seconds, "mbytes": parsed.mbytes, "interval_s": parsed.interval, "mode": parsed.mode,
                "sysctls": parsed.sysctl,
                "load_average_before": [round(x, 2) for x in load], "conditions": results}  # fmt: skip
    if parsed.json:
        parsed.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
