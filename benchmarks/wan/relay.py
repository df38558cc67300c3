"""The WAN emulator: a user-space frame relay between the switch namespace's veth ports.

    ip netns exec SWITCH python -m benchmarks.wan.relay CONFIG_JSON

Why it exists: the kernel here has no ``sch_netem``, so one-way delay and random loss are
emulated here. Every host's link ends in the switch namespace as one veth port; this
process reads each frame that arrives on a port (AF_PACKET), picks the output port by the
destination MAC, drops it with the source link's uplink loss and the destination link's
downlink loss (Bernoulli per frame, independent), and sends it after the source link's
one-way delay plus the destination link's (a heap of due times). Rate caps are not done
here: each port's egress has a kernel tbf qdisc, which a send goes through, so a full
queue is a tail drop (counted as ``queue_drops``). Frames are one wire packet each because
the bed turns TSO/GSO and checksum offload off on every veth (``netbed.disable_offloads``).

Control on stdin, one command a line: ``down HOST`` / ``up HOST`` (total outage of that
host's link, both directions), ``stats`` (one JSON line of counters on stdout). It prints
``ready`` once every port is open, and its counters when stdin closes or on SIGTERM.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import select
import signal
import socket
import sys
import time
from typing import Any

ETH_P_ALL = 0x0003
PACKET_IGNORE_OUTGOING = 23  # linux/if_packet.h (Linux >= 4.20): do not read our own sends
SOL_PACKET = 263
_MAX_FRAME = 65536
_READ_BURST = 64  # frames read from one port before looking at the others and the heap


class Port:
    """One switch port: a host's link, its per-direction delay and loss, its counters."""

    def __init__(self, host: str, ifname: str, mac: str, delay_s: float, loss: float) -> None:
        self.host, self.ifname = host, ifname
        self.mac = bytes.fromhex(mac.replace(":", ""))
        self.delay_s, self.loss = delay_s, loss
        self.down = False
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sock.bind((ifname, 0))
        self.sock.setblocking(False)
        self.counters = {
            "rx_frames": 0,  # frames from the host into the switch
            "rx_bytes": 0,
            "tx_frames": 0,  # frames sent on towards the host
            "tx_bytes": 0,
            "loss_drops": 0,  # emulated random loss (counted at the link that lost it)
            "outage_drops": 0,
            "queue_drops": 0,  # the tbf queue towards the host was full
            "unroutable": 0,  # broadcast or unknown destination MAC
        }


def run(config: dict[str, Any]) -> dict[str, dict[str, int]]:
    rng = random.Random(config.get("seed", 0))
    ports = [Port(p["host"], p["ifname"], p["mac"], p["delay_ms"] / 1000.0, p["loss"]) for p in config["ports"]]
    by_mac = {p.mac: p for p in ports}
    by_fd = {p.sock.fileno(): p for p in ports}
    by_host = {p.host: p for p in ports}
    poller = select.epoll()
    for p in ports:
        poller.register(p.sock.fileno(), select.EPOLLIN)
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    poller.register(stdin, select.EPOLLIN)
    heap: list[tuple[float, int, Port, bytes]] = []
    seq = 0
    pending = b""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)

    def send(out: Port, frame: bytes) -> None:
        try:
            out.sock.send(frame)
        except (BlockingIOError, OSError):  # ENOBUFS: the tbf queue is full (a tail drop)
            out.counters["queue_drops"] += 1
            return
        out.counters["tx_frames"] += 1
        out.counters["tx_bytes"] += len(frame)

    while not stopping:
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, out, frame = heapq.heappop(heap)
            send(out, frame)
        timeout = max(0.0, heap[0][0] - now) if heap else 0.5
        try:
            events = poller.poll(timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd, _ in events:
            if fd == stdin:
                try:
                    data = os.read(stdin, 4096)
                except BlockingIOError:
                    continue
                if not data:  # the bed closed our stdin: finish
                    stopping = True
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    words = line.decode().split()
                    if words[:1] == ["stats"]:
                        print(json.dumps({p.host: p.counters for p in ports}), flush=True)
                    elif len(words) == 2 and words[0] in ("down", "up") and words[1] in by_host:
                        by_host[words[1]].down = words[0] == "down"
                        print(f"ok {words[0]} {words[1]}", flush=True)
                    else:
                        print(f"error: unknown command {line!r}", flush=True)
                continue
            src = by_fd[fd]
            for _ in range(_READ_BURST):
                try:
                    frame = src.sock.recv(_MAX_FRAME)
                except BlockingIOError:
                    break
                src.counters["rx_frames"] += 1
                src.counters["rx_bytes"] += len(frame)
                dst = by_mac.get(frame[:6])
                if dst is None or dst is src:
                    src.counters["unroutable"] += 1
                    continue
                if src.down or dst.down:
                    (src if src.down else dst).counters["outage_drops"] += 1
                    continue
                if src.loss and rng.random() < src.loss:
                    src.counters["loss_drops"] += 1
                    continue
                if dst.loss and rng.random() < dst.loss:
                    dst.counters["loss_drops"] += 1
                    continue
                due = now + src.delay_s + dst.delay_s
                if due <= now:
                    send(dst, frame)
                else:
                    seq += 1
                    heapq.heappush(heap, (due, seq, dst, frame))
    for p in ports:
        p.sock.close()
    poller.close()
    return {p.host: p.counters for p in ports}


def main() -> int:
    counters = run(json.loads(sys.argv[1]))
    print(json.dumps({"final": counters}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
