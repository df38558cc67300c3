"""The embedding API: a task, reward and environment given as objects, and the user-dataset example."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from echo2 import Buffer, Learner, LearnerConfig, PromptSource, Rewarder, Sampler, SamplerConfig, WeightPublisher
from echo2.actors.testing import Idle
from echo2.envs.base import Observation
from echo2.envs.chain_addition import ChainAddition
from echo2.errors import ConfigError, ResolveError
from echo2.job import EpisodeConfig, JobConfig, JobObjects
from echo2.pipeline import Pipeline
from echo2.tasks.base import Prompt, check_job_task, correctness, load_job_task, reward_range
from echo2.tasks.dataset import DatasetTask

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "addition500.jsonl"


class TwoTask:
    """A task of one's own: every answer is "2"."""

    name = "two"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        while True:
            yield Prompt("t", "1+1=", "2")

    def heldout(self, n: int) -> list[Prompt]:
        return [Prompt(f"h{i}", "1+1=", "2") for i in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion == prompt.answer else 0.0

    def correct(self, prompt: Prompt, completion: str) -> bool:
        return completion == prompt.answer


def half(prompt: Prompt, completion: str) -> float:
    return 0.5


def test_a_task_object_replaces_the_job_task_and_keeps_its_predicate() -> None:
    job = JobConfig()  # task = "addition": ignored when an object is given
    task = load_job_task(job, JobObjects(task=TwoTask(), reward=half))
    prompt = task.heldout(1)[0]
    assert task.name == "two" and prompt.answer == "2"
    assert task.reward(prompt, "2") == 0.5  # the reward object
    predicate = correctness(task)
    assert predicate is not None and predicate(prompt, "2") and not predicate(prompt, "3")


def test_a_reward_object_is_checked_like_a_named_one() -> None:
    def unavailable(prompt: Prompt, completion: str) -> float:
        return 0.0

    def check() -> None:
        raise RuntimeError("no sandbox here")

    unavailable.check = check  # type: ignore[attr-defined]
    with pytest.raises(ResolveError, match=r"reward .*unavailable cannot run on this machine: no sandbox here"):
        load_job_task(JobConfig(), JobObjects(reward=unavailable))


def test_objects_and_strings_that_disagree_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^job\.task_kwargs: apply to a task named by job\.task"):
        load_job_task(JobConfig(task_kwargs={"digits": 2}), JobObjects(task=TwoTask()))
    with pytest.raises(ConfigError, match=r"^job\.reward: names 'exact' and a reward object is given too"):
        load_job_task(JobConfig(reward="exact"), JobObjects(reward=half))


def test_an_object_where_an_import_string_is_needed_says_where_it_goes() -> None:
    job = JobConfig(task=TwoTask())  # type: ignore[arg-type]  # what a user may try first
    expected = r"^job\.task: a TwoTask object where an import string is needed .* echo2\.Pipeline\(actors, task=\.\.\., reward=\.\.\.\)$"
    with pytest.raises(ConfigError, match=expected):
        load_job_task(job)
    with pytest.raises(ConfigError, match=expected):
        check_job_task(job)  # what topology load and --dry-run run
    with pytest.raises(ConfigError, match=r"^job\.reward: a function object where an import string is needed"):
        load_job_task(JobConfig(reward=half))  # type: ignore[arg-type]


def test_pipeline_refuses_what_is_not_a_task_or_reward() -> None:
    with pytest.raises(ConfigError, match=r"^task: a str lacks the Task interface"):
        Pipeline([Idle("idle")], task="addition")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^reward: a reward is a function"):
        Pipeline([Idle("idle")], reward=1.0)  # type: ignore[arg-type]


async def test_pipeline_hands_its_objects_to_every_actor() -> None:
    idle = Idle("idle")
    task = TwoTask()
    async with Pipeline([idle], task=task, reward=half) as pipeline:
        assert idle.ctx.job_objects == JobObjects(task=task, reward=half)
        pipeline.request_stop()
        await pipeline.wait()


def test_a_dataset_task_takes_its_reward_and_predicate_as_functions() -> None:
    def right(prompt: Prompt, completion: str) -> bool:
        return completion == prompt.answer

    task = DatasetTask(
        str(DATA), prompt_field="question", id_field="id", heldout_fraction=0.2, reward=half, correct=right
    )
    prompt = task.heldout(1)[0]
    assert task.reward(prompt, prompt.answer) == 0.5
    predicate = correctness(task)
    assert predicate is not None and predicate(prompt, prompt.answer) and not predicate(prompt, prompt.answer + "0")
    assert reward_range(task) is None  # `half` declares none
    with pytest.raises(ResolveError, match="not a float"):
        DatasetTask(str(DATA), prompt_field="question", reward=1.0)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_user_dataset_example_trains_watches_and_reports_pass_at_k() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "user_dataset.py"), "--steps", "4", "--pass-at-k", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # The watcher's metrics stream: the initial evaluation, then each step's reward and loss.
    assert "[watcher] step 0 | held-out pass@1 (greedy) " in out and "pass@2 (sampled) " in out
    assert "[watcher] step 1: reward " in out and "[watcher] step 2: reward " in out
    # It ended its own loop after two steps (watch_steps) and the run went on to the end.
    assert "[watcher] step 3" not in out
    assert "done: 4 steps, held-out pass@1 (greedy) " in out
    assert "pass@2 (2 samples per prompt at temperature 1, top_p 1; unbiased estimator (Chen et al. 2021))" in out


# -- an environment given as an object -------------------------------------------------------


def test_pipeline_refuses_what_is_not_an_environment_factory() -> None:
    with pytest.raises(ConfigError, match=r"^environment: a ChainAddition instance: pass its class"):
        Pipeline([Idle("idle")], environment=ChainAddition())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^environment: a str is not an environment factory"):
        Pipeline([Idle("idle")], environment="chain_addition")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^environment: environment .*cannot be built: ValueError"):
        Pipeline([Idle("idle")], environment=functools.partial(ChainAddition, operands=2))
    with pytest.raises(ConfigError, match=r"^environment: .* built a Prompt, which lacks reset and step"):
        Pipeline([Idle("idle")], environment=lambda: Prompt("t", "1+1=", "2"))  # type: ignore[arg-type,return-value]


def test_an_environment_object_and_a_named_one_are_not_both_given() -> None:
    named = JobConfig(episode=EpisodeConfig(environment="chain_addition"))
    with pytest.raises(ConfigError, match=r"^job\.episode\.environment: names 'chain_addition' and an environment"):
        Pipeline([Idle("idle", job=named)], environment=ChainAddition)
    with_kwargs = JobConfig(episode=EpisodeConfig(environment_kwargs={"operands": 4}))
    with pytest.raises(ConfigError, match=r"^job\.episode\.environment_kwargs: .*functools\.partial"):
        Pipeline([Idle("idle", job=with_kwargs)], environment=ChainAddition)


class CountedChain(ChainAddition):
    """``chain_addition`` recording which thread reset each episode (whose actor played it)."""

    resets: ClassVar[list[str]] = []

    def reset(self, prompt: Prompt, seed: int) -> Observation:
        CountedChain.resets.append(threading.current_thread().name)
        return super().reset(prompt, seed)


@pytest.mark.timeout(120)
async def test_an_environment_object_is_played_replayed_and_evaluated(tmp_path: Path) -> None:
    CountedChain.resets.clear()
    # Local to this test: no import string could name it, so every use below is the object.
    factory = functools.partial(CountedChain, operands=3, digits=2)
    job = JobConfig(
        group_size=4, groups_per_step=2, max_new_tokens=5, episode=EpisodeConfig(max_turns=2, max_episode_tokens=23)
    )
    learner = Learner("learner", LearnerConfig(max_steps=2, eval_every=2, eval_prompts=4), job)
    actors = [
        PromptSource("prompts", job=job),
        Sampler("sampler", SamplerConfig(credits=4, max_batch_groups=4), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        learner,
        WeightPublisher("publisher", job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path, environment=factory) as pipeline:
        assert all(a.job.multi_turn and a.job.episode.environment.endswith(":CountedChain") for a in actors)
        await pipeline.wait()
    assert learner.summary["steps"] == 2
    # Episodes played by the sampler, replayed by the rewarder, evaluated by the learner:
    # all in the object's environments.
    played_by = {name.rsplit("_", 1)[0] for name in CountedChain.resets}
    assert {"sampler-env", "rewarder-replay", "eval-env"} <= played_by, played_by
    assert [e.pass_at_1 is not None for e in learner.evals] == [True, True]  # the environment's verdicts
