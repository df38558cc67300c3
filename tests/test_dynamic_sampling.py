"""Dynamic sampling (DAPO): groups whose rewards all equal each other are dropped at the
Buffer, counted, settled through the lease mechanism and replaced by new prompts."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from tests.test_actors import _closed, _group, running

from echo2.actors.buffer import Buffer, BufferConfig
from echo2.actors.learner import Learner, LearnerConfig
from echo2.actors.prompt_source import PromptSource
from echo2.actors.rewarder import Rewarder
from echo2.actors.sampler import Sampler, SamplerConfig
from echo2.actors.weight_publisher import WeightPublisher
from echo2.job import JobConfig
from echo2.messages import ZERO_VARIANCE, Batch, BatchRequest, Hello, LeaseClosed, ScoredGroup, TaskLease, WorkRequest
from echo2.pipeline import Pipeline
from echo2.tools.audit import audit
from echo2.transport import Transport

pytestmark = pytest.mark.timeout(30)


def scored(task_id: str, rewards: list[float], keep: list[bool] | None = None, lease_id: int = 1) -> ScoredGroup:
    texts = tuple(f"{i}" for i in range(len(rewards)))
    return ScoredGroup(
        group=_group(task_id, 0, lease_id, texts=texts),
        rewards=np.array(rewards, dtype=np.float32),
        keep=np.array([True] * len(rewards) if keep is None else keep),
    )


def test_zero_reward_variance_reads_the_kept_rewards_only() -> None:
    assert scored("a", [1.0, 1.0, 1.0]).zero_reward_variance
    assert scored("a", [0.0, 0.0]).zero_reward_variance
    assert not scored("a", [1.0, 0.0, 1.0]).zero_reward_variance
    # the differing reward is not kept: what trains is all equal
    assert scored("a", [1.0, 0.0, 1.0], keep=[True, False, True]).zero_reward_variance
    assert scored("a", [1.0, 0.0], keep=[True, False]).zero_reward_variance  # one kept: advantage 0
    assert not scored("a", [0.5, 0.25, 0.5]).zero_reward_variance


async def test_buffer_drops_zero_variance_groups_counts_them_and_settles_their_leases(transport: Transport) -> None:
    buffer = Buffer("buf", BufferConfig(drop_zero_variance=True), job=JobConfig(staleness=2, group_size=2))
    async with running(buffer, transport) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        rewarder = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        learner = transport.dealer(name="learner", connect=[f"inproc://{p}/batch"], identity=b"learner")
        try:
            await rewarder.send(scored("all-right", [1.0, 1.0], lease_id=1))
            await rewarder.send(scored("mixed", [1.0, 0.0], lease_id=2))
            await rewarder.send(scored("all-wrong", [0.0, 0.0], lease_id=3))
            await rewarder.send(scored("mixed-2", [0.0, 1.0], lease_id=4))
            outcomes = {c.lease_id: (c.outcome, c.reason) for c in await _closed(completions, 4)}
            assert outcomes == {
                1: ("dropped", ZERO_VARIANCE),
                2: ("stored", ""),
                3: ("dropped", ZERO_VARIANCE),
                4: ("stored", ""),
            }
            # A second copy of a dropped task is a duplicate: the task was decided once.
            await rewarder.send(scored("all-right", [1.0, 0.0], lease_id=9))
            assert [(c.outcome, c.lease_id) for c in await _closed(completions, 1)] == [("duplicate", 9)]

            await learner.send(BatchRequest(request_id=1, incarnation=0, version=0, num_groups=2))
            batch = await learner.recv()
            assert isinstance(batch, Batch)
            assert sorted(g.group.task_id for g in batch.groups) == ["mixed", "mixed-2"]
            assert batch.buffer is not None and batch.buffer.dropped == {ZERO_VARIANCE: 2, "duplicate": 1}
            assert buffer.statistics().groups_stored == 2
        finally:
            for endpoint in (completions, rewarder, learner):
                endpoint.close()


async def test_buffer_keeps_zero_variance_groups_by_default(transport: Transport) -> None:
    buffer = Buffer("buf", job=JobConfig(staleness=2, group_size=2))
    async with running(buffer, transport) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        rewarder = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        try:
            await rewarder.send(scored("all-right", [1.0, 1.0], lease_id=1))
            assert [(c.outcome, c.reason) for c in await _closed(completions, 1)] == [("stored", "")]
            assert buffer.dropped == {}
        finally:
            completions.close()
            rewarder.close()


async def test_a_dropped_groups_window_slot_leases_a_new_prompt(transport: Transport) -> None:
    """The PromptSource's half of "replaced": the task is settled (not re-issued) and its
    place in the in-flight window goes to the next prompt."""
    source = PromptSource("ps", job=JobConfig(groups_per_step=2, staleness=0))  # window = 2 groups
    async with running(source, transport) as p:
        sampler = transport.dealer(name="s0", connect=[f"inproc://{p}/tasks"], identity=b"s0")
        completions = transport.push(name="buf.completions", connect=[f"inproc://{p}/completions"])
        try:
            await sampler.send(Hello(peer_id="s0", role="sampler"))
            await sampler.recv()
            await sampler.send(WorkRequest(sampler_id="s0", credits=10, incarnation=0, installed_version=0))
            first = [await sampler.recv(), await sampler.recv()]
            assert all(isinstance(lease, TaskLease) for lease in first)
            for lease in first:
                await completions.send(
                    LeaseClosed(
                        lease_id=lease.lease_id,
                        task_id=lease.task_id,
                        attempt=lease.attempt,
                        outcome="dropped",
                        reason=ZERO_VARIANCE,
                    )
                )
            replaced = [await sampler.recv(), await sampler.recv()]
            assert all(isinstance(lease, TaskLease) and lease.attempt == 0 for lease in replaced)
            assert {lease.task_id for lease in replaced}.isdisjoint({lease.task_id for lease in first})
            assert source.counters["closed_dropped"] == 2 and source.counters["leases_reissued"] == 0
        finally:
            sampler.close()
            completions.close()


def test_the_switch_is_typed_config() -> None:
    with pytest.raises(msgspec.ValidationError, match="drop_zero_variance"):
        msgspec.convert({"drop_zero_variance": "yes"}, BufferConfig, strict=True)


@pytest.mark.timeout(120)
async def test_a_run_with_dynamic_sampling_audits_clean_and_counts_the_dropped_groups(tmp_path: Path) -> None:
    """End to end in one process: simulated samplers answer right half the time, so with
    G = 2 about half the groups have equal rewards; those are dropped and replaced, the
    learner still trains full batches (with a masked-IS correction), and the audit finds
    nothing lost or duplicated and the dropped groups under their own count."""
    job = JobConfig(staleness=2, group_size=2, groups_per_step=2, max_new_tokens=5)
    simulated = {"seconds_per_token": 0.0, "success_rate": 0.5}
    steps = 4
    actors = [
        PromptSource("prompt_source", job=job),
        Sampler("sampler", SamplerConfig(engine="simulated", engine_kwargs=simulated, credits=4), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", BufferConfig(drop_zero_variance=True), job=job),
        Learner(
            "learner",
            LearnerConfig(max_steps=steps, eval_every=0, eval_prompts=2, checkpoint_every=0, loss="geo_sequence_mask"),
            job,
        ),
        WeightPublisher("weight_publisher", job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        await pipeline.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["groups_trained"] == steps * 2
    report = audit([tmp_path])
    assert report.ok and not report.lost and not report.duplicated, report
    assert report.trained == steps * 2
    assert report.zero_variance > 0, report  # the simulated rule is seeded: the same groups every run
    assert ZERO_VARIANCE not in str(report.rejected)  # its own outcome, not a refusal
    # the learner's summary holds the Buffer's count at the last batch; more may follow
    assert 0 < summary["drops_by_reason"][ZERO_VARIANCE] <= report.zero_variance
    records = [json.loads(line) for line in (tmp_path / "metrics" / "learner.jsonl").read_text().splitlines()]
    assert all("is_masked_fraction" in r for r in records if r["kind"] == "step")
