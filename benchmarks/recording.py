"""What recording a port costs: echo2 PUSH -> PULL throughput with the receiving port
recorded (``[run] record``, ``echo2.transport.recording``) against the same run unrecorded.

    python benchmarks/recording.py [--quick] [--repeats N] [--json]

One process, one event loop, inproc (how co-located actors run, and where the transport's
own cost is the largest share, so the ratio is the least flattering). Cases from
``benchmarks/transport.py``: ``small`` (one ~100-byte record per message, sent in bundles,
recorded as one record per bundle), ``batched`` (64 records per message) and ``1MB`` (a
weight chunk, its array a frame of its own). Off and on are interleaved, ``--repeats``
times each; the report is the median throughput of each and their ratio (on / off; 1.0 is
free). The recording goes to a temporary directory on the same disk as ``$TMPDIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.transport import CASE_BY_NAME, WARMUP_MESSAGES, BenchMessage, Case
from echo2.transport import Transport
from echo2.transport.recording import DEFAULT_MAX_BYTES

CASES = ("small", "batched", "1MB")


async def one_run(case: Case, n: int, record_to: Path | None) -> float:
    """Messages per second from the first measured send to the last receive."""
    message = case.message()
    async with Transport() as transport:
        pull = transport.pull(name="bench.pull", bind=["inproc://bench-recording"], message_types=BenchMessage)
        push = transport.push(name="bench.push", connect=["inproc://bench-recording"], message_types=BenchMessage)
        if record_to is not None:
            pull.record_to(record_to, actor="bench", port="pull", socket="pull", max_bytes=DEFAULT_MAX_BYTES * 64)

        async def send(count: int) -> None:
            for _ in range(count):
                await push.send(message)
            await push.flush()

        async def receive(count: int) -> None:
            got = 0
            while got < count:
                got += len(await pull.recv_many())

        await asyncio.gather(send(WARMUP_MESSAGES), receive(WARMUP_MESSAGES))
        started = time.perf_counter()
        await asyncio.gather(send(n), receive(n))
        elapsed = time.perf_counter() - started
        push.close()
        pull.close()
    return n / elapsed


def measure(case_name: str, n: int, repeats: int, directory: Path) -> dict[str, Any]:
    case = CASE_BY_NAME[case_name]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(repeats):
        rates["off"].append(asyncio.run(one_run(case, n, None)))
        path = directory / f"{case_name}-{repeat}.rec"
        rates["on"].append(asyncio.run(one_run(case, n, path)))
        path.unlink()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {
        "case": case_name,
        "messages": n,
        "repeats": repeats,
        "off_msg_per_s": round(off),
        "on_msg_per_s": round(on),
        "ratio_on_off": round(on / off, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each (default 7, quick 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    with tempfile.TemporaryDirectory(prefix="echo2-bench-rec-") as tmp:
        for name in CASES:
            case = CASE_BY_NAME[name]
            result = measure(name, case.n_quick if args.quick else case.n_full, repeats, Path(tmp))
            if args.json:
                print(json.dumps(result))
            else:
                print(
                    f"{name:8s} off {result['off_msg_per_s']:>9,} msg/s  on {result['on_msg_per_s']:>9,} msg/s"
                    f"  on/off {result['ratio_on_off']:.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
