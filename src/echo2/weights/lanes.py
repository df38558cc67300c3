"""Lanes: one hop of the weight path over parallel connections to one inbox.

On a long lossy path one TCP stream carries a fraction of the link (see
``echo2.weights.pacing``: at 200 ms and 1% loss a reno stream carries ~0.6 Mbit/s), so a
hop sends its chunks over several streams at once: ``Lanes`` keeps up to ``count.n``
senders (one per lane: a chunk stream, or a ZeroMQ PUSH that stays one lane), each sending
one chunk at a time, and hands every chunk ``put`` to the next free lane. The receiver
needs nothing for it: chunks land in place by index whatever connection carried them.

How many lanes: ``StreamCount`` decides after every busy period (from the first chunk put
while the lanes were idle to one round trip after the last was taken by the kernel; a long
one in windows of ``SAMPLE_EVERY_S`` or 4 round trips), from
the bytes acknowledged, sent and retransmitted and the round trips the kernel measured on
the lanes' connections, and the share of the period the lanes had a chunk to send (a
period in which they mostly waited for chunks says nothing about the path). A count that changes opens lanes as chunks need them and retires
the extra ones once idle; the count outlives the lanes (``count`` is passed in: a hop
re-opened after a failure starts from what was learned).

Each ``put`` gets an outcome through its ``done`` callback: "sent" (the kernel took the
whole frame), "failed" (the peer is gone) or "discarded" (``discard``: a superseded
version's chunks that had not left yet). A lane whose send fails (no progress for the
stall deadline, a reset, a refused connection) closes its connection and its chunk goes
to another lane; once ``min(n, GONE_AFTER)`` sends in a row failed with none succeeding the
peer counts as gone: every chunk still queued fails, and so does every later ``put``. A
connection the peer closes (seen even while its lane is idle) loses the chunks its kernel
held unacknowledged: they go out again on the other lanes (the receiver drops a stream stuck
mid-chunk so that a repair can take its place; the chunks queued behind it on that stream
would otherwise be lost without anyone knowing).
Memory: chunks are views (of a snapshot or an assembly buffer), at most ``n`` queued
beside the ``n`` being sent; ``put`` waits for room.

Dialed lanes (``open_sender=None``; ``echo2.weights.dial``): the connections are the
peer's, handed over with ``adopt``; a lane runs on each, never more than ``n``, and a lane
whose connection fails ends with it (its chunk goes to another). With none left the peer
is gone. ``dial_wanted`` says when to ask the peer for more (``count.n`` above what it
dialed).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Literal

from echo2.errors import ClosedError, TransportError
from echo2.messages import WeightChunk
from echo2.transport.context import Transport
from echo2.weights.dial import is_dial_address
from echo2.weights.pacing import INITIAL_WINDOW, PathSample, StreamCount
from echo2.weights.plan import ChunkSender, chunk_sender
from echo2.weights.stream import ChunkStreamSender, StreamCredentials, is_stream_address

log = logging.getLogger(__name__)

Outcome = Literal["sent", "failed", "discarded"]
GONE_AFTER = 4
"""Sends failing in a row, none succeeding between them, after which the peer is gone (a
dead peer refuses every reconnection at once; a live one succeeds on some lane)."""
SAMPLE_EVERY_S = 0.5
"""A busy period longer than this (and 4 round trips) is measured in windows of it."""
Done = Callable[[Outcome], None]


@dataclasses.dataclass
class _Entry:
    chunk: WeightChunk
    done: Done | None
    tag: object


class Lanes:
    """Parallel senders to one inbox; see the module docstring."""

    def __init__(
        self,
        open_sender: Callable[[], ChunkSender] | None,
        *,
        group: asyncio.TaskGroup,
        count: StreamCount,
        send_timeout_s: float = 5.0,
        name: str = "",
    ) -> None:
        """``open_sender`` opens one lane's sender (it connects lazily; None: lanes run on
        connections the peer dialed, ``adopt``); ``group`` holds the lanes' tasks;
        ``send_timeout_s`` bounds a ZeroMQ send (a chunk stream is judged by its own
        progress: ``ChunkStreamSender``)."""
        self._open_sender = open_sender
        self._group = group
        self.count = count
        self.send_timeout_s = send_timeout_s
        self.name = name
        self._spare: collections.deque[ChunkStreamSender] = collections.deque()  # dialed, no lane yet
        self._queue: collections.deque[_Entry] = collections.deque()
        self._idle: collections.deque[asyncio.Future[_Entry | None]] = collections.deque()
        self._room: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lanes: dict[int, asyncio.Task[None]] = {}
        self._senders: dict[int, ChunkSender] = {}
        # Per lane, the chunks its connection's kernel took and the peer may not have yet:
        # (entry, bytes written up to its end). A connection lost takes them with it.
        self._unacked: dict[int, collections.deque[tuple[_Entry, int]]] = {}
        self._outstanding = 0  # chunks put and not yet sent, failed or discarded
        self._failures_in_row = 0
        self.failed = False
        self.closed = False
        self._period_start: tuple[float, dict[int, tuple[int, int, int]]] | None = None
        self._sending_since: dict[int, float] = {}  # lane -> when its chunk in hand was taken
        self._busy_s = 0.0  # lane-seconds with a chunk in hand, this period
        self._period_end: asyncio.TimerHandle | None = None
        self.counters = dict.fromkeys(
            ("sent", "failed", "discarded", "lane_failures", "lanes_opened", "connections_lost", "requeued"), 0
        )

    # -- API -------------------------------------------------------------------------

    @property
    def streams(self) -> int:
        """Lanes open now."""
        return len(self._lanes)

    @property
    def dialed(self) -> bool:
        """The peer dials these lanes' connections (``adopt``)."""
        return self._open_sender is None

    @property
    def connections(self) -> int:
        """Dialed lanes: connections open (with a lane or spare)."""
        alive = sum(1 for s in self._senders.values() if not s.closed)
        return alive + sum(1 for s in self._spare if not s.closed)

    def dial_wanted(self) -> int:
        """Dialed lanes: how many connections to ask the peer for (0: enough)."""
        return self.count.n if self.dialed and self.connections < self.count.n else 0

    def adopt(self, sender: ChunkStreamSender) -> None:
        """Dialed lanes: a connection the peer opened; a lane takes it when chunks need it."""
        if self.failed or self.closed:
            sender.close()
            return
        self._spare.append(sender)
        if self._queue and len(self._lanes) < self.count.n:
            self._open_lane()

    def any_sender(self) -> ChunkStreamSender | None:
        """An open connection of dialed lanes (to ask the peer for more on)."""
        for sender in [*self._spare, *self._senders.values()]:
            if isinstance(sender, ChunkStreamSender) and not sender.closed:
                return sender
        return None

    def warm(self) -> None:
        """Open the first lane's connection now, before any chunk (a no-op once a lane is
        open, or for dialed lanes): the path's round trip is then known when the next
        version is cut."""
        if not self._lanes and not (self.failed or self.closed or self.dialed):
            self._open_lane(connect_first=True)

    def rtt_s(self) -> float:
        """The longest smoothed round trip of the lanes' connections (0: none measured)."""
        return max(
            (s.info().rtt_s for s in list(self._senders.values()) if isinstance(s, ChunkStreamSender)), default=0.0
        )

    def per_stream_bps(self) -> float | None:
        """What one lane carries, bytes/s: as last measured, else what a fresh TCP stream
        sends in a round trip of this path (its initial window); None: nothing known.
        Safe to call from another thread (the publisher cuts versions in one)."""
        measured = self.count.per_stream_bps()
        if measured is not None:
            return measured
        infos = [s.info() for s in list(self._senders.values()) if isinstance(s, ChunkStreamSender)]
        rtt = max((i.rtt_s for i in infos), default=0.0)
        mss = max((i.mss for i in infos), default=0)
        return INITIAL_WINDOW * mss / rtt if rtt > 0 and mss > 0 else None

    async def put(self, chunk: WeightChunk, done: Done | None = None, tag: object = None) -> bool:
        """Queue ``chunk`` for the next free lane (waits while ``n`` are queued); False at
        once (and ``done`` is not called) if the peer is gone or the lanes are closed."""
        while len(self._queue) >= self.count.n and not (self.failed or self.closed):
            room = asyncio.get_running_loop().create_future()
            self._room.append(room)
            try:
                await room
            finally:
                if not room.done():
                    room.cancel()
        if self.failed or self.closed:
            return False
        if self._outstanding == 0:
            self._start_period()
        self._outstanding += 1
        self._hand(_Entry(chunk, done, tag))
        return True

    async def send(self, chunk: WeightChunk) -> bool:
        """Send one chunk and wait until the kernel took it; False if it failed."""
        outcome = asyncio.get_running_loop().create_future()

        def done(result: Outcome) -> None:
            if not outcome.done():
                outcome.set_result(result)

        if not await self.put(chunk, done):
            return False
        return await outcome == "sent"

    def discard(self, keep: Callable[[object], bool]) -> int:
        """Drop the queued chunks whose tag ``keep`` refuses (those being sent finish);
        returns how many."""
        kept: collections.deque[_Entry] = collections.deque()
        dropped: list[_Entry] = []
        for entry in self._queue:
            (kept if keep(entry.tag) else dropped).append(entry)
        self._queue = kept
        for entry in dropped:
            self.counters["discarded"] += 1
            self._settle(entry, "discarded")
        self._wake_room()
        return len(dropped)

    def close(self) -> None:
        """Close every lane; chunks still queued are discarded."""
        if self.closed:
            return
        self.closed = True
        self.discard(lambda tag: False)
        for task in self._lanes.values():
            task.cancel()
        self._lanes.clear()
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        while self._idle:
            future = self._idle.popleft()
            if not future.done():
                future.set_result(None)
        while self._spare:
            self._spare.popleft().close()
        self._wake_room(everyone=True)
        if self._period_end is not None:
            self._period_end.cancel()

    # -- dispatch --------------------------------------------------------------------

    def _settle(self, entry: _Entry, outcome: Outcome) -> None:
        self._outstanding -= 1
        if entry.done is not None:
            entry.done(outcome)
        if outcome != "sent" or self._period_start is None:
            return
        if self._outstanding == 0:
            self._end_period_soon()
        elif time.monotonic() - self._period_start[0] >= self._sample_every_s():
            self._measure()  # a long busy period is measured in windows, each its own sample
            self._start_period()

    def _hand(self, entry: _Entry, *, first: bool = False) -> None:
        """To an idle lane, else the queue (opening a lane if fewer than ``n`` are open)."""
        while self._idle:
            future = self._idle.popleft()
            if not future.done():
                future.set_result(entry)
                return
        if first:
            self._queue.appendleft(entry)
        else:
            self._queue.append(entry)
        if len(self._lanes) < self.count.n and (not self.dialed or self._spare):
            self._open_lane()

    def _open_lane(self, *, connect_first: bool = False) -> None:
        index = next(i for i in range(len(self._lanes) + 1) if i not in self._lanes)
        self.counters["lanes_opened"] += 1
        lane = self._lane(index, connect_first=connect_first)
        self._lanes[index] = self._group.create_task(lane, name=f"{self.name}-lane{index}")

    async def _next(self, index: int) -> _Entry | None:
        if index >= self.count.n:
            return None  # the count went down: this lane retires
        if self._queue:
            entry = self._queue.popleft()
            self._wake_room()
            return entry
        future: asyncio.Future[_Entry | None] = asyncio.get_running_loop().create_future()
        self._idle.append(future)
        try:
            return await future
        finally:
            if not future.done():
                future.cancel()

    def _wake_room(self, *, everyone: bool = False) -> None:
        while self._room and (everyone or len(self._queue) < self.count.n):
            room = self._room.popleft()
            if not room.done():
                room.set_result(None)
                if not everyone:
                    return

    # -- one lane --------------------------------------------------------------------

    async def _lane(self, index: int, *, connect_first: bool = False) -> None:
        try:
            if connect_first and self._open_sender is not None:
                first = self._senders[index] = self._open_sender()
                if isinstance(first, ChunkStreamSender):
                    try:
                        await first.connect()
                    except (TimeoutError, ClosedError, TransportError):
                        self._senders.pop(index).close()  # the first chunk tries again
            while not self.closed:
                entry = await self._next(index)
                if entry is None:
                    return
                self._sending_since[index] = time.monotonic()
                try:
                    ok = await self._send(index, entry.chunk)
                except asyncio.CancelledError:
                    self._settle(entry, "discarded")  # closed while sending
                    raise
                finally:
                    self._count_busy(self._sending_since.pop(index))
                if ok:
                    self._failures_in_row = 0
                    self.counters["sent"] += 1
                    self._written(index, entry)
                    self._settle(entry, "sent")
                else:
                    self._lane_failed(index, entry)
                    if self.failed or index not in self._lanes:
                        return
        finally:
            if self._lanes.get(index) is asyncio.current_task():
                del self._lanes[index]
            left = self._senders.pop(index, None)
            if left is not None:
                left.close()

    def _next_sender(self) -> ChunkSender:
        if self._open_sender is not None:
            return self._open_sender()
        while self._spare:
            sender = self._spare.popleft()
            if not sender.closed:
                return sender
        raise ClosedError(f"{self.name}: no dialed connection left")

    async def _send(self, index: int, chunk: WeightChunk) -> bool:
        sender = self._senders.get(index)
        try:
            if sender is None or sender.closed:
                sender = self._senders[index] = self._next_sender()
                self._unacked[index] = collections.deque()
                if isinstance(sender, ChunkStreamSender):
                    sender.on_lost = lambda: self._connection_lost(index, sender)
            if isinstance(sender, ChunkStreamSender):
                return await sender.send(chunk)  # judged by its progress
            async with asyncio.timeout(self.send_timeout_s):
                return await sender.send(chunk)
        except (TimeoutError, ClosedError, TransportError):
            return False

    def _written(self, index: int, entry: _Entry) -> None:
        """The kernel took ``entry``'s frame on lane ``index``: remember it until acknowledged."""
        sender = self._senders.get(index)
        if not isinstance(sender, ChunkStreamSender):
            return
        ledger = self._unacked.setdefault(index, collections.deque())
        ledger.append((entry, sender.bytes_written))
        acked = sender.info().bytes_acked - 1  # the SYN counts one
        while ledger and ledger[0][1] <= acked:
            ledger.popleft()

    def _requeue_unacked(self, index: int, sender: ChunkSender | None, but: _Entry | None = None) -> None:
        """A lane's connection is gone: what its kernel held unacknowledged goes out again on
        another lane (its ``done`` was told "sent" already; the copy reports nothing)."""
        ledger = self._unacked.pop(index, collections.deque())
        acked = sender.info().bytes_acked - 1 if isinstance(sender, ChunkStreamSender) else 0
        lost = [entry for entry, end in ledger if end > acked and entry is not but]
        for entry in reversed(lost):
            self.counters["requeued"] += 1
            self._outstanding += 1
            self._hand(_Entry(entry.chunk, None, entry.tag), first=True)

    def _connection_lost(self, index: int, sender: ChunkStreamSender) -> None:
        """The peer closed lane ``index``'s connection while the lane was idle or sending."""
        if self._senders.get(index) is not sender or self.closed:
            return
        self.counters["connections_lost"] += 1
        self._senders.pop(index)
        self._requeue_unacked(index, sender)
        sender.close()

    def _lane_failed(self, index: int, entry: _Entry) -> None:
        self.counters["lane_failures"] += 1
        self._failures_in_row += 1
        sender = self._senders.pop(index, None)
        self._requeue_unacked(index, sender, but=entry)
        if sender is not None:
            sender.close()
        if self.dialed:
            if self.connections > 0:  # the chunk goes to another connection; this lane ends
                self._lanes.pop(index, None)
                self._hand(entry, first=True)
                return
        elif self._failures_in_row < max(1, min(self.count.n, GONE_AFTER)):
            self._hand(entry, first=True)  # another lane tries it; this one reconnects
            return
        self.failed = True
        log.debug("%s: peer gone after %d failed sends", self.name, self._failures_in_row)
        pending, self._queue = [entry, *self._queue], collections.deque()
        for lost in pending:
            self.counters["failed"] += 1
            self._settle(lost, "failed")
        for future in self._idle:
            if not future.done():
                future.set_result(None)
        self._idle.clear()
        self._wake_room(everyone=True)

    # -- measurement -----------------------------------------------------------------

    def _totals(self) -> dict[int, tuple[int, int, int]]:
        totals = {}
        for index, sender in self._senders.items():
            if isinstance(sender, ChunkStreamSender):
                info = sender.info()
                totals[index] = (info.bytes_acked, info.bytes_sent, info.bytes_retrans)
        return totals

    def _sample_every_s(self) -> float:
        """How long a busy period runs before it is measured: enough round trips for
        the kernel's counters to move (a second at least)."""
        rtts = [s.info().rtt_s for s in self._senders.values() if isinstance(s, ChunkStreamSender)]
        return max(SAMPLE_EVERY_S, 4 * max(rtts, default=0.0))

    def _count_busy(self, since_s: float) -> None:
        if self._period_start is not None:
            self._busy_s += time.monotonic() - max(since_s, self._period_start[0])

    def _start_period(self) -> None:
        if self._period_end is not None:  # a new burst within the last one's round trip
            self._period_end.cancel()
            self._period_end = None
            self._measure()
        self._period_start = (time.monotonic(), self._totals())
        self._busy_s = 0.0

    def _end_period_soon(self) -> None:
        """Measure one round trip after the lanes went idle: the last bytes sent are
        acknowledged by then."""
        rtts = [s.info().rtt_s for s in self._senders.values() if isinstance(s, ChunkStreamSender)]
        if self._period_start is None or not rtts:
            return
        loop = asyncio.get_running_loop()
        self._period_end = loop.call_later(max(rtts), self._measure)

    def _measure(self) -> None:
        self._period_end = None
        start = self._period_start
        self._period_start = None
        if start is None or self.closed:
            return
        started_s, before = start
        now = time.monotonic()
        busy_s = self._busy_s + sum(now - max(since, started_s) for since in self._sending_since.values())
        infos = {i: s.info() for i, s in self._senders.items() if isinstance(s, ChunkStreamSender)}
        if not infos:
            return
        acked = sent = retrans = 0
        for index, info in infos.items():
            a0, s0, r0 = before.get(index, (0, 0, 0))
            if info.bytes_sent < s0:  # a lane reconnected during the period: a new socket
                a0 = s0 = r0 = 0
            acked, sent, retrans = (
                acked + info.bytes_acked - a0,
                sent + info.bytes_sent - s0,
                retrans + info.bytes_retrans - r0,
            )
        measured = [i for i in infos.values() if i.rtt_s > 0]
        sample = PathSample(
            streams=len(infos),
            seconds=now - started_s,
            acked_bytes=acked,
            sent_bytes=sent,
            retrans_bytes=retrans,
            rtt_s=sum(i.rtt_s for i in measured) / len(measured) if measured else 0.0,
            min_rtt_s=min((i.min_rtt_s for i in measured if i.min_rtt_s > 0), default=0.0),
            mss=max((i.mss for i in measured), default=1448),
            utilization=busy_s / ((now - started_s) * len(infos)) if now > started_s else 0.0,
        )
        before_n = self.count.n
        after_n = self.count.observe(sample)
        if after_n != before_n:
            log.info(
                "%s: %d -> %d streams (%.1f Mbit/s over %d, rtt %.0f ms, loss %.2f%%)",
                self.name, before_n, after_n, sample.goodput_bps * 8e-6, sample.streams,
                sample.rtt_s * 1e3, sample.loss * 100,
            )  # fmt: skip
        # Lanes past the count retire: idle ones now, busy ones when they ask for the next
        # chunk (``_next``).
        for _ in range(len(self._lanes) - after_n):
            while self._idle and self._idle[0].done():
                self._idle.popleft()
            if not self._idle:
                break
            self._idle.popleft().set_result(None)


def open_lanes(
    transport: Transport,
    address: str,
    *,
    name: str,
    group: asyncio.TaskGroup,
    counts: dict[str, StreamCount],
    max_streams: int,
    credentials: StreamCredentials | None,
    max_message_bytes: int,
    connect_timeout_s: float,
    send_timeout_s: float,
) -> Lanes:
    """Lanes to the inbox at ``address``, by its scheme: chunk streams (up to
    ``max_streams``), a member's dialed connections (``adopt``), or a ZeroMQ PUSH (one
    lane). The stream count lives in ``counts`` by address, so lanes opened again after a
    failure start from what was learned."""
    count = counts.get(address)
    if count is None:
        streams = is_stream_address(address) or is_dial_address(address)
        count = counts[address] = StreamCount(cap=max_streams if streams else 1)
    if is_dial_address(address):
        return Lanes(None, group=group, count=count, send_timeout_s=send_timeout_s, name=name)

    def open_sender() -> ChunkSender:
        return chunk_sender(
            transport,
            name,
            address,
            max_message_bytes,
            credentials=credentials,
            connect_timeout_s=connect_timeout_s,
            stall_timeout_s=send_timeout_s,
        )

    return Lanes(open_sender, group=group, count=count, send_timeout_s=send_timeout_s, name=name)


__all__ = ["Done", "Lanes", "Outcome", "open_lanes"]
