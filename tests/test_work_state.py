"""Membership that heals (issue 13 item 2): work credit stated, not added; leases a torn
connection lost are re-issued at once; a sampler cut off from its PromptSource trains again
once the link returns (``echo2.actors.work_state``)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from tests.test_actors import running

from echo2.actors.buffer import Buffer
from echo2.actors.learner import Learner, LearnerConfig
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.rewarder import Rewarder
from echo2.actors.sampler import Sampler, SamplerConfig
from echo2.actors.weight_publisher import WeightPublisher
from echo2.actors.work_state import SamplerWork, reconcile
from echo2.job import JobConfig
from echo2.messages import (
    ExpireLease,
    Hello,
    LeaseClosed,
    PolicyVersion,
    TaskLease,
    Welcome,
    WorkGrant,
    WorkRequest,
)
from echo2.pipeline import Pipeline
from echo2.tools.audit import audit
from echo2.transport import Transport

pytestmark = pytest.mark.timeout(60)


def _state(max_leases: int, held=(), submitted=(), sync: int = 1, acked: int = 0) -> WorkRequest:
    return WorkRequest(
        sampler_id="s", max_leases=max_leases, held=list(held), submitted=list(submitted), sync=sync, acked=acked
    )


# -- the rule ---------------------------------------------------------------------------


def test_credit_is_max_leases_minus_held_and_on_their_way_and_only_fenced_leases_are_lost() -> None:
    # Open for this connection: 1, 2 held; 3 answered; 4, 5 sent before the acknowledged
    # grant (fence 5) yet neither held nor answered: lost; 6, 7 sent after it: on their way.
    judged = reconcile(_state(8, held=[1, 2], submitted=[3]), [1, 2, 3, 4, 5, 6, 7], fence=5, max_hold=64)
    assert judged.lost == [4, 5] and judged.pending == 2
    assert judged.credits == 8 - 2 - 2 and not judged.clamped
    # A state acknowledging no grant this PromptSource knows judges nothing lost.
    unknown = reconcile(_state(8, held=[1, 2], submitted=[3]), [1, 2, 3, 4, 5, 6, 7], fence=None, max_hold=64)
    assert unknown.lost == [] and unknown.pending == 4 and unknown.credits == 2


def test_the_same_state_twice_grants_the_same_credit_and_more_than_allowed_is_clamped() -> None:
    state = _state(4, held=[1])
    assert reconcile(state, [1], None, 64) == reconcile(state, [1], None, 64)  # set, not added
    greedy = reconcile(_state(10**6, held=[]), [], None, 16)
    assert greedy.credits == 16 and greedy.clamped
    busy = reconcile(_state(4, held=range(100)), [], None, 16)  # holds more than it may
    assert busy.credits == 0 and busy.clamped


def test_a_sampler_states_again_at_once_when_leases_a_grant_counted_never_came() -> None:
    work = SamplerWork("s", max_leases=4, restate_s=2.0)
    first = work.state(PolicyVersion(0, 3))
    assert (first.max_leases, first.held, first.sync, first.acked, first.installed_version) == (4, [], 1, 0, 3)
    assert not work.due()  # just stated
    for lease_id in (10, 11):
        work.received(lease_id)
    assert not work.granted(WorkGrant(server_id="ps", sync=1, credits=4, pending=2))  # both came
    assert work.acked == 1 and work.owed == 4
    work.answered([10])
    second = work.state(None)
    assert second.held == [11] and second.submitted == [10] and second.acked == 1
    # The grant says 3 leases were on their way when it was judged; none arrived before it.
    assert work.granted(WorkGrant(server_id="ps", sync=2, credits=0, pending=3))
    assert work.restates_for_loss == 1 and work.state(None).acked == 2
    # A grant older than the one acknowledged changes nothing.
    assert not work.granted(WorkGrant(server_id="ps", sync=1, credits=9, pending=9)) and work.acked == 2
    assert work.due(time.monotonic() + 2.0)  # holds 1 of 4: states again after restate_s


# -- the PromptSource --------------------------------------------------------------------


async def test_leases_the_sampler_never_received_are_reissued_at_once(transport: Transport) -> None:
    """Hand-driven: 4 leases granted, 2 of them "lost on the way"; the next states find
    them lost (after the grant that fences them), the Buffer expires them, and their tasks
    come back to the same sampler as new attempts. A repeated state grants nothing more."""
    job = JobConfig(groups_per_step=4, staleness=1)
    # A window of 4: nothing new is leased until the lost leases are settled.
    config = PromptSourceConfig(lease_ttl_s=600.0, expiry_check_s=0.02, max_inflight_groups=4, end_notice_timeout_s=0.1)
    source = PromptSource("ps", config, job)
    async with running(source, transport) as p:
        buffer_control = transport.pull(name="buf.control", bind=[f"inproc://{p}/peer-lease_control"])
        completions = transport.push(name="buf.completions", connect=[f"inproc://{p}/completions"])
        dealer = transport.dealer(name="s", connect=[f"inproc://{p}/tasks"], identity=b"s/1")

        async def play_the_buffer() -> None:  # nothing was stored: every expiry is real
            async for message in buffer_control:
                if isinstance(message, ExpireLease):
                    await completions.send(
                        LeaseClosed(
                            lease_id=message.lease_id,
                            task_id=message.task_id,
                            attempt=message.attempt,
                            outcome="expired",
                        )
                    )

        async def next_of(kind: type) -> Any:
            while not isinstance(message := await dealer.recv(), kind):
                pass
            return message

        try:
            async with asyncio.TaskGroup() as group:
                buffer = group.create_task(play_the_buffer())
                await dealer.send(Hello(peer_id="s", role="sampler"))
                assert (await next_of(Welcome)).accepted
                version = {"incarnation": 0, "installed_version": 0}
                await dealer.send(WorkRequest(sampler_id="s", max_leases=4, sync=1, **version))
                grant = await next_of(WorkGrant)
                assert (grant.sync, grant.credits, grant.pending) == (1, 4, 0)
                leases = [await next_of(TaskLease) for _ in range(4)]
                kept, lost = leases[:2], leases[2:]
                held = [lease.lease_id for lease in kept]
                # Sent after grant 1: on their way as far as the PromptSource knows.
                await dealer.send(WorkRequest(sampler_id="s", max_leases=4, held=held, sync=2, acked=1, **version))
                grant = await next_of(WorkGrant)
                assert (grant.credits, grant.pending, grant.reissued) == (0, 2, 0)
                # Received none of them before grant 2: they were lost; say so.
                await dealer.send(WorkRequest(sampler_id="s", max_leases=4, held=held, sync=3, acked=2, **version))
                grant = await next_of(WorkGrant)
                assert (grant.credits, grant.pending, grant.reissued) == (2, 0, 2)
                again = [await next_of(TaskLease) for _ in range(2)]
                assert {(lease.task_id, lease.attempt) for lease in again} == {
                    (lease.task_id, lease.attempt + 1) for lease in lost
                }
                assert source.statistics().leases_lost_in_transit == 2
                # The same state again: credit is set, not added; nothing more is sent.
                held += [lease.lease_id for lease in again]
                for sync in (4, 5):
                    await dealer.send(
                        WorkRequest(sampler_id="s", max_leases=4, held=held, sync=sync, acked=3, **version)
                    )
                    grant = await next_of(WorkGrant)
                    assert (grant.credits, grant.pending, grant.reissued) == (0, 0, 0)
                assert source.statistics().open_leases == 4
                buffer.cancel()
        finally:
            for endpoint in (dealer, buffer_control, completions):
                endpoint.close()


# -- end to end ---------------------------------------------------------------------------


async def test_a_sampler_cut_off_from_its_prompt_source_trains_again_when_the_link_returns(tmp_path: Path) -> None:
    """One process, one sampler: every message on ``tasks``, both ways, is lost for a while
    (as a torn connection loses what was queued on it), starting as leases go out. Leases
    last 10 minutes, so no expiry rescues it: before, the sampler held nothing, was owed
    leases that never came, and the run stalled. Now it trains to the end, audits clean,
    and the PromptSource counts the leases lost on the way."""
    job = JobConfig(staleness=2, group_size=2, groups_per_step=2, max_new_tokens=5)
    simulated = {"seconds_per_token": 0.0, "success_rate": 0.5}
    steps = 8
    source = PromptSource("prompt_source", PromptSourceConfig(lease_ttl_s=600.0), job=job)
    sampler = Sampler(
        "sampler", SamplerConfig(engine="simulated", engine_kwargs=simulated, credits=4, restate_s=0.2), job
    )
    learner = Learner("learner", LearnerConfig(max_steps=steps, eval_every=0, eval_prompts=2, checkpoint_every=0), job)
    actors = [source, sampler, Rewarder("rewarder", job=job), Buffer("buffer", job=job), learner]
    actors.append(WeightPublisher("weight_publisher", job=job))
    outage: dict[str, float] = {}
    dropped = {"to_sampler": 0, "to_source": 0}

    def cut(direction: str, message: object) -> bool:
        now = time.monotonic()
        if "start" not in outage and direction == "to_sampler" and isinstance(message, TaskLease) and learner.version:
            outage["start"] = now  # as leases go out to it, once it has been trained from
        if "start" in outage and now - outage["start"] < 1.0:
            dropped[direction] += 1
            return True
        return False

    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        to_sampler, to_source = source._tasks_ep.send, sampler._tasks.send

        async def source_send(peer: bytes, message: Any) -> bool:
            return True if cut("to_sampler", message) else await to_sampler(peer, message)

        async def sampler_send(message: Any) -> bool:
            return True if cut("to_source", message) else await to_source(message)

        source._tasks_ep.send = source_send  # type: ignore[method-assign]
        sampler._tasks.send = sampler_send  # type: ignore[method-assign]
        await asyncio.wait_for(pipeline.wait(), 45)
    assert dropped["to_sampler"] >= 1 and dropped["to_source"] >= 1, dropped
    assert learner.version == steps
    assert source.statistics().leases_lost_in_transit >= 1
    report = audit([tmp_path])
    assert report.ok and not report.lost and not report.duplicated, report
    # The weight path's counters are in the run's metrics, not only in heartbeats: the
    # last ``stats`` record of each is written as the actor stops.
    for actor, kind, counted in (
        ("sampler", "SamplerStats", "installs"),
        ("weight_publisher", "PublisherStats", "published"),
    ):
        lines = [json.loads(line) for line in (tmp_path / "metrics" / f"{actor}.jsonl").read_text().splitlines()]
        last = [r for r in lines if r["kind"] == "stats"][-1]
        assert last["type"] == kind and last[counted] >= 1, last
    assert {"repair_bytes_sent", "superseded", "members_expired", "send_failures"} <= last.keys()
