"""Deadlines, byte progress and repair pacing on slow lossy paths (``echo2.weights.pacing``),
and the chunk stream sender judged by progress (``echo2.weights.stream``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from echo2.messages import ChunkRequest, WeightChunk
from echo2.transport import Transport
from echo2.weights import WeightBroadcaster
from echo2.weights.pacing import OutstandingRepairs, RateMeter, RepairPacer, transfer_deadline_s
from echo2.weights.plan import send_chunk
from echo2.weights.stream import ChunkStreamSender


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


MB = 1 << 20


def test_deadlines_follow_the_slowest_of_floor_rate_and_round_trip() -> None:
    assert transfer_deadline_s(MB, 0.0, 0.0, floor_s=2.0) == 2.0  # nothing measured: the floor
    # 1 MB at 100 KB/s is ~10 s of transfer: K (3) times that, not the 2 s floor.
    assert transfer_deadline_s(MB, 100_000, 0.2, floor_s=2.0, k=3) == pytest.approx(3 * MB / 100_000)
    assert transfer_deadline_s(1000, 1e9, 1.5, floor_s=2.0, k=3) == pytest.approx(4.5)  # a far path


def test_rate_meter_measures_bytes_and_idle_time_and_keeps_the_last_rate_when_stalled() -> None:
    clock = FakeClock()
    meter = RateMeter(window_s=4.0, clock=clock)
    assert meter.rate_bps == 0.0
    for second in range(5):
        meter.observe(second * 100_000)
        clock.now += 1.0
    assert meter.rate_bps == pytest.approx(100_000)
    assert meter.idle_s == pytest.approx(1.0)
    for _ in range(10):  # a total outage: no byte for 10 s
        meter.observe(400_000)
        clock.now += 1.0
    assert meter.idle_s == pytest.approx(11.0)
    assert meter.rate_bps == pytest.approx(100_000)  # deadlines stay finite
    meter.progressed()
    assert meter.idle_s == 0.0


def test_repair_pacer_keeps_a_window_and_asks_again_only_after_each_chunks_deadline() -> None:
    clock = FakeClock()
    sizes = [MB] * 10
    pacer = RepairPacer(sizes, floor_s=2.0, max_outstanding_bytes=3 * MB, k=3, clock=clock)
    rate = 100_000.0  # bytes/s: a loss-bound reno stream at 200 ms, 1%
    first = pacer.due(list(range(10)), rate, 0.2)
    assert first == [0, 1, 2]  # the window, not the whole version
    assert pacer.due(list(range(10)), rate, 0.2) == []  # nothing new until something lands
    # Each chunk's deadline counts the chunks queued before it (K x queued bytes / rate).
    assert pacer.next_deadline_s() == pytest.approx(clock.now + 3 * MB / rate)
    assert pacer.landed(0, MB) == MB
    assert pacer.due([1, 2, 3, 4], rate, 0.2) == [3]  # one place freed, 1 and 2 still owed
    clock.now += 3 * 2 * MB / rate + 0.01  # chunk 1's deadline passed, chunk 2's and 3's not
    assert pacer.due([1, 2, 3, 4], rate, 0.2, progressing=True) == []  # late, not lost: bytes still come
    assert pacer.due([1, 2, 3, 4], rate, 0.2) == [1]  # the version went quiet: asked again
    assert pacer.expired == 1
    tally = pacer.tally
    assert tally.missing_bytes == 4 * MB  # chunks 0-3, each counted once
    assert tally.requested_bytes == 5 * MB  # chunk 1 twice
    assert tally.received_bytes == MB
    assert pacer.landed(9, MB) == 0  # never requested: not repair bytes
    assert pacer.landed(2, MB) == MB  # requested, whatever path it came by
    assert tally.received_bytes == 2 * MB
    assert pacer.outstanding() == {1, 3}


def test_a_chunk_larger_than_the_window_still_goes_when_none_is_outstanding() -> None:
    pacer = RepairPacer([8 * MB, MB], floor_s=1.0, max_outstanding_bytes=MB, clock=FakeClock())
    assert pacer.due([0, 1], 0.0, 0.0) == [0]
    assert pacer.due([0, 1], 0.0, 0.0) == []


def test_publisher_side_requests_repeated_before_they_are_served_add_nothing() -> None:
    queued = OutstandingRepairs()
    assert queued.admit("a", (1, 5), [0, 1, 2]) == [0, 1, 2]
    assert queued.admit("a", (1, 5), [1, 2, 3]) == [3]
    assert queued.admit("b", (1, 5), [1]) == [1]  # per member
    queued.sent("a", (1, 5), 1)
    assert queued.admit("a", (1, 5), [1, 1]) == [1]  # served: may be asked again (once)
    assert queued.admit("a", (1, 6), [0]) == [0]  # a newer version starts afresh
    assert queued.queued("a") == 1


async def test_the_broadcaster_counts_and_drops_duplicate_repair_indices() -> None:
    transport = Transport()
    router = transport.router(name="pub.weights", bind=["inproc://pacing-dedup"])
    broadcaster = WeightBroadcaster(transport, router)
    try:
        request = ChunkRequest(sampler_id="a", incarnation=1, version=3, indices=[0, 1, 2])
        broadcaster._on_repair_request(b"peer-a", request)
        broadcaster._on_repair_request(
            b"peer-a", ChunkRequest(sampler_id="a", incarnation=1, version=3, indices=[2, 3])
        )
        assert broadcaster.counters["repair_duplicates_dropped"] == 1
        assert broadcaster.counters["repair_requests"] == 2
        served = [broadcaster._repairs.get_nowait()[1].indices for _ in range(broadcaster._repairs.qsize())]
        assert served == [[0, 1, 2], [3]]
    finally:
        broadcaster.close()
        router.close()
        transport.close()


# -- the sender: progress, not completion -----------------------------------------------


def _chunk(nbytes: int) -> WeightChunk:
    return WeightChunk(incarnation=1, version=1, index=0, data=np.zeros(nbytes, dtype=np.uint8))


async def _accepting_server(read_piece: int | None, pause_s: float) -> tuple[asyncio.Server, int]:
    """A tcp peer that reads ``read_piece`` bytes every ``pause_s`` (a slow path), or
    never reads (None: a stuck peer)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while read_piece is not None:
                data = await reader.read(read_piece)
                if not data:
                    break
                await asyncio.sleep(pause_s)  # the slow link, not a synchronisation
            else:
                await asyncio.Event().wait()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_chunk_slower_than_the_stall_timeout_still_arrives() -> None:
    """Before, a send had to finish in its timeout: a 1 MB chunk at 100 KB/s never could."""
    nbytes = 24 * MB
    server, port = await _accepting_server(read_piece=1 * MB, pause_s=0.02)
    sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}", stall_timeout_s=0.25)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await send_chunk(sender, _chunk(nbytes), timeout_s=0.25)
        assert loop.time() - started > 0.25  # the whole chunk took longer than the timeout
        assert not sender.closed and sender.stalls == 0
    finally:
        sender.close()
        server.close()
        await server.wait_closed()


async def test_a_peer_that_stops_reading_fails_the_send_and_closes_the_stream() -> None:
    server, port = await _accepting_server(read_piece=None, pause_s=0.0)
    sender = ChunkStreamSender(f"chunkstream://127.0.0.1:{port}", stall_timeout_s=0.2)
    try:
        async with asyncio.timeout(10):
            assert not await send_chunk(sender, _chunk(64 * MB), timeout_s=0.2)
        assert sender.closed and sender.stalls == 1
    finally:
        sender.close()
        server.close()
        await server.wait_closed()
