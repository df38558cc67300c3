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

Cost: the relay touches every frame of the bed, in Python, while the job it carries
competes for the same cores. A relay that waits for a core delays frames beyond their
setting and overflows its sockets (drops nobody counts), so it runs under the real-time
round-robin scheduler where it may (root; the kernel still keeps 5% of each second for
everything else), and keeps its per-frame work small: one FIFO per (source, destination)
pair, since every frame of a pair has the same delay (no heap), and its CPU seconds are
reported with its counters (``cpu_s`` in each port's ``"relay"`` entry).
"""

from __future__ import annotations

import collections
import contextlib
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


def _realtime() -> bool:
    """Run under SCHED_RR (priority 1) if allowed; True if it took."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        return True
    return False


def run(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rng = random.Random(config.get("seed", 0))
    ports = [Port(p["host"], p["ifname"], p["mac"], p["delay_ms"] / 1000.0, p["loss"]) for p in config["ports"]]
    by_mac = {p.mac: p for p in ports}
    by_fd = {p.sock.fileno(): p for p in ports}
    by_host = {p.host: p for p in ports}
    # One FIFO of (due, frame) per (source, destination): a pair's delay is fixed, so its
    # frames come due in the order they arrived.
    pairs = {(src.host, dst.host): collections.deque() for src in ports for dst in ports if src is not dst}
    waiting: dict[tuple[str, str], collections.deque[tuple[float, bytes]]] = {}  # the non-empty ones
    poller = select.epoll()
    for p in ports:
        poller.register(p.sock.fileno(), select.EPOLLIN)
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    poller.register(stdin, select.EPOLLIN)
    pending = b""
    stopping = False
    realtime = _realtime()

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

    def stats() -> dict[str, dict[str, Any]]:
        cpu = {"cpu_s": round(time.process_time(), 3), "realtime": realtime}
        return {**{p.host: p.counters for p in ports}, "relay": cpu}

    while not stopping:
        now = time.monotonic()
        timeout = 0.5
        for key, queue in list(waiting.items()):
            out = by_host[key[1]]
            while queue and queue[0][0] <= now:
                send(out, queue.popleft()[1])
            if queue:
                timeout = min(timeout, queue[0][0] - now)
            else:
                del waiting[key]
        try:
            events = poller.poll(max(0.0, timeout))
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
                        print(json.dumps(stats()), flush=True)
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
                delay = src.delay_s + dst.delay_s
                if delay <= 0:
                    send(dst, frame)
                    continue
                key = (src.host, dst.host)
                queue = pairs[key]
                queue.append((now + delay, frame))
                waiting[key] = queue
    for p in ports:
        p.sock.close()
    poller.close()
    return stats()


def main() -> int:
    counters = run(json.loads(sys.argv[1]))
    print(json.dumps({"final": counters}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
