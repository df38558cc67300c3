"""Transport throughput: echo2 endpoints against raw pyzmq, naive zmq.asyncio and mp.Queue.

    python benchmarks/transport.py [--quick] [--json] [--transports inproc,ipc,tcp]
                                   [--repeats N] [--check] [--cases small,batched,1MB,16MB]

For each transport and case, every contender moves the same messages, encoded and decoded
by the same echo2 ``Codec``, so the ratios isolate the transport layer (sockets, event
loop, framing), not serialization:

* ``echo2``: ``PushEndpoint.send`` per message, ``PullEndpoint.recv_many`` (the fast path),
  with the defaults a user gets: small messages sent back to back leave in bundles of up to
  64 (``SocketOptions.coalesce``); the producer ``flush()``es before its barrier;
* ``raw-sync``: synchronous pyzmq PUSH/PULL, ``copy=False`` for large frames;
* ``naive-asyncio``: ``zmq.asyncio``, awaiting every ``send_multipart``/``recv_multipart``;
* ``mp-queue``: ``multiprocessing.Queue`` carrying the encoded frames (not for inproc).

Cases: ``small`` (one ~100-byte ``MetricsRecord`` per message), ``batched`` (64 of the same
records in one message), ``1MB`` and ``16MB`` (a ``WeightChunk`` of uint8, sent as its own
zero-copy frame). Each case runs ``--repeats`` times (contenders interleaved) and reports the
median. Placement: for ipc and tcp the producer and the consumer are two spawned processes,
connected and warmed up, then started together by a barrier; the consumer's clock runs from
the barrier to the last message. For inproc everything runs in one process sharing one
ZeroMQ context (inproc requires it): echo2 and naive asyncio as two tasks on one event loop
(how co-located echo2 actors run), raw sync as two threads.

Read ratios, not absolute numbers: the machines are shared and noisy. The floors at the end
are the project's performance contract; ``--check`` turns a FAIL into a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from echo2.messages import Message, MetricsRecord, WeightChunk
from echo2.transport import Codec, Transport

TRANSPORTS = ("inproc", "ipc", "tcp")
CONTENDERS = ("echo2", "raw-sync", "naive-asyncio", "mp-queue")
BARRIER_TIMEOUT_S = 120.0
WARMUP_MESSAGES = 200


class RecordBatch(Message):
    """Benchmark-local message: many small records in one message (the batched case)."""

    records: list[MetricsRecord]


BenchMessage = MetricsRecord | RecordBatch | WeightChunk

RECORD = MetricsRecord(
    source="sampler-07",
    kind="rollout",
    time_s=1718000000.125,
    values={"reward": 0.75, "tokens": 123, "ok": True},
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    records: int  # records per message (1 unless batched)
    nbytes: int  # array bytes (0 for record cases)
    n_quick: int
    n_full: int

    def message(self) -> Message:
        if self.nbytes:
            return WeightChunk(incarnation=1, version=1, index=0, data=np.ones(self.nbytes, np.uint8))
        if self.records > 1:
            return RecordBatch(records=[RECORD] * self.records)
        return RECORD

    @property
    def large(self) -> bool:
        return self.nbytes > 0


CASES = (
    Case("small", records=1, nbytes=0, n_quick=20_000, n_full=100_000),
    Case("batched", records=64, nbytes=0, n_quick=1_500, n_full=6_000),
    Case("1MB", records=1, nbytes=1 << 20, n_quick=300, n_full=1_000),
    Case("16MB", records=1, nbytes=16 << 20, n_quick=24, n_full=80),
)
CASE_BY_NAME = {c.name: c for c in CASES}
# The naive contender is ~10x slower on small messages: fewer of them keep runs short.
NAIVE_SCALE = {"small": 0.25}

FLOORS = (
    ("small batched tcp: echo2 / raw-sync", "tcp", "batched", "echo2", "raw-sync", 0.5),
    ("small unbatched tcp: echo2 / naive-asyncio", "tcp", "small", "echo2", "naive-asyncio", 5.0),
    ("16 MB tcp: echo2 / raw-sync copy=False", "tcp", "16MB", "echo2", "raw-sync", 0.7),
)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured run: who, where, what, how many."""

    contender: str
    transport: str
    case: str
    n: int
    warmup: int


# ---------------------------------------------------------------- roles, per contender
#
# A role gets an ``Env``: where to bind or connect, a barrier ``sync`` (start, then done),
# and for inproc the shared context/transport. Receivers return the seconds from the
# start barrier to the last message; senders return None.


@dataclasses.dataclass
class Env:
    url: str  # bind URL for the receiver, connect URL for the sender
    sync: Callable[[], Any]  # blocking (threads/processes) or awaitable (tasks)
    report: Callable[[str], None] = lambda address: None  # receiver -> actual bound address
    context: Any = None  # shared zmq context (inproc)
    transport: Transport | None = None  # shared echo2 transport (inproc)
    queue: Any = None  # the mp.Queue (mp-queue contender)


async def _maybe_await(value: Any) -> None:
    if isinstance(value, Awaitable):
        await value


def _case_codec() -> Codec:
    return Codec(BenchMessage)


async def echo2_recv(env: Env, trial: Trial) -> float:
    transport = env.transport or Transport()
    try:
        pull = transport.pull(name="bench.pull", bind=[env.url], message_types=BenchMessage)
        env.report(pull.endpoints[0])
        got = 0
        while got < trial.warmup:
            got += len(await pull.recv_many())
        await _maybe_await(env.sync())
        start, got = time.perf_counter(), 0
        while got < trial.n:
            got += len(await pull.recv_many())
        elapsed = time.perf_counter() - start
        await _maybe_await(env.sync())
        pull.close()
        return elapsed
    finally:
        if env.transport is None:
            transport.close()


async def echo2_send(env: Env, trial: Trial) -> None:
    transport = env.transport or Transport()
    try:
        push = transport.push(name="bench.push", connect=[env.url], message_types=BenchMessage)
        message = CASE_BY_NAME[trial.case].message()
        for _ in range(trial.warmup):
            await push.send(message)
        await push.flush()  # the barrier below blocks this loop: hand the last bundle over
        await _maybe_await(env.sync())
        for _ in range(trial.n):
            await push.send(message)
        await push.flush()
        await _maybe_await(env.sync())
        push.close()
    finally:
        if env.transport is None:
            transport.close()


def raw_recv(env: Env, trial: Trial) -> float:
    context = env.context or zmq.Context()
    codec, copy = _case_codec(), not CASE_BY_NAME[trial.case].large
    sock = context.socket(zmq.PULL)
    try:
        sock.bind(env.url)
        env.report(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        for _ in range(trial.warmup):
            codec.decode(sock.recv_multipart(copy=copy))
        env.sync()
        start = time.perf_counter()
        for _ in range(trial.n):
            codec.decode(sock.recv_multipart(copy=copy))
        elapsed = time.perf_counter() - start
        env.sync()
        return elapsed
    finally:
        sock.close(linger=0)
        if env.context is None:
            context.term()


def raw_send(env: Env, trial: Trial) -> None:
    context = env.context or zmq.Context()
    codec, message = _case_codec(), CASE_BY_NAME[trial.case].message()
    sock = context.socket(zmq.PUSH)
    try:
        sock.connect(env.url)
        for _ in range(trial.warmup):
            sock.send_multipart(codec.encode(message), copy=False)
        env.sync()
        for _ in range(trial.n):
            sock.send_multipart(codec.encode(message), copy=False)
        env.sync()
    finally:
        sock.close(linger=0)
        if env.context is None:
            context.term()


async def naive_recv(env: Env, trial: Trial) -> float:
    context = env.context or zmq.asyncio.Context()
    codec, copy = _case_codec(), not CASE_BY_NAME[trial.case].large
    sock = context.socket(zmq.PULL)
    try:
        sock.bind(env.url)
        env.report(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        for _ in range(trial.warmup):
            codec.decode(await sock.recv_multipart(copy=copy))
        await _maybe_await(env.sync())
        start = time.perf_counter()
        for _ in range(trial.n):
            codec.decode(await sock.recv_multipart(copy=copy))
        elapsed = time.perf_counter() - start
        await _maybe_await(env.sync())
        return elapsed
    finally:
        sock.close(linger=0)
        if env.context is None:
            context.term()


async def naive_send(env: Env, trial: Trial) -> None:
    context = env.context or zmq.asyncio.Context()
    codec, message = _case_codec(), CASE_BY_NAME[trial.case].message()
    sock = context.socket(zmq.PUSH)
    try:
        sock.connect(env.url)
        for _ in range(trial.warmup):
            await sock.send_multipart(codec.encode(message), copy=False)
        await _maybe_await(env.sync())
        for _ in range(trial.n):
            await sock.send_multipart(codec.encode(message), copy=False)
        await _maybe_await(env.sync())
    finally:
        sock.close(linger=0)
        if env.context is None:
            context.term()


def _picklable(frames: list[Any]) -> list[Any]:
    """Frames for pickling: the header as bytes, data frames as (zero-copy) uint8 arrays."""
    return [frames[0], *(np.frombuffer(f, np.uint8) for f in frames[1:])]


def queue_recv(env: Env, trial: Trial) -> float:
    codec = _case_codec()
    env.report("mp-queue")
    for _ in range(trial.warmup):
        codec.decode(env.queue.get())
    env.sync()
    start = time.perf_counter()
    for _ in range(trial.n):
        codec.decode(env.queue.get())
    elapsed = time.perf_counter() - start
    env.sync()
    return elapsed


def queue_send(env: Env, trial: Trial) -> None:
    codec, message = _case_codec(), CASE_BY_NAME[trial.case].message()
    for _ in range(trial.warmup):
        env.queue.put(_picklable(codec.encode(message)))
    env.sync()
    for _ in range(trial.n):
        env.queue.put(_picklable(codec.encode(message)))
    env.sync()


ROLES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "echo2": (echo2_recv, echo2_send),
    "raw-sync": (raw_recv, raw_send),
    "naive-asyncio": (naive_recv, naive_send),
    "mp-queue": (queue_recv, queue_send),
}


def run_role(role: Callable[..., Any], env: Env, trial: Trial) -> Any:
    if inspect.iscoroutinefunction(role):
        return asyncio.run(role(env, trial))
    return role(env, trial)


# ------------------------------------------------------------------- inproc: one process


def run_inproc(trial: Trial) -> float:
    recv_role, send_role = ROLES[trial.contender]
    url = f"inproc://bench-{trial.contender}-{trial.case}-{time.monotonic_ns()}"
    if trial.contender == "echo2" or trial.contender == "naive-asyncio":

        async def both() -> float:
            barrier = asyncio.Barrier(2)
            shared: dict[str, Any] = {}
            if trial.contender == "echo2":
                shared["transport"] = Transport()
            else:
                shared["context"] = zmq.asyncio.Context()
            try:
                env = Env(url=url, sync=barrier.wait, **shared)
                async with asyncio.TaskGroup() as tg:
                    receiving = tg.create_task(recv_role(env, trial))
                    tg.create_task(send_role(env, trial))
                return receiving.result()
            finally:
                if "transport" in shared:
                    shared["transport"].close()
                else:
                    shared["context"].term()

        return asyncio.run(both())

    context = zmq.Context()
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
    env = Env(url=url, sync=barrier.wait, context=context)
    result: dict[str, Any] = {}

    def receiver() -> None:
        try:
            result["elapsed"] = recv_role(env, trial)
        except BaseException as exc:  # reported by the caller below
            result["error"] = exc
            barrier.abort()

    thread = threading.Thread(target=receiver, name="bench-recv")
    thread.start()
    try:
        send_role(env, trial)
    except BaseException:
        barrier.abort()
        raise
    finally:
        thread.join()
        context.term()
    if "error" in result:
        raise result["error"]
    return result["elapsed"]


# ------------------------------------------------------- ipc / tcp: two spawned processes


def worker_main(conn: Any, barrier: Any, queue: Any) -> None:
    """A benchmark process: runs one role per command until told to stop."""

    def sync() -> None:
        barrier.wait(BARRIER_TIMEOUT_S)

    while True:
        command = conn.recv()
        if command is None:
            return
        side, trial_fields, url = command
        trial = Trial(**trial_fields)
        role = ROLES[trial.contender][0 if side == "recv" else 1]
        env = Env(url=url, sync=sync, queue=queue, report=lambda a: conn.send(("address", a)))
        try:
            conn.send(("done", run_role(role, env, trial)))
        except BaseException:
            barrier.abort()
            conn.send(("error", traceback.format_exc()))


class ProcessPair:
    """Two spawned worker processes (consumer, producer) reused for every trial.

    A trial that fails on either side restarts both processes, so that a consumer left
    waiting for a producer that died cannot hang the rest of the run.
    """

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="e2b-", dir="/tmp")
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(2)
        self.queue = ctx.Queue(maxsize=1000)
        self.conns, self.procs = [], []
        for name in ("bench-consumer", "bench-producer"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, self.barrier, self.queue), name=name, daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def _stop(self, graceful: bool) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if graceful:
                conn.send(None)
                proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
            conn.close()
        self.queue.close()

    def run(self, trial: Trial) -> float:
        try:
            return self._run(trial)
        except BaseException:
            self._stop(graceful=False)
            self._start()
            raise

    def _run(self, trial: Trial) -> float:
        consumer, producer = self.conns
        if trial.transport == "tcp":
            url = "tcp://127.0.0.1:0"
        else:
            url = f"ipc://{self.ipc_dir}/{trial.contender}-{trial.case}.sock"
        fields = dataclasses.asdict(trial)
        consumer.send(("recv", fields, url))
        kind, address = self._replies([consumer])[consumer]
        if kind != "address":
            raise RuntimeError(f"consumer failed before binding:\n{address}")
        producer.send(("send", fields, address))
        replies = self._replies([consumer, producer])
        self.barrier.reset()
        return replies[consumer][1]

    def _replies(self, conns: list[Any]) -> dict[Any, tuple[str, Any]]:
        """One reply from each of ``conns``; the first error (from either side) raises."""
        out: dict[Any, tuple[str, Any]] = {}
        deadline = time.monotonic() + BARRIER_TIMEOUT_S + 30
        while len(out) < len(conns):
            waiting = [c for c in conns if c not in out]
            ready = mp.connection.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("a benchmark process stopped answering")
            for conn in ready:
                out[conn] = conn.recv()
                if out[conn][0] == "error":
                    raise RuntimeError(out[conn][1])
        return out

    def close(self) -> None:
        self._stop(graceful=True)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- reporting


@dataclasses.dataclass
class Result:
    transport: str
    case: str
    contender: str
    n: int
    message_bytes: int
    records: int
    seconds: list[float]

    @property
    def msgs_per_s(self) -> float:
        rates = [self.n / s for s in self.seconds if s > 0]
        return statistics.median(rates) if rates else math.nan

    @property
    def gb_per_s(self) -> float:
        return self.msgs_per_s * self.message_bytes / 1e9


def message_bytes(case: Case) -> int:
    return sum(memoryview(f).nbytes for f in _case_codec().encode(case.message()))


def contenders_for(transport: str) -> list[str]:
    return [c for c in CONTENDERS if not (transport == "inproc" and c == "mp-queue")]


def measure(
    transports: list[str], cases: list[Case], repeats: int, quick: bool, log: Callable[[str], None]
) -> list[Result]:
    results: dict[tuple[str, str, str], Result] = {}
    pair = ProcessPair() if any(t != "inproc" for t in transports) else None
    try:
        for transport in transports:
            for case in cases:
                size = message_bytes(case)
                for _ in range(repeats):
                    for contender in contenders_for(transport):
                        n = case.n_quick if quick else case.n_full
                        if contender == "naive-asyncio":
                            n = max(1, int(n * NAIVE_SCALE.get(case.name, 1.0)))
                        warmup = min(WARMUP_MESSAGES, max(2, n // 10))
                        trial = Trial(contender, transport, case.name, n, warmup)
                        key = (transport, case.name, contender)
                        result = results.setdefault(
                            key, Result(transport, case.name, contender, n, size, case.records, [])
                        )
                        try:
                            seconds = run_inproc(trial) if transport == "inproc" else pair.run(trial)  # type: ignore[union-attr]
                        except Exception as exc:  # a failed trial is reported, not fatal
                            log(f"!! {transport}/{case.name}/{contender} failed: {exc}")
                            seconds = math.nan
                        result.seconds.append(seconds)
                log(f".. {transport} {case.name} done")
    finally:
        if pair is not None:
            pair.close()
    return list(results.values())


def ratio_to(results: list[Result], r: Result, baseline: str) -> float:
    for other in results:
        if (other.transport, other.case, other.contender) == (r.transport, r.case, baseline):
            return r.msgs_per_s / other.msgs_per_s if other.msgs_per_s > 0 else math.nan
    return math.nan


def _json_number(value: float, digits: int) -> float | None:
    """JSON has no NaN: a failed measurement is null."""
    return None if math.isnan(value) else round(value, digits)


def floors(results: list[Result]) -> list[dict[str, Any]]:
    index = {(r.transport, r.case, r.contender): r for r in results}
    out = []
    for name, transport, case, contender, baseline, floor in FLOORS:
        a, b = index.get((transport, case, contender)), index.get((transport, case, baseline))
        if a is None or b is None:
            out.append({"floor": name, "ratio": None, "min": floor, "result": "SKIP"})
            continue
        ratio = a.msgs_per_s / b.msgs_per_s if b.msgs_per_s > 0 else math.nan
        verdict = "PASS" if ratio >= floor else "FAIL"
        out.append({"floor": name, "ratio": _json_number(ratio, 3), "min": floor, "result": verdict})
    return out


def print_table(results: list[Result], repeats: int) -> None:
    header = f"{'transport':9} {'case':8} {'contender':14} {'msgs/s':>11} {'records/s':>11} {'GB/s':>7} {'vs raw':>7}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.transport:9} {r.case:8} {r.contender:14} {r.msgs_per_s:11,.0f} "
            f"{r.msgs_per_s * r.records:11,.0f} {r.gb_per_s:7.3f} {ratio_to(results, r, 'raw-sync'):7.2f}"
        )
    print(
        f"\nmedian of {repeats} runs; the same Codec encodes and decodes for every contender. "
        "inproc: one process, one shared ZeroMQ context (echo2 and naive asyncio: two tasks on "
        "one loop; raw sync: two threads). ipc/tcp: producer and consumer in two spawned "
        "processes, warmed up, started by a barrier. inproc passes large frames by reference "
        "(zero-copy), so its GB/s is not a bandwidth; mp-queue is the same pipe on both rows."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages and 2 repeats (< 60 s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated subset")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (default 5, quick 2)")
    parser.add_argument("--check", action="store_true", help="exit non-zero when a floor fails")
    parser.add_argument("--cases", default=",".join(CASE_BY_NAME), help="comma-separated subset")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"unknown transport(s) {unknown}; choose from {', '.join(TRANSPORTS)}")
    cases = [CASE_BY_NAME[c] for c in args.cases.split(",") if c in CASE_BY_NAME]
    if not cases or len(cases) != len([c for c in args.cases.split(",") if c]):
        parser.error(f"--cases: choose from {', '.join(CASE_BY_NAME)}")
    repeats = args.repeats or (2 if args.quick else 5)
    if repeats < 1:
        parser.error("--repeats must be at least 1")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    started = time.perf_counter()
    results = measure(transports, cases, repeats, args.quick, log)
    checks = floors(results)
    log(f".. {time.perf_counter() - started:.1f} s in all")
    if args.json:
        for r in results:
            print(
                json.dumps(
                    {
                        "transport": r.transport,
                        "case": r.case,
                        "contender": r.contender,
                        "msgs_per_s": _json_number(r.msgs_per_s, 1),
                        "records_per_s": _json_number(r.msgs_per_s * r.records, 1),
                        "gb_per_s": _json_number(r.gb_per_s, 4),
                        "ratio_to_raw_sync": _json_number(ratio_to(results, r, "raw-sync"), 3),
                        "messages": r.n,
                        "message_bytes": r.message_bytes,
                        "repeats": len(r.seconds),
                        "seconds": [_json_number(s, 5) for s in r.seconds],
                    }
                )
            )
        for check in checks:
            print(json.dumps(check))
    else:
        print_table(results, repeats)
        print("\nfloors:")
        for check in checks:
            ratio = "n/a" if check["ratio"] is None else f"{check['ratio']:.2f}"
            if check["result"] == "FAIL" and check["ratio"] is None:
                ratio = "failed to measure"
            print(f"  {check['result']:4}  {check['floor']}: {ratio} (floor {check['min']})")
    failed = any(c["result"] == "FAIL" for c in checks)
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
