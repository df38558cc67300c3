"""Deadlines and repair pacing for weight transfers on slow, lossy paths.

At 200 ms RTT and 1% loss one loss-bound TCP stream moves ~100 KB/s, so a 1 MB chunk takes
about 10 s: a timeout counted in completed chunks (the old "2 s without a chunk") fires in
the middle of every chunk, aborts the stream and re-requests everything, and the repairs
then queue behind each other on the same slow path. Here instead:

* progress is counted in bytes (``RateMeter``): a transfer is stalled only when no byte of
  it arrived for ``stall_deadline_s`` = max(floor, K x RTT);
* each repaired chunk gets its own deadline (``transfer_deadline_s``): max(floor, K x bytes
  queued up to and including it / measured rate, K x RTT), and it is not requested again
  before that deadline passes, nor while bytes of the version keep arriving;
* at most ``max_outstanding_bytes`` of repair are outstanding per member (``RepairPacer``),
  so a stall never turns into a request for the whole version at once.

And how many TCP streams a hop uses (``StreamCount``). One loss-bound stream carries about
MSS / RTT x 1.22 / sqrt(p) (Mathis et al. 1997): at 200 ms and 1% loss under reno, ~0.6
Mbit/s, measured in the WAN test bed, and N streams carry about N times that until the link
fills (64 streams: 45 Mbit/s, 128: 71 Mbit/s of a 100 Mbit/s link). A hop therefore starts
with one stream and doubles its streams while the last measurement says they are what
limits it (retransmissions, no standing queue) and the last doubling paid; it backs off
when a queue stands (the link is full) or when more streams bought nothing. bbr is not
loss-bound: one stream already carries ~54 Mbit/s there, and the count settles at a few.
The chunk size follows the count (``chunk_bytes_for``): a version must have a few chunks
per stream, or the extra streams have nothing to carry.

Pure and clocked by an injected ``clock`` (monotonic seconds): tests drive it directly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sequence

K = 3.0
"""Slack on every derived deadline: K times the expected transfer time or round trip."""
DEFAULT_MAX_OUTSTANDING_BYTES = 4 << 20
"""Repair bytes a member may have requested and not yet received (4 chunks of 1 MB)."""

Clock = Callable[[], float]


def transfer_deadline_s(nbytes: int, rate_bps: float, rtt_s: float, floor_s: float, k: float = K) -> float:
    """Seconds to allow for ``nbytes`` to arrive at ``rate_bps`` (bytes/s; 0: unknown) over
    a path of round trip ``rtt_s`` (0: unknown): never less than ``floor_s``."""
    deadline = max(floor_s, k * rtt_s)
    if rate_bps > 0:
        deadline = max(deadline, k * nbytes / rate_bps)
    return deadline


class RateMeter:
    """Bytes per second received, over the last ``window_s``, from running totals.

    ``observe(total)`` takes a monotonic byte count (every path of the version together);
    ``rate_bps`` is 0 until two observations span some time. ``idle_s`` is how long the
    total has not grown: the byte-level progress a stall is judged by.
    """

    def __init__(self, window_s: float = 8.0, clock: Clock = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()
        self._last_growth_s = clock()
        self._rate_bps = 0.0

    def observe(self, total_bytes: int) -> None:
        now = self._clock()
        grew = not self._samples or total_bytes > self._samples[-1][1]
        self._samples.append((now, total_bytes))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        if grew:
            self._last_growth_s = now
            self._rate_bps = self._window_rate() or self._rate_bps

    def progressed(self) -> None:
        """Progress seen some other way (a chunk verified): not idle from now."""
        self._last_growth_s = self._clock()

    def _window_rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 and b1 > b0 else 0.0

    @property
    def rate_bps(self) -> float:
        """The rate over the window that ended with the last byte received (0: none yet).
        A stalled path has not become infinitely slow: deadlines must stay finite."""
        return self._rate_bps

    @property
    def idle_s(self) -> float:
        return self._clock() - self._last_growth_s


@dataclasses.dataclass
class RepairTally:
    """One version's repair accounting, in bytes (what the WAN floors compare)."""

    missing_bytes: int = 0
    """Bytes of the distinct chunks that were missing when first requested."""
    requested_bytes: int = 0
    """Bytes asked for, re-requests included."""
    received_bytes: int = 0
    """Bytes that arrived for chunks once requested, by any path, duplicates included."""


class RepairPacer:
    """Which missing chunks of one version to request now (receiver side, per version).

    A chunk requested is outstanding until it lands (``landed``) or its deadline passes;
    only then may it be requested again. New requests stop at ``max_outstanding_bytes``
    (at least one chunk goes out when none is outstanding, whatever its size). Deadlines
    follow the queue: the n-th chunk of a request is expected after the n chunks before it.
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        *,
        floor_s: float,
        max_outstanding_bytes: int = DEFAULT_MAX_OUTSTANDING_BYTES,
        k: float = K,
        clock: Clock = time.monotonic,
    ) -> None:
        self._sizes = chunk_sizes
        self.floor_s = floor_s
        self.max_outstanding_bytes = max_outstanding_bytes
        self.k = k
        self._clock = clock
        self._deadlines: dict[int, float] = {}  # outstanding index -> monotonic deadline
        self._ever_requested: set[int] = set()
        self.tally = RepairTally()
        self.expired = 0
        """Requests whose deadline passed before their chunk landed (each re-requestable)."""

    @property
    def outstanding_bytes(self) -> int:
        return sum(self._sizes[i] for i in self._deadlines)

    def outstanding(self) -> set[int]:
        return set(self._deadlines)

    def due(
        self,
        missing: Sequence[int],
        rate_bps: float,
        rtt_s: float,
        *,
        progressing: bool = False,
        limit: int = 1 << 30,
    ) -> list[int]:
        """The chunks of ``missing`` to request now (at most ``limit``), in order; records
        them as requested. ``progressing``: bytes of the version are still arriving, so a
        request past its deadline is late, not lost (before the rate is measured its
        deadline is only the floor, and a 1 MB chunk at 100 KB/s takes 10 s): it expires
        once the version is quiet."""
        now = self._clock()
        for index, deadline in list(self._deadlines.items()):
            if now >= deadline and not progressing:
                del self._deadlines[index]
                self.expired += 1
        queued = self.outstanding_bytes
        chosen: list[int] = []
        for index in missing:
            if len(chosen) >= limit:
                break
            if index in self._deadlines:
                continue
            size = self._sizes[index]
            if queued + size > self.max_outstanding_bytes and (queued or chosen):
                break
            queued += size
            self._deadlines[index] = now + transfer_deadline_s(queued, rate_bps, rtt_s, self.floor_s, self.k)
            self.tally.requested_bytes += size
            if index not in self._ever_requested:
                self._ever_requested.add(index)
                self.tally.missing_bytes += size
            chosen.append(index)
        return chosen

    def landed(self, index: int, nbytes: int) -> int:
        """Chunk ``index`` arrived (verified or a duplicate, on any path); returns the bytes
        counted as repair received (0: never requested)."""
        self._deadlines.pop(index, None)
        if index not in self._ever_requested:
            return 0
        self.tally.received_bytes += nbytes
        return nbytes

    def next_deadline_s(self) -> float | None:
        return min(self._deadlines.values(), default=None)


class OutstandingRepairs:
    """Publisher side: the chunk indices queued for each member and not yet sent, so that a
    request repeated before the first was served adds nothing."""

    def __init__(self) -> None:
        self._queued: dict[str, tuple[object, set[int]]] = {}  # member -> (version, indices)

    def admit(self, member: str, version: object, indices: Sequence[int]) -> list[int]:
        """The indices of this request not already queued for ``member`` (now queued)."""
        held = self._queued.get(member)
        if held is None or held[0] != version:
            held = (version, set())
            self._queued[member] = held
        fresh = [i for i in dict.fromkeys(indices) if i not in held[1]]
        held[1].update(fresh)
        return fresh

    def sent(self, member: str, version: object, index: int) -> None:
        """``index`` left the queue (sent, or given up on): a later request may ask again."""
        held = self._queued.get(member)
        if held is not None and held[0] == version:
            held[1].discard(index)

    def queued(self, member: str) -> int:
        held = self._queued.get(member)
        return len(held[1]) if held is not None else 0


# -- parallel streams per hop ------------------------------------------------------------

MATHIS_C = 1.22
"""sqrt(3/2): the constant of the Mathis bound for a loss-bound reno stream."""
LOSS_BOUND = 4.0
"""A stream carrying at most this many times its Mathis share is taken to be held back by
loss (the bound is an estimate: slow start and few samples make one period's vary)."""
MIN_CHUNK_BYTES = 16 << 10
"""Smallest chunk ``chunk_bytes_for`` picks: below it the per-chunk costs (a header, a
digest, a verification hand-off) start to show."""
MAX_CHUNKS = 16384
"""Most chunks a version is cut into (the manifest carries a digest per chunk)."""


@dataclasses.dataclass(frozen=True)
class PathSample:
    """What one busy period of a hop's streams measured, from the kernel's TCP_INFO."""

    streams: int
    """Streams open during the period."""
    seconds: float
    acked_bytes: int
    """Bytes the receiver acknowledged (tcpi_bytes_acked), summed over the streams."""
    sent_bytes: int
    """Bytes put on the wire, retransmissions included (tcpi_bytes_sent)."""
    retrans_bytes: int
    """Bytes retransmitted (tcpi_bytes_retrans)."""
    rtt_s: float
    """Smoothed round trip, the mean over the streams (tcpi_rtt)."""
    min_rtt_s: float
    """Lowest round trip seen (tcpi_min_rtt): the path without queues."""
    mss: int = 1448
    utilization: float = 1.0
    """Fraction of the period the streams had a chunk to send: below 3/4 the sender, not
    the path, was the limit, and the period says nothing about more streams."""

    @property
    def goodput_bps(self) -> float:
        """Bytes per second acknowledged, all streams together."""
        return self.acked_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def loss(self) -> float:
        """Fraction of the bytes sent that were sent again."""
        return self.retrans_bytes / self.sent_bytes if self.sent_bytes > 0 else 0.0

    @property
    def queueing_s(self) -> float:
        """Delay a standing queue adds to the path."""
        return max(0.0, self.rtt_s - self.min_rtt_s)

    def mathis_bps(self) -> float:
        """What one loss-bound reno stream carries on this path (inf: no loss seen)."""
        if self.loss <= 0 or self.rtt_s <= 0:
            return float("inf")
        return self.mss / self.rtt_s * MATHIS_C / math.sqrt(self.loss)


class StreamCount:
    """How many parallel TCP streams one hop uses (see the module docstring).

    ``observe`` takes the measurement of a busy period and returns the count for the next:

    * a period shorter than two round trips (or ``min_period_s``), with fewer than
      ``min_segments`` segments sent per stream, or in which the streams had nothing to
      send a quarter of the time, says too little: unchanged;
    * a standing queue (RTT above the path's minimum by a fifth, and 5 ms) means the link
      is full: a quarter fewer streams (never below ``floor``);
    * streams each within ``LOSS_BOUND`` times their Mathis share (``PathSample.mathis_bps``,
      at the loss averaged over the periods seen, as one period's is noisy) are held back
      by loss, each on its own: more of them carry more. Others (bbr, or a path whose loss
      is not what limits it) share some other limit: after an increase that bought less
      than a quarter of its proportional gain (x1.25 for a doubling), back to the count
      before it, and no growth for the next ``hold`` periods;
    * retransmissions without a standing queue, every stream allowed in use: twice as
      many streams (four times while fewer than 16 and loss-bound), up to ``cap``;
    * else unchanged.
    """

    def __init__(
        self,
        *,
        cap: int,
        initial: int = 1,
        floor: int = 1,
        hold: int = 2,
        min_period_s: float = 0.05,
        min_segments: int = 32,
    ) -> None:
        if not 1 <= floor <= cap:
            raise ValueError(f"need 1 <= floor <= cap, got floor={floor}, cap={cap}")
        self.cap, self.floor, self.hold, self.min_period_s = cap, floor, hold, min_period_s
        self.min_segments = min_segments
        self.n = min(cap, max(floor, initial))
        self._before: PathSample | None = None  # the last sample before an increase
        self._held = 0
        self.loss = 0.0
        """Loss averaged over the periods measured (exponentially, 1/3 weight on the newest)."""
        self.last: PathSample | None = None
        self.samples = 0

    def observe(self, sample: PathSample) -> int:
        if (
            sample.seconds < max(self.min_period_s, 2 * sample.min_rtt_s)
            or sample.sent_bytes < self.min_segments * sample.mss * sample.streams
            or sample.utilization < 0.75
        ):
            return self.n
        self.samples += 1
        self.last = sample
        before, self._before = self._before, None
        held, self._held = self._held > 0, max(0, self._held - 1)
        self.loss = sample.loss if self.samples == 1 else (2 * self.loss + sample.loss) / 3
        averaged = dataclasses.replace(sample, retrans_bytes=int(self.loss * sample.sent_bytes))
        loss_bound = self.loss > 0 and sample.goodput_bps / sample.streams <= LOSS_BOUND * averaged.mathis_bps()
        if before is not None and sample.streams > before.streams and not loss_bound:
            wanted = 1 + 0.25 * (sample.streams / before.streams - 1)
            if sample.goodput_bps < before.goodput_bps * wanted:
                self.n, self._held = max(self.floor, before.streams), self.hold
                return self.n
        if sample.queueing_s > max(0.005, 0.2 * sample.min_rtt_s):
            self.n = max(self.floor, sample.streams - max(1, sample.streams // 4))
        elif sample.loss > 0 and not held and self.n <= sample.streams < self.cap:
            factor = 4 if loss_bound and sample.streams < 16 else 2
            self.n, self._before = min(self.cap, sample.streams * factor), sample
        return self.n

    def per_stream_bps(self) -> float | None:
        """What one stream carried in the last period measured (None: none yet)."""
        last = self.last
        return last.goodput_bps / last.streams if last is not None else None


CHUNK_SECONDS = 0.5
"""A chunk should take one stream no longer than this: a chunk is the unit that is lost
with a superseded version, repaired, and forwarded down a chain only once complete."""
INITIAL_WINDOW = 10
"""Segments a fresh TCP stream sends in its first round trip (Linux's initial window)."""


def chunk_bytes_for(
    total_bytes: int, streams: int, max_chunk_bytes: int, *, per_stream_bps: float | None = None, per_stream: int = 2
) -> int:
    """The chunk size for a version of ``total_bytes`` sent over ``streams`` parallel
    streams each carrying ``per_stream_bps`` (None: unknown): about ``per_stream`` chunks
    per stream (one being sent while the next waits), none taking a stream longer than
    ``CHUNK_SECONDS``; at most ``max_chunk_bytes``, at least ``MIN_CHUNK_BYTES`` and
    total / ``MAX_CHUNKS``; a multiple of 4 KiB. On a clean fast path (one stream, tens of
    MB/s) that is ``max_chunk_bytes``, the size tuned for it."""
    wanted = total_bytes // max(1, streams * per_stream)
    if per_stream_bps is not None and per_stream_bps > 0:
        wanted = min(wanted, int(per_stream_bps * CHUNK_SECONDS))
    floor = max(MIN_CHUNK_BYTES, -(-total_bytes // MAX_CHUNKS))
    size = min(max_chunk_bytes, max(floor, wanted))
    return max(4096, size // 4096 * 4096) if size >= 4096 else size


__all__ = [
    "CHUNK_SECONDS",
    "DEFAULT_MAX_OUTSTANDING_BYTES",
    "INITIAL_WINDOW",
    "LOSS_BOUND",
    "MAX_CHUNKS",
    "MIN_CHUNK_BYTES",
    "K",
    "OutstandingRepairs",
    "PathSample",
    "RateMeter",
    "RepairPacer",
    "RepairTally",
    "StreamCount",
    "chunk_bytes_for",
    "transfer_deadline_s",
]
