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

Multi-turn jobs (``[job.episode]``, ``echo2.envs``): a group's completions are episodes
in turn segments. Admission also checks the segments (``check_segments``); the reward is
then not computed from text but by replaying each episode on this, the trusted, side
(``echo2.envs.replay``): a fresh environment reset from the lease record's prompt and the
lease's seed, stepped with the sampler's actions, must produce every observation token the
sampler sent (else the group is refused, ``observation_mismatch``), and its return is the
reward. A replay that raises or passes ``turn_timeout_s`` per turn fails the lease as a
sampler's failing environment does (``GroupRejected`` with ``environment_raised`` or
``environment_timeout``: re-issued, counted as ``replay:raised:<Type>``, ``replay:timeout``
in ``episode_failures``). An environment that cannot be
replayed is accepted only from ``job.episode.trusted_samplers``, with their returns. A
sampler's ``EpisodeFailed`` (its environment failed) becomes a ``GroupRejected`` of the
holder: the lease is re-issued.

Input: ``rollouts`` (PULL, bound; every Sampler connects) — ``RolloutGroup``, ``EpisodeFailed``;
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
import math
import time
from typing import Annotated, ClassVar

import msgspec
import numpy as np
from msgspec import Meta

from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors.admission import (
    EpisodeAdmission,
    Rejection,
    check_group,
    check_lease,
    rollout_group_max_bytes,
    trusted_prompt,
    trusted_prompt_codec,
    trusted_texts,
)
from echo2.envs.base import EnvironmentSpec, load_job_environment
from echo2.envs.codec import load_episode_codec
from echo2.envs.episode import EpisodeCodec, EpisodeLimits, episode_text
from echo2.envs.play import EnvironmentFailed
from echo2.envs.replay import ReplayMismatch, episode_segments, replay_episode
from echo2.job import JobConfig, JobObjects
from echo2.messages import (
    AdmissionWindow,
    EpisodeFailed,
    GroupRejected,
    LeaseQuery,
    LeaseRecord,
    LeaseRecords,
    RewarderStats,
    RolloutGroup,
    ScoredGroup,
)
from echo2.tasks.base import Prompt, load_job_task, reward_range
from echo2.tasks.calls import TimedCalls


class RewarderConfig(ActorConfig, frozen=True):
    item_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds one completion's reward call may take before it counts as timed out."""
    threads: Annotated[int, Meta(ge=1)] = 4
    """Reward calls run at once, each in a worker thread (and as many replays of episodes,
    in multi-turn jobs); more wait their turn, and a call's timeout runs from when it starts."""
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
        self._calls = TimedCalls(
            self.config.threads,
            name=f"{self.name}-reward",
            max_stuck=self.config.max_stuck_threads,
            on_renew=lambda stuck: self.ctx.log.warning("%d reward calls hung; starting a fresh thread pool", stuck),
        )
        self._slots = asyncio.Semaphore(self.config.max_concurrent_groups)
        self._rollouts = ctx.open("rollouts", max_message_bytes=rollout_group_max_bytes(self.job))
        self._scored = ctx.open("scored")
        self._leases = ctx.open("leases")
        self._query_ids = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "groups_scored",
                "groups_dropped",
                "items_scored",
                "groups_rejected",
                "lease_lookup_retries",
                "episodes_replayed",
            ),
            0,
        )
        self.item_errors: dict[str, int] = {}
        self.episode_failures: dict[str, int] = {}
        self._episodes: _Replays | None = None
        if self.job.multi_turn:
            # Replays are the environment's own deterministic code, CPU-bound like rewards:
            # as many threads as rewards get (a replay waiting its turn spends no deadline).
            calls = TimedCalls(self.config.threads, name=f"{self.name}-replay", max_stuck=self.config.max_stuck_threads)
            self._episodes = await asyncio.to_thread(_Replays.load, self.job, ctx.job_objects, calls)

    def statistics(self) -> RewarderStats:
        return RewarderStats(
            **self.counters,
            item_errors=dict(self.item_errors),
            stuck_threads=self._calls.stuck + (self._episodes.calls.stuck if self._episodes is not None else 0),
            episode_failures=dict(self.episode_failures),
        )

    async def aclose(self) -> None:
        for calls in (getattr(self, "_calls", None), getattr(getattr(self, "_episodes", None), "calls", None)):
            if calls is not None:
                calls.close()

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._serve())

    async def _serve(self) -> None:
        async with asyncio.TaskGroup() as group:
            while True:
                received = await self._rollouts.recv_many(self.config.max_concurrent_groups)
                rollouts = [m for m in received if isinstance(m, RolloutGroup)]
                failed = [m for m in received if isinstance(m, EpisodeFailed)]
                if not rollouts and not failed:
                    continue
                records, window = await self._lookup(
                    sorted({*(r.lease_id for r in rollouts), *(f.lease_id for f in failed)})
                )
                for report in failed:
                    await self._on_episode_failed(report, records.get(report.lease_id))
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
            admission = self._episodes.admission if self._episodes is not None else None
            rejection = check_group(rollout, record, window, admission)
        if rejection is None:
            assert record is not None
            texts = self._trusted_texts(rollout)
            if not isinstance(texts, tuple):
                # Scored and trained as the trusted side reads it: its prompt, its decoding.
                return msgspec.structs.replace(rollout, prompt=record.prompt, texts=texts), record
            rejection = texts
        await self._reject(rollout, record if holder else None, rejection)
        return None

    def _trusted_texts(self, rollout: RolloutGroup) -> list[str] | Rejection:
        if self._episodes is None:
            return trusted_texts(rollout, self._codec)
        codec = self._episodes.codec
        try:
            return [episode_text(codec, episode_segments(rollout, i)) for i in range(rollout.group_size)]
        except (ValueError, KeyError, IndexError) as exc:  # an id the tokenizer maps to no text
            return "token_out_of_vocab", f"the tokenizer cannot decode an episode: {exc}"

    async def _reject(
        self, sent: RolloutGroup | EpisodeFailed, holder_record: LeaseRecord | None, rejection: Rejection
    ) -> None:
        """Refuse ``sent`` (``GroupRejected`` to the Buffer); ``holder_record``: the lease's
        record when ``sent`` is the holder's (it echoed the token), else None."""
        reason, detail = rejection
        self.counters["groups_rejected"] += 1
        record = holder_record
        await self._scored.send(
            GroupRejected(
                lease_id=sent.lease_id,
                task_id=record.task_id if record is not None else sent.task_id,
                attempt=record.attempt if record is not None else sent.attempt,
                sampler_id=record.sampler_id if record is not None else sent.sampler_id,
                version=sent.version if isinstance(sent, RolloutGroup) else -1,
                reason=reason,
                holder=record is not None,
                detail=detail,
            )
        )

    async def _on_episode_failed(self, report: EpisodeFailed, record: LeaseRecord | None) -> None:
        """A sampler's environment failed an episode: with the lease's token, the lease is
        closed ``rejected`` (re-issued at once) for the report's reason."""
        rejection = check_lease(report, record)
        if rejection is None and self._episodes is None:
            rejection = "bad_segments", "an episode failure reported in a single-turn job"
        if rejection is not None:
            await self._reject(
                report, record if rejection[0] not in ("unknown_lease", "wrong_token") else None, rejection
            )
            return
        key = f"sampler:{report.reason}"
        self.episode_failures[key] = self.episode_failures.get(key, 0) + 1
        self.ctx.log.info("task %s: %s's environment failed (%s)", report.task_id, report.sampler_id, report.detail)
        await self._reject(report, record, (report.reason, report.detail))

    async def _score_and_forward(self, rollout: RolloutGroup, record: LeaseRecord) -> None:
        try:
            if self._episodes is not None:
                scored = await self._score_episodes(rollout, record, self._episodes)
                if scored is None:
                    return
            else:
                scored = await self._score(rollout, trusted_prompt(record))
            await self._scored.send(scored)
        finally:
            self._slots.release()

    async def _score_episodes(
        self, rollout: RolloutGroup, record: LeaseRecord, replays: _Replays
    ) -> ScoredGroup | None:
        """Rewards of a multi-turn group by replaying its episodes; None: refused, because
        the replay disagreed with what the sampler sent (``observation_mismatch``) or the
        environment failed in the replay (the lease is re-issued, as for a sampler's
        failure: never a reward of 0)."""
        started = time.perf_counter()
        prompt = trusted_prompt(record)
        if not replays.spec.replayable:  # admitted from a trusted sampler only, returns included
            assert rollout.episode_returns is not None
            results = [(float(r), "") for r in rollout.episode_returns]
        else:
            outcomes = await asyncio.gather(
                *(self._replay(replays, prompt, record.episode_seed, rollout, i) for i in range(rollout.group_size))
            )
            mismatch = next((o for o in outcomes if isinstance(o, ReplayMismatch)), None)
            if mismatch is not None:
                await self._reject(rollout, record, ("observation_mismatch", str(mismatch)))
                return None
            failure = next((o for o in outcomes if isinstance(o, EnvironmentFailed)), None)
            if failure is not None:
                await self._reject(rollout, record, (failure.reason, f"replay: {failure.detail}"))
                return None
            results = [o for o in outcomes if isinstance(o, tuple)]
        return self._scored_group(rollout, results, time.perf_counter() - started)

    async def _replay(
        self, replays: _Replays, prompt: Prompt, seed: int, rollout: RolloutGroup, i: int
    ) -> tuple[float, str] | ReplayMismatch | EnvironmentFailed:
        """(return, "") of completion ``i``'s replay ((0.0, "not_finite") for a return that
        is no number), the mismatch, or how the environment failed."""
        segments = episode_segments(rollout, i)
        deadline = self.job.episode.turn_timeout_s * (self.job.episode.max_turns + 1)
        self.counters["episodes_replayed"] += 1
        try:
            replayed = await replays.calls.call(
                deadline, replay_episode, replays.spec.factory, prompt, seed, segments, replays.codec, replays.limits
            )
        except ReplayMismatch as mismatch:
            return mismatch
        except TimeoutError:
            return self._episode_failed(
                "replay:timeout", EnvironmentFailed("environment_timeout", f"past {deadline:g} s")
            )
        except Exception as exc:  # user code: any failure fails the episode
            failure = EnvironmentFailed("environment_raised", f"raised:{type(exc).__name__}: {exc}")
            return self._episode_failed(f"replay:raised:{type(exc).__name__}", failure)
        if not math.isfinite(replayed.returns):
            return 0.0, "not_finite"
        return replayed.returns, ""

    def _episode_failed(self, key: str, failure: EnvironmentFailed) -> EnvironmentFailed:
        self.episode_failures[key] = self.episode_failures.get(key, 0) + 1
        return failure

    async def _score(self, rollout: RolloutGroup, prompt: Prompt) -> ScoredGroup:
        started = time.perf_counter()
        results = await self._score_group(prompt, rollout.texts)
        return self._scored_group(rollout, results, time.perf_counter() - started)

    def _scored_group(self, rollout: RolloutGroup, results: list[tuple[float, str]], reward_s: float) -> ScoredGroup:
        """The group with its rewards; an item with a reason failed: kept out, counted."""
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
            reward_s=reward_s,
        )

    async def _score_group(self, prompt: Prompt, texts: list[str]) -> list[tuple[float, str]]:
        """All of a group's rewards in one worker-thread call (one hand-off, not G); if that
        misses the group's deadline, fall back to one call per item to find the culprit."""
        deadline = self.config.item_timeout_s * max(1, len(texts))
        try:
            return await self._calls.call(deadline, self._score_in_thread, prompt, texts)
        except TimeoutError:
            return list(await asyncio.gather(*(self._score_one(prompt, text) for text in texts)))

    def _score_in_thread(self, prompt: Prompt, texts: list[str]) -> list[tuple[float, str]]:
        return [_checked(self._task.reward, prompt, text, self._bounds) for text in texts]

    async def _score_one(self, prompt: Prompt, completion: str) -> tuple[float, str]:
        """Returns (reward, "") or (0.0, reason)."""
        try:
            return await self._calls.call(
                self.config.item_timeout_s, _checked, self._task.reward, prompt, completion, self._bounds
            )
        except TimeoutError:
            return 0.0, "timeout"


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


class _Replays:
    """What a Rewarder of a multi-turn job replays episodes with (``echo2.envs.replay``)."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        codec: EpisodeCodec,
        limits: EpisodeLimits,
        admission: EpisodeAdmission,
        calls: TimedCalls,
    ) -> None:
        self.spec, self.codec, self.limits, self.admission, self.calls = spec, codec, limits, admission, calls

    @classmethod
    def load(cls, job: JobConfig, objects: JobObjects | None, calls: TimedCalls) -> _Replays:
        spec = load_job_environment(job, objects)
        codec = load_episode_codec(job.model, job.prompt_format)
        return cls(spec, codec, EpisodeLimits.of_job(job), EpisodeAdmission.of_job(job, spec.replayable), calls)
