"""Probes that check the emulator against its settings: UDP echo (RTT, loss), TCP bulk (goodput).

    python -m benchmarks.wan.probe udp-echo PORT                 # server, until killed
    python -m benchmarks.wan.probe udp-ping HOST PORT COUNT GAP_MS
    python -m benchmarks.wan.probe tcp-sink PORT                 # server: one connection
    python -m benchmarks.wan.probe tcp-send HOST PORT SECONDS
    python -m benchmarks.wan.probe tcp-multi-sink PORT              # server: many connections
    python -m benchmarks.wan.probe tcp-multi-send HOST PORT SECONDS STREAMS

Clients print one JSON line. ``udp-ping`` sends COUNT numbered datagrams GAP_MS apart and
reports the median and 90th percentile round trip of those that came back and the fraction
lost (a probe is lost if either direction drops it). ``tcp-send`` writes for SECONDS and
reports the bytes the receiver acknowledged reading (the sink answers with its count), so
the figure is goodput, not what sat in socket buffers. ``tcp-multi-send`` does the same
over STREAMS parallel connections (one thread, non-blocking sockets) and reports the
aggregate and the per-stream spread: how many loss-bound streams fill a link.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

from benchmarks.wan.netbed import REPO_ROOT, Bed

_PROBE = struct.Struct("!Id")  # sequence number, send time (monotonic)


def udp_echo(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", port))
        print("ready", flush=True)
        while True:
            data, peer = sock.recvfrom(2048)
            sock.sendto(data, peer)


def udp_ping(host: str, port: int, count: int, gap_ms: float) -> dict[str, float]:
    rtts: dict[int, float] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        sock.settimeout(0.001)
        next_send = time.monotonic()
        sent = 0
        last_send = 0.0
        while sent < count or time.monotonic() < last_send + 2.0:  # 2 s for the last replies
            now = time.monotonic()
            if sent < count and now >= next_send:
                sock.send(_PROBE.pack(sent, now))
                sent += 1
                last_send = now
                next_send += gap_ms / 1000
            try:
                seq, t_sent = _PROBE.unpack(sock.recv(64)[: _PROBE.size])
            except TimeoutError:
                continue
            rtts.setdefault(seq, time.monotonic() - t_sent)
    values = sorted(rtts.values())
    return {
        "sent": count,
        "received": len(values),
        "loss": 1 - len(values) / count,
        "rtt_ms_median": 1000 * statistics.median(values) if values else float("nan"),
        "rtt_ms_p90": 1000 * values[int(0.9 * (len(values) - 1))] if values else float("nan"),
    }


def tcp_sink(port: int) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(1)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            total = 0
            buf = bytearray(1 << 20)
            while n := conn.recv_into(buf):
                total += n
            conn.sendall(struct.pack("!Q", total))


def tcp_send(host: str, port: int, seconds: float) -> dict[str, float]:
    block = b"\0" * (1 << 16)
    with socket.create_connection((host, port), timeout=30) as sock:
        cc = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            sock.sendall(block)
        sock.shutdown(socket.SHUT_WR)
        (received,) = struct.unpack("!Q", _recv_exact(sock, 8))
        elapsed = time.monotonic() - start
    return {"bytes": received, "seconds": elapsed, "goodput_mbit": received * 8 / elapsed / 1e6, "cc": cc}


def tcp_multi_sink(port: int) -> None:
    """Read and discard whatever any number of connections send, until killed."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(1024)
        server.setblocking(False)
        print("ready", flush=True)
        buf = bytearray(1 << 18)
        with selectors.DefaultSelector() as sel:
            sel.register(server, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is server:
                        conn, _ = server.accept()
                        conn.setblocking(False)
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    try:
                        n = sock.recv_into(buf)
                    except BlockingIOError:
                        continue
                    except OSError:
                        n = 0
                    if not n:
                        sel.unregister(sock)
                        sock.close()


_ACKED = struct.Struct("<120xQ")  # struct tcp_info: tcpi_bytes_acked


def _bytes_acked(sock: socket.socket) -> int:
    return int(_ACKED.unpack(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _ACKED.size))[0])


def tcp_multi_send(host: str, port: int, seconds: float, streams: int) -> dict[str, Any]:
    """Keep ``streams`` connections busy for ``seconds``; goodput is what the receiver
    acknowledged over the last 3/4 of the time (after slow start), by the kernel's count."""
    block = memoryview(b"\0" * (1 << 16))
    socks = [socket.create_connection((host, port), timeout=30) for _ in range(streams)]
    cc = socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
    warm: list[int] = []
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, 1 << 17)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_WRITE)
        start = time.monotonic()
        warm_at = start + seconds / 4
        while (left := seconds - (time.monotonic() - start)) > 0:
            if not warm and time.monotonic() >= warm_at:
                warm, warm_at = [_bytes_acked(s) for s in socks], time.monotonic()
            for key, _ in sel.select(min(left, 0.05)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with contextlib.suppress(BlockingIOError):
                    sock.send(block)
        acked = [_bytes_acked(s) - w for s, w in zip(socks, warm, strict=True)]
        elapsed = time.monotonic() - warm_at
    for sock in socks:
        sock.close()
    per_stream = sorted(n * 8 / elapsed / 1e6 for n in acked)
    return {
        "streams": streams,
        "seconds": round(elapsed, 2),
        "goodput_mbit": sum(acked) * 8 / elapsed / 1e6,
        "per_stream_mbit_median": statistics.median(per_stream),
        "per_stream_mbit_min": per_stream[0],
        "per_stream_mbit_max": per_stream[-1],
        "cc": cc,
    }


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed before answering")
        data += chunk
    return data


def main(argv: list[str]) -> int:
    match argv:
        case ["udp-echo", port]:
            udp_echo(int(port))
        case ["udp-ping", host, port, count, gap_ms]:
            print(json.dumps(udp_ping(host, int(port), int(count), float(gap_ms))), flush=True)
        case ["tcp-sink", port]:
            tcp_sink(int(port))
        case ["tcp-send", host, port, seconds]:
            print(json.dumps(tcp_send(host, int(port), float(seconds))), flush=True)
        case ["tcp-multi-sink", port]:
            tcp_multi_sink(int(port))
        case ["tcp-multi-send", host, port, seconds, streams]:
            print(json.dumps(tcp_multi_send(host, int(port), float(seconds), int(streams))), flush=True)
        case _:
            print(__doc__, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def _start_server(bed: Bed, host: str, args: list[str]) -> subprocess.Popen[str]:
    """Start a probe server in ``host``'s namespace and wait for its "ready" (bound) line."""
    proc = bed.popen(host, [sys.executable, "-m", "benchmarks.wan.probe", *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"probe server {args} did not start in {host}")
    return proc


def _stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def validate(
    bed: Bed, server: str, client: str, *, pings: int = 400, gap_ms: float = 5.0, bulk_s: float = 4.0
) -> dict[str, Any]:
    """RTT, loss and TCP goodput (server -> client, the weights' direction) of one path.

    Expected values from the two links' shapes sit beside the measured ones.
    """
    a, b = bed.hosts[server], bed.hosts[client]
    py = sys.executable
    echo = _start_server(bed, server, ["udp-echo", "9901"])
    try:
        ping = subprocess.run(
            ["ip", "netns", "exec", b.namespace, py, "-m", "benchmarks.wan.probe", "udp-ping", a.address, "9901", str(pings), str(gap_ms)],
            capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=bed.env(),
        )  # fmt: skip
    finally:
        _stop_server(echo)
    sink = _start_server(bed, client, ["tcp-sink", "9902"])
    try:
        bulk = subprocess.run(
            ["ip", "netns", "exec", a.namespace, py, "-m", "benchmarks.wan.probe", "tcp-send", b.address, "9902", str(bulk_s)],
            capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=bed.env(),
        )  # fmt: skip
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            sink.wait(timeout=10)  # it exits once it has answered
        _stop_server(sink)
    rtt, goodput = json.loads(ping.stdout), json.loads(bulk.stdout)
    one_way_loss = 1 - (1 - a.shape.loss) * (1 - b.shape.loss)
    rates = [s.rate_mbit for s in (a.shape, b.shape) if s.rate_mbit > 0]
    return {
        "path": f"{server}->{client}",
        "rtt_ms_configured": 2 * (a.shape.delay_ms + b.shape.delay_ms),
        "rtt_ms_median": rtt["rtt_ms_median"],
        "rtt_ms_p90": rtt["rtt_ms_p90"],
        "loss_round_trip_configured": 1 - (1 - one_way_loss) ** 2,
        "loss_round_trip_measured": rtt["loss"],
        "probes": rtt["sent"],
        "rate_mbit_configured": min(rates) if rates else 0.0,
        "tcp_goodput_mbit": goodput["goodput_mbit"],
        "tcp_congestion_control": goodput["cc"],
    }


def stream_sweep(
    bed: Bed, server: str, client: str, counts: list[int], *, seconds: float = 8.0
) -> list[dict[str, Any]]:
    """Aggregate TCP goodput ``server -> client`` over each number of parallel streams in
    ``counts``, one after the other (what the weight path's stream count is chosen from)."""
    a, b = bed.hosts[server], bed.hosts[client]
    rows = []
    for count in counts:
        relay_before = bed.relay_counters()
        sink = _start_server(bed, client, ["tcp-multi-sink", "9903"])
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", a.namespace, sys.executable, "-m", "benchmarks.wan.probe", "tcp-multi-send",
                 b.address, "9903", str(seconds), str(count)],
                capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=bed.env(),
            )  # fmt: skip
        finally:
            _stop_server(sink)
        relay_after = bed.relay_counters()
        drops = {
            host: {k: relay_after[host][k] - relay_before[host][k] for k in ("loss_drops", "queue_drops", "rx_frames")}
            for host in (server, client)
        }
        rows.append({**json.loads(done.stdout), "relay": drops})
    return rows
