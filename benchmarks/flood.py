"""Flood: a running job's memory and throughput while hostile frames hit its data process.

    python -m benchmarks.flood [--seconds 60] [--frames 1000000] [--big-frames 20] [--json]

One invocation runs examples/topology.toml twice for the same wall-clock length: fault-free
(the baseline), then with a flooder process sending ``--frames`` hostile messages spread
over the run to every socket the data process binds (PromptSource, Rewarder, Buffer):
random bytes, frames that pass the magic check and fail later, well-formed messages whose
fields contradict each other (``echo2.transport.consistency``), requests for absurd
amounts (credits of 10^6 from a peer never welcomed), and ``--big-frames`` frames of
200 MB. Every process's peak RSS (``VmHWM``, polled from /proc while it runs) is reported
against the same process's in the fault-free run, with learner steps per minute (the
trained throughput: every step trains ``groups_per_step`` groups) as a ratio too.
Floors (issue 18): every process's peak RSS <= 2x its fault-free peak; throughput >= 0.9x.
The flooder counts the connections the data process closed on it (its oversized frames).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from benchmarks.chaos import _bound_urls, _launch, _run_dir, _steps_per_minute
from echo2.rundir import RunDir

BIG_FRAME_BYTES = 200 * 1024 * 1024


def _inconsistent_frames() -> list[list[bytes]]:
    """Well-formed messages that no honest peer sends: each is dropped at decode or served
    no more than the configuration allows."""
    from echo2.messages import BatchRequest, ChunkRequest, RolloutGroup, ScoredGroup, WeightManifest, WorkRequest
    from echo2.transport import Codec

    group = RolloutGroup(
        lease_id=1, task_id="t", attempt=0, sampler_id="evil", incarnation=0, version=0, prompt="1+1=",
        prompt_token_ids=np.arange(4, dtype=np.int32), token_ids=np.arange(8, dtype=np.int32),
        logprobs=np.zeros(8, np.float32), offsets=np.array([0, 6, 3, 8], np.int32),
        texts=["a", "b", "c"], finish_reasons=["eos"] * 3,
    )  # fmt: skip
    messages = [
        WorkRequest(sampler_id="evil", credits=10**6),
        BatchRequest(request_id=1, incarnation=0, version=0, num_groups=10**6),
        ChunkRequest(sampler_id="evil", incarnation=0, version=1, indices=[-1, 2, 3]),
        WeightManifest(
            incarnation=0,
            version=1,
            total_bytes=1 << 30,
            chunk_bytes=1 << 20,
            tensors=[],
            chunk_digests=[b"x" * 32],
            digest=b"x" * 32,
            published_at_s=0.0,
        ),
        group,
        ScoredGroup(group=group, rewards=np.zeros(5, np.float32), keep=np.ones(1, bool)),
    ]
    codec = Codec()
    return [[bytes(memoryview(f).cast("B")) for f in codec.encode(m)] for m in messages]


def _flood(targets: list[tuple[str, int]], total: int, big: int, seconds: float, stop: Any, out: Any) -> None:
    """Send ``total`` hostile messages (``big`` of them 200 MB) over ``seconds``."""
    context = zmq.Context()
    sockets, monitors = [], []
    for url, kind in targets:
        s = context.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        monitors.append(s.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        s.connect(url)
        sockets.append(s)
    rng = random.Random(0)
    inconsistent = _inconsistent_frames()
    huge = memoryview(b"\xe2\x01" + bytes(BIG_FRAME_BYTES - 2))  # one buffer, sent zero-copy
    big_every = max(1, total // big) if big else 0
    sent = refused = big_sent = closed = 0
    started = time.monotonic()
    interval = seconds / max(total, 1)
    try:
        while sent < total and not stop.is_set():
            pick = rng.random()
            if big_every and sent % big_every == big_every // 2:
                frames: list[Any] = [huge]
                big_sent += 1
            elif pick < 0.3:
                frames = rng.choice(inconsistent)
            else:
                frames = [rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 3))]
                if pick < 0.5:
                    frames[0] = b"\xe2\x01" + frames[0]  # passes the magic check, fails later
            try:
                sockets[sent % len(sockets)].send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                refused += 1  # a full pipe (or a connection just closed on us): not delivered
            sent += 1
            ahead = started + sent * interval - time.monotonic()
            if ahead > 0.05:  # pace in bursts: the flooder's CPU must not be the fault
                stop.wait(ahead)
    finally:
        for monitor in monitors:
            while True:
                try:
                    monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                closed += 1
            monitor.close(linger=0)
        for s in sockets:
            s.disable_monitor()
            s.close(linger=0)
        context.term()
    out.put({"sent": sent, "not_queued": refused, "big_sent": big_sent, "connections_closed_on_us": closed})


def _peak_rss(pid: int) -> int:
    """Peak resident set of a live process, bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _watch_rss(run: RunDir, peaks: dict[str, int], stop: threading.Event) -> None:
    while not stop.wait(0.25):
        try:
            pids = json.loads(run.pids_path.read_text())["processes"]
        except (OSError, ValueError):
            continue
        for name, pid in pids.items():
            peaks[name] = max(peaks.get(name, 0), _peak_rss(pid))


def run_case(seconds: float, *, frames: int, big: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="echo2-flood-") as parent_name:
        parent = Path(parent_name)
        launcher = _launch(parent, seconds)
        peaks: dict[str, int] = {}
        stop_watch = threading.Event()
        context = multiprocessing.get_context("spawn")
        stop, out = context.Event(), context.Queue()
        flooder = None
        try:
            run = _run_dir(parent)
            watcher = threading.Thread(target=_watch_rss, args=(run, peaks, stop_watch))
            watcher.start()
            if frames:
                flooder = context.Process(target=_flood, args=(_bound_urls(run), frames, big, seconds * 0.8, stop, out))
                flooder.start()
            output, _ = launcher.communicate(timeout=seconds + 120)
        finally:
            stop.set()
            flood = out.get(timeout=60) if flooder is not None else {}
            if flooder is not None:
                flooder.join(timeout=30)
            stop_watch.set()
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        watcher.join()
        spm, steps = _steps_per_minute(run)
        return {
            "case": "flood" if frames else "fault-free",
            "seconds": seconds,
            "exit_code": launcher.returncode,
            "steps": steps,
            "steps_per_min": round(spm, 1),
            "peak_rss_mb": {name: round(b / 2**20, 1) for name, b in sorted(peaks.items())},
            "decode_error_log_lines": sum(1 for line in output.splitlines() if "dropped a malformed message" in line),
            "crashes": sum(1 for line in output.splitlines() if "failed with" in line or "died with" in line),
            **flood,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--big-frames", type=int, default=20, help="of the frames, how many are 200 MB")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    base = run_case(args.seconds, frames=0, big=0)
    flood = run_case(args.seconds, frames=args.frames, big=args.big_frames)
    rss_ratio = {
        name: round(flood["peak_rss_mb"][name] / mb, 2)
        for name, mb in base["peak_rss_mb"].items()
        if mb and name in flood["peak_rss_mb"]
    }
    throughput = round(flood["steps_per_min"] / base["steps_per_min"], 3) if base["steps_per_min"] else None
    summary = {
        "case": "floors",
        "peak_rss_ratio": rss_ratio,
        "steps_per_min_ratio": throughput,
        "every peak RSS <= 2x fault-free": bool(rss_ratio) and max(rss_ratio.values()) <= 2.0,
        "throughput >= 0.9x": throughput is not None and throughput >= 0.9,
        "0 crashes": flood["crashes"] == 0,
    }
    for record in (base, flood, summary):
        print(json.dumps(record) if args.json else record, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
