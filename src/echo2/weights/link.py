"""Emulated WAN links on the weight path: bandwidth caps and added latency, in the app.

``tc netem`` is not available on the machines echo2 is built on, and ``tc tbf`` needs root
and network namespaces; an application-level shaper runs anywhere and is honest as long as
every byte sent on the weight path goes through it. ``TokenBucket.acquire(n)`` is awaited
before a payload of ``n`` bytes is handed to ZeroMQ (uplink) or after one is taken from it
(downlink, which back-pressures the sender through TCP and the high-water marks).
``DelayLine`` adds a one-way latency: items come out ``latency_s`` after they went in, in
order, and pipelined (a full link of chunks is in flight at once, as on a real path).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def mbps_to_bytes_per_s(mbps: float) -> float:
    """Megabits (10^6 bits) per second -> bytes per second."""
    return mbps * 1e6 / 8.0


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One actor's link on the weight path; 0 means uncapped / no added latency."""

    uplink_mbps: float = 0.0
    downlink_mbps: float = 0.0
    latency_ms: float = 0.0

    def uplink(self, burst_bytes: int) -> TokenBucket:
        return TokenBucket(mbps_to_bytes_per_s(self.uplink_mbps), burst_bytes)

    def downlink(self, burst_bytes: int) -> TokenBucket:
        return TokenBucket(mbps_to_bytes_per_s(self.downlink_mbps), burst_bytes)


class TokenBucket:
    """A byte-rate pacer (GCRA form of a token bucket): ``rate`` bytes/s, ``burst`` bytes.

    ``acquire(n)`` returns once the bucket has paid for ``n`` bytes; a payload larger than
    the burst is allowed and simply waits longer (it is not split). ``rate <= 0``: no cap.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = 1 << 20) -> None:
        self.rate = float(rate_bytes_per_s)
        self.burst = max(1, int(burst_bytes))
        self._tat = 0.0  # theoretical arrival time of the next byte
        self.bytes = 0
        self.waited_s = 0.0

    @property
    def capped(self) -> bool:
        return self.rate > 0

    def delay_for(self, nbytes: int, now: float | None = None) -> float:
        """Charge ``nbytes`` and return how long the caller must wait before using them."""
        self.bytes += nbytes
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        # Bytes handed out by time t never exceed burst + rate * t.
        self._tat = max(self._tat, now) + nbytes / self.rate
        return max(0.0, self._tat - self.burst / self.rate - now)

    async def acquire(self, nbytes: int) -> None:
        delay = self.delay_for(nbytes)
        if delay > 0:
            self.waited_s += delay
            await asyncio.sleep(delay)


class DelayLine(Generic[T]):
    """A FIFO whose items become available ``latency_s`` after ``put_nowait``.

    ``clock`` (seconds) and ``sleep`` are the monotonic clock and the asyncio sleep unless a
    test injects a fake pair."""

    def __init__(
        self,
        latency_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.latency_s = max(0.0, latency_s)
        self._items: collections.deque[tuple[float, T]] = collections.deque()
        self._event = asyncio.Event()
        self._clock = clock
        self._sleep = sleep

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> None:
        self._items.append((self._clock() + self.latency_s, item))
        self._event.set()

    async def get(self) -> T:
        while not self._items:
            self._event.clear()
            await self._event.wait()
        due, _ = self._items[0]
        delay = due - self._clock()
        if delay > 0:
            await self._sleep(delay)
        return self._items.popleft()[1]


__all__ = ["DelayLine", "LinkSpec", "TokenBucket", "mbps_to_bytes_per_s"]
