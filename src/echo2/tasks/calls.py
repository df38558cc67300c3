"""User code run in worker threads under a deadline (rewards and environments may raise or hang).

Python cannot kill a thread: a call past its deadline keeps its thread until it returns.
:class:`TimedCalls` counts such threads (``stuck``) and, every ``max_stuck`` of them,
replaces its pool so later calls run at full width. A deadline runs from the call's
submission: a call queued behind hung ones can miss it too (size ``threads`` for the
calls in flight at once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class TimedCalls:
    """Runs functions in a thread pool, each under its own deadline."""

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
        self._pool = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=self.name)

    async def call(self, timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; ``TimeoutError`` after ``timeout_s`` seconds,
        whatever ``fn`` raised otherwise."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            self._hung()
            raise

    def _hung(self) -> None:
        self.stuck += 1
        if self.stuck % self.max_stuck == 0:
            if self._on_renew is not None:
                self._on_renew(self.stuck)
            # Calls still queued in the old pool keep their place (and their deadlines):
            # cancelling them would raise CancelledError in their callers, which reads as
            # the caller's own task being cancelled.
            self._pool.shutdown(wait=False, cancel_futures=False)
            self._pool = self._new_pool()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
