"""Weight broadcast: T_bcast of star, relay and striped relay, capped and uncapped, vs gloo.

    python benchmarks/broadcast.py [--size-mb 64] [--n 1 2 4 8] [--bw-mbps 200]
                                   [--modes star relay striped]
                                   [--regimes uncapped b0=bw b0=2bw] [--json PATH] [--no-gloo]

Setup: the publisher (``WeightBroadcaster``) runs in this process with its ``weights``
ROUTER on tcp 127.0.0.1; N subscriber processes each run a ``WeightReceiver`` (relay inbox
on tcp too) and report ``WeightsInstalled`` the moment a version is complete and verified
(no engine: install time 0). T_bcast is the publisher's: from publication until
ceil(N / 1.1) subscribers installed. For each regime and N the subscribers are started
once and every mode publishes one fresh snapshot of ``--size-mb`` (a new version each).

Regimes: ``uncapped``; ``b0=bw``: every subscriber's uplink and downlink capped at Bw and
the publisher's uplink B0 = Bw; ``b0=2bw``: B0 = 2 Bw. The caps are the application-level
token buckets of ``echo2.weights.link`` and apply to every byte on the weight path.

Also measured in the same run: raw TCP loopback bandwidth (two threads, plain sockets,
``sendall``/``recv_into``), twice: once cache-hot (one 1 MB buffer sent over and over, the
kernel's best case) and, uncapped at N = 1, once right before every measured version,
moving that version's bytes into a pre-mapped buffer of the same size (paired: each
transfer is compared with raw TCP under the same load, and the median of the per-version
ratios is the figure); and, uncapped, ``torch.distributed.broadcast`` over gloo of the
same bytes to N ranks (N + 1 processes, tcp init on 127.0.0.1).

Receivers' relay inboxes are chunk streams (``--data-plane stream``, the default over tcp:
bytes land straight in the assembly buffer) or ZeroMQ PULL sockets (``--data-plane zmq``).
Shared memory is off unless ``--shm`` (then, uncapped, every subscriber maps each version
from ``/dev/shm`` and nothing crosses TCP; paired raw TCP is still reported beside it).

Floors (issue 'weight dissemination'): capped b0=bw, N=8: relay <= 1.25 x G/Bw, star
>= 6 x G/Bw; uncapped N=1 (relay) >= 0.5 x raw TCP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from echo2.messages import Snapshot
from echo2.transport import Transport
from echo2.weights import DATA_PLANES, WeightBroadcaster, WeightReceiver
from echo2.weights.chunks import (
    DEFAULT_DIGEST,
    SnapshotAssembler,
    flatten_tensors,
    make_manifest,
    prefaulted_buffer,
)
from echo2.weights.link import LinkSpec
from echo2.weights.shm import default_shm_dir

MODES = ("star", "relay", "striped")
REGIMES = ("uncapped", "b0=bw", "b0=2bw")


# -- subscriber process ---------------------------------------------------------------------


async def _subscriber(
    name: str, control_url: str, link: LinkSpec, chunk_bytes: int, data_plane: str, shm: bool, sealed: bool = False
) -> None:
    """One member process: installs every version it gets and reports it at once, until SIGTERM
    (``sealed``: under ``[security]``; benchmarks/secure_streams.py runs these too)."""
    transport = Transport()
    control = transport.dealer(name=f"{name}.weights", connect=[control_url], identity=name.encode())
    receiver: WeightReceiver

    def done(assembler: SnapshotAssembler) -> None:
        asyncio.get_running_loop().create_task(receiver.report_installed(assembler.key, 0.0))

    receiver = WeightReceiver(
        transport,
        control,
        name=name,
        link=link,
        gap_timeout_s=3.0,
        announce_s=0.5,
        chunk_bytes_hint=chunk_bytes,
        on_complete=done,
        data_plane=data_plane,
        shm_dir=default_shm_dir() if shm else None,
        sealed=sealed,
    )
    receiver.open()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        async with asyncio.TaskGroup() as group:
            task = group.create_task(receiver.run())
            await stop.wait()
            task.cancel()
    finally:
        receiver.close()
        transport.close()


def subscriber_main(argv: list[str]) -> None:
    """``NAME URL UP_MBPS DOWN_MBPS CHUNK_BYTES DATA_PLANE shm|net [sealed|plain]``."""
    name, url, up, down, chunk, data_plane, shm, *rest = argv
    link = LinkSpec(float(up), float(down))
    sealed = rest == ["sealed"]
    asyncio.run(_subscriber(name, url, link, int(chunk), data_plane, shm == "shm", sealed))


# -- references ------------------------------------------------------------------------------


def raw_tcp_bandwidth(nbytes: int, source: np.ndarray | None = None) -> float:
    """Bytes/s of one plain TCP loopback stream (sendall / recv_into, 1 MB calls).

    ``source=None``: the same 1 MB buffer sent and received over and over (cache-hot at
    both ends: the kernel's copy at its best). With ``source`` (a snapshot's bytes): the
    bytes a broadcast moves, from that buffer into one of the same size mapped beforehand
    (as a receiver's assembly buffer is, ``prefault_next``).
    """
    snapshot = source is not None
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    if source is not None:
        nbytes = source.nbytes
        payload = memoryview(source).cast("B")
        sink = prefaulted_buffer(nbytes)
    else:
        payload = memoryview(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
        sink = np.empty(1 << 20, dtype=np.uint8)
    rounds = -(-nbytes >> 20)
    view = memoryview(sink).cast("B")

    def send() -> None:
        with socket.create_connection(listener.getsockname()) as out:
            for i in range(rounds):
                out.sendall(payload[(i << 20) : ((i + 1) << 20)] if snapshot else payload)

    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = listener.accept()
    started = time.perf_counter()
    total, want = 0, (nbytes if snapshot else rounds << 20)
    while total < want:
        got = conn.recv_into(view[total : total + (1 << 20)] if snapshot else view)
        if not got:
            break
        total += got
    elapsed = time.perf_counter() - started
    sender.join()
    conn.close()
    listener.close()
    return total / elapsed


def digest_bandwidth(nbytes: int, chunk: int) -> float:
    """Bytes/s of per-chunk verification (the default digest) on one thread."""
    from echo2.weights.chunks import digest

    data = memoryview(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)).cast("B")
    started = time.perf_counter()
    for i in range(0, nbytes, chunk):
        digest(data[i : i + chunk])
    return nbytes / (time.perf_counter() - started)


def _gloo_rank(rank: int, world: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = torch.zeros(nbytes, dtype=torch.uint8)
    if rank == 0:
        data += 7
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(data, src=0)
        dist.barrier()
        times.append(time.perf_counter() - started)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def gloo_broadcast_s(n: int, nbytes: int, repeats: int = 1) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_gloo_rank, args=(r, n + 1, port, nbytes, repeats, out)) for r in range(n + 1)]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=300))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# -- publisher side --------------------------------------------------------------------------


def make_snapshot(version: int, nbytes: int) -> Snapshot:
    rng = np.random.default_rng(version)
    specs, flat = flatten_tensors({"w": rng.integers(0, 255, nbytes, dtype=np.uint8)})
    return Snapshot(
        incarnation=1,
        version=version,
        tensors=specs,
        data=flat,
        created_at_s=time.time(),
    )


async def run_regime(
    n: int,
    modes: list[str],
    nbytes: int,
    chunk: int,
    sub_link: LinkSpec,
    pub_link: LinkSpec,
    stripes: int,
    repeats: int = 1,
    paired_raw: bool = False,
    data_plane: str = "stream",
    shm: bool = False,
) -> dict[str, dict[str, Any]]:
    transport = Transport()
    router = transport.router(name="bench.weights", bind=["tcp://127.0.0.1:0"])
    url = router.endpoints[0]
    broadcaster = WeightBroadcaster(
        transport,
        router,
        mode=modes[0],
        stripes=stripes,
        chunk_bytes=chunk,
        link=pub_link,
        member_ttl_s=30.0,
        send_timeout_s=60.0,
        shm_dir=default_shm_dir() if shm else None,
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--subscriber",
                f"s{i}",
                url,
                str(sub_link.uplink_mbps),
                str(sub_link.downlink_mbps),
                str(chunk),
                data_plane,
                "shm" if shm else "net",
            ],
        )
        for i in range(n)
    ]
    results: dict[str, dict[str, Any]] = {}
    try:
        async with asyncio.TaskGroup() as group:
            main = group.create_task(broadcaster.run())
            try:
                async with asyncio.timeout(60):
                    await broadcaster.wait_members(n)
                version = 0
                for mode in modes:
                    broadcaster.mode = mode
                    # Warm-up: one version opens this mode's connections (seeds, chains).
                    # Uncapped, it is full size, as every version of a real run is: the
                    # measured one then lands in memory the receivers mapped in between
                    # (``prefault_next``), the steady state. Capped, the link is the bound
                    # and a small one saves minutes.
                    version += 1
                    warm_bytes = nbytes if sub_link == LinkSpec() else chunk * 2 * stripes
                    warm = make_snapshot(version, warm_bytes)
                    broadcaster.publish_nowait(warm, make_manifest(warm, chunk))
                    async with asyncio.timeout(120):
                        await broadcaster.wait_bcast((1, version))
                    times, raws, repairs, stream = [], [], 0, 0
                    for _ in range(repeats):
                        version += 1
                        snap = make_snapshot(version, nbytes)
                        manifest = make_manifest(snap, chunk)
                        if paired_raw:
                            # The baseline of this very version, right before it: on a
                            # shared machine the load moves between seconds, so each
                            # transfer is compared with raw TCP moving the same bytes then.
                            raws.append(await asyncio.to_thread(raw_tcp_bandwidth, nbytes, snap.data))
                        before = dict(broadcaster.counters)
                        broadcaster.publish_nowait(snap, manifest)
                        async with asyncio.timeout(600):
                            times.append(await broadcaster.wait_bcast((1, version)))
                        after = broadcaster.counters
                        repairs += after["repair_chunks_sent"] - before["repair_chunks_sent"]
                        stream += after["stream_bytes"] - before["stream_bytes"]
                    t = statistics.median(times)
                    results[mode] = {
                        "t_bcast_s": t,
                        "t_bcast_all_s": [round(x, 4) for x in times],
                        "repair_chunks": repairs // repeats,
                        "publisher_bytes": stream // repeats,
                    }
                    if raws:
                        ratios = [nbytes / x / r for x, r in zip(times, raws, strict=True)]
                        results[mode]["raw_tcp_paired_bytes_per_s"] = [round(r) for r in raws]
                        results[mode]["x_raw_paired"] = statistics.median(ratios)
                        print(
                            f"  {mode:8s} N={n}: paired raw TCP {statistics.median(raws) / 1e9:.2f} GB/s,"
                            f" echo2/raw per version {', '.join(f'{x:.2f}' for x in ratios)}",
                            file=sys.stderr,
                            flush=True,
                        )
                    print(
                        f"  {mode:8s} N={n}: T_bcast {t:7.3f} s"
                        + (f" (median of {', '.join(f'{x:.3f}' for x in times)})" if repeats > 1 else ""),
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                main.cancel()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        broadcaster.close()
        transport.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--chunk-mb", type=float, default=1.0)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--bw-mbps", type=float, default=200.0)
    parser.add_argument("--stripes", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument(
        "--shm",
        action="store_true",
        help="uncapped: subscribers on this host map versions from shared memory (no TCP)",
    )
    parser.add_argument(
        "--data-plane",
        default="stream",
        choices=DATA_PLANES,
        help="receivers' relay inboxes: chunk streams (default) or ZeroMQ PULL",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="uncapped: versions per mode (and raw TCP runs); medians are reported",
    )
    parser.add_argument("--json", default="", help="write results as JSON here ('-': stdout)")
    args = parser.parse_args()
    nbytes = int(args.size_mb * (1 << 20))
    chunk = int(args.chunk_mb * (1 << 20))
    bw = args.bw_mbps
    floor_s = nbytes * 8 / (bw * 1e6)
    print(
        f"load: {os.getloadavg()[0]:.2f}  G = {nbytes / 2**20:.0f} MiB, chunk {chunk / 2**20:g} MiB, "
        f"Bw = {bw:g} Mbit/s, G/Bw = {floor_s:.2f} s",
        file=sys.stderr,
    )
    raws = [raw_tcp_bandwidth(max(nbytes, 256 << 20)) for _ in range(args.repeats)]
    raw = statistics.median(raws)
    print(
        f"raw TCP loopback, cache-hot 1 MB buffers: {raw / 1e9:.2f} GB/s"
        f" (median of {', '.join(f'{x / 1e9:.2f}' for x in raws)})",
        file=sys.stderr,
    )
    hashing = digest_bandwidth(nbytes, chunk)
    print(f"chunk verification ({DEFAULT_DIGEST}, one thread): {hashing / 1e9:.2f} GB/s", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for regime in args.regimes:
        if regime == "uncapped":
            sub, pub = LinkSpec(), LinkSpec()
        else:
            sub = LinkSpec(uplink_mbps=bw, downlink_mbps=bw)
            pub = LinkSpec(uplink_mbps=bw * (2 if regime == "b0=2bw" else 1))
        print(f"regime {regime}", file=sys.stderr)
        for n in args.n:
            res = asyncio.run(
                run_regime(
                    n,
                    args.modes,
                    nbytes,
                    chunk,
                    sub,
                    pub,
                    args.stripes,
                    repeats=args.repeats if regime == "uncapped" else 1,
                    paired_raw=regime == "uncapped" and n == 1,
                    data_plane=args.data_plane,
                    shm=args.shm and regime == "uncapped",
                )
            )
            for mode, r in res.items():
                rows.append({"regime": regime, "mode": mode, "n": n, **r})
        if regime == "uncapped" and not args.no_gloo:
            for n in args.n:
                t = gloo_broadcast_s(n, nbytes, args.repeats)
                print(f"  gloo     N={n}: {t:7.3f} s", file=sys.stderr, flush=True)
                rows.append({"regime": regime, "mode": "gloo", "n": n, "t_bcast_s": t})
    # Ratios.
    base = {(r["regime"], r["mode"]): r["t_bcast_s"] for r in rows if r["n"] == min(args.n)}
    for r in rows:
        r["x_floor"] = r["t_bcast_s"] / floor_s if r["regime"] != "uncapped" else None
        r["x_n1"] = r["t_bcast_s"] / base[(r["regime"], r["mode"])]
        r["gb_per_s"] = nbytes / r["t_bcast_s"] / 1e9
    print(f"\n| regime | mode | N | T_bcast s | x G/Bw | x N={min(args.n)} | GB/s per subscriber |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        xf = f"{r['x_floor']:.2f}" if r["x_floor"] is not None else "-"
        print(
            f"| {r['regime']} | {r['mode']} | {r['n']} | {r['t_bcast_s']:.3f} | {xf} | {r['x_n1']:.2f} | {r['gb_per_s']:.2f} |"
        )
    floors = []

    def find(regime: str, mode: str, n: int) -> dict[str, Any] | None:
        return next(
            (r for r in rows if (r["regime"], r["mode"], r["n"]) == (regime, mode, n)),
            None,
        )

    if (relay := find("b0=bw", "relay", 8)) is not None:
        floors.append(
            (
                "capped b0=bw N=8 relay <= 1.25 x G/Bw",
                relay["x_floor"],
                relay["x_floor"] <= 1.25,
            )
        )
    if (star := find("b0=bw", "star", 8)) is not None:
        floors.append(
            (
                "capped b0=bw N=8 star >= 6 x G/Bw",
                star["x_floor"],
                star["x_floor"] >= 6.0,
            )
        )
    if (one := find("uncapped", "relay", 1)) is not None:
        ratio = one["x_raw_paired"]
        floors.append(("uncapped N=1 >= 0.5 x raw TCP (same bytes, paired per version; median)", ratio, ratio >= 0.5))
        floors.append(
            ("(uncapped N=1 / cache-hot raw TCP, medians of separate runs)", one["gb_per_s"] * 1e9 / raw, True)
        )
        floors.append(("(uncapped N=1 / one-thread verification rate)", one["gb_per_s"] * 1e9 / hashing, True))
    if (e4 := find("uncapped", "relay", 4)) is not None and (g4 := find("uncapped", "gloo", 4)) is not None:
        floors.append(
            (
                "uncapped N=4 echo2 relay / gloo throughput",
                g4["t_bcast_s"] / e4["t_bcast_s"],
                True,
            )
        )
    print()
    for name, value, ok in floors:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.2f}")
    if args.json:
        doc = {
            "size_bytes": nbytes,
            "chunk_bytes": chunk,
            "bw_mbps": bw,
            "floor_s": floor_s,
            "raw_tcp_bytes_per_s": raw,
            "digest_bytes_per_s": hashing,
            "load": os.getloadavg()[0],
            "data_plane": args.data_plane,
            "shm": args.shm,
            "rows": rows,
            "floors": [{"name": n, "value": v, "ok": ok} for n, v, ok in floors],
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--subscriber":
        subscriber_main(sys.argv[2:])
    else:
        main()
