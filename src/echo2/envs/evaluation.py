"""Held-out evaluation of a multi-turn job: greedy episodes, judged by the environment.

pass@1 is the fraction of held-out prompts whose greedy episode the environment says
succeeded (``succeeded()``; None when it declares no verdict); the mean reward is the mean
return of the same episodes. Runs on the trusted side (the learner), with the full prompt
(answer and metadata) and each task's episode seed, as the replay does. An episode whose
environment failed is left out of both numbers and counted (``failed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from echo2.engines.base import Completion, Engine, SamplingParams
from echo2.envs.base import EnvironmentSpec, episode_seed
from echo2.envs.episode import EpisodeCodec, EpisodeLimits
from echo2.envs.play import EpisodeRequest, play_episodes
from echo2.tasks.base import Prompt
from echo2.tasks.calls import TimedCalls
from echo2.tasks.evaluation import HeldoutScore


@dataclass(frozen=True)
class EpisodeEvaluation:
    score: HeldoutScore
    failed: int
    """Held-out episodes whose environment raised or timed out (in neither number)."""


def evaluate_episodes(
    engine: Engine,
    prompts: Sequence[Prompt],
    *,
    step: int,
    spec: EnvironmentSpec,
    codec: EpisodeCodec,
    limits: EpisodeLimits,
    job_seed: int,
    timeout_s: float,
    threads: int = 4,
) -> EpisodeEvaluation:
    """Play one greedy episode per prompt with ``engine`` (synchronously: call it off the event loop)."""
    requests = [
        EpisodeRequest(
            group=i, prompt=p, prompt_ids=engine.encode_prompt(p.text), seed=episode_seed(job_seed, p.task_id)
        )
        for i, p in enumerate(prompts)
    ]

    async def generate(contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [row[0] for row in engine.generate(contexts, 1, params)]

    calls = TimedCalls(threads, name="eval-env")
    try:
        played = asyncio.run(
            play_episodes(
                requests,
                factory=spec.factory,
                generate=generate,
                codec=codec,
                limits=limits,
                calls=calls,
                timeout_s=timeout_s,
                temperature=0.0,
                top_p=1.0,
                version=lambda: step,
            )
        )
    finally:
        calls.close()
    finished = [p for p in played if p.failure is None]
    verdicts = [p.success for p in finished]
    n = len(finished)
    pass_at_1 = None if not n or any(v is None for v in verdicts) else sum(bool(v) for v in verdicts) / n
    mean_reward = sum(p.episode.returns for p in finished) / n if n else 0.0
    return EpisodeEvaluation(
        HeldoutScore(step=step, pass_at_1=pass_at_1, mean_reward=mean_reward, prompts=n), failed=len(played) - n
    )
