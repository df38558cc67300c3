"""PromptSource: leases tasks to samplers that ask for work, and re-issues lost work.

Role: the only place work is created. A task is one prompt to be sampled ``group_size``
times; it is handed out as a lease (``lease_id``, ``attempt``, ``ttl_s``).

Input: ``tasks`` (ROUTER) — ``Hello`` and ``WorkRequest(credits)`` from Samplers;
``completions`` (PULL) — ``LeaseClosed`` and ``LearnerProgress`` from the Buffer.
Output: ``TaskLease`` to samplers with credit; ``ExpireLease`` to the Buffer (``lease_control``).

Backpressure: work is pulled, never pushed. A sampler receives at most the credits it
granted, and the whole pipeline holds at most ``max_inflight_groups`` groups that are
leased or stored but not yet trained, so generation cannot run ahead of the learner by
more than the staleness budget allows. Each lease carries ``min_version`` (the learner's
next version minus S): samplers wait for weights rather than make work that would arrive
too stale to train.

Loss recovery: a lease whose deadline passes is offered to the Buffer for expiry; the
Buffer answers ``stored`` (a result already landed: nothing to do) or ``expired`` (no
result can be trained any more: re-issue with ``attempt + 1``). A task is dropped after
``max_attempts``. A sampler that disconnects simply stops being offered work; its leases
expire.

Shutdown: on ``stopping`` it stops issuing and returns.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from echo2.actor import Actor, ActorConfig, Port
from echo2.actors.common import load_job_task, run_until_stopped
from echo2.messages import (
    ExpireLease,
    Hello,
    LeaseClosed,
    LearnerProgress,
    TaskLease,
    Welcome,
    WorkRequest,
)
from echo2.messages import PROTOCOL_VERSION
from echo2.tasks.base import Prompt


class PromptSourceConfig(ActorConfig):
    lease_ttl_s: float = 60.0
    """Seconds a sampler has to deliver a scored group before the task is re-issued."""
    max_attempts: int = 5
    """Issues of one task before it is dropped (counted as ``attempts_exhausted``)."""
    max_inflight_groups: int = 0
    """Groups leased or stored but not yet trained; 0 = groups_per_step * min(S + 1, 2)."""
    expiry_check_s: float = 0.5
    """How often deadlines are checked (granularity of expiry)."""
    max_tasks: int = 0
    """Stop after this many distinct tasks (0 = unlimited)."""


@dataclass
class _Lease:
    lease_id: int
    prompt: Prompt
    attempt: int
    sampler: bytes
    deadline: float
    expiring: bool = False


class PromptSource(Actor):
    kind: ClassVar[str] = "prompt_source"
    Config = PromptSourceConfig
    ports: ClassVar[dict[str, Port]] = {
        "tasks": Port("router", bind=True),
        "completions": Port("pull", bind=True),
        "lease_control": Port("push", bind=False),
    }
    config: PromptSourceConfig

    def setup_state(self) -> None:
        job = self.job
        self._task = load_job_task(job)
        self._prompts = self._task.prompts(job.seed)
        self._retry: deque[tuple[Prompt, int]] = deque()  # (prompt, attempt) to re-issue first
        self._credits: dict[bytes, int] = {}
        self._ready_samplers: deque[bytes] = deque()
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._next_version = 0
        self._stored = self._trained = self._dropped_after_store = 0
        self._issued_tasks = 0
        self.counters = dict.fromkeys(
            (
                "leases_issued",
                "leases_reissued",
                "leases_expired",
                "leases_stored",
                "closed_duplicate",
                "closed_late",
                "closed_dropped",
                "attempts_exhausted",
                "refused_peers",
            ),
            0,
        )
        limit = self.config.max_inflight_groups
        self._max_inflight = limit or job.groups_per_step * min(job.staleness + 1, 2)
        self._wakeup = asyncio.Event()

    async def setup(self, ctx) -> None:  # type: ignore[no-untyped-def]
        await super().setup(ctx)
        self.setup_state()
        self._tasks_ep = ctx.open("tasks")
        self._completions = ctx.open("completions")
        self._control = ctx.open("lease_control")

    def statistics(self) -> dict[str, float]:
        return {**self.counters, "open_leases": len(self._leases), "inflight": self._inflight()}

    def _inflight(self) -> int:
        return len(self._leases) + self._stored - self._trained - self._dropped_after_store

    # -- loops -----------------------------------------------------------------------

    async def run(self) -> None:
        await run_until_stopped(
            self.ctx.stopping,
            self._serve_samplers(),
            self._serve_completions(),
            self._expire_leases(),
            self._issue(),
        )

    async def _serve_samplers(self) -> None:
        while True:
            for peer, message in await self._tasks_ep.recv_many():
                if isinstance(message, WorkRequest):
                    self._credits[peer] = self._credits.get(peer, 0) + max(0, message.credits)
                    self._wakeup.set()
                elif isinstance(message, Hello):
                    await self._greet(peer, message)

    async def _greet(self, peer: bytes, hello: Hello) -> None:
        accepted = hello.protocol_version == PROTOCOL_VERSION
        reason = "" if accepted else (
            f"protocol {hello.protocol_version} not supported (this PromptSource speaks {PROTOCOL_VERSION})"
        )
        if not accepted:
            self.counters["refused_peers"] += 1
            self.ctx.log.warning("refused sampler %s: %s", hello.peer_id, reason)
        else:
            # A (re)connecting sampler starts with no credit: anything it held is gone.
            self._credits[peer] = 0
        await self._tasks_ep.send(peer, Welcome(server_id=self.name, accepted=accepted, reason=reason))

    async def _serve_completions(self) -> None:
        while True:
            for message in await self._completions.recv_many():
                if isinstance(message, LeaseClosed):
                    self._on_closed(message)
                elif isinstance(message, LearnerProgress):
                    self._next_version = max(self._next_version, message.next_version)
                    self._trained = max(self._trained, message.groups_trained)
                    self._dropped_after_store = max(
                        self._dropped_after_store, message.groups_dropped_after_store
                    )
            self._wakeup.set()

    def _on_closed(self, closed: LeaseClosed) -> None:
        lease = self._leases.get(closed.lease_id)
        if closed.outcome == "late":
            self.counters["closed_late"] += 1
            return
        if lease is None:
            return  # already settled (e.g. a repeated answer to a repeated ExpireLease)
        del self._leases[closed.lease_id]
        if closed.outcome == "stored":
            # Counted here, not from LearnerProgress, so that a stored group never leaves
            # the in-flight window before it is trained or dropped.
            self.counters["leases_stored"] += 1
            self._stored += 1
        elif closed.outcome == "expired":
            self.counters["leases_expired"] += 1
            if lease.attempt + 1 < self.config.max_attempts:
                self._retry.append((lease.prompt, lease.attempt + 1))
            else:
                self.counters["attempts_exhausted"] += 1
        elif closed.outcome == "duplicate":
            self.counters["closed_duplicate"] += 1
        else:
            self.counters["closed_dropped"] += 1

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.expiry_check_s)  # a timer, not a synchronisation
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                lease.expiring = True
                await self._control.send(
                    ExpireLease(lease_id=lease_id, task_id=lease.prompt.task_id, attempt=lease.attempt)
                )
                # Ask again later if the Buffer does not answer (it may be restarting).
                heapq.heappush(self._deadlines, (now + self.config.lease_ttl_s, lease_id))

    def _min_version(self) -> int:
        """Oldest policy whose work will still be admissible when the learner reaches it.

        Batches are served oldest first, so work issued now is trained after everything
        already stored or leased: about ``ahead`` batches after the learner's next version.
        """
        ahead = (len(self._leases) + self._stored - self._trained - self._dropped_after_store) // max(
            1, self.job.groups_per_step
        )
        return max(0, self._next_version + ahead - self.job.staleness)

    def _next_prompt(self) -> tuple[Prompt, int] | None:
        if self._retry:
            return self._retry.popleft()
        if self.config.max_tasks and self._issued_tasks >= self.config.max_tasks:
            return None
        self._issued_tasks += 1
        return next(self._prompts), 0

    async def _issue(self) -> None:
        job = self.job
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            for peer, credit in list(self._credits.items()):
                while credit > 0 and self._inflight() < self._max_inflight:
                    item = self._next_prompt()
                    if item is None:
                        break
                    prompt, attempt = item
                    lease = _Lease(
                        lease_id=next(self._lease_ids),
                        prompt=prompt,
                        attempt=attempt,
                        sampler=peer,
                        deadline=time.monotonic() + self.config.lease_ttl_s,
                    )
                    message = TaskLease(
                        lease_id=lease.lease_id,
                        task_id=prompt.task_id,
                        attempt=attempt,
                        prompt=prompt.text,
                        answer=prompt.answer,
                        group_size=job.group_size,
                        ttl_s=self.config.lease_ttl_s,
                        temperature=job.temperature,
                        top_p=job.top_p,
                        max_new_tokens=job.max_new_tokens,
                        min_version=self._min_version(),
                    )
                    if not await self._tasks_ep.send(peer, message):
                        # The sampler is gone: put the task back, forget its credit.
                        self._retry.appendleft((prompt, attempt))
                        credit = 0
                        break
                    self._leases[lease.lease_id] = lease
                    heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
                    self.counters["leases_issued"] += 1
                    if attempt:
                        self.counters["leases_reissued"] += 1
                    credit -= 1
                self._credits[peer] = credit
