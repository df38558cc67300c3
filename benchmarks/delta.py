"""Delta-coded weight versions: bytes on the wire and T_bcast, dense vs delta, on capped links.

    python benchmarks/delta.py [--size-mb 128] [--n 4] [--bw-mbps 100] [--chunk-kb 256]
                               [--fractions 0.01 0.02 0.03 0.30] [--repeats 5] [--json PATH]
    python -m benchmarks.delta --memory   # a member's RSS with delta coding off and on

Setup: the publisher (``WeightBroadcaster``, relay mode) in this process; N member
processes, broadcast.py's own (each a ``WeightReceiver`` that reports ``WeightsInstalled``
as soon as a version is complete and verified), every member's uplink and downlink and the
publisher's uplink capped at Bw. A state of ``--size-mb`` of bf16 (normal weights), and for
each changed fraction f: one dense version (the base every member installs), then the
next state, in which a fraction f of elements took a small update (x (1 + 1e-2 N(0,1)),
rounded to bf16), published dense, then delta-coded back and forth between the two
states. A member reports an install only after the rebuilt state verified against the
manifest's full-state digests, chunk by chunk: every install is digest-equal to the
learner's state. T_bcast dense is one version; T_bcast delta is the median of ``--repeats``
delta versions going back and forth between the two states (the same changes each time).

Reported per fraction: delta payload / dense bytes, T_bcast dense and delta (median of
``--repeats``), delta T_bcast / (delta bytes / Bw), encode time vs the manifest's hashing
of the same state (ratio in the same run), and the CPU seconds a member spent on a delta
version (receiving, forwarding, rebuilding and verifying the state; median over members
and versions): N members sharing C cores need at least N x that / C seconds, whatever Bw. Then a loss run: 10% of the publisher's
chunks dropped and the second member of the chain (a relay) killed right after the
delta version is published; the other members must still install it (repair).

Floors (issue 16): 1-3% changed: delta bytes <= 6% of dense; delta T_bcast <= 1.25 x
(delta bytes / Bw); digest-equal under 10% loss with a relay killed; 30% changed: delta
T_bcast never above dense (the publisher falls back to dense from 25% changed,
``DELTA_MAX_CHANGED``: ``fallback_to_dense`` in the row).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echo2.messages import Snapshot, WeightChunk
from echo2.transport import Transport
from echo2.weights import WeightBroadcaster
from echo2.weights.broadcaster import DeltaForm
from echo2.weights.chunks import flatten_tensors, make_manifest
from echo2.weights.delta import encode
from echo2.weights.link import LinkSpec

BROADCAST = Path(__file__).with_name("broadcast.py")


def bf16_states(nbytes: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(before, after) bf16 bit patterns (uint16): a fraction ``fraction`` of elements updated."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(nbytes // 2, generator=gen) * 0.02
    hit = torch.rand(len(w), generator=gen) < fraction
    w2 = w.clone()
    w2[hit] *= 1 + 1e-2 * torch.randn(int(hit.sum()), generator=gen)
    return (
        w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
        w2.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
    )


def snapshot(version: int, weights: np.ndarray) -> Snapshot:
    specs, flat = flatten_tensors({"w": weights})
    return Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=time.time())


class Bench:
    def __init__(self, n: int, bw_mbps: float, chunk: int, anchor_every: int) -> None:
        self.n = n
        self.chunk = chunk
        self.drop = 0.0
        self.rng = random.Random(0)
        self.transport = Transport()
        self.router = self.transport.router(name="bench.weights", bind=["tcp://127.0.0.1:0"])
        self.broadcaster = WeightBroadcaster(
            self.transport,
            self.router,
            mode="relay",
            chunk_bytes=chunk,
            link=LinkSpec(uplink_mbps=bw_mbps),
            member_ttl_s=30.0,
            send_timeout_s=60.0,
            fault=self._fault,
            delta_anchor_every=anchor_every,
        )
        url = self.router.endpoints[0]
        self.procs = {
            f"s{i}": subprocess.Popen(
                [sys.executable, str(BROADCAST), "--subscriber", f"s{i}", url, *self._member_args(bw_mbps, chunk)]
            )
            for i in range(n)
        }
        self.version = 0
        self.fell_back = False
        self.last_cpu_s: list[float] = []
        """CPU seconds each member spent during the last version (until all installed)."""

    @staticmethod
    def _member_args(bw_mbps: float, chunk: int) -> list[str]:
        """broadcast.py's member: uplink, downlink, chunk bytes, data plane, no shm."""
        return [str(bw_mbps), str(bw_mbps), str(chunk), "stream", "net"]

    def _fault(self, seed: str, chunk: WeightChunk) -> WeightChunk | None:
        return None if self.drop and self.rng.random() < self.drop else chunk

    async def publish(self, snap: Snapshot, delta: bool) -> tuple[float, int, float]:
        """(seconds until every member installed it, bytes the form carried, changed fraction)."""
        b = self.broadcaster
        snap, manifest = b.prepare(snap)
        form: DeltaForm | None = await asyncio.to_thread(b.prepare_delta, snap, manifest) if delta else None
        self.fell_back = delta and form is None  # the publisher chose dense (DELTA_MAX_*)
        if not delta:
            b.prepare_delta(snap, manifest)  # the next version's base, as the publisher would
        cpu = self.members_cpu_s()
        started = time.monotonic()
        b.publish_nowait(snap, manifest, form)
        async with asyncio.timeout(600):
            await b.wait_installed(snap.policy_version, self.n)
        self.last_cpu_s = [after - before for before, after in zip(cpu, self.members_cpu_s(), strict=True)]
        if form is None:
            return time.monotonic() - started, manifest.total_bytes, float("nan")
        return time.monotonic() - started, form.payload.nbytes, form.stats.changed_fraction

    def members_cpu_s(self) -> list[float]:
        """CPU seconds (user + system) each member process has used so far (Linux /proc)."""
        ticks = os.sysconf("SC_CLK_TCK")
        out = []
        for p in self.procs.values():
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / ticks)  # utime, stime
        return out

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.broadcaster.close()
        self.transport.close()


def encode_cost(before: np.ndarray, after: np.ndarray, chunk: int) -> dict[str, float]:
    """Encoding time vs hashing the same state for its manifest (same run, medians of 3)."""
    base, new = snapshot(1, before), snapshot(2, after)
    hashing, encoding = [], []
    for _ in range(3):
        t = time.perf_counter()
        make_manifest(new, chunk)
        hashing.append(time.perf_counter() - t)
        t = time.perf_counter()
        encode(new.data, base.data, new.tensors)
        encoding.append(time.perf_counter() - t)
    return {"hash_s": statistics.median(hashing), "encode_s": statistics.median(encoding)}


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def memory_run(size_mb: float, anchor_every: int, versions: int = 3) -> list[float]:
    """This process's RSS after each of ``versions`` dense versions that one member (a
    ``WeightReceiver`` in this process) installs and lets go of, publisher alongside."""
    from tests.test_weights_relay import harness

    rng = np.random.default_rng(0)
    weights = rng.integers(0, 1 << 16, int(size_mb * (1 << 19)), dtype=np.uint16)
    out = []
    async with harness(mode="relay", delta_anchor_every=anchor_every) as h:
        h.add("a").prefault_next = False  # no spare mapped in the background: RSS holds still
        await h.broadcaster.wait_members(1)
        for version in range(1, versions + 1):
            snap, manifest = h.broadcaster.prepare(snapshot(version, weights))
            h.broadcaster.publish_nowait(snap, manifest, h.broadcaster.prepare_delta(snap, manifest))
            await h.wait_complete(["a"], version)
            await h.broadcaster.wait_installed(snap.policy_version, 1)
            h.complete["a"].clear()  # installed: the member's engine would hold its own copy
            del snap
            gc.collect()
            out.append(round(rss_mib(), 1))
    return out


def base_memory(args: argparse.Namespace) -> dict[str, Any]:
    """RSS with delta coding off and on, each in a fresh process: with it on, the member
    keeps the last state as its delta base (one state more); off, it keeps none."""
    out: dict[str, Any] = {"state_mib": args.size_mb}
    for label, anchor_every in (("delta_off", 0), ("delta_on", 1_000_000)):
        code = f"import asyncio, json; from benchmarks.delta import memory_run; print(json.dumps(asyncio.run(memory_run({args.size_mb}, {anchor_every}))))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out[label] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"RSS after each version (publisher and one member, MiB): delta off {out['delta_off']}, "
        f"on {out['delta_on']} (state {args.size_mb:g} MiB)",
        file=sys.stderr,
    )
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.memory:
        return {"memory": base_memory(args), "load": os.getloadavg()[0]}
    nbytes = int(args.size_mb * (1 << 20))
    chunk = args.chunk_kb * 1024
    bw_bps = args.bw_mbps * 1e6 / 8
    bench = Bench(args.n, args.bw_mbps, chunk, anchor_every=1_000_000)
    out: dict[str, Any] = {"size_mb": args.size_mb, "n": args.n, "bw_mbps": args.bw_mbps, "chunk_kb": args.chunk_kb}
    try:
        async with asyncio.TaskGroup() as group:
            main = group.create_task(bench.broadcaster.run())
            try:
                async with asyncio.timeout(60):
                    await bench.broadcaster.wait_members(args.n)
                rows = []
                for fraction in args.fractions:
                    before, after = bf16_states(nbytes, fraction, seed=int(fraction * 1000))
                    dense_t, delta_t = [], []
                    delta_bytes, changed = 0, 0.0
                    bench.version += 1
                    await bench.publish(snapshot(bench.version, before), delta=False)  # the base
                    bench.version += 1
                    t, _, _ = await bench.publish(snapshot(bench.version, after), delta=False)
                    dense_t.append(t)
                    member_cpu, fell_back = [], False
                    for repeat in range(args.repeats):
                        # Back and forth between the two states: each a delta of the same changes.
                        bench.version += 1
                        state = before if repeat % 2 == 0 else after
                        t, delta_bytes, changed = await bench.publish(snapshot(bench.version, state), delta=True)
                        delta_t.append(t)
                        member_cpu.append(statistics.median(bench.last_cpu_s))
                        fell_back = fell_back or bench.fell_back
                    if fell_back:  # what went out was dense: its bytes and fraction from the coding
                        _, stats = encode(snapshot(0, after).data, snapshot(0, before).data, snapshot(0, after).tensors)
                        delta_bytes, changed = nbytes, stats.changed_fraction
                    cost = encode_cost(before, after, chunk)
                    row = {
                        "fallback_to_dense": fell_back,
                        "changed_fraction": changed,
                        "target_fraction": fraction,
                        "dense_bytes": nbytes,
                        "delta_bytes": delta_bytes,
                        "delta_over_dense": delta_bytes / nbytes,
                        "t_dense_s": statistics.median(dense_t),
                        "t_delta_s": statistics.median(delta_t),
                        "t_delta_each_s": delta_t,
                        "member_cpu_s": statistics.median(member_cpu),
                        "members_cpu_over_cores_s": statistics.median(member_cpu) * args.n / (os.cpu_count() or 1),
                        "delta_x_bytes_over_bw": statistics.median(delta_t) / (delta_bytes / bw_bps),
                        "dense_x_bytes_over_bw": statistics.median(dense_t) / (nbytes / bw_bps),
                        **cost,
                        "encode_over_hash": cost["encode_s"] / cost["hash_s"],
                    }
                    rows.append(row)
                    print(
                        f"f={row['changed_fraction']:.4f}: delta/dense {row['delta_over_dense']:.4f}, "
                        f"T dense {row['t_dense_s']:.2f} s, T delta {row['t_delta_s']:.3f} s "
                        f"({row['delta_x_bytes_over_bw']:.2f} x bytes/Bw), encode {cost['encode_s']:.3f} s "
                        f"({row['encode_over_hash']:.1f} x hashing); member CPU {row['member_cpu_s']:.3f} s per delta version",
                        file=sys.stderr,
                        flush=True,
                    )
                out["fractions"] = rows
                # Loss: 10% of the publisher's chunks dropped, the relay s1 killed mid-version.
                before, after = bf16_states(nbytes, 0.02, seed=7)
                bench.version += 1
                await bench.publish(snapshot(bench.version, before), delta=False)
                bench.drop = 0.10
                bench.version += 1
                snap = snapshot(bench.version, after)
                snap, manifest = bench.broadcaster.prepare(snap)
                form = bench.broadcaster.prepare_delta(snap, manifest)
                started = time.monotonic()
                bench.broadcaster.publish_nowait(snap, manifest, form)
                await asyncio.sleep(0.05)  # a benchmark, not a test: the kill lands mid-version
                bench.procs["s1"].kill()
                async with asyncio.timeout(300):
                    await bench.broadcaster.wait_installed(snap.policy_version, args.n - 1)
                installed = bench.broadcaster.installed_by(snap.policy_version)
                loss = {
                    "t_s": time.monotonic() - started,
                    "installed": installed,
                    "killed_before_install": "s1" not in installed,
                    "repair_chunks_sent": bench.broadcaster.counters["repair_chunks_sent"],
                    "delta": form is not None,
                }
                out["loss"] = loss
                print(f"loss 10% + relay s1 killed: {installed} installed in {loss['t_s']:.2f} s", file=sys.stderr)
            finally:
                main.cancel()
    finally:
        bench.close()
    out["load"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=128.0)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--bw-mbps", type=float, default=100.0)
    parser.add_argument("--chunk-kb", type=int, default=256)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.30])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="only a member's memory, delta off and on (uncapped)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
