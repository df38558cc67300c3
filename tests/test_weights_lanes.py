"""Parallel chunk streams per hop (``echo2.weights.lanes``), how many (``StreamCount``) and
the chunk size that follows (``chunk_bytes_for``), and the kernel's view of a stream."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
from tests.polling import until
from tests.test_chunkstream import iter_chunks, snapshot

from echo2.messages import WeightChunk
from echo2.weights.chunks import SnapshotAssembler, make_manifest
from echo2.weights.lanes import Lanes, Outcome
from echo2.weights.pacing import MIN_CHUNK_BYTES, PathSample, StreamCount, chunk_bytes_for
from echo2.weights.stream import ChunkStreamSender, ChunkStreamServer, tcp_info

MB = 1 << 20


def _sample(streams: int, goodput_bps: float, *, loss: float = 0.01, rtt_s: float = 0.2, queue_s: float = 0.0,
            seconds: float = 2.0, utilization: float = 1.0) -> PathSample:  # fmt: skip
    acked = int(goodput_bps * seconds)
    return PathSample(
        streams=streams, seconds=seconds, acked_bytes=acked, sent_bytes=int(acked * (1 + loss)),
        retrans_bytes=int(acked * loss), rtt_s=rtt_s + queue_s, min_rtt_s=rtt_s, utilization=utilization,
    )  # fmt: skip


RENO_STREAM = 80_000.0  # bytes/s: one reno stream at 200 ms and 1% loss (measured: ~0.6 Mbit/s)


def test_loss_bound_streams_multiply_until_the_cap_and_a_clean_path_keeps_one() -> None:
    count = StreamCount(cap=128)
    seen = [count.n]
    while count.n < 128 and len(seen) < 20:  # each stream keeps its loss-bound share: streams add up
        seen.append(count.observe(_sample(count.n, RENO_STREAM * count.n)))
    assert seen == [1, 4, 16, 32, 64, 128]
    assert count.observe(_sample(128, RENO_STREAM * 128)) == 128  # the cap holds

    clean = StreamCount(cap=128)
    for _ in range(5):  # no retransmission: one stream is not loss-bound
        assert clean.observe(_sample(1, 50e6, loss=0.0)) == 1


def test_more_streams_that_buy_nothing_go_back_and_hold() -> None:
    count = StreamCount(cap=128, hold=3)
    assert count.observe(_sample(1, 6e6)) == 2  # 6 MB/s on one stream at 1%: not loss-bound (bbr), doubled
    assert count.observe(_sample(2, 6.2e6)) == 1  # the link was the limit: back, and held
    for _ in range(3):
        assert count.observe(_sample(1, 6e6)) == 1
    assert count.observe(_sample(1, 6e6)) == 2  # the hold is over: it tries again


def test_a_standing_queue_sheds_streams_and_short_or_idle_periods_decide_nothing() -> None:
    count = StreamCount(cap=128, initial=64)
    assert count.observe(_sample(64, 11e6, queue_s=0.08)) == 48  # a queue stands: the link is full
    assert count.observe(_sample(48, 1e5, seconds=0.1)) == 48  # under two round trips
    assert count.observe(_sample(48, 11e6, utilization=0.4)) == 48  # the lanes mostly waited for chunks
    assert count.observe(_sample(8, 11e6)) == 48  # fewer streams busy than allowed: nothing to learn
    with pytest.raises(ValueError):
        StreamCount(cap=4, floor=8)


def test_chunks_shrink_with_the_streams_a_version_is_spread_over() -> None:
    assert chunk_bytes_for(32 * MB, 1, MB) == MB  # one stream: the size tuned for clean paths
    assert chunk_bytes_for(32 * MB, 16, MB) == MB
    assert chunk_bytes_for(32 * MB, 64, MB) == 256 << 10  # two chunks per stream
    assert chunk_bytes_for(3 * MB, 128, MB) == MIN_CHUNK_BYTES  # never below the floor
    assert chunk_bytes_for(16 << 30, 128, MB) == MB  # 16 GB: at most MAX_CHUNKS digests
    assert chunk_bytes_for(10 * MB, 8, MB) % 4096 == 0
    assert chunk_bytes_for(4096, 4, 1024) == 1024  # a configured size below the floor stays


# -- lanes on real sockets ------------------------------------------------------------


class Inbox:
    """A chunk stream server assembling one version, counting the connections it saw."""

    def __init__(self, assembler: SnapshotAssembler) -> None:
        self.assembler = assembler
        self.got: list[WeightChunk] = []
        self.arrived = asyncio.Event()
        self.server = ChunkStreamServer(self.deliver, self.destination, assembler.release)
        self.peers: set[tuple[str, int]] = set()

    def deliver(self, chunk: WeightChunk) -> None:
        assert self.assembler.offer(chunk) == "stored"
        self.got.append(chunk)
        self.server.taken()
        for connection in self.server._connections:
            if connection.transport is not None:
                self.peers.add(connection.transport.get_extra_info("peername"))
        if self.assembler.complete:
            self.arrived.set()

    def destination(self, key: object, index: int, nbytes: int) -> np.ndarray | None:
        return self.assembler.destination(index, nbytes)


def _open(address: str) -> ChunkStreamSender:
    return ChunkStreamSender(address, stall_timeout_s=1.0, connect_timeout_s=1.0)


async def test_lanes_spread_a_version_over_parallel_connections_and_it_lands_whole() -> None:
    snap = snapshot(48 * 64 * 1024)
    manifest = make_manifest(snap, 64 * 1024)
    inbox = Inbox(SnapshotAssembler(manifest))
    address = f"chunkstream://127.0.0.1:{await inbox.server.start('127.0.0.1')}"
    outcomes: list[Outcome] = []
    async with asyncio.TaskGroup() as group:
        lanes = Lanes(lambda: _open(address), group=group, count=StreamCount(cap=8, initial=8), name="test")
        try:
            for chunk in iter_chunks(snap, manifest):
                assert await lanes.put(chunk, outcomes.append, tag=manifest.version)
            async with asyncio.timeout(10):
                await inbox.arrived.wait()
            assert lanes.streams == 8
        finally:
            lanes.close()
            inbox.server.close()
    assert bytes(inbox.assembler.buffer) == bytes(snap.data)
    assert outcomes.count("sent") == len(manifest.chunk_digests)
    assert len(inbox.peers) == 8  # eight connections carried the version


async def test_queued_chunks_of_a_superseded_version_are_discarded_not_sent() -> None:
    with socket.socket() as listener:  # accepts, never reads: the lanes back up
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"chunkstream://127.0.0.1:{listener.getsockname()[1]}"
        outcomes: dict[int, Outcome] = {}
        async with asyncio.TaskGroup() as group:
            lanes = Lanes(lambda: _open(address), group=group, count=StreamCount(cap=2, initial=2), name="test")
            try:
                chunks = [WeightChunk(1, 1, i, np.zeros(8 * MB, np.uint8)) for i in range(4)]
                for chunk in chunks:
                    assert await lanes.put(chunk, lambda o, i=chunk.index: outcomes.__setitem__(i, o), tag=(1, 1))
                assert lanes.discard(lambda tag: tag != (1, 1)) == 2  # two queued, two in the lanes
                assert sorted(i for i, o in outcomes.items() if o == "discarded") == [2, 3]
            finally:
                lanes.close()


async def test_a_peer_that_is_gone_fails_the_lanes_once_and_every_later_put() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"chunkstream://127.0.0.1:{probe.getsockname()[1]}"  # nobody listens
    outcomes: list[Outcome] = []
    async with asyncio.TaskGroup() as group:
        lanes = Lanes(lambda: _open(address), group=group, count=StreamCount(cap=4, initial=4), name="test")
        try:
            chunk = WeightChunk(1, 1, 0, np.zeros(1024, np.uint8))
            assert await lanes.put(chunk, outcomes.append)
            await until(lambda: lanes.failed, what="the lanes to give up on the peer")
            assert outcomes == ["failed"]
            assert not await lanes.put(chunk, outcomes.append)
            assert outcomes == ["failed"]  # a refused put calls nothing
        finally:
            lanes.close()


async def test_the_kernel_reports_what_a_stream_sent_and_what_came_back() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        client.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(peer.recv(1 << 20))
        info = tcp_info(client)
        assert info.bytes_sent == 100_000 and info.bytes_acked >= 100_000
        assert info.bytes_retrans == 0 and info.mss > 0 and info.rtt_s > 0
    finally:
        for sock in (client, peer, server):
            sock.close()
    assert tcp_info(None).rtt_s == 0.0
