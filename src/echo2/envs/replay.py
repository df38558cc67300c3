"""The trusted replay of an episode: what makes a multi-turn reward unforgeable.

A sampler sends its episodes as token segments (``RolloutGroup.turn_*``). The trusted side
builds a fresh environment, resets it from its own record of the prompt (answer and
metadata included) and the lease's seed, and steps it with the model's actions exactly
as sent, under the same rules (``echo2.envs.episode.Episode``). Every observation the
environment makes must equal, token for token, the environment segment the sampler sent
in its place; the episode must end where the sampler's ended; the return is the replay's.
A sampler therefore cannot invent observations (a forged tool result, a hint) nor a
reward: at most it chooses actions, which is what it is asked to do, and their log-probs
are checked against the learner's (quarantine on mismatch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from echo2.envs.base import EnvironmentFactory, close_environment, succeeded
from echo2.envs.episode import ENVIRONMENT, MODEL, Episode, EpisodeCodec, EpisodeLimits, Segment
from echo2.messages import RolloutGroup
from echo2.tasks.base import Prompt


class ReplayMismatch(Exception):
    """The sampler's episode is not what the environment makes of its actions."""


@dataclass(frozen=True)
class Replayed:
    returns: float
    success: bool | None


def episode_segments(group: RolloutGroup, i: int) -> list[Segment]:
    """Completion ``i`` of an admitted multi-turn group, as its segments in order."""
    assert group.turn_offsets is not None and group.turn_sources is not None
    bounds = group.turn_offsets.astype(np.int64)
    lo, hi = int(group.offsets[i]), int(group.offsets[i + 1])
    first, last = np.searchsorted(bounds, [lo, hi])
    return [
        Segment(group.token_ids[int(bounds[k]) : int(bounds[k + 1])], int(group.turn_sources[k]))
        for k in range(int(first), int(last))
    ]


def replay_episode(
    factory: EnvironmentFactory,
    prompt: Prompt,
    seed: int,
    segments: Sequence[Segment],
    codec: EpisodeCodec,
    limits: EpisodeLimits,
) -> Replayed:
    """Replay one episode; ``ReplayMismatch`` when it differs from ``segments``. The
    environment's own exceptions propagate (the caller counts them)."""
    queue = deque(segments)
    env = factory()
    try:
        episode = Episode(limits, codec)
        _expect(queue, episode.observe_reset(env.reset(prompt, seed)))
        while (budget := episode.budget()) > 0:
            if not queue or queue[0].source != MODEL:
                raise ReplayMismatch(f"the episode stops after {episode.turns} turns; the environment goes on")
            ids = queue.popleft().ids
            if not 1 <= len(ids) <= budget:
                raise ReplayMismatch(f"an action of {len(ids)} tokens where the budget was {budget}")
            action = episode.act(ids.tolist(), np.zeros(len(ids)), 0)
            _expect(queue, episode.after_step(env.step(action)))
        if queue:
            raise ReplayMismatch(f"{len(queue)} segments after the episode ended ({episode.ended_by})")
        return Replayed(episode.returns, succeeded(env))
    finally:
        close_environment(env)


def _expect(queue: deque[Segment], observed: list[int]) -> None:
    """The next segment must be the environment's observation ``observed`` (none if empty)."""
    if not observed:
        if queue and queue[0].source == ENVIRONMENT:
            raise ReplayMismatch("an observation the environment did not make")
        return
    if not queue or queue[0].source != ENVIRONMENT:
        raise ReplayMismatch("an observation the environment made is missing")
    sent = queue.popleft().ids
    if len(sent) != len(observed) or not np.array_equal(sent, np.asarray(observed)):
        raise ReplayMismatch(f"observation differs: sent {len(sent)} tokens, the environment made {len(observed)}")
