"""Admission of untrusted work: every check a rollout group passes before it is scored.

A sampler may be anyone's machine (ECHO-2's rented or volunteered GPUs), so nothing it
sends is believed: the trusted side keeps its own record of every open lease
(``LeaseRecord``: the prompt, its reference answer and metadata, the trusted tokenization,
the holder and a random token) and :func:`check_group` compares a group against it. The
reward is computed from the record's ``Prompt`` (:func:`trusted_prompt`), never from what
the sampler sent, and the learner trains on the trusted prompt ids (a group whose
``prompt_token_ids`` differ is refused).

Where the records live, and why there: the PromptSource holds the open leases (it must, to
re-issue them), so it answers ``LeaseQuery`` on its ``leases`` channel and each Rewarder
asks for the records of the groups it received, in one query per received batch. Samplers
round-robin over Rewarders, so pushing records to "the" Rewarder would need every record
sent to every Rewarder (and a record racing its own group); a lookup by id works for any
number of Rewarders in any process, the record is bounded by the open leases, and a
lease's record disappears when the lease closes, so a replayed or duplicated group finds
no lease (``unknown_lease``). The reply also carries the ``AdmissionWindow``.

A group that echoes its lease's token is the holder's: its rejection closes the lease at
once (``LeaseClosed(outcome="rejected")``, re-issued) and counts toward quarantining the
holder (:class:`RejectionTracker`). A group without the right token proves nothing about
who sent it (``sampler_id`` is self-claimed without CURVE), so it is counted under the
name it claims, and neither touches the lease nor quarantines anyone: otherwise one forged
group could cancel, or one forger could get quarantined, an honest sampler.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from echo2.job import JobConfig
from echo2.messages import AdmissionWindow, EpisodeFailed, LeaseRecord, RejectReason, RolloutGroup
from echo2.models.identity import present_location
from echo2.models.location import CONFIG_FILE, load_prompt_tokenizer
from echo2.tasks.base import Prompt

LOGPROB_TOLERANCE = 1e-3
"""A log-probability may exceed 0 by this much (float32 rounding of log-softmax)."""

QUARANTINE_EXEMPT: frozenset[RejectReason] = frozenset({"stale_version", "environment_raised", "environment_timeout"})
"""Rejections that do not count toward quarantine: an honest sampler on a slow link makes
stale work now and then (and a sampler that stays too old is given no leases instead); an
environment that fails on a sampler is the environment's fault, not the sampler's."""


PROMPT_ALLOWANCE_BYTES = 1 << 20
"""A group's prompt (text and ids) and fixed fields, at most: far beyond any task's."""
BYTES_PER_SAMPLED_TOKEN = 4 + 4 + 64
"""An id (int32), a log-probability (float32) and the token's text (at most 64 UTF-8 bytes)."""


BYTES_PER_TURN = 4 + 1 + 4
"""A multi-turn group's segment boundary (int32), source (uint8) and version (int32)."""


def rollout_group_max_bytes(job: JobConfig) -> int:
    """The largest message a legitimate group of this job can be (a ``ScoredGroup`` adds
    two bytes per sample): the ``max_message_bytes`` of every socket that receives groups,
    so that a peer's bigger frame closes its connection before any of it is buffered."""
    per_sample = job.max_new_tokens * BYTES_PER_SAMPLED_TOKEN + 256  # + finish reason, offsets
    if job.multi_turn:  # an episode: its tokens, two segments per turn and its return
        episode = job.episode
        segments = 2 * episode.max_turns + 1
        per_sample = episode.max_episode_tokens * BYTES_PER_SAMPLED_TOKEN + segments * BYTES_PER_TURN + 256 + 4
    return PROMPT_ALLOWANCE_BYTES + job.group_size * per_sample


def lease_meta(record: LeaseRecord, fields: Sequence[str]) -> dict[str, Any]:
    """The prompt metadata a lease carries to the sampler's environment: ``fields`` only
    (``job.episode.lease_fields``), those the row has."""
    return {name: record.meta[name] for name in fields if name in record.meta}


@dataclass(frozen=True)
class PromptCodec:
    """The trusted side's tokenizer (prompts encoded, completions decoded) and the model's vocabulary size."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    """Text of a completion's ids, exactly as every engine makes ``Completion.text``."""
    vocab_size: int


def trusted_prompt_codec(job: JobConfig) -> PromptCodec:
    """The job's prompt tokenization and vocabulary, from the model's files (no weights loaded).

    The tokenizer renders prompts as ``job.prompt_format`` says, the one setting every
    engine renders them by too. ``vocab_size`` is the model config's (the logits' width: an
    id at or past it would index past the embedding), read from ``config.json``.
    """
    location = present_location(job.model)
    tokenizer = load_prompt_tokenizer(location, job.prompt_format)
    config = json.loads((location.directory / CONFIG_FILE).read_text())
    vocab_size = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))
    return PromptCodec(tokenizer.encode_prompt, tokenizer.decode, vocab_size or tokenizer.vocab_size)


def trusted_texts(group: RolloutGroup, codec: PromptCodec) -> list[str] | Rejection:
    """The completions' texts decoded from their token ids on the trusted side.

    A reward reads text, the learner trains on ids: scoring the sampler's ``texts`` would let
    it pair a right answer's text with any ids. Call only on a group ``check_group`` admitted.
    """
    offsets = group.offsets.tolist()
    try:
        return [codec.decode(group.token_ids[a:b].tolist()) for a, b in itertools.pairwise(offsets)]
    except (ValueError, KeyError, IndexError) as exc:  # an id the tokenizer maps to no text
        return "token_out_of_vocab", f"the tokenizer cannot decode a completion: {exc}"


def trusted_prompt(record: LeaseRecord) -> Prompt:
    """The ``Prompt`` a reward is computed from: the trusted record's, whole."""
    return Prompt(task_id=record.task_id, text=record.prompt, answer=record.answer, meta=dict(record.meta))


Rejection = tuple[RejectReason, str]
"""(reason, detail) of a refused group."""


def check_lease(group: RolloutGroup | EpisodeFailed, record: LeaseRecord | None) -> Rejection | None:
    """Is ``group`` (or the report of a failed episode) the holder's answer to an open lease? None when it is."""
    if record is None:
        return "unknown_lease", f"lease {group.lease_id} is not open"
    if not isinstance(group.lease_token, bytes) or group.lease_token != record.token:
        return "wrong_token", "the lease's token was not echoed"
    return None


@dataclass(frozen=True)
class EpisodeAdmission:
    """What admission checks a multi-turn job's groups against (``JobConfig.episode``)."""

    max_turns: int
    max_episode_tokens: int
    replayable: bool
    """False: the trusted side cannot replay the environment; groups come only from
    ``trusted_samplers``, and their ``episode_returns`` are the rewards."""
    trusted_samplers: frozenset[str]

    @classmethod
    def of_job(cls, job: JobConfig, replayable: bool) -> EpisodeAdmission:
        episode = job.episode
        return cls(episode.max_turns, episode.max_episode_tokens, replayable, frozenset(episode.trusted_samplers))


def check_group(
    group: RolloutGroup, record: LeaseRecord, window: AdmissionWindow, episodes: EpisodeAdmission | None = None
) -> Rejection | None:
    """Everything about a holder's group that must hold before it is scored; None if it does.

    ``episodes``: the job is multi-turn, and every completion is an episode in turn
    segments (checked by :func:`check_segments`); None: single-turn, and a group with
    segments is refused.

    Never raises on any decoded ``RolloutGroup``: arrays are checked for dtype and rank
    before their values are read.
    """
    if group.task_id != record.task_id or group.attempt != record.attempt or group.sampler_id != record.sampler_id:
        return "wrong_task", f"group names ({group.task_id}, {group.attempt}, {group.sampler_id})"
    if group.incarnation > window.incarnation or group.version < 0 or group.version > window.newest:
        return (
            "unpublished_version",
            f"({group.incarnation}, {group.version}) newer than ({window.incarnation}, {window.newest}) or negative",
        )
    if group.incarnation == window.incarnation and group.version < window.oldest:
        return "stale_version", f"version {group.version} < {window.oldest}"
    shape = _check_arrays(group, record.group_size)
    if shape is not None:
        return shape
    if episodes is None and _has_segments(group):
        return "bad_segments", "turn segments in a single-turn job"
    offsets = group.offsets.astype(np.int64)
    lengths = np.diff(offsets)
    limit = record.max_new_tokens if episodes is None else episodes.max_episode_tokens
    if int(lengths.max(initial=0)) > limit:
        what = "max_new_tokens" if episodes is None else "max_episode_tokens"
        return "too_long", f"a completion of {int(lengths.max())} tokens > {what} {limit}"
    tokens = group.token_ids
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= window.vocab_size):
        return "token_out_of_vocab", f"token ids outside [0, {window.vocab_size})"
    logprobs = group.logprobs
    if not bool(np.isfinite(logprobs).all()):
        return "bad_logprobs", "non-finite log-probability"
    if logprobs.size and float(logprobs.max()) > LOGPROB_TOLERANCE:
        return "bad_logprobs", f"log-probability {float(logprobs.max()):.4g} > 0"
    trusted = record.prompt_token_ids
    if group.prompt_token_ids.shape != trusted.shape or not np.array_equal(group.prompt_token_ids, trusted):
        return "prompt_mismatch", "prompt token ids differ from the trusted tokenization"
    if episodes is not None:
        return check_segments(group, record, window, episodes)
    return None


def _has_segments(group: RolloutGroup) -> bool:
    return any(
        a is not None for a in (group.turn_offsets, group.turn_sources, group.turn_versions, group.episode_returns)
    )


def check_segments(
    group: RolloutGroup, record: LeaseRecord, window: AdmissionWindow, episodes: EpisodeAdmission
) -> Rejection | None:
    """A multi-turn group's turn segments (``RolloutGroup.turn_*``): well-formed, within the
    episode's limits, each action within ``max_new_tokens``, every turn's version one S
    admits and the group's ``version`` the oldest of them, versions never decreasing within
    an episode, environment tokens with log-prob 0. Whether the environment tokens are the
    environment's is the replay's question (``echo2.envs.replay``)."""
    bounds_in, sources_in, versions_in = group.turn_offsets, group.turn_sources, group.turn_versions
    if bounds_in is None or sources_in is None or versions_in is None:
        return "bad_segments", "a multi-turn job's group without turn segments"
    for name, array in (("turn_offsets", bounds_in), ("turn_sources", sources_in), ("turn_versions", versions_in)):
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
            return "bad_segments", f"{name} is not a 1-d integer array"
    k = sources_in.size
    if bounds_in.size != k + 1 or versions_in.size != k:
        return "bad_segments", "turn_offsets, turn_sources and turn_versions disagree in length"
    bounds = bounds_in.astype(np.int64)
    if bounds[0] != 0 or bool((np.diff(bounds) <= 0).any()) or bounds[-1] != group.token_ids.size:
        return "bad_segments", "turn_offsets do not rise strictly from 0 to len(token_ids)"
    offsets = group.offsets.astype(np.int64)
    if not bool(np.isin(offsets, bounds).all()):
        return "bad_segments", "a completion boundary inside a turn segment"
    sources = sources_in.astype(np.int64)
    if bool(((sources != 0) & (sources != 1)).any()):
        return "bad_segments", "turn_sources other than 0 (environment) and 1 (model)"
    model = sources == 1
    seg_lengths = np.diff(bounds)
    if int(seg_lengths[model].max(initial=0)) > record.max_new_tokens:
        return (
            "too_long",
            f"an action of {int(seg_lengths[model].max())} tokens > max_new_tokens {record.max_new_tokens}",
        )
    sample = np.searchsorted(offsets, bounds[:-1], side="right") - 1  # (K,) completion of each segment
    turns = np.bincount(sample[model], minlength=group.group_size)
    if int(turns.min(initial=1)) < 1 or int(turns.max(initial=0)) > episodes.max_turns:
        return "bad_segments", f"an episode with no action or more than max_turns {episodes.max_turns}"
    versions = versions_in.astype(np.int64)
    if bool((versions[~model] != -1).any()):
        return "bad_segments", "an environment segment with a policy version"
    turn_versions = versions[model]
    if int(turn_versions.min()) != group.version:
        return "bad_segments", f"version {group.version} is not the oldest turn's ({int(turn_versions.min())})"
    newest = int(turn_versions.max())
    if group.incarnation == window.incarnation and newest > window.newest:
        return "unpublished_version", f"a turn of version {newest} newer than {window.newest}"
    same_episode = sample[model][1:] == sample[model][:-1]
    if bool((np.diff(turn_versions)[same_episode] < 0).any()):
        return "bad_segments", "an episode whose turn versions decrease"
    environment_tokens = np.repeat(~model, seg_lengths)
    if bool((group.logprobs[environment_tokens] != 0).any()):
        return "bad_logprobs", "an environment token with a log-probability other than 0"
    returns = group.episode_returns
    if returns is not None and (
        not isinstance(returns, np.ndarray) or returns.dtype.kind != "f" or returns.shape != (group.group_size,)
        or not bool(np.isfinite(returns).all())
    ):  # fmt: skip
        return "bad_segments", "episode_returns is not one finite float per episode"
    if not episodes.replayable:
        if record.sampler_id not in episodes.trusted_samplers:
            return "untrusted_episode", f"{record.sampler_id} is not in job.episode.trusted_samplers"
        if returns is None:
            return "bad_segments", "an episode that cannot be replayed, without its returns"
    return None


def _check_arrays(group: RolloutGroup, group_size: int) -> Rejection | None:
    arrays = {
        "prompt_token_ids": group.prompt_token_ids,
        "token_ids": group.token_ids,
        "logprobs": group.logprobs,
        "offsets": group.offsets,
    }
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray) or array.ndim != 1:
            return "bad_shape", f"{name} is not a 1-d array"
    for name in ("prompt_token_ids", "token_ids", "offsets"):
        if arrays[name].dtype.kind not in "iu":
            return "bad_shape", f"{name} has dtype {arrays[name].dtype}, not an integer"
    if group.logprobs.dtype.kind != "f":
        return "bad_shape", f"logprobs has dtype {group.logprobs.dtype}, not a float"
    if group.group_size != group_size:
        return "wrong_group_size", f"{group.group_size} completions, lease says {group_size}"
    if len(group.texts) != group_size or len(group.finish_reasons) != group_size:
        return "bad_shape", "texts or finish_reasons do not hold one entry per completion"
    offsets = group.offsets.astype(np.int64)
    if offsets[0] != 0 or bool((np.diff(offsets) < 0).any()) or offsets[-1] != group.token_ids.size:
        return "bad_shape", "offsets are not monotone from 0 to len(token_ids)"
    if group.logprobs.size != group.token_ids.size:
        return "bad_shape", "not one log-probability per generated token"
    if group.prompt_token_ids.size == 0:
        return "bad_shape", "empty prompt"
    return None


class RejectionTracker:
    """Counts each sampler's admission rejections in a sliding window; says when one has
    had ``limit`` within ``window_s`` seconds (the quarantine rule)."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._times: dict[str, deque[float]] = {}

    def add(self, sampler: str) -> bool:
        """Count one rejection of ``sampler``; True when it reaches the limit in the window."""
        now = self._clock()
        times = self._times.setdefault(sampler, deque())
        times.append(now)
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times) >= self.limit
