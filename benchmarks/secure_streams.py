"""Encrypted weight streams: plain chunk stream vs TLS chunk stream vs ZeroMQ PUSH/PULL + CURVE.

    python benchmarks/secure_streams.py [--size-mb 32] [--chunk-kb 1024] [--reps 7]
                                        [--planes plain tls curve zmq] [--json PATH]

Setup: the receiver runs in this process and the sender in a child process (the two
ends of a relay hop, on loopback, uncapped). Per rep and plane the receiver tells the
sender to go and times until every chunk of one version (``--size-mb``, 1 MB chunks as
the broadcaster cuts them) has landed in a pre-mapped assembly buffer: in place for the
chunk streams (``plain``, ``tls``), copied in from the received frame for ZeroMQ
(``zmq`` plain, ``curve`` encrypted), as ``WeightReceiver`` does. Planes take turns
within each rep (interleaved), so load on the machine affects them alike; the figure per
encrypted plane is the median over reps of its throughput divided by the same rep's
plain chunk stream (``x_plain``). Verification is left out: it is the same on every
plane and would hide the transport's cost.

Floor (issue 14, item 3): the chosen encrypted plane >= 0.7 x the plain chunk stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from echo2.errors import TransportError
from echo2.messages import WeightChunk
from echo2.transport import Transport
from echo2.transport.auth import CurveClient, CurveServer, load_keypair, make_keypair
from echo2.transport.endpoint import SocketOptions
from echo2.weights.chunks import prefaulted_buffer
from echo2.weights.secure import load_stream_tls, make_stream_cert
from echo2.weights.stream import ChunkStreamSender, ChunkStreamServer

PLANES = ("plain", "tls", "zmq", "curve")
ENCRYPTED = ("tls", "curve")


def _chunks(nbytes: int, chunk_bytes: int, version: int) -> list[WeightChunk]:
    data = np.random.default_rng(version).integers(0, 255, nbytes, dtype=np.uint8)
    return [
        WeightChunk(incarnation=1, version=version, index=i, data=data[start : start + chunk_bytes])
        for i, start in enumerate(range(0, nbytes, chunk_bytes))
    ]


# -- sender (child process) -------------------------------------------------------------


async def _send_all(conn: Connection, addresses: dict[str, str], keys: str, nbytes: int, chunk_bytes: int) -> None:
    tls = load_stream_tls(keys, "sender")
    transport = Transport()
    curve_keys = load_keypair(Path(keys) / "sender.key_secret")
    server_key = load_keypair(Path(keys) / "receiver.key_secret").public
    senders: dict[str, Any] = {
        "plain": ChunkStreamSender(addresses["plain"]),
        "tls": ChunkStreamSender(addresses["tls"], tls=tls.client, peer="receiver"),
        "zmq": transport.push(
            name="zmq", connect=[addresses["zmq"]], options=SocketOptions(hwm=8, max_message_bytes=64 << 20)
        ),
        "curve": transport.push(
            name="curve",
            connect=[addresses["curve"]],
            options=SocketOptions(hwm=8, max_message_bytes=64 << 20),
            curve=CurveClient(curve_keys, {addresses["curve"]: server_key}),
        ),
    }
    payload = _chunks(nbytes, chunk_bytes, 0)
    try:
        while True:
            command = await asyncio.to_thread(conn.recv)
            if command is None:
                return
            plane, version = command
            for chunk in payload:
                await senders[plane].send(
                    WeightChunk(incarnation=1, version=version, index=chunk.index, data=chunk.data)
                )
    finally:
        for sender in senders.values():
            sender.close()
        transport.close()


def sender_main(conn: Connection, addresses: dict[str, str], keys: str, nbytes: int, chunk_bytes: int) -> None:
    asyncio.run(_send_all(conn, addresses, keys, nbytes, chunk_bytes))


# -- receiver (this process) -------------------------------------------------------------


class _Version:
    """One version being received: its buffer and when its last chunk landed."""

    def __init__(self, nbytes: int, chunk_bytes: int) -> None:
        self.buffer = prefaulted_buffer(nbytes)
        self.chunk_bytes = chunk_bytes
        self.expected = -(-nbytes // chunk_bytes)
        self.got = 0
        self.done = asyncio.Event()

    def place(self, index: int, nbytes: int) -> np.ndarray:
        return self.buffer[index * self.chunk_bytes : index * self.chunk_bytes + nbytes]

    def landed(self) -> None:
        self.got += 1
        if self.got == self.expected:
            self.done.set()


async def measure(size_mb: int, chunk_kb: int, reps: int, planes: list[str]) -> dict[str, Any]:
    nbytes, chunk_bytes = size_mb << 20, chunk_kb << 10
    keys = tempfile.mkdtemp(prefix="echo2-keys-")
    for name in ("sender", "receiver"):
        make_stream_cert(keys, name)
        make_keypair(keys, name)
    tls = load_stream_tls(keys, "receiver")
    current: dict[str, _Version] = {}

    def destination(plane: str) -> Any:
        return lambda key, index, size: current[plane].place(index, size)

    def delivered(plane: str) -> Any:
        def on_chunk(chunk: WeightChunk) -> None:
            servers[plane].taken()
            current[plane].landed()

        return on_chunk

    transport = Transport()
    receiver_keys = load_keypair(Path(keys) / "receiver.key_secret")
    transport.enable_curve({load_keypair(Path(keys) / "sender.key_secret").public})
    pulls = {
        "zmq": transport.pull(
            name="zmq", bind=["tcp://127.0.0.1:0"], options=SocketOptions(hwm=8, max_message_bytes=64 << 20)
        ),
        "curve": transport.pull(
            name="curve",
            bind=["tcp://127.0.0.1:0"],
            options=SocketOptions(hwm=8, max_message_bytes=64 << 20),
            curve=CurveServer(receiver_keys),
        ),
    }
    results: dict[str, list[float]] = {p: [] for p in planes}
    spurious: dict[str, int] = {}
    async with asyncio.TaskGroup() as group:
        servers = {
            "plain": ChunkStreamServer(delivered("plain"), destination("plain"), lambda c: None),
            "tls": ChunkStreamServer(delivered("tls"), destination("tls"), lambda c: None, tls=tls.server),
        }
        addresses = {
            p: f"chunkstream://127.0.0.1:{await s.start('127.0.0.1', group=group)}" for p, s in servers.items()
        }
        addresses.update({p: pull.endpoints[0] for p, pull in pulls.items()})

        async def drain(plane: str) -> None:
            pull = pulls[plane]
            while True:
                try:
                    messages = await pull.recv_many(16)
                except TransportError as exc:
                    # Seen only on the CURVE PULL (pyzmq's asyncio recv woken with nothing
                    # to read, EAGAIN); nothing is lost: receive again. Counted in the JSON.
                    if not isinstance(exc.__cause__, zmq.Again):
                        raise
                    spurious[plane] = spurious.get(plane, 0) + 1
                    continue
                for message in messages:
                    assert isinstance(message, WeightChunk)
                    version = current[plane]
                    np.copyto(version.place(message.index, message.data.nbytes), message.data)  # into place
                    version.landed()

        drains = [group.create_task(drain(p)) for p in pulls]
        ours, theirs = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(
            target=sender_main, args=(theirs, addresses, keys, nbytes, chunk_bytes), daemon=True
        )
        child.start()
        try:
            version = 0
            for rep in range(reps + 1):  # rep 0 warms up: connections, handshakes, page faults
                for plane in planes:
                    version += 1
                    current[plane] = _Version(nbytes, chunk_bytes)
                    start = time.perf_counter()
                    ours.send((plane, version))
                    async with asyncio.timeout(120):
                        await current[plane].done.wait()
                    if rep:
                        results[plane].append(nbytes / (time.perf_counter() - start))
        finally:
            ours.send(None)
            await asyncio.to_thread(child.join, 30)
            for task in drains:
                task.cancel()
            for server in servers.values():
                server.close()
            for pull in pulls.values():
                pull.close()
    transport.close()
    summary: dict[str, Any] = {
        "size_mb": size_mb,
        "chunk_kb": chunk_kb,
        "reps": reps,
        "bytes_per_s": {p: [round(r) for r in v] for p, v in results.items()},
        "median_mb_per_s": {p: round(statistics.median(v) / 1e6, 1) for p, v in results.items()},
        "spurious_eagain": spurious,
    }
    if "plain" in planes:
        summary["x_plain"] = {
            p: round(statistics.median(r / b for r, b in zip(results[p], results["plain"], strict=True)), 3)
            for p in planes
            if p != "plain"
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--chunk-kb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--planes", nargs="+", default=list(PLANES), choices=PLANES)
    parser.add_argument("--json", default="", help="write results as JSON here ('-': stdout)")
    args = parser.parse_args()
    summary = asyncio.run(measure(args.size_mb, args.chunk_kb, args.reps, args.planes))
    for plane in args.planes:
        ratio = summary.get("x_plain", {}).get(plane)
        print(
            f"{plane:>6}: {summary['median_mb_per_s'][plane]:8.1f} MB/s"
            + (f"   {ratio:.3f} x plain" if ratio is not None else ""),
            file=sys.stderr,
        )
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
