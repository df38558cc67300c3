"""Waiting in tests for state that the code under test updates on its own schedule."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout_s``.

    For an actor's counters or tables, which no event announces: where a handshake or an
    event exists, wait on that instead.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.005)
