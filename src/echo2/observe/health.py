"""What ``/health`` says: live and ready, for one process and for a host's launcher.

A process answers its own ``/health`` from its event loop, so an answer means *live*. It is
*ready* once every actor's setup has completed, while no actor has failed, the run is not
stopping and its runtime's last heartbeat tick is younger than the heartbeat timeout.

A process that is stopped (SIGSTOP) or whose loop is stuck cannot answer at all, so its
readiness must be served by someone who can see it: the launcher of its host probes every
process's ``/health/ready`` once per ``run.heartbeat_s`` and serves the host's ``/health``,
ready when every process it started answered ready within the last heartbeat timeout
(``HEARTBEAT_TIMEOUT_BEATS`` heartbeats). Both answer ``/health`` (JSON; 200 ready, 503
not), ``/health/ready`` (the same) and ``/health/live`` (200 whenever they answer), the
paths a Kubernetes readiness and liveness probe take.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from echo2.observe.http import Response, Route, get

HEARTBEAT_TIMEOUT_BEATS = 3.0
"""A process is not ready when its last heartbeat (or ready answer) is older than this many
``run.heartbeat_s``: one lost or late beat is not an outage, three are."""

ActorState = Literal["setting up", "running", "finished", "failed", "cancelled"]


def heartbeat_timeout_s(heartbeat_s: float) -> float:
    return HEARTBEAT_TIMEOUT_BEATS * heartbeat_s


class ProcessHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A process's ``/health`` body."""

    process: str
    ready: bool
    reason: str = ""
    """Why it is not ready ("" when ready)."""
    actors: dict[str, ActorState] = {}
    last_heartbeat_age_s: float | None = None
    """Seconds since the runtime's last heartbeat tick (None before the first)."""
    live: bool = True


class ProcessView(msgspec.Struct, frozen=True, kw_only=True):
    """What a launcher knows of one of its processes."""

    ready: bool
    reason: str = ""
    pid: int | None = None
    last_ready_age_s: float | None = None
    """Seconds since the process last answered ready (None: never)."""
    restarts: int = 0


class HostHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A launcher's ``/health`` body: its host's processes."""

    host: str
    ready: bool
    processes: dict[str, ProcessView] = {}
    live: bool = True


def health_routes(current: Callable[[], ProcessHealth | HostHealth]) -> dict[str, Route]:
    """``/health``, ``/health/ready`` and ``/health/live`` answered from ``current()``."""

    def ready() -> Response:
        health = current()
        return (200 if health.ready else 503), "application/json", msgspec.json.encode(health) + b"\n"

    def live() -> Response:
        return 200, "text/plain", b"live\n"

    return {"/health": ready, "/health/ready": ready, "/health/live": live}


class ProcessWatch:
    """The launcher's view of its processes' readiness, from probing their ``/health/ready``.

    ``pids()`` gives each process the launcher started and its PID while it is alive (None
    when it is not); ``restarts()`` the restarts of each."""

    def __init__(
        self,
        ports: Mapping[str, int],
        heartbeat_s: float,
        pids: Callable[[], Mapping[str, int | None]],
        restarts: Callable[[], Mapping[str, int]] = dict,
        *,
        host: str = "",
    ) -> None:
        self.ports = dict(ports)
        self.heartbeat_s = heartbeat_s
        self.timeout_s = heartbeat_timeout_s(heartbeat_s)
        self.host = host
        self._pids = pids
        self._restarts = restarts
        self._last_ready: dict[str, float] = {}
        self._last_answer: dict[str, str] = {}
        self._said_not_ready: set[str] = set()
        """Answered, and not ready: no grace, unlike a process that does not answer."""

    async def run(self) -> None:
        """Probe every process once per heartbeat, concurrently, until cancelled."""
        while True:
            await asyncio.gather(*(self._probe(name, port) for name, port in self.ports.items()))
            await asyncio.sleep(self.heartbeat_s)

    async def _probe(self, name: str, port: int) -> None:
        try:
            status, body = await get(port, "/health/ready", self.heartbeat_s)
        except (OSError, TimeoutError) as exc:
            self._last_answer[name] = f"no answer on port {port} ({type(exc).__name__})"
            return
        if status == 200:
            self._last_ready[name] = time.monotonic()
            self._last_answer[name] = ""
            self._said_not_ready.discard(name)
        else:
            self._said_not_ready.add(name)
            try:
                reason = msgspec.json.decode(body, type=ProcessHealth).reason
            except msgspec.DecodeError:
                reason = f"HTTP {status}"
            self._last_answer[name] = f"not ready: {reason}"

    def health(self) -> HostHealth:
        now = time.monotonic()
        pids, restarts = self._pids(), self._restarts()
        views: dict[str, ProcessView] = {}
        for name in self.ports:
            last = self._last_ready.get(name)
            age = None if last is None else round(now - last, 3)
            pid = pids.get(name)
            ready = pid is not None and age is not None and age <= self.timeout_s and name not in self._said_not_ready
            if ready:
                reason = ""
            elif pid is None:
                reason = "not running"
            else:
                reason = self._last_answer.get(name) or "no ready answer yet"
                if age is not None:
                    reason += f"; last ready {age:.1f} s ago (timeout {self.timeout_s:g} s)"
            views[name] = ProcessView(
                ready=ready, reason=reason, pid=pid, last_ready_age_s=age, restarts=restarts.get(name, 0)
            )
        return HostHealth(host=self.host, ready=all(v.ready for v in views.values()), processes=views)
