"""Playing episodes: the loop a Sampler runs (and the learner's held-out evaluation).

All episodes of a batch advance together, one model turn at a time: the live episodes'
contexts (prompt + everything so far) go to the engine in one call per turn budget, then
every environment is stepped at once in worker threads, each call under the turn timeout.
Between turns the caller may install newer weights (``between_turns``); each action
records the version that sampled it.

Episodes belong to groups (a lease's G episodes): when one fails, the rest of its group
is abandoned too, since the lease is failed as a whole.
"""

from __future__ import annotations

import asyncio
import functools
from collections import defaultdict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from echo2.engines.base import Completion, SamplingParams
from echo2.envs.base import Environment, EnvironmentFactory, close_environment, succeeded
from echo2.envs.episode import MODEL, Episode, EpisodeCodec, EpisodeLimits, episode_arrays, episode_text
from echo2.messages import EnvironmentFailure, RolloutGroup, TaskLease
from echo2.tasks.base import Prompt
from echo2.tasks.calls import TimedCalls

OTHER_EPISODE_FAILED = "another episode of its group failed"
"""``EnvironmentFailed.detail`` of the episodes abandoned with a failed one."""

Generate = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]
"""One completion per context, in order (an engine's ``generate`` with ``n = 1``)."""


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to play: its group, the prompt as the environment sees it, the prompt's
    token ids and the seed the environment resets with."""

    group: Hashable
    prompt: Prompt
    prompt_ids: list[int]
    seed: int


class EnvironmentFailed(Exception):
    """An episode's environment raised or timed out."""

    def __init__(self, reason: EnvironmentFailure, detail: str) -> None:
        super().__init__(detail)
        self.reason: EnvironmentFailure = reason
        self.detail = detail


@dataclass
class Played:
    """A finished episode, or why it failed (then ``episode`` is partial)."""

    request: EpisodeRequest
    episode: Episode
    success: bool | None = None
    """The environment's ``succeeded()`` verdict (None: it declares none)."""
    failure: EnvironmentFailed | None = None
    close_error: str = ""
    """What ``close()`` raised or that it hung ("": closed, or nothing to close): not the
    episode's failure (its record is complete), for the caller to count."""


async def play_episodes(
    requests: Sequence[EpisodeRequest],
    *,
    factory: EnvironmentFactory,
    generate: Generate,
    codec: EpisodeCodec,
    limits: EpisodeLimits,
    calls: TimedCalls,
    timeout_s: float,
    temperature: float,
    top_p: float,
    version: Callable[[], int],
    between_turns: Callable[[], Awaitable[None]] | None = None,
) -> list[Played]:
    """Play every request's episode to its end; results in request order."""
    played = [Played(r, Episode(limits, codec)) for r in requests]
    envs: list[Environment | None] = [None] * len(played)

    async def guarded(i: int, what: str, fn: Callable[[], None]) -> None:
        try:
            await calls.call(timeout_s, fn)
        except TimeoutError:
            fail(i, EnvironmentFailed("environment_timeout", f"{what} ran past {timeout_s:g} s"))
        except Exception as exc:  # user code: any failure fails the episode, whatever it was
            fail(i, EnvironmentFailed("environment_raised", f"raised:{type(exc).__name__}: {exc}"))

    def fail(i: int, failure: EnvironmentFailed) -> None:
        group = played[i].request.group
        for p in played:
            if p.request.group == group and p.failure is None:
                p.failure = failure if p is played[i] else EnvironmentFailed(failure.reason, OTHER_EPISODE_FAILED)

    def reset(i: int) -> None:
        env = envs[i] = factory()
        p = played[i]
        p.episode.observe_reset(env.reset(p.request.prompt, p.request.seed))

    def step(i: int, action) -> None:
        env = envs[i]
        assert env is not None
        episode = played[i].episode
        episode.after_step(env.step(action))
        if episode.done:
            played[i].success = succeeded(env)

    try:
        await asyncio.gather(*(guarded(i, "reset", functools.partial(reset, i)) for i in range(len(played))))
        while True:
            by_budget: dict[int, list[int]] = defaultdict(list)
            for i, p in enumerate(played):
                if p.failure is None and not p.episode.done and (budget := p.episode.budget()) > 0:
                    by_budget[budget].append(i)
            for i, p in enumerate(played):
                if p.failure is None and p.episode.done and not p.episode.turns:
                    fail(i, EnvironmentFailed("environment_raised", "the reset left no room for an action"))
            if not by_budget:
                break
            if between_turns is not None:
                await between_turns()
            sampled_by = version()
            actions = []
            for budget, indices in sorted(by_budget.items()):
                contexts = [played[i].request.prompt_ids + played[i].episode.tokens for i in indices]
                params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=budget)
                completions = await generate(contexts, params)
                for i, completion in zip(indices, completions, strict=True):
                    episode = played[i].episode
                    actions.append((i, episode.act(completion.token_ids, completion.logprobs, sampled_by)))
            await asyncio.gather(
                *(guarded(i, "step", functools.partial(step, i, a)) for i, a in actions if played[i].failure is None)
            )
    finally:
        await asyncio.gather(*(_close(p, env, calls, timeout_s) for p, env in zip(played, envs, strict=True) if env))
    return played


async def _close(played: Played, env: Environment, calls: TimedCalls, timeout_s: float) -> None:
    try:  # close() may block like any environment call
        await calls.call(timeout_s, close_environment, env)
    except TimeoutError:
        played.close_error = "timeout"
    except Exception as exc:  # user code: the episode's record is complete either way
        played.close_error = f"raised:{type(exc).__name__}"


def episode_group(
    lease: TaskLease,
    sampler_id: str,
    incarnation: int,
    prompt_ids: list[int],
    episodes: Sequence[Episode],
    codec: EpisodeCodec,
    generate_s: float = 0.0,
) -> RolloutGroup:
    """The ``RolloutGroup`` of one lease's finished episodes (what a Sampler sends): each
    completion is an episode's tokens after the prompt, in segments; ``version`` is the
    oldest policy version that sampled any of its actions."""
    arrays = episode_arrays(episodes)
    model_versions = arrays.turn_versions[arrays.turn_sources == MODEL]
    return RolloutGroup(
        lease_id=lease.lease_id,
        task_id=lease.task_id,
        attempt=lease.attempt,
        sampler_id=sampler_id,
        incarnation=incarnation,
        version=int(model_versions.min()) if model_versions.size else 0,
        prompt=lease.prompt,
        prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        token_ids=arrays.token_ids,
        logprobs=arrays.logprobs,
        offsets=arrays.offsets,
        texts=[episode_text(codec, e.segments()) for e in episodes],
        finish_reasons=[e.ended_by for e in episodes],
        generate_s=generate_s,
        lease_token=lease.token,
        turn_offsets=arrays.turn_offsets,
        turn_sources=arrays.turn_sources,
        turn_versions=arrays.turn_versions,
        episode_returns=arrays.returns,
    )
