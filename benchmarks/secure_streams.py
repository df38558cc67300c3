"""Weights under [security]: sealed versions vs plain, publish to installed, same run.

    python benchmarks/secure_streams.py [--size-mb 32] [--chunk-kb 1024] [--reps 7]
                                        [--members 1 3] [--json PATH]

Setup: two publishers (``WeightBroadcaster``) in this process, one plain and one sealed
(``sealed=True``: ``echo2.weights.seal`` and authenticated inboxes), each with its own
``--members`` subscriber processes (``WeightReceiver`` on tcp chunk streams, loopback,
uncapped; a member reports ``WeightsInstalled`` the moment its version is complete,
verified and, sealed, opened). One member is a single hop (``star``); three are a relay
chain publisher -> s0 -> s1 -> s2. Per rep the two publishers take turns (interleaved, so
load on the machine affects both alike), each publishing one fresh ``--size-mb`` version:
the clock runs from the snapshot's hand-over, through ``prepare`` (the manifest's digests,
plain; encryption and digests, sealed: the publisher's whole cost), until every member has
installed it (the members' verification and, sealed, decryption included). Figures: median
MB/s per plane and the median over reps of sealed / plain of the same rep (``x_plain``).

Also, for the record: the primitives in this process (BLAKE3 of every chunk, one thread:
what a plain manifest costs; ``seal_version`` into prefaulted memory: encrypt + digest in
2 threads; opening: AES-256-CTR decryption of every chunk, one thread).

Floor (issue 14, item 3): sealed >= 0.7 x plain.

Earlier run (2026-12-01, the TLS attempt this replaces; bytes into place, no
verification; benchmarks/results/secure-streams-2026-12-01.json): plain chunk stream 967
MB/s, mutual TLS chunk stream 194 (0.31x), plain ZeroMQ 526, CURVE ZeroMQ 241 (0.27x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from echo2.messages import PolicyVersion, Snapshot
from echo2.transport import Transport
from echo2.weights import WeightBroadcaster
from echo2.weights.chunks import digest, flatten_tensors, prefaulted_buffer
from echo2.weights.seal import opener_for, seal_version

PLANES = ("plain", "sealed")
BROADCAST = Path(__file__).with_name("broadcast.py")


# -- publisher side -------------------------------------------------------------------------


def make_snapshot(version: int, nbytes: int) -> Snapshot:
    specs, flat = flatten_tensors({"w": np.random.default_rng(version).integers(0, 255, nbytes, dtype=np.uint8)})
    return Snapshot(incarnation=1, version=version, tensors=specs, data=flat, created_at_s=time.time())


class Plane:
    """One publisher and its member processes."""

    def __init__(self, name: str, members: int, chunk_bytes: int) -> None:
        self.name, self.members, self.sealed = name, members, name == "sealed"
        self.prepare_s: list[float] = []
        self.transport = Transport()
        router = self.transport.router(name=f"{name}.weights", bind=["tcp://127.0.0.1:0"])
        self.broadcaster = WeightBroadcaster(
            self.transport,
            router,
            name=f"{name}-publisher",
            mode="star" if members == 1 else "relay",
            stripes=1,
            chunk_bytes=chunk_bytes,
            member_ttl_s=60.0,
            send_timeout_s=60.0,
            sealed=self.sealed,
        )
        self.procs = [
            subprocess.Popen(
                # broadcast.py's member process: uncapped, tcp chunk streams, no shared memory
                [
                    sys.executable,
                    str(BROADCAST),
                    "--subscriber",
                    f"s{i}",
                    router.endpoints[0],
                    "0",
                    "0",
                    str(chunk_bytes),
                    "stream",
                    "net",
                    name,
                ]
            )
            for i in range(members)
        ]

    async def publish(self, snap: Snapshot) -> float:
        """Seconds from hand-over to every member installed (``prepare_s`` records the
        publisher's share)."""
        start = time.perf_counter()
        travelling, manifest = await asyncio.to_thread(self.broadcaster.prepare, snap)
        self.prepare_s.append(time.perf_counter() - start)
        self.broadcaster.publish_nowait(travelling, manifest)
        async with asyncio.timeout(300):
            await self.broadcaster.wait_installed(PolicyVersion(snap.incarnation, snap.version), self.members)
        return time.perf_counter() - start

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.broadcaster.close()
        self.transport.close()


async def measure(members: int, nbytes: int, chunk_bytes: int, reps: int, settle_s: float = 0.3) -> dict[str, Any]:
    planes = [Plane(name, members, chunk_bytes) for name in PLANES]
    times: dict[str, list[float]] = {name: [] for name in PLANES}
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(p.broadcaster.run()) for p in planes]
            try:
                for plane in planes:
                    async with asyncio.timeout(60):
                        await plane.broadcaster.wait_members(members)
                version = 0
                for rep in range(reps + 1):  # rep 0 warms up: connections, spare buffers
                    version += 1
                    order = planes if rep % 2 == 0 else planes[::-1]
                    for plane in order:
                        snap = make_snapshot(version, nbytes)
                        # Settle: members prefault the next version's memory after each
                        # install (both planes do); let that finish rather than charge it
                        # to whichever plane publishes next on these shared cores.
                        await asyncio.sleep(settle_s)
                        elapsed = await plane.publish(snap)
                        if rep > 0:
                            times[plane.name].append(elapsed)
                stats = {p.name: p.broadcaster.statistics() for p in planes}
            finally:
                for task in tasks:
                    task.cancel()
    finally:
        for plane in planes:
            plane.close()
    rates = {name: [nbytes / t for t in ts] for name, ts in times.items()}
    ratios = [s / p for s, p in zip(rates["sealed"], rates["plain"], strict=True)]
    result = {
        "members": members,
        "bytes_per_s": {name: [round(r) for r in rs] for name, rs in rates.items()},
        "median_mb_per_s": {name: round(statistics.median(rs) / 1e6, 1) for name, rs in rates.items()},
        "x_plain": round(statistics.median(ratios), 3),
        "x_plain_per_rep": [round(r, 3) for r in ratios],
        # Less sensitive to one rep hit by load: all plain time over all sealed time.
        "x_plain_total": round(sum(times["plain"]) / sum(times["sealed"]), 3),
        "repair_chunks_sent": {name: s["repair_chunks_sent"] for name, s in stats.items()},
        "median_prepare_ms": {p.name: round(statistics.median(p.prepare_s[1:]) * 1e3, 1) for p in planes},
    }
    print(
        f"members={members}: plain {result['median_mb_per_s']['plain']} MB/s,"
        f" sealed {result['median_mb_per_s']['sealed']} MB/s, x_plain {result['x_plain']}"
        f" (total {result['x_plain_total']})"
        f" (prepare ms {result['median_prepare_ms']})"
        f" (per rep {', '.join(f'{r:.2f}' for r in ratios)})",
        file=sys.stderr,
        flush=True,
    )
    return result


def primitives(nbytes: int, chunk_bytes: int, reps: int = 5) -> dict[str, float]:
    snap = make_snapshot(0, nbytes)
    seal_s, open_s = [], []
    plaintext = np.empty(nbytes, dtype=np.uint8)
    for _ in range(reps):
        out = prefaulted_buffer(nbytes)  # as the broadcaster's spare
        start = time.perf_counter()
        sealed, manifest = seal_version(snap, chunk_bytes, out=out)
        seal_s.append(time.perf_counter() - start)
        opener = opener_for(manifest)
        assert opener is not None
        start = time.perf_counter()
        for i, at in enumerate(range(0, nbytes, chunk_bytes)):
            opener(i, sealed.data[at : at + chunk_bytes], plaintext[at : at + chunk_bytes])
        open_s.append(time.perf_counter() - start)
    assert np.array_equal(plaintext, snap.data)
    hash_s = []
    for _ in range(reps):
        start = time.perf_counter()
        for at in range(0, nbytes, chunk_bytes):
            digest(snap.data[at : at + chunk_bytes])
        hash_s.append(time.perf_counter() - start)
    return {
        "digest_only_gb_per_s": round(nbytes / statistics.median(hash_s) / 1e9, 2),
        "seal_and_digest_gb_per_s": round(nbytes / statistics.median(seal_s) / 1e9, 2),
        "open_gb_per_s": round(nbytes / statistics.median(open_s) / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--chunk-kb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--members", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args()
    nbytes, chunk_bytes = args.size_mb << 20, args.chunk_kb << 10
    out: dict[str, Any] = {"size_mb": args.size_mb, "chunk_kb": args.chunk_kb, "reps": args.reps}
    out["primitives"] = primitives(nbytes, chunk_bytes)
    print(f"primitives: {out['primitives']}", file=sys.stderr, flush=True)
    out["runs"] = [asyncio.run(measure(m, nbytes, chunk_bytes, args.reps)) for m in args.members]
    out["earlier_tls_attempt_2026_12_01"] = {
        "note": "bytes into place, no verification; secure-streams-2026-12-01.json",
        "median_mb_per_s": {"plain_stream": 967.0, "tls_stream": 193.6, "zmq": 526.3, "curve_zmq": 241.2},
        "x_plain": {"tls_stream": 0.308, "curve_zmq": 0.267},
    }
    text = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
