"""Rewarder: scores every completion of a rollout group with the task's reward function.

Role: the trusted side of scoring. Reward code is user code: it may raise or hang. Each
completion is scored in a worker thread with a deadline (``item_timeout_s``); a completion
whose reward raised, timed out, returned a non-finite number or one outside the task's
declared ``reward_range`` is kept out of training (``keep[i] = False``) and counted by
reason (``raised:<Type>``, ``timeout``, ``not_a_number``, ``not_finite``, ``out_of_range``),
never scored as 0; the Buffer totals the reasons (``BufferStats.reward_failures``) and the
learner's ``summary.json`` reports them (``reward_failures_by_reason``). A group with fewer than
``min_kept`` scored completions is forwarded as dropped so that the Buffer, the single
accountant, closes its lease.

Admission (``echo2.actors.admission``): nothing a sampler sends is believed. For each
batch of groups received the Rewarder asks the PromptSource for the open leases' records
(``LeaseQuery`` on ``leases``), refuses a group that does not match its lease or is not
well-formed for the model (``GroupRejected`` to the Buffer, which counts it and closes the
lease), and scores the rest against the record's ``Prompt`` (answer and meta included),
never the sampler's copy. The forwarded group carries the trusted prompt text.

Input: ``rollouts`` (PULL, bound; every Sampler connects) — ``RolloutGroup``;
``leases`` (DEALER, to the PromptSource) — ``LeaseRecords``.
Output: ``scored`` (PUSH, to the Buffer) — ``ScoredGroup``, ``GroupRejected``.

Backpressure: at most ``max_concurrent_groups`` groups are scored at once; beyond that the
Rewarder stops reading, the PULL queue fills to its HWM and samplers block on send.

Hung reward code: Python cannot kill a thread. A timed-out call keeps its thread; the
number of such threads is in ``statistics().stuck_threads``, and the pool is replaced
once ``max_stuck_threads`` are stuck, so scoring continues at full width.

Shutdown: on ``stopping`` it stops reading and returns; unscored groups' leases expire.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from typing import Annotated, ClassVar

import msgspec
import numpy as np
from msgspec import Meta

from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors.admission import (
    check_group,
    check_lease,
    rollout_group_max_bytes,
    trusted_prompt,
    trusted_prompt_codec,
    trusted_texts,
)
from echo2.messages import (
    AdmissionWindow,
    GroupRejected,
    LeaseQuery,
    LeaseRecord,
    LeaseRecords,
    RewarderStats,
    RolloutGroup,
    ScoredGroup,
)
from echo2.tasks.base import Prompt, load_job_task, reward_range


class RewarderConfig(ActorConfig, frozen=True):
    item_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds one completion's reward call may take before it counts as timed out."""
    threads: Annotated[int, Meta(ge=1)] = 4
    """Worker threads that run reward code."""
    max_concurrent_groups: Annotated[int, Meta(ge=1)] = 8
    """Groups scored at once; beyond it the Rewarder stops reading (backpressure)."""
    min_kept: Annotated[int, Meta(ge=0)] = 2
    """A group needs this many scored completions to be trainable (GRPO needs a baseline)."""
    max_stuck_threads: Annotated[int, Meta(ge=1)] = 16
    """Threads stuck in timed-out reward calls after which the pool is replaced."""
    lease_lookup_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds to wait for the PromptSource's lease records before asking again."""


class Rewarder(Actor):
    kind: ClassVar[str] = "rewarder"
    Config = RewarderConfig
    ports: ClassVar[dict[str, Port]] = {
        "rollouts": Port("pull", bind=True),
        "scored": Port("push", bind=False),
        "leases": Port("dealer", bind=False),
    }
    config: RewarderConfig

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        self._task = load_job_task(self.job, ctx.job_objects)
        self._bounds = reward_range(self._task)
        self._codec = await asyncio.to_thread(trusted_prompt_codec, self.job)
        self._pool = self._new_pool()
        self._stuck = 0
        self._slots = asyncio.Semaphore(self.config.max_concurrent_groups)
        self._rollouts = ctx.open("rollouts", max_message_bytes=rollout_group_max_bytes(self.job))
        self._scored = ctx.open("scored")
        self._leases = ctx.open("leases")
        self._query_ids = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("groups_scored", "groups_dropped", "items_scored", "groups_rejected", "lease_lookup_retries"), 0
        )
        self.item_errors: dict[str, int] = {}

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.threads, thread_name_prefix=f"{self.name}-reward"
        )

    def statistics(self) -> RewarderStats:
        return RewarderStats(**self.counters, item_errors=dict(self.item_errors), stuck_threads=self._stuck)

    async def aclose(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._serve())

    async def _serve(self) -> None:
        async with asyncio.TaskGroup() as group:
            while True:
                received = await self._rollouts.recv_many(self.config.max_concurrent_groups)
                rollouts = [m for m in received if isinstance(m, RolloutGroup)]
                if not rollouts:
                    continue
                records, window = await self._lookup(sorted({r.lease_id for r in rollouts}))
                for rollout in rollouts:
                    admitted = await self._admit(rollout, records.get(rollout.lease_id), window)
                    if admitted is not None:
                        await self._slots.acquire()
                        group.create_task(self._score_and_forward(*admitted))

    async def _lookup(self, lease_ids: list[int]) -> tuple[dict[int, LeaseRecord], AdmissionWindow]:
        """The PromptSource's records of these leases (absent: not open) and the window."""
        self._query_ids += 1
        request_id = self._query_ids
        while True:
            await self._leases.send(LeaseQuery(request_id=request_id, lease_ids=lease_ids))
            try:
                async with asyncio.timeout(self.config.lease_lookup_timeout_s):
                    while True:
                        reply = await self._leases.recv()
                        if isinstance(reply, LeaseRecords) and reply.request_id == request_id:
                            return {r.lease_id: r for r in reply.records}, reply.window
            except TimeoutError:
                self.counters["lease_lookup_retries"] += 1
                self.ctx.log.warning("no lease records from the PromptSource in %.1f s; asking again",
                                     self.config.lease_lookup_timeout_s)  # fmt: skip

    async def _admit(
        self, rollout: RolloutGroup, record: LeaseRecord | None, window: AdmissionWindow
    ) -> tuple[RolloutGroup, LeaseRecord] | None:
        """(the group with the trusted prompt, its record), or None when it was refused."""
        rejection = check_lease(rollout, record)
        holder = rejection is None
        if record is not None and rejection is None:
            rejection = check_group(rollout, record, window)
        if rejection is None:
            assert record is not None
            texts = trusted_texts(rollout, self._codec)
            if not isinstance(texts, tuple):
                # Scored and trained as the trusted side reads it: its prompt, its decoding.
                return msgspec.structs.replace(rollout, prompt=record.prompt, texts=texts), record
            rejection = texts
        reason, detail = rejection
        self.counters["groups_rejected"] += 1
        await self._scored.send(
            GroupRejected(
                lease_id=rollout.lease_id,
                task_id=record.task_id if holder and record is not None else rollout.task_id,
                attempt=record.attempt if holder and record is not None else rollout.attempt,
                sampler_id=record.sampler_id if holder and record is not None else rollout.sampler_id,
                version=rollout.version,
                reason=reason,
                holder=holder,
                detail=detail,
            )
        )
        return None

    async def _score_and_forward(self, rollout: RolloutGroup, record: LeaseRecord) -> None:
        try:
            scored = await self._score(rollout, trusted_prompt(record))
            await self._scored.send(scored)
        finally:
            self._slots.release()

    async def _score(self, rollout: RolloutGroup, prompt: Prompt) -> ScoredGroup:
        started = time.perf_counter()
        results = await self._score_group(prompt, rollout.texts)
        rewards = np.zeros(len(results), dtype=np.float32)
        keep = np.zeros(len(results), dtype=bool)
        errors: dict[str, int] = {}
        for i, (reward, error) in enumerate(results):
            if error:
                errors[error] = errors.get(error, 0) + 1
                self.item_errors[error] = self.item_errors.get(error, 0) + 1
            else:
                rewards[i], keep[i] = reward, True
        self.counters["items_scored"] += int(keep.sum())
        dropped = ""
        if int(keep.sum()) < min(self.config.min_kept, len(results)):
            dropped = "reward_failed"
            self.counters["groups_dropped"] += 1
        else:
            self.counters["groups_scored"] += 1
        return ScoredGroup(
            group=rollout,
            rewards=rewards,
            keep=keep,
            dropped_reason=dropped,
            item_errors=errors,
            reward_s=time.perf_counter() - started,
        )

    async def _score_group(self, prompt: Prompt, texts: list[str]) -> list[tuple[float, str]]:
        """All of a group's rewards in one worker-thread call (one hand-off, not G); if that
        misses the group's deadline, fall back to one call per item to find the culprit."""
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._pool, self._score_in_thread, prompt, texts)
        try:
            async with asyncio.timeout(self.config.item_timeout_s * max(1, len(texts))):
                return await call  # (not wait_for: on 3.11 it can swallow a cancellation)
        except TimeoutError:
            self._thread_hung()
            return list(await asyncio.gather(*(self._score_one(prompt, text) for text in texts)))

    def _score_in_thread(self, prompt: Prompt, texts: list[str]) -> list[tuple[float, str]]:
        return [_checked(self._task.reward, prompt, text, self._bounds) for text in texts]

    async def _score_one(self, prompt: Prompt, completion: str) -> tuple[float, str]:
        """Returns (reward, "") or (0.0, reason)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, _checked, self._task.reward, prompt, completion, self._bounds)
        try:
            async with asyncio.timeout(self.config.item_timeout_s):
                return await future
        except TimeoutError:
            self._thread_hung()
            return 0.0, "timeout"

    def _thread_hung(self) -> None:
        """A reward call missed its deadline and keeps its thread; renew the pool now and then."""
        self._stuck += 1
        if self._stuck % self.config.max_stuck_threads == 0:
            self.ctx.log.warning("%d reward calls hung; starting a fresh thread pool", self._stuck)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()


def _checked(reward_fn, prompt: Prompt, completion: str, bounds: tuple[float, float] | None) -> tuple[float, str]:
    """(reward, "") or (0.0, reason): user reward code may raise or return garbage, or a
    value outside the range its task declares (``bounds``)."""
    try:
        reward = reward_fn(prompt, completion)
    except Exception as exc:  # user code: any failure costs this item only
        return 0.0, f"raised:{type(exc).__name__}"
    try:
        value = float(reward)
    except (TypeError, ValueError):
        return 0.0, "not_a_number"
    if not math.isfinite(value):
        return 0.0, "not_finite"
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        return 0.0, "out_of_range"
    return value, ""
