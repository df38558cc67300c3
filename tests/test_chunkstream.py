"""Chunk streams: weight chunks over plain TCP, received straight into the assembly buffer."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from echo2.errors import TransportError
from echo2.messages import Snapshot, WeightChunk
from echo2.weights.chunks import (
    SnapshotAssembler,
    flatten_tensors,
    iter_chunks,
    make_manifest,
)
from echo2.weights.stream import (
    HEADER,
    MAGIC,
    ChunkStreamSender,
    ChunkStreamServer,
    parse_address,
)

CHUNK = 64 * 1024


def snapshot(nbytes: int = 10 * CHUNK + 77) -> Snapshot:
    specs, flat = flatten_tensors({"w": np.random.default_rng(3).integers(0, 255, nbytes, dtype=np.uint8)})
    return Snapshot(incarnation=1, version=1, tensors=specs, data=flat, created_at_s=0.0)


class Inbox:
    """A server feeding an assembler the way WeightReceiver does, recording what it got."""

    def __init__(self, assembler: SnapshotAssembler | None, max_pending: int = 32) -> None:
        self.assembler = assembler
        self.chunks: asyncio.Queue[WeightChunk] = asyncio.Queue()
        self.abandoned: list[WeightChunk] = []
        self.header_read = asyncio.Event()  # a frame's header arrived
        self.gone = asyncio.Event()  # a frame was abandoned
        self.backlog = asyncio.Event()  # more delivered than max_pending
        self.server = ChunkStreamServer(
            self.deliver, self.destination, self.abandon, max_chunk_bytes=1 << 20, max_pending=max_pending
        )

    def deliver(self, chunk: WeightChunk) -> None:
        self.chunks.put_nowait(chunk)
        if self.chunks.qsize() > self.server.max_pending:
            self.backlog.set()

    def destination(self, key: tuple[int, int], index: int, nbytes: int) -> np.ndarray | None:
        self.header_read.set()
        if self.assembler is None or self.assembler.key != key:
            return None
        return self.assembler.destination(index, nbytes)

    def abandon(self, chunk: WeightChunk) -> None:
        self.abandoned.append(chunk)
        if self.assembler is not None:
            self.assembler.release(chunk)
        self.gone.set()

    async def start(self) -> str:
        port = await self.server.start("127.0.0.1")
        return f"chunkstream://127.0.0.1:{port}"

    async def take(self, count: int) -> list[WeightChunk]:
        out = []
        async with asyncio.timeout(10):
            for _ in range(count):
                out.append(await self.chunks.get())
                self.server.taken()
        return out


async def test_chunks_land_in_place_and_verify_without_a_copy() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    assembler = SnapshotAssembler(manifest)
    inbox = Inbox(assembler)
    sender = ChunkStreamSender(await inbox.start())
    try:
        chunks = list(iter_chunks(snap, manifest))
        for chunk in chunks:
            assert await sender.send(chunk)
        got = await inbox.take(len(chunks))
        assert [c.index for c in got] == [c.index for c in chunks]  # order kept per connection
        outcomes = [assembler.offer(c) for c in got]
    finally:
        sender.close()
        inbox.server.close()
    assert outcomes == ["stored"] * len(chunks)
    assert assembler.complete and bytes(assembler.buffer) == bytes(snap.data)
    assert inbox.server.counters["chunks_in_place"] == len(chunks)
    assert inbox.server.counters["chunks_copied"] == 0


async def test_chunks_with_no_place_yet_arrive_in_their_own_buffer() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    inbox = Inbox(None)  # no manifest yet: every chunk is "early"
    sender = ChunkStreamSender(await inbox.start())
    try:
        for chunk in iter_chunks(snap, manifest):
            await sender.send(chunk)
        got = await inbox.take(len(manifest.chunk_digests))
    finally:
        sender.close()
        inbox.server.close()
    assembler = SnapshotAssembler(manifest)
    assert [assembler.offer(c) for c in got] == ["stored"] * len(got)  # copied in, then
    assert bytes(assembler.buffer) == bytes(snap.data)
    assert inbox.server.counters["chunks_copied"] == len(got)


async def test_a_corrupt_chunk_received_in_place_is_counted_and_its_place_freed() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    assembler = SnapshotAssembler(manifest)
    inbox = Inbox(assembler)
    sender = ChunkStreamSender(await inbox.start())
    good = next(iter_chunks(snap, manifest))
    bad_data = np.array(good.data)
    bad_data[7] ^= 0xFF
    try:
        await sender.send(WeightChunk(incarnation=1, version=1, index=0, data=bad_data))
        (landed,) = await inbox.take(1)
        # While the stream holds chunk 0's place, a copy of chunk 0 from elsewhere waits its turn.
        assert assembler.offer(good) == "duplicate"
        assert assembler.offer(landed) == "corrupt"
        assert assembler.corrupt_chunks == 1 and 0 in assembler.missing()
        await sender.send(good)  # the repair lands in the freed place
        (repaired,) = await inbox.take(1)
        assert assembler.offer(repaired) == "stored"
    finally:
        sender.close()
        inbox.server.close()
    assert bytes(assembler.buffer[:CHUNK]) == bytes(snap.data[:CHUNK])


def raw_peer(address: str) -> socket.socket:
    """A non-blocking plain TCP connection to a chunk stream server, to misbehave on."""
    peer = socket.create_connection(parse_address(address))
    peer.setblocking(False)
    return peer


async def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (EOF, or a reset when it left data unread)."""
    try:
        async with asyncio.timeout(10):
            return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except ConnectionResetError:
        return True


async def test_malformed_frames_close_only_their_connection() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    assembler = SnapshotAssembler(manifest)
    inbox = Inbox(assembler)
    address = await inbox.start()
    loop = asyncio.get_running_loop()
    rogue = raw_peer(address)
    try:
        await loop.sock_sendall(rogue, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * HEADER.size)
        assert await closed_by_peer(rogue)
        oversized = HEADER.pack(MAGIC, 1, 1, 1, 0, 1 << 30)  # a body over max_chunk_bytes
        rogue2 = raw_peer(address)
        await loop.sock_sendall(rogue2, oversized)
        assert await closed_by_peer(rogue2)
        rogue2.close()
        sender = ChunkStreamSender(address)  # the server still serves everyone else
        chunks = list(iter_chunks(snap, manifest))
        for chunk in chunks:
            await sender.send(chunk)
        got = await inbox.take(len(chunks))
        sender.close()
    finally:
        rogue.close()
        inbox.server.close()
    assert [assembler.offer(c) for c in got] == ["stored"] * len(chunks)
    assert inbox.server.counters["malformed"] == 2


async def test_a_peer_lost_mid_chunk_gives_its_place_back() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    assembler = SnapshotAssembler(manifest)
    inbox = Inbox(assembler)
    address = await inbox.start()
    loop = asyncio.get_running_loop()
    peer = raw_peer(address)
    await loop.sock_sendall(peer, HEADER.pack(MAGIC, 1, 1, 1, 2, CHUNK) + bytes(CHUNK // 2))
    async with asyncio.timeout(10):
        await inbox.header_read.wait()  # chunk 2's place is claimed; now the peer dies mid-body
    assert assembler.destination(2, CHUNK) is None
    peer.close()
    async with asyncio.timeout(10):
        await inbox.gone.wait()
    inbox.server.close()
    assert inbox.server.counters["frames_truncated"] == 1
    assert inbox.abandoned[0].index == 2
    assert assembler.destination(2, CHUNK) is not None  # free again for a repair


async def test_a_consumer_that_falls_behind_pauses_its_senders() -> None:
    snap = snapshot(40 * CHUNK)
    manifest = make_manifest(snap, CHUNK)
    inbox = Inbox(SnapshotAssembler(manifest), max_pending=2)
    sender = ChunkStreamSender(await inbox.start())
    chunks = list(iter_chunks(snap, manifest))
    try:
        for chunk in chunks:
            await sender.send(chunk)
        async with asyncio.timeout(10):
            await inbox.backlog.wait()
        assert inbox.server.counters["pauses"] >= 1
        got = await inbox.take(len(chunks))  # taking resumes reading: everything arrives
    finally:
        sender.close()
        inbox.server.close()
    assert [c.index for c in got] == list(range(len(chunks)))


async def test_sending_to_nobody_raises_a_transport_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}")
    with pytest.raises(TransportError):
        await sender.send(WeightChunk(incarnation=1, version=1, index=0, data=np.zeros(8, np.uint8)))
    assert sender.closed


def test_addresses_are_checked() -> None:
    assert parse_address("chunkstream://10.0.0.2:5555") == ("10.0.0.2", 5555)
    for bad in ("tcp://10.0.0.2:5555", "chunkstream://nohost", "chunkstream://:12"):
        with pytest.raises(ValueError):
            parse_address(bad)


async def test_a_peer_stuck_mid_chunk_is_dropped_on_demand() -> None:
    snap = snapshot()
    manifest = make_manifest(snap, CHUNK)
    assembler = SnapshotAssembler(manifest)
    inbox = Inbox(assembler)
    address = await inbox.start()
    loop = asyncio.get_running_loop()
    peer = raw_peer(address)
    try:
        await loop.sock_sendall(peer, HEADER.pack(MAGIC, 1, 1, 1, 4, CHUNK) + bytes(100))  # then silence
        async with asyncio.timeout(10):
            await inbox.header_read.wait()
        assert assembler.destination(4, CHUNK) is None  # held by the silent peer
        assert inbox.server.drop_partial() == 1
        async with asyncio.timeout(10):
            await inbox.gone.wait()
        assert await closed_by_peer(peer)
    finally:
        peer.close()
        inbox.server.close()
    assert assembler.destination(4, CHUNK) is not None
