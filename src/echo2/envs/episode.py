"""One episode's token record, and the rules that grow and end it.

The same :class:`Episode` is driven by a sampler playing the episode
(``echo2.envs.play``) and by the trusted side replaying it (``echo2.envs.replay``), so both
apply one rule for every decision:

- before each model turn the budget is ``min(max_new_tokens, max_episode_tokens - used)``;
  the episode ends (truncated) when it is below 1 token;
- after each action the environment is stepped (the action counts as a turn), its reward
  added to the return;
- the episode ends when the environment says done or after ``max_turns`` actions; the
  observation of that last step is not appended (no model turn would read it);
- an observation that would leave no room for one more action token ends the episode
  (truncated) instead of being appended.

Segments: the record is a list of segments, each one model action (source 1, with the
policy version that sampled it and its log-probs) or one environment observation (source
0, log-probs 0). This is what a ``RolloutGroup`` carries per completion (``turn_offsets``,
``turn_sources``, ``turn_versions``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from echo2.envs.base import Action, Observation, StepResult

MODEL, ENVIRONMENT = 1, 0
"""``turn_sources`` values."""
NO_VERSION = -1
"""``turn_versions`` of an environment segment."""


@dataclass(frozen=True)
class Segment:
    """One segment of an episode: a model action or an environment observation."""

    ids: np.ndarray  # int (n,)
    source: int  # MODEL or ENVIRONMENT


def episode_text(codec: EpisodeCodec, segments: Sequence[Segment]) -> str:
    """An episode's text, segment by segment (each decoded up to its EOS): for logs."""
    return "".join(codec.decode(s.ids.tolist()) for s in segments)


@dataclass(frozen=True)
class EpisodeLimits:
    """The bounds every episode of a job keeps (``JobConfig.episode``, ``max_new_tokens``)."""

    max_turns: int
    max_episode_tokens: int
    max_new_tokens: int

    @classmethod
    def of_job(cls, job) -> EpisodeLimits:
        return cls(job.episode.max_turns, job.episode.max_episode_tokens, job.max_new_tokens)


@dataclass(frozen=True)
class EpisodeCodec:
    """The model's tokenizer as episodes use it: observations encoded without special
    tokens, actions decoded as every engine decodes a completion's text."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    eos_ids: frozenset[int]
    vocab_size: int

    def action(self, token_ids: Sequence[int] | np.ndarray) -> Action:
        ids = tuple(int(t) for t in token_ids)
        return Action(token_ids=ids, text=self.decode(ids), finished=bool(ids) and ids[-1] in self.eos_ids)

    def observation_ids(self, observation: Observation) -> list[int]:
        """Token ids of an observation; ValueError for ids outside the vocabulary or text
        the tokenizer cannot encode (the environment's fault)."""
        if observation is None:
            return []
        if isinstance(observation, str):
            return [int(t) for t in self.encode(observation)] if observation else []
        ids = [int(t) for t in observation]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"observation token ids outside [0, {self.vocab_size})")
        return ids


class Episode:
    """The record of one episode so far (see the module docstring)."""

    def __init__(self, limits: EpisodeLimits, codec: EpisodeCodec) -> None:
        self.limits, self.codec = limits, codec
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.ends: list[int] = []
        """End offset (into ``tokens``) of each segment."""
        self.sources: list[int] = []
        self.versions: list[int] = []
        self.turns = 0
        self.returns = 0.0
        self.done = False
        self.ended_by = ""
        """Why it ended: "done" (the environment), "max_turns", "max_episode_tokens"."""

    def _append(
        self, ids: Sequence[int] | np.ndarray, logprobs: Sequence[float] | np.ndarray, source: int, version: int
    ) -> None:
        self.tokens.extend(int(t) for t in ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.ends.append(len(self.tokens))
        self.sources.append(source)
        self.versions.append(version)

    def segments(self) -> list[Segment]:
        starts = [0, *self.ends[:-1]]
        tokens = np.asarray(self.tokens, dtype=np.int32)
        return [Segment(tokens[a:b], src) for a, b, src in zip(starts, self.ends, self.sources, strict=True)]

    def _end(self, reason: str) -> None:
        self.done, self.ended_by = True, reason

    def observe_reset(self, observation: Observation) -> list[int]:
        """Append the reset's observation (may be empty); returns its ids."""
        return self._observe(self.codec.observation_ids(observation))

    def budget(self) -> int:
        """Tokens the next action may take; ends the episode (returns 0) when none fit."""
        if self.done:
            return 0
        room = min(self.limits.max_new_tokens, self.limits.max_episode_tokens - len(self.tokens))
        if room < 1:
            self._end("max_episode_tokens")
            return 0
        return room

    def act(
        self, token_ids: Sequence[int] | np.ndarray, logprobs: Sequence[float] | np.ndarray, version: int
    ) -> Action:
        """Append the model's action (sampled by policy ``version``); returns it for the environment."""
        if len(token_ids) == 0:
            raise ValueError("an action has at least one token")
        self._append(token_ids, logprobs, MODEL, version)
        self.turns += 1
        return self.codec.action(token_ids)

    def after_step(self, result: StepResult) -> list[int]:
        """Apply the environment's answer to the last action; returns the observation ids
        appended ([] when the episode ended or the observation was empty)."""
        if not isinstance(result, StepResult):
            raise TypeError(f"step() returned a {type(result).__name__}, not a StepResult")
        self.returns += float(result.reward)
        if result.done:
            self._end("done")
            return []
        if self.turns >= self.limits.max_turns:
            self._end("max_turns")
            return []
        return self._observe(self.codec.observation_ids(result.observation))

    def _observe(self, ids: list[int]) -> list[int]:
        if not ids:
            return []
        if len(self.tokens) + len(ids) >= self.limits.max_episode_tokens:
            self._end("max_episode_tokens")
            return []
        self._append(ids, [0.0] * len(ids), ENVIRONMENT, NO_VERSION)
        return ids


@dataclass(frozen=True)
class EpisodeArrays:
    """A group's episodes as ``RolloutGroup`` arrays (``rollout_group`` fields)."""

    token_ids: np.ndarray  # int32 (sum T_i,)
    logprobs: np.ndarray  # float32 (sum T_i,)
    offsets: np.ndarray  # int32 (G + 1,)
    turn_offsets: np.ndarray  # int32 (K + 1,)
    turn_sources: np.ndarray  # uint8 (K,)
    turn_versions: np.ndarray  # int32 (K,)
    returns: np.ndarray  # float32 (G,)


def episode_arrays(episodes: Sequence[Episode]) -> EpisodeArrays:
    """Concatenate episodes into one group's ragged arrays."""
    lengths = [len(e.tokens) for e in episodes]
    offsets = np.zeros(len(episodes) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ends = [np.asarray(e.ends, dtype=np.int64) + base for e, base in zip(episodes, offsets[:-1], strict=True)]
    return EpisodeArrays(
        token_ids=np.asarray([t for e in episodes for t in e.tokens], dtype=np.int32),
        logprobs=np.asarray([x for e in episodes for x in e.logprobs], dtype=np.float32),
        offsets=offsets,
        turn_offsets=np.concatenate([[0], *ends]).astype(np.int32),
        turn_sources=np.asarray([s for e in episodes for s in e.sources], dtype=np.uint8),
        turn_versions=np.asarray([v for e in episodes for v in e.versions], dtype=np.int32),
        returns=np.asarray([e.returns for e in episodes], dtype=np.float32),
    )
