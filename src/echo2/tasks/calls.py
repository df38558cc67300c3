"""User code run in worker threads under a deadline (rewards and environments may raise or hang).

A call's deadline runs from when its function starts in a worker thread, not from when it
was asked for: a call waiting its turn behind slow or hung ones (more calls than
``threads``) waits without spending its time, so ``threads`` is sized for the parallelism
the code needs, not for the calls that may be in flight at once.

Python cannot kill a thread: a call past its deadline keeps its thread until it returns.
:class:`TimedCalls` counts such calls (``stuck``). Every call that is let through finds a
free thread at once: the pool holds ``threads + max_stuck`` threads, at most ``threads``
calls run for callers still waiting, and when the rest are all held by abandoned calls (a
missed deadline, a cancelled caller) the pool is replaced, so later calls run at full
width while the abandoned threads finish on their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Pool:
    """A thread pool and the number of its threads given work that has not finished."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.busy = 0
        self._lock = threading.Lock()  # the count drops in the worker thread that finished
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def _finished(self, _: object) -> None:
        with self._lock:
            self.busy -= 1

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        with self._lock:
            self.busy += 1
        future = self.executor.submit(fn)
        future.add_done_callback(self._finished)
        return future


class TimedCalls:
    """Runs functions in worker threads, at most ``threads`` at once, each under its own
    deadline from when it starts."""

    def __init__(
        self, threads: int, *, name: str, max_stuck: int = 16, on_renew: Callable[[int], None] | None = None
    ) -> None:
        if threads < 1 or max_stuck < 1:
            raise ValueError(f"threads and max_stuck must be >= 1, got {threads} and {max_stuck}")
        self.threads, self.name, self.max_stuck = threads, name, max_stuck
        self.stuck = 0
        """Calls that missed their deadline (their threads may still run)."""
        self._on_renew = on_renew
        """Told the number stuck each time the pool is replaced (to log it)."""
        self._pool = _Pool(threads + max_stuck, name)
        self._turns: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        """The running loop's semaphore of ``threads`` turns (a semaphore belongs to one loop)."""

    def _semaphore(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        if self._turns is None or self._turns[0] is not loop:
            self._turns = (loop, asyncio.Semaphore(self.threads))
        return self._turns[1]

    async def call(self, timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread once one of ``threads`` turns is free;
        ``TimeoutError`` when it runs past ``timeout_s`` seconds from its start, whatever
        ``fn`` raised otherwise."""
        loop = asyncio.get_running_loop()
        async with self._semaphore(loop):
            if self._pool.busy >= self._pool.workers:
                self._renew()
            began: asyncio.Future[float] = loop.create_future()

            def timed() -> T:
                _tell(loop, began, time.monotonic())
                return fn(*args)

            future = asyncio.wrap_future(self._pool.submit(timed), loop=loop)
            deadline: asyncio.Timeout | None = None
            try:
                await asyncio.wait((future, began), return_when=asyncio.FIRST_COMPLETED)
                if future.done():
                    return future.result()
                started_at = loop.time() - (time.monotonic() - began.result())  # in the loop's clock
                async with asyncio.timeout_at(started_at + timeout_s) as deadline:
                    return await future
            except TimeoutError:
                if deadline is not None and deadline.expired():  # not a TimeoutError fn raised
                    self.stuck += 1
                raise
            except asyncio.CancelledError:
                future.cancel()  # a call not yet started is dropped; one running keeps its thread
                raise

    def _renew(self) -> None:
        """Every thread of the pool is held by an abandoned call: start a fresh pool."""
        if self._on_renew is not None:
            self._on_renew(self.stuck)
        self._pool.executor.shutdown(wait=False, cancel_futures=False)
        self._pool = _Pool(self.threads + self.max_stuck, self.name)

    def close(self) -> None:
        self._pool.executor.shutdown(wait=False, cancel_futures=True)


def _tell(loop: asyncio.AbstractEventLoop, future: asyncio.Future[float], value: float) -> None:
    """Resolve ``future`` with ``value`` from a worker thread."""
    try:
        loop.call_soon_threadsafe(_resolve, future, value)
    except RuntimeError:  # the loop is closed: its caller is gone, the call runs for no one
        return


def _resolve(future: asyncio.Future[float], value: float) -> None:
    if not future.done():
        future.set_result(value)
