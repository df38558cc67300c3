"""The pure chunk layer (manifests, assembly, verification) and the link emulation."""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest

from echo2.messages import Snapshot, WeightChunk, WeightManifest
from echo2.weights import announce_url, bcast_threshold, relay_bind_url
from echo2.weights.chunks import (
    ManifestRejected,
    SnapshotAssembler,
    check_manifest,
    digest,
    flatten_tensors,
    iter_chunks,
    make_manifest,
)
from echo2.weights.link import DelayLine, LinkSpec, TokenBucket, mbps_to_bytes_per_s


def snapshot(nbytes: int = 10_000, version: int = 1) -> Snapshot:
    rng = np.random.default_rng(version)
    specs, flat = flatten_tensors(
        {
            "a": rng.standard_normal((nbytes // 8,)).astype(np.float32),
            "b": np.arange(7, dtype=np.int64),
        }
    )
    return Snapshot(incarnation=2, version=version, tensors=specs, data=flat, created_at_s=0.0)


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b-256"])
def test_assembled_snapshot_is_byte_equal_and_unflattens(algorithm: str) -> None:
    snap = snapshot()
    manifest = make_manifest(snap, chunk_bytes=1024, algorithm=algorithm)
    assert manifest.digest_algorithm == algorithm
    assembler = SnapshotAssembler(manifest)
    chunks = list(iter_chunks(snap, manifest))
    for chunk in reversed(chunks):
        assert assembler.add(chunk)
        assert not assembler.add(chunk)  # duplicates are not stored twice
    assert assembler.complete and assembler.missing() == []
    assert digest(assembler.buffer) == digest(snap.data)
    assert assembler.tensors()["b"].tolist() == list(range(7))
    held = assembler.chunk(3)
    assert not held.data.flags.writeable and bytes(held.data) == bytes(chunks[3].data)


def test_corrupt_and_misfit_chunks_are_counted_not_stored() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, chunk_bytes=1024)
    assembler = SnapshotAssembler(manifest)
    good = next(iter_chunks(snap, manifest))
    bad = np.array(good.data)
    bad[10] ^= 1
    assert not assembler.add(msgspec.structs.replace(good, data=bad))
    assert not assembler.add(msgspec.structs.replace(good, data=np.array(good.data[:-1])))
    assert assembler.corrupt_chunks == 2
    assert not assembler.add(msgspec.structs.replace(good, version=99))  # another version: ignored
    assert assembler.missing()[0] == 0
    assert assembler.add(good)
    with pytest.raises(RuntimeError):
        assembler.tensors()


@pytest.mark.parametrize(
    "change",
    [
        {"digest": b"\x00" * 32},
        {"chunk_digests": None},  # one chunk digest altered
        {"total_bytes": 1},
        {"chunk_bytes": 0},
        {"digest_algorithm": "md5"},
    ],
)
def test_inconsistent_manifests_are_rejected(change: dict) -> None:
    manifest = make_manifest(snapshot(), chunk_bytes=1024)
    if change.get("chunk_digests", 0) is None:
        digests = list(manifest.chunk_digests)
        digests[1] = b"\x01" * 32
        change = {"chunk_digests": digests}
    forged = msgspec.structs.replace(manifest, **change)
    with pytest.raises(ManifestRejected):
        check_manifest(forged)
    with pytest.raises(ManifestRejected):
        SnapshotAssembler(forged)


def test_token_bucket_paces_to_its_rate() -> None:
    bucket = TokenBucket(mbps_to_bytes_per_s(8.0), burst_bytes=1000)  # 1 MB/s
    now = 100.0
    waits = [bucket.delay_for(1000, now=now) for _ in range(5)]
    assert waits[0] == 0.0
    assert waits[-1] == pytest.approx(4 * 1000 / 1e6)
    assert TokenBucket(0).delay_for(10**9) == 0.0


async def test_token_bucket_acquire_waits_in_real_time() -> None:
    bucket = LinkSpec(uplink_mbps=80.0).uplink(burst_bytes=100_000)  # 10 MB/s
    started = time.monotonic()
    for _ in range(10):
        await bucket.acquire(100_000)  # 1 MB
    # A lower bound only: the pacing itself is exact in test_token_bucket_paces_to_its_rate,
    # and a loaded machine may add any delay on top.
    assert time.monotonic() - started >= 0.085


class FakeClock:
    """A monotonic clock that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


async def test_delay_line_adds_latency_and_keeps_order() -> None:
    clock = FakeClock()
    line: DelayLine[int] = DelayLine(0.05, clock=clock, sleep=clock.sleep)
    for i in range(5):
        line.put_nowait(i)
    got = [await line.get() for _ in range(5)]
    assert got == list(range(5))
    assert clock.now - 1000.0 == pytest.approx(0.05)  # pipelined: one latency, not five
    clock.now += 1.0
    line.put_nowait(5)
    assert await line.get() == 5 and clock.slept[-1] == pytest.approx(0.05)  # each item waits its own


async def test_delay_line_waits_in_real_time() -> None:
    line: DelayLine[int] = DelayLine(0.05)
    started = time.monotonic()
    line.put_nowait(0)
    assert await line.get() == 0
    assert time.monotonic() - started >= 0.045  # a lower bound: a loaded machine may add any delay


def test_bcast_threshold_is_a_fraction_one_over_gamma() -> None:
    assert [bcast_threshold(n) for n in (0, 1, 2, 8, 10, 11, 20)] == [
        0,
        1,
        2,
        8,
        10,
        10,
        19,
    ]


def test_relay_addresses_follow_the_control_medium() -> None:
    assert relay_bind_url("inproc://x/weights", "s0").startswith("inproc://echo2-relay/s0-")
    ipc = relay_bind_url("ipc:///tmp/echo2-r/weights", "s0")
    assert ipc.startswith("ipc:///tmp/echo2-r/relay-") and len(ipc) < 100
    assert relay_bind_url("tcp://10.1.2.3:47000", "s0") == "tcp://*:0"
    assert announce_url("tcp://0.0.0.0:5555", "tcp://127.0.0.1:47000") == "tcp://127.0.0.1:5555"
    assert announce_url("tcp://0.0.0.0:5555", "tcp://10.0.0.1:1", relay_host="h7") == "tcp://h7:5555"


def test_manifest_round_trips_through_the_codec() -> None:
    from echo2.transport import Codec

    manifest = make_manifest(snapshot(), chunk_bytes=4096)
    codec = Codec()
    assert codec.decode(codec.encode(manifest)) == manifest
    chunk = next(iter_chunks(snapshot(), manifest))
    decoded = codec.decode([bytes(memoryview(f).cast("B")) for f in codec.encode(chunk)])
    assert isinstance(decoded, WeightChunk) and bytes(decoded.data) == bytes(chunk.data)
    assert isinstance(manifest, WeightManifest)
