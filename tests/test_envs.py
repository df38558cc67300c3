"""Multi-turn environments (``echo2.envs``): the episode rules, playing, the trusted replay,
failures, and what admission checks of a group's turn segments.

Episodes here are played through the real code paths (``play_episodes``, ``episode_group``,
``replay_episode``) with a scripted policy standing in for the engine, so every case is
deterministic: an oracle that answers each turn right, or wrong on purpose.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
from tests.polling import until
from tests.test_admission import ScriptedSampler

from echo2 import ledger
from echo2.actors.admission import EpisodeAdmission, check_group, check_lease
from echo2.actors.buffer import Buffer
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.rewarder import Rewarder
from echo2.engines.base import Completion, SamplingParams
from echo2.envs.base import Action, StepResult, episode_seed, load_environment
from echo2.envs.chain_addition import ChainAddition
from echo2.envs.codec import load_episode_codec
from echo2.envs.episode import ENVIRONMENT, MODEL, EpisodeLimits, Segment
from echo2.envs.play import EpisodeRequest, Played, episode_group, play_episodes
from echo2.envs.replay import ReplayMismatch, episode_segments, replay_episode
from echo2.envs.tools import ToolEnvironment, ToolError, tool
from echo2.job import EpisodeConfig, JobConfig
from echo2.messages import AdmissionWindow, EpisodeFailed, LeaseRecord, RejectReason, RolloutGroup, TaskLease
from echo2.models import CharTokenizer
from echo2.pipeline import Pipeline
from echo2.tasks.base import Prompt
from echo2.tasks.calls import TimedCalls

pytestmark = pytest.mark.timeout(60)

TOKENIZER = CharTokenizer()
CODEC = load_episode_codec("")
LIMITS = EpisodeLimits(max_turns=2, max_episode_tokens=23, max_new_tokens=5)
CHAIN = load_environment("chain_addition", {"operands": 3, "digits": 3})
PROMPT = Prompt(task_id="add3-0-0", text="123+456=", answer="975")
SEED = episode_seed(0, PROMPT.task_id)
TOKEN = b"\x07" * 16

Policy = Callable[[str, int], str]
"""(the last turn's prompt text, the context's length in tokens) -> the answer text to give."""


def right(context: str, _: int) -> str:
    a, b = re.findall(r"(\d+)\+(\d+)=$", context)[0]
    return str(int(a) + int(b))[::-1]


def scripted(policy: Policy) -> Callable[[list[list[int]], SamplingParams], object]:
    """An engine stand-in answering each context as ``policy`` says, with log-probs -0.25."""

    async def generate(contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for context in contexts:
            last = (
                context[len(context) - context[::-1].index(TOKENIZER.eos_id) :]
                if TOKENIZER.eos_id in context
                else context
            )
            text = TOKENIZER.decode(last)  # the last turn's prompt: after the last EOS
            ids = np.asarray([*TOKENIZER.encode(policy(text, len(context))), TOKENIZER.eos_id], np.int32)
            ids = ids[: params.max_new_tokens]
            out.append(Completion(ids, np.full(len(ids), -0.25, np.float32), "eos", ""))
        return out

    return generate


def play(
    policy: Policy = right, *, n: int = 2, factory=CHAIN.factory, timeout_s: float = 5.0, groups: int = 1
) -> list[Played]:
    requests = [
        EpisodeRequest(group=g, prompt=PROMPT, prompt_ids=TOKENIZER.encode_prompt(PROMPT.text), seed=SEED)
        for g in range(groups)
        for _ in range(n)
    ]
    calls = TimedCalls(4, name="test-env")
    try:
        return asyncio.run(
            play_episodes(
                requests, factory=factory, generate=scripted(policy), codec=CODEC, limits=LIMITS, calls=calls,
                timeout_s=timeout_s, temperature=1.0, top_p=1.0, version=lambda: 0,
            )
        )  # fmt: skip
    finally:
        calls.close()


def group_of(played: list[Played], **fields: object) -> RolloutGroup:
    lease = TaskLease(
        lease_id=1, task_id=PROMPT.task_id, attempt=0, prompt=PROMPT.text, group_size=len(played), ttl_s=5.0,
        token=TOKEN, episode_seed=SEED,
    )  # fmt: skip
    group = episode_group(lease, "s", 0, TOKENIZER.encode_prompt(PROMPT.text), [p.episode for p in played], CODEC)
    return msgspec.structs.replace(group, **fields) if fields else group


def record_of(group: RolloutGroup) -> LeaseRecord:
    return LeaseRecord(
        lease_id=group.lease_id, task_id=group.task_id, attempt=0, sampler_id="s", token=TOKEN,
        group_size=group.group_size, max_new_tokens=LIMITS.max_new_tokens, prompt=PROMPT.text, answer=PROMPT.answer,
        prompt_token_ids=group.prompt_token_ids.copy(), episode_seed=SEED,
    )  # fmt: skip


# -- the built-in environment and the episode rules ----------------------------------


def test_right_answers_reveal_the_next_operand_and_succeed() -> None:
    (p,) = play(n=1)
    episode = p.episode
    assert p.failure is None and p.success is True and episode.returns == 1.0 and episode.ended_by == "done"
    assert episode.sources == [MODEL, ENVIRONMENT, MODEL]
    text = [TOKENIZER.decode(s.ids) for s in episode.segments()]
    assert text[0] == "975" and re.fullmatch(r"579\+\d{3}=", text[1]), text
    c = int(text[1][4:7])
    assert text[2] == str(579 + c)[::-1]


def test_a_wrong_answer_ends_the_episode_with_what_it_earned() -> None:
    (first_wrong,) = play(lambda context, _: "000", n=1)
    assert first_wrong.episode.returns == 0.0 and first_wrong.success is False
    assert first_wrong.episode.sources == [MODEL]
    (second_wrong,) = play(lambda context, length: right(context, length) if length < 15 else "1", n=1)
    assert second_wrong.episode.returns == 0.5 and second_wrong.success is False
    assert second_wrong.episode.sources == [MODEL, ENVIRONMENT, MODEL]


def test_the_operands_follow_the_seed() -> None:
    env = ChainAddition()
    env.reset(PROMPT, 1)
    first = env.step(Action(tuple(TOKENIZER.encode("975")), "975", True)).observation
    env.reset(PROMPT, 1)
    again = env.step(Action(tuple(TOKENIZER.encode("975")), "975", True)).observation
    env.reset(PROMPT, 2)
    other = env.step(Action(tuple(TOKENIZER.encode("975")), "975", True)).observation
    assert first == again and first != other


def test_an_observation_that_would_fill_the_budget_ends_the_episode() -> None:
    tight = EpisodeLimits(max_turns=4, max_episode_tokens=12, max_new_tokens=5)
    calls = TimedCalls(1, name="test-env")
    request = EpisodeRequest(group=0, prompt=PROMPT, prompt_ids=TOKENIZER.encode_prompt(PROMPT.text), seed=SEED)
    (p,) = asyncio.run(
        play_episodes(
            [request], factory=load_environment("chain_addition", {"operands": 5}).factory,
            generate=scripted(right), codec=CODEC, limits=tight, calls=calls, timeout_s=5.0, temperature=1.0,
            top_p=1.0, version=lambda: 0,
        )
    )  # fmt: skip
    calls.close()
    # 4 answer tokens, then "579+ccc=" (8) would leave no room for an action in 12.
    assert p.episode.ended_by == "max_episode_tokens" and p.episode.sources == [MODEL]
    assert len(p.episode.tokens) <= 12


# -- the trusted replay ------------------------------------------------------------------


def replay(group: RolloutGroup, i: int, segments: list[Segment] | None = None) -> float:
    segments = episode_segments(group, i) if segments is None else segments
    return replay_episode(CHAIN.factory, PROMPT, SEED, segments, CODEC, LIMITS).returns


def test_the_replay_of_an_honest_episode_finds_its_return() -> None:
    played = play(lambda context, length: right(context, length) if length < 15 else "1", n=1) + play(n=1)
    group = group_of(played)
    assert [replay(group, i) for i in range(2)] == [0.5, 1.0]
    assert group.version == 0 and group.episode_returns.tolist() == [0.5, 1.0]


def test_a_forged_observation_a_cut_episode_and_an_extra_turn_do_not_replay() -> None:
    group = group_of(play(n=1))
    honest = episode_segments(group, 0)
    forged_ids = honest[1].ids.copy()
    forged_ids[-2] = forged_ids[-2] % 10 + 3  # another digit of the revealed operand
    cases = {
        "forged observation": [honest[0], Segment(forged_ids, ENVIRONMENT), honest[2]],
        "cut after the observation": honest[:2],
        "cut before it": honest[:1],
        "an extra turn": [*honest, Segment(honest[2].ids, ENVIRONMENT), honest[2]],
        "an observation as an action": [honest[0], Segment(honest[1].ids, MODEL), honest[2]],
    }
    for name, segments in cases.items():
        with pytest.raises(ReplayMismatch):
            replay(group, 0, segments)
            pytest.fail(name)


# -- failures ----------------------------------------------------------------------------


class Failing(ChainAddition):
    """Raises, or hangs until released, on its second step."""

    hang: threading.Event | None = None

    def step(self, action: Action) -> StepResult:
        if action.text and len(action.token_ids) and self._right == 1:
            if self.hang is not None:
                self.hang.wait(10)
            raise RuntimeError("the game server fell over")
        return super().step(action)


def test_an_environment_that_raises_fails_its_whole_group_only() -> None:
    played = play(n=2, groups=1, factory=Failing)
    assert all(p.failure is not None and p.failure.reason == "environment_raised" for p in played)
    assert "RuntimeError" in played[0].failure.detail  # type: ignore[union-attr]
    # One group failing leaves the others playing: a wrong first answer never reaches step 2.
    mixed = play(lambda context, length: "0" if length < 15 else right(context, length), n=2, groups=2, factory=Failing)
    assert all(p.failure is None and p.episode.returns == 0.0 for p in mixed)


def test_an_environment_that_hangs_fails_by_timeout() -> None:
    release = threading.Event()

    class Hanging(Failing):
        hang = release

    try:
        played = play(n=1, factory=Hanging, timeout_s=0.3)
    finally:
        release.set()
    assert played[0].failure is not None and played[0].failure.reason == "environment_timeout"


# -- admission of turn segments ------------------------------------------------------------

EPISODES = EpisodeAdmission(max_turns=2, max_episode_tokens=23, replayable=True, trusted_samplers=frozenset())
WINDOW = AdmissionWindow(incarnation=0, newest=2, oldest=-1, vocab_size=15)


def honest_group() -> RolloutGroup:
    return group_of(play(n=2))


def _edit(**arrays: Callable[[RolloutGroup], object]) -> Callable[[RolloutGroup], RolloutGroup]:
    return lambda g: msgspec.structs.replace(g, **{k: f(g) for k, f in arrays.items()})


def _set(array: str, index: int, value: int) -> Callable[[RolloutGroup], np.ndarray]:
    def edit(g: RolloutGroup) -> np.ndarray:
        out = getattr(g, array).copy()
        out[index] = value
        return out

    return edit


SEGMENT_DEFECTS: dict[str, tuple[Callable[[RolloutGroup], RolloutGroup], RejectReason]] = {
    "no segments": (_edit(turn_offsets=lambda g: None), "bad_segments"),
    "float offsets": (_edit(turn_offsets=lambda g: g.turn_offsets.astype(np.float32)), "bad_segments"),
    "lengths disagree": (_edit(turn_versions=lambda g: g.turn_versions[:-1]), "bad_segments"),
    "offsets not rising": (_edit(turn_offsets=_set("turn_offsets", 1, 0)), "bad_segments"),
    "a boundary inside a segment": (
        _edit(
            turn_offsets=lambda g: np.delete(g.turn_offsets, 3),
            turn_sources=lambda g: np.delete(g.turn_sources, 2),
            turn_versions=lambda g: np.delete(g.turn_versions, 2),
        ),
        "bad_segments",
    ),
    "a source 2": (_edit(turn_sources=_set("turn_sources", 0, 2)), "bad_segments"),
    "an environment-only episode": (
        _edit(
            turn_sources=lambda g: np.where(np.arange(len(g.turn_sources)) < 3, 0, g.turn_sources).astype(np.uint8),
            turn_versions=lambda g: np.where(np.arange(len(g.turn_sources)) < 3, -1, g.turn_versions).astype(np.int32),
            logprobs=lambda g: np.where(np.arange(len(g.logprobs)) < g.offsets[1], 0.0, g.logprobs).astype(np.float32),
        ),
        "bad_segments",
    ),
    "an environment segment with a version": (_edit(turn_versions=_set("turn_versions", 1, 0)), "bad_segments"),
    "a turn newer than the learner": (_edit(turn_versions=_set("turn_versions", 2, 9)), "unpublished_version"),
    "version not the oldest turn's": (
        _edit(turn_versions=lambda g: np.where(g.turn_sources == 1, 1, -1).astype(np.int32)),
        "bad_segments",
    ),
    "versions going back": (
        _edit(turn_versions=lambda g: np.array([1, -1, 0, 1, -1, 1], np.int32), version=lambda g: 0),
        "bad_segments",
    ),
    "an environment token with a log-prob": (
        _edit(logprobs=lambda g: np.where(g.loss_mask() == 0, -0.5, g.logprobs).astype(np.float32)),
        "bad_logprobs",
    ),
    "an action longer than max_new_tokens": (  # the first action and the observation after it as one action
        _edit(
            turn_offsets=lambda g: np.delete(g.turn_offsets, 1),
            turn_sources=lambda g: np.delete(g.turn_sources, 1),
            turn_versions=lambda g: np.delete(g.turn_versions, 1),
        ),
        "too_long",
    ),
    "returns of the wrong length": (_edit(episode_returns=lambda g: np.zeros(3, np.float32)), "bad_segments"),
}


def test_an_honest_multi_turn_group_is_admitted() -> None:
    group = honest_group()
    assert check_lease(group, record_of(group)) is None
    assert check_group(group, record_of(group), WINDOW, EPISODES) is None
    # ... and segments in a single-turn job are refused.
    assert check_group(group, record_of(group), WINDOW)[0] == "bad_segments"  # type: ignore[index]


@pytest.mark.parametrize("defect", sorted(SEGMENT_DEFECTS))
def test_each_segment_defect_is_rejected_with_its_reason(defect: str) -> None:
    edit, reason = SEGMENT_DEFECTS[defect]
    honest = honest_group()
    found = check_group(edit(honest), record_of(honest), WINDOW, EPISODES)
    assert found is not None and found[0] == reason, found


def test_an_episode_that_cannot_be_replayed_is_accepted_from_trusted_samplers_only() -> None:
    group = honest_group()
    external = EpisodeAdmission(2, 23, replayable=False, trusted_samplers=frozenset({"trusted"}))
    assert check_group(group, record_of(group), WINDOW, external)[0] == "untrusted_episode"  # type: ignore[index]
    trusted = msgspec.structs.replace(record_of(group), sampler_id="trusted")
    assert check_group(msgspec.structs.replace(group, sampler_id="trusted"), trusted, WINDOW, external) is None
    no_returns = msgspec.structs.replace(group, sampler_id="trusted", episode_returns=None)
    assert check_group(no_returns, trusted, WINDOW, external)[0] == "bad_segments"  # type: ignore[index]


def test_the_loss_mask_is_zero_on_every_environment_token() -> None:
    group = honest_group()
    mask = group.loss_mask()
    for i in range(group.group_size):
        position = int(group.offsets[i])
        for segment in episode_segments(group, i):
            span = mask[position : position + len(segment.ids)]
            assert (span == (1 if segment.source == MODEL else 0)).all()
            position += len(segment.ids)
    assert mask.sum() < mask.size  # there were environment tokens


# -- a running pipeline: the Rewarder replays, refuses forgeries, re-issues failures -------


def _multi_turn_job() -> JobConfig:
    return JobConfig(
        group_size=2, groups_per_step=2, staleness=1, max_new_tokens=5,
        episode=EpisodeConfig(environment="chain_addition", max_turns=2, max_episode_tokens=23),
    )  # fmt: skip


def wrong_second(context: str, length: int) -> str:
    return right(context, length) if length < 15 else "1"


class EpisodeSampler(ScriptedSampler):
    """A sampler without an engine that plays its leases' episodes with ``policy`` through
    the real episode loop, then hands the groups to ``tamper`` (honest: unchanged)."""

    policy: Policy = staticmethod(right)
    tamper: Callable[[list[RolloutGroup | EpisodeFailed]], list[RolloutGroup | EpisodeFailed]] = staticmethod(
        lambda groups: groups
    )

    @staticmethod
    def script(leases: list[TaskLease], name: str) -> list[RolloutGroup]:
        raise AssertionError("replaced per instance")


def episode_script(sampler: EpisodeSampler) -> Callable[[list[TaskLease], str], list]:
    def script(leases: list[TaskLease], name: str) -> list:
        out: list = []
        for lease in leases:
            prompt = Prompt(task_id=lease.task_id, text=lease.prompt, answer="", meta=dict(lease.episode_meta))
            ids = TOKENIZER.encode_prompt(lease.prompt)
            requests = [EpisodeRequest(lease.lease_id, prompt, ids, lease.episode_seed)] * lease.group_size
            calls = TimedCalls(2, name="scripted-env")
            episodes = play_episodes(
                requests, factory=CHAIN.factory, generate=scripted(sampler.policy), codec=CODEC, limits=LIMITS,
                calls=calls, timeout_s=5.0, temperature=1.0, top_p=1.0, version=lambda: 0,
            )  # fmt: skip
            try:  # the scripted sampler's script is synchronous: its own loop, in a thread
                with concurrent.futures.ThreadPoolExecutor(1) as thread:
                    played = thread.submit(asyncio.run, episodes).result()
            finally:
                calls.close()
            out.append(episode_group(lease, name, 0, ids, [p.episode for p in played], CODEC))
        return sampler.tamper(out)

    return script


def forge(groups: list) -> list:
    """First lease: an observation's digit changed. Second: returns of 1 claimed (the second
    answers were wrong). Third: reported failed, as if its environment had raised."""
    first, second, third = groups
    ids = first.token_ids.copy()
    env_token = int(np.flatnonzero(first.loss_mask() == 0)[1])
    ids[env_token] = 3 + (ids[env_token] - 3 + 1) % 10  # another digit
    return [
        msgspec.structs.replace(first, token_ids=ids),
        msgspec.structs.replace(second, episode_returns=np.ones(2, np.float32)),
        EpisodeFailed(
            lease_id=third.lease_id, task_id=third.task_id, attempt=third.attempt, sampler_id=third.sampler_id,
            lease_token=third.lease_token, reason="environment_raised", detail="raised:RuntimeError: down",
        ),
    ]  # fmt: skip


async def test_the_rewarder_replays_episodes_refuses_forgeries_and_reissues_failures(tmp_path: Path) -> None:
    tasks = 12
    job = _multi_turn_job()
    # Short leases: the forger waits for 3 leases at a time, and the last ones may never come.
    config = PromptSourceConfig(max_tasks=tasks, max_inflight_groups=1000, lease_ttl_s=2.0)
    source = PromptSource("prompt_source", config, job)
    rewarder = Rewarder("rewarder", job=job)
    buffer = Buffer("buffer", job=job)
    honest = EpisodeSampler("honest", job=job)
    honest.policy = wrong_second  # type: ignore[method-assign,assignment]
    honest.script = episode_script(honest)  # type: ignore[method-assign,assignment]
    forger = EpisodeSampler("forger", job=job)
    forger.hold = 3
    forger.policy = wrong_second  # type: ignore[method-assign,assignment]
    forged = []

    def forge_once(groups: list) -> list:
        if forged:
            return groups
        forged.append(True)
        return forge(groups)

    forger.tamper = forge_once  # type: ignore[method-assign,assignment]
    forger.script = episode_script(forger)  # type: ignore[method-assign,assignment]
    async with Pipeline([source, rewarder, buffer, forger, honest], run_dir=tmp_path) as pipeline:
        await until(lambda: buffer.counters["groups_stored"] >= tasks, 40, "every task stored once")
        stats = buffer.statistics()
        pipeline.request_stop()

    by_forger = stats.rejected_by_sampler["forger"]
    assert by_forger.get("observation_mismatch", 0) >= 1 and by_forger.get("environment_raised", 0) >= 1, by_forger
    assert rewarder.episode_failures.get("sampler:environment_raised", 0) >= 1
    assert rewarder.counters["episodes_replayed"] >= 2 * tasks
    assert source.counters["quarantined_samplers"] == 0  # a failed environment is not the sampler's fault
    events = ledger.read([tmp_path]).events
    accepted = {e.task: e for e in events if isinstance(e, ledger.Accepted)}
    assert len(accepted) == tasks
    stored = {g.group.task_id: g for g in buffer._store}
    for task, event in accepted.items():
        rewards = stored[task].rewards.tolist()
        # The replay's returns: 0.5 per episode (the second answer wrong), whoever sent it;
        # the forger's claimed 1.0 counts for nothing.
        assert rewards == [0.5, 0.5], (event.sampler, rewards)
        assert stored[task].keep.all()
    # Refused and failed leases were re-issued and stored from someone.
    rejected_tasks = {e.task for e in events if isinstance(e, ledger.Rejected) and e.holder}
    assert rejected_tasks and rejected_tasks <= set(accepted)


# -- tools as typed methods ------------------------------------------------------------------


class Calculator(ToolEnvironment):
    """Add with a tool, then answer: 1 for the right sum."""

    @tool
    def add(self, a: int, b: int) -> int:
        """The sum of two integers."""
        return a + b

    @tool
    def divide(self, a: int, b: int) -> float:
        """a / b."""
        if b == 0:
            raise ToolError("division by zero")
        return a / b

    def score(self, answer: str) -> float:
        assert self.prompt is not None
        a, b = self.prompt.text.rstrip("=").split("+")
        return 1.0 if answer == str(int(a) + int(b)) else 0.0


def _call(text: str) -> Action:
    return Action(token_ids=(1,), text=text, finished=True)


def test_tools_are_typed_methods_the_model_calls() -> None:
    env = Calculator()
    env.reset(PROMPT, 0)
    names = {s["name"]: s for s in env.tool_schemas()}
    assert set(names) == {"add", "divide"}
    assert names["add"]["parameters"]["properties"]["a"] == {"type": "integer"}
    assert names["add"]["parameters"]["required"] == ["a", "b"] and names["add"]["description"]
    answers = {
        '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>': "579",
        '<tool_call>{"name": "add", "arguments": {"a": "123", "b": 456}}</tool_call>': "error: Expected `int`",
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>': "error: missing a required argument",
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>': "error: no tool 'mul'",
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>': "error: division by zero",
        "<tool_call>not json</tool_call>": "error: the call is not JSON",
    }
    for call, expected in answers.items():
        result = env.step(_call(call))
        assert not result.done and isinstance(result.observation, str)
        assert result.observation.startswith(f"<tool_response>{expected}"), (call, result.observation)
    final = env.step(_call("579"))
    assert final.done and final.reward == 1.0 and env.calls == len(answers)


def test_a_tool_that_fails_unexpectedly_fails_the_episode() -> None:
    class Broken(Calculator):
        @tool
        def add(self, a: int, b: int) -> int:
            raise KeyError("the tool's backend is gone")

    env = Broken()
    env.reset(PROMPT, 0)
    with pytest.raises(KeyError):
        env.step(_call('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'))


class ReplayFails(ChainAddition):
    """The job's environment as the Rewarder replays it: it always raises (the scripted
    samplers play ``chain_addition`` itself)."""

    def step(self, action: Action) -> StepResult:
        raise RuntimeError("replay-side failure")


async def test_an_episode_whose_replay_fails_fails_its_lease_never_scored_0(tmp_path: Path) -> None:
    job = msgspec.structs.replace(
        _multi_turn_job(),
        episode=EpisodeConfig(environment="tests.test_envs:ReplayFails", max_turns=2, max_episode_tokens=23),
    )
    config = PromptSourceConfig(max_tasks=3, max_inflight_groups=1000, max_attempts=2)
    source = PromptSource("prompt_source", config, job)
    rewarder = Rewarder("rewarder", job=job)
    buffer = Buffer("buffer", job=job)
    sampler = EpisodeSampler("honest", job=job)
    sampler.script = episode_script(sampler)  # type: ignore[method-assign,assignment]
    async with Pipeline([source, rewarder, buffer, sampler], run_dir=tmp_path) as pipeline:
        await until(lambda: source.counters["attempts_exhausted"] >= 3, 30, "every task tried twice and given up")
        stats = buffer.statistics()
        pipeline.request_stop()
    # Each failed replay failed its lease: re-issued (2 attempts each), never scored.
    assert stats.groups_stored == 0 and stats.reward_failures == {}
    assert stats.rejected == {"environment_raised": 6}
    assert rewarder.episode_failures == {"replay:raised:RuntimeError": 12}  # 2 episodes per group
    assert source.counters["leases_reissued"] == 3 and source.counters["quarantined_samplers"] == 0


# -- environment calls under a deadline -------------------------------------------------------


async def test_a_call_waiting_its_turn_does_not_spend_its_deadline() -> None:
    release = threading.Event()
    calls = TimedCalls(1, name="test-timed")  # one call at a time
    try:
        slow = asyncio.ensure_future(calls.call(30.0, release.wait, 30.0))
        waiting = asyncio.ensure_future(calls.call(0.5, lambda: 1))  # its turn comes after `slow`
        await asyncio.sleep(1.0)  # past the waiting call's deadline, had it run from the request
        assert not waiting.done()
        release.set()
        assert await slow is True and await waiting == 1
        assert calls.stuck == 0
    finally:
        release.set()
        calls.close()


async def test_a_call_past_its_deadline_from_its_start_times_out_and_hung_threads_are_replaced() -> None:
    release = threading.Event()
    renewed: list[int] = []
    calls = TimedCalls(1, name="test-timed", max_stuck=1, on_renew=renewed.append)
    try:
        for _ in range(2):  # the pool's 1 + max_stuck threads: both end up held by hung calls
            with pytest.raises(TimeoutError):
                await calls.call(0.1, release.wait, 30.0)
        assert calls.stuck == 2 and renewed == []
        assert await calls.call(5.0, lambda: 2) == 2  # a fresh pool runs it at once
        assert renewed == [2]
        with pytest.raises(KeyError):  # what the function raises comes through as it is
            await calls.call(5.0, {}.__getitem__, "x")
        assert calls.stuck == 2
    finally:
        release.set()
        calls.close()
