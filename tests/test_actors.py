"""Each data-plane actor alone, driven by the test through real sockets.

The test plays the actor's peers: it binds or connects raw endpoints to the actor's inproc
addresses (one shared Transport, so inproc reaches across) and checks what the actor says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from echo2.actor import Actor, PortAddresses
from echo2.actors.buffer import Buffer
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.actors.rewarder import Rewarder, RewarderConfig
from echo2.job import JobConfig
from echo2.messages import (
    AdmissionWindow,
    Batch,
    BatchRequest,
    ExpireLease,
    Hello,
    LearnerProgress,
    LeaseClosed,
    LeaseRecord,
    LeaseRecords,
    RolloutGroup,
    ScoredGroup,
    TaskLease,
    Welcome,
    WorkRequest,
)
from echo2.models.tokenizer import EOS_ID, CharTokenizer
from echo2.runtime import ProcessRuntime
from echo2.tasks.base import declares_reward_range
from echo2.transport import Transport

pytestmark = pytest.mark.timeout(30)


def _addresses(actor: Actor, prefix: str) -> dict[str, PortAddresses]:
    """Binders bind inproc://prefix/port; connectors connect to inproc://prefix/peer-port."""
    out = {}
    for port, spec in actor.ports.items():
        url = f"inproc://{prefix}/{port}" if spec.bind else f"inproc://{prefix}/peer-{port}"
        out[port] = PortAddresses(bind=(url,)) if spec.bind else PortAddresses(connect=(url,))
    return out


@contextlib.asynccontextmanager
async def running(
    actor: Actor, transport: Transport, run_dir: Path | None = None, resume: bool = False
) -> AsyncIterator[str]:
    """``actor`` running alone (in ``run_dir``, as a ``--resume`` if ``resume``); yields the
    prefix of its inproc addresses."""
    prefix = f"t-{actor.name}-{id(actor):x}"
    runtime = ProcessRuntime(
        [actor],
        {actor.name: _addresses(actor, prefix)},
        transport=transport,
        run_dir=run_dir,
        resume=resume,
        drain_timeout_s=2.0,
    )
    async with asyncio.TaskGroup() as group:
        group.create_task(runtime.run())
        await runtime.wait_ready()
        try:
            yield prefix
        finally:
            runtime.request_stop("test finished")


TOKEN = bytes(range(16))
TOKENIZER = CharTokenizer()


def _group(task_id: str, version: int, lease_id: int = 1, texts=("975", "974")) -> RolloutGroup:
    """A well-formed group of the tiny model whose completions' ids spell ``texts`` (the
    Rewarder scores what it decodes from the ids, not the texts a sampler claims)."""
    n = len(texts)
    ids = [np.asarray([*TOKENIZER.encode(t), EOS_ID], dtype=np.int32) for t in texts]
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int32)
    return RolloutGroup(
        lease_token=TOKEN,
        lease_id=lease_id,
        task_id=task_id,
        attempt=0,
        sampler_id="s",
        incarnation=0,
        version=version,
        prompt="123+456=",
        prompt_token_ids=np.arange(8, dtype=np.int32),
        token_ids=np.concatenate(ids),
        logprobs=np.full(int(offsets[-1]), -0.5, dtype=np.float32),
        offsets=offsets,
        texts=list(texts),
        finish_reasons=["eos"] * n,
    )


def lease_record(group: RolloutGroup, answer: str = "975", max_new_tokens: int = 16) -> LeaseRecord:
    """The trusted record of the lease ``group`` answers (what the PromptSource would hold)."""
    return LeaseRecord(
        lease_id=group.lease_id,
        task_id=group.task_id,
        attempt=group.attempt,
        sampler_id=group.sampler_id,
        token=TOKEN,
        group_size=group.group_size,
        max_new_tokens=max_new_tokens,
        prompt=group.prompt,
        answer=answer,
        meta={"source": "test"},
        prompt_token_ids=group.prompt_token_ids.copy(),
    )


WINDOW = AdmissionWindow(incarnation=0, newest=0, oldest=-3, vocab_size=15)


@contextlib.asynccontextmanager
async def lease_records_served(
    leases, records: dict[int, LeaseRecord], window: AdmissionWindow = WINDOW
) -> AsyncIterator[None]:
    """Play the PromptSource's ``leases`` channel: answer every ``LeaseQuery`` from ``records``."""

    async def serve() -> None:
        while True:
            for peer, query in await leases.recv_many():
                found = [records[i] for i in query.lease_ids if i in records]
                await leases.send(peer, LeaseRecords(request_id=query.request_id, records=found, window=window))

    async with asyncio.TaskGroup() as group:
        server = group.create_task(serve())
        try:
            yield
        finally:
            server.cancel()


def _scored(
    task_id: str, version: int, lease_id: int, reason: str = "", item_errors: dict[str, int] | None = None
) -> ScoredGroup:
    return ScoredGroup(
        group=_group(task_id, version, lease_id),
        rewards=np.array([1.0, 0.0], dtype=np.float32),
        keep=np.array([True, True]),
        dropped_reason=reason,
        item_errors=item_errors or {},
    )


async def _closed(completions, n: int) -> list[LeaseClosed]:
    out: list[LeaseClosed] = []
    while len(out) < n:
        out += [m for m in await completions.recv_many() if isinstance(m, LeaseClosed)]
    return out


# -- Buffer -------------------------------------------------------------------------------


async def test_buffer_admits_only_fresh_groups_and_accounts_for_every_one(transport: Transport) -> None:
    buffer = Buffer("buf", job=JobConfig(staleness=2))
    async with running(buffer, transport) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        scored = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        control = transport.push(name="ps.control", connect=[f"inproc://{p}/lease_control"])
        learner = transport.dealer(name="learner", connect=[f"inproc://{p}/batch"], identity=b"learner")
        try:
            # The learner is at version 5 with S = 2: versions 3.. are admissible.
            await learner.send(BatchRequest(request_id=1, incarnation=0, version=5, num_groups=2))
            item_errors = [{"out_of_range": 2}, {"timeout": 1}, {}]  # the Rewarder's, per group
            for i, version in enumerate([1, 3, 5]):
                await scored.send(_scored(f"task-{i}", version, lease_id=10 + i, item_errors=item_errors[i]))
            await scored.send(_scored("task-2", 5, lease_id=99))  # same task again
            outcomes = {c.lease_id: (c.outcome, c.reason) for c in await _closed(completions, 4)}
            # The request and the groups travel on different sockets, so the version-1 group
            # is either refused on arrival or stored and evicted when the request is seen.
            assert outcomes.pop(10) in (("dropped", "stale"), ("stored", ""))
            assert outcomes == {11: ("stored", ""), 12: ("stored", ""), 99: ("duplicate", "")}

            batch = await learner.recv()
            assert isinstance(batch, Batch) and batch.request_id == 1
            assert sorted(g.group.task_id for g in batch.groups) == ["task-1", "task-2"]
            assert batch.buffer is not None
            assert batch.buffer.dropped == {"stale": 1, "duplicate": 1}
            # Reward failures count whether their group was trained or dropped.
            assert batch.buffer.reward_failures == {"out_of_range": 2, "timeout": 1}

            # Expiry is decided once: a stored lease stays stored, an open one expires and a
            # result arriving after that is rejected as late.
            await control.send(ExpireLease(lease_id=11, task_id="task-1", attempt=0))
            await control.send(ExpireLease(lease_id=20, task_id="task-9", attempt=0))
            outcomes = {c.lease_id: c.outcome for c in await _closed(completions, 2)}
            assert outcomes == {11: "stored", 20: "expired"}
            await scored.send(_scored("task-9", 5, lease_id=20))
            assert [c.outcome for c in await _closed(completions, 1)] == ["late"]
            assert buffer.dropped["late"] == 1
        finally:
            for endpoint in (completions, scored, control, learner):
                endpoint.close()


async def test_buffer_evicts_groups_that_became_stale_while_waiting(transport: Transport) -> None:
    buffer = Buffer("buf", job=JobConfig(staleness=0))
    async with running(buffer, transport) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        scored = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        learner = transport.dealer(name="learner", connect=[f"inproc://{p}/batch"], identity=b"learner")
        try:
            await scored.send(_scored("old", 0, lease_id=1))
            await _closed(completions, 1)
            # S = 0: once the learner asks at version 1, a version-0 group can never train.
            await learner.send(BatchRequest(request_id=1, incarnation=0, version=1, num_groups=1))
            progress = None
            while progress is None:
                for m in await completions.recv_many():
                    if isinstance(m, LearnerProgress):
                        progress = m
            assert progress.groups_dropped_after_store == 1
            await scored.send(_scored("new", 1, lease_id=2))
            batch = await learner.recv()
            assert [g.group.task_id for g in batch.groups] == ["new"]
        finally:
            for endpoint in (completions, scored, learner):
                endpoint.close()


# -- PromptSource -------------------------------------------------------------------------


async def test_expired_lease_is_reissued_with_next_attempt(transport: Transport) -> None:
    source = PromptSource(
        "ps",
        PromptSourceConfig(lease_ttl_s=0.2, expiry_check_s=0.02),
        JobConfig(group_size=4, staleness=1),
    )
    async with running(source, transport) as p:
        sampler = transport.dealer(name="s0", connect=[f"inproc://{p}/tasks"], identity=b"s0")
        buffer_control = transport.pull(name="buf.control", bind=[f"inproc://{p}/peer-lease_control"])
        completions = transport.push(name="buf.completions", connect=[f"inproc://{p}/completions"])
        try:
            await sampler.send(Hello(peer_id="s0", role="sampler"))
            welcome = await sampler.recv()
            assert isinstance(welcome, Welcome) and welcome.accepted
            await sampler.send(WorkRequest(sampler_id="s0", credits=1))
            first = await sampler.recv()
            assert isinstance(first, TaskLease) and first.attempt == 0 and first.group_size == 4

            # The sampler goes silent; the deadline passes and the source asks the buffer.
            expire = await buffer_control.recv()
            assert isinstance(expire, ExpireLease) and expire.lease_id == first.lease_id
            await completions.send(
                LeaseClosed(lease_id=first.lease_id, task_id=first.task_id, attempt=0, outcome="expired")
            )
            # Two sockets carry no order between them: ask again once the source took it in.
            while source.counters["leases_expired"] < 1:
                await asyncio.sleep(0)
            await sampler.send(WorkRequest(sampler_id="s0", credits=1))
            again = await sampler.recv()
            assert isinstance(again, TaskLease)
            assert (again.task_id, again.attempt) == (first.task_id, 1)
            assert again.lease_id != first.lease_id
            assert source.counters["leases_reissued"] == 1
        finally:
            for endpoint in (sampler, buffer_control, completions):
                endpoint.close()


async def test_sampler_with_another_protocol_version_is_refused(transport: Transport) -> None:
    source = PromptSource("ps", job=JobConfig())
    async with running(source, transport) as p:
        sampler = transport.dealer(name="s0", connect=[f"inproc://{p}/tasks"], identity=b"s0")
        try:
            await sampler.send(Hello(peer_id="s0", role="sampler", protocol_version=99))
            welcome = await sampler.recv()
            assert isinstance(welcome, Welcome) and not welcome.accepted
            assert "protocol 99" in welcome.reason
        finally:
            sampler.close()


async def test_issuance_is_bounded_by_the_inflight_window(transport: Transport) -> None:
    job = JobConfig(groups_per_step=2, staleness=0)  # window = 2 groups
    source = PromptSource("ps", job=job)
    async with running(source, transport) as p:
        sampler = transport.dealer(name="s0", connect=[f"inproc://{p}/tasks"], identity=b"s0")
        completions = transport.push(name="buf.completions", connect=[f"inproc://{p}/completions"])
        try:
            await sampler.send(Hello(peer_id="s0", role="sampler"))
            await sampler.recv()
            await sampler.send(WorkRequest(sampler_id="s0", credits=10, incarnation=0, installed_version=0))
            leases = [await sampler.recv(), await sampler.recv()]
            # Stored is not trained: the window stays full until the learner takes them.
            for lease in leases:
                await completions.send(
                    LeaseClosed(lease_id=lease.lease_id, task_id=lease.task_id, attempt=0, outcome="stored")
                )
            await completions.send(LearnerProgress(next_version=1, groups_trained=2, groups_dropped_after_store=0))
            # S = 0: version 0 can no longer be trained; the sampler reports its install.
            await sampler.send(WorkRequest(sampler_id="s0", credits=0, incarnation=0, installed_version=1))
            third = await sampler.recv()
            assert isinstance(third, TaskLease) and third.min_version == 1
            assert source.counters["leases_issued"] >= 3
            assert sampler.statistics().received == 4  # welcome + exactly three leases so far
        finally:
            sampler.close()
            completions.close()


# -- Rewarder -----------------------------------------------------------------------------


@declares_reward_range(0.0, 1.0)
def flaky_reward(prompt, completion: str) -> float:
    """Test reward: raises on "666", hangs (beyond the deadline) on "777", returns a value
    outside its declared range on "888"."""
    if completion == "888":
        return 5.0
    if completion == "666":
        raise RuntimeError("reward code crashed")
    if completion == "777":
        import threading

        threading.Event().wait(2.0)
    return float(completion == prompt.answer)


async def test_reward_failures_cost_the_item_not_the_actor(transport: Transport) -> None:
    job = JobConfig(reward="tests.test_actors:flaky_reward")
    rewarder = Rewarder("rw", RewarderConfig(item_timeout_s=0.2, min_kept=2), job)
    async with running(rewarder, transport) as p:
        rollouts = transport.push(name="s.rollouts", connect=[f"inproc://{p}/rollouts"])
        scored = transport.pull(name="buf.scored", bind=[f"inproc://{p}/peer-scored"])
        leases = transport.router(name="ps.leases", bind=[f"inproc://{p}/peer-leases"])
        try:
            a_group = _group("a", 0, lease_id=1, texts=("975", "666", "777", "1", "888"))
            b_group = _group("b", 0, lease_id=2, texts=("666", "666", "975"))
            records = {g.lease_id: lease_record(g) for g in (a_group, b_group)}
            results = {}
            async with lease_records_served(leases, records):
                await rollouts.send(a_group)
                await rollouts.send(b_group)
                while len(results) < 2:
                    for m in await scored.recv_many():
                        results[m.group.task_id] = m
            a, b = results["a"], results["b"]
            assert a.keep.tolist() == [True, False, False, True, False]
            assert a.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
            assert a.item_errors == {"raised:RuntimeError": 1, "timeout": 1, "out_of_range": 1}
            assert a.dropped_reason == ""
            assert b.dropped_reason == "reward_failed"  # one kept < min_kept
            assert rewarder.statistics().item_errors["timeout"] == 1
        finally:
            rollouts.close()
            scored.close()
            leases.close()


def _bare_sampler(**config: object):  # type: ignore[no-untyped-def]
    """A Sampler's batching state without its sockets or engine (``setup`` not run)."""
    from collections import deque

    from echo2.actors.sampler import Sampler, SamplerConfig
    from echo2.actors.work_state import SamplerWork

    sampler = Sampler("s", SamplerConfig(engine="simulated", **config), JobConfig())
    sampler._leases, sampler._revoked = deque(), set()
    sampler._lease_arrived, sampler._have_work = asyncio.Event(), asyncio.Event()
    sampler._work = SamplerWork("s", sampler.config.credits, sampler.config.restate_s)
    return sampler


def _lease(i: int) -> TaskLease:
    return TaskLease(lease_id=i, task_id=f"t{i}", attempt=0, prompt="1+2=", group_size=2, ttl_s=9.0)


async def test_sampler_waits_for_granted_leases_to_fill_a_batch() -> None:
    sampler = _bare_sampler(max_batch_groups=4, batch_wait_s=30.0)  # the wait is a hang guard
    sampler._leases.append(_lease(0))
    sampler._work.owed = 3
    filling = asyncio.ensure_future(sampler._fill_batch())
    for i in (1, 2, 3):
        await asyncio.sleep(0)
        assert not filling.done()  # still short of a full batch, more are owed
        sampler._leases.append(_lease(i))
        sampler._work.received(i)
        sampler._lease_arrived.set()
    await asyncio.wait_for(filling, 5)
    assert [lease.lease_id for lease in sampler._take_batch()] == [0, 1, 2, 3]


async def test_sampler_does_not_wait_for_leases_it_was_not_granted() -> None:
    sampler = _bare_sampler(max_batch_groups=4, batch_wait_s=30.0)
    sampler._leases.append(_lease(0))
    await asyncio.wait_for(sampler._fill_batch(), 5)  # nothing owed: returns at once
    assert [lease.lease_id for lease in sampler._take_batch()] == [0]


async def test_sampler_batch_wait_is_bounded_and_off_by_default() -> None:
    unbounded = _bare_sampler(max_batch_groups=4)  # batch_wait_s = 0: never waits
    unbounded._work.owed = 3
    await asyncio.wait_for(unbounded._fill_batch(), 5)
    late = _bare_sampler(max_batch_groups=4, batch_wait_s=0.01)  # owed leases never come
    late._leases.append(_lease(0))
    late._work.owed = 3
    await asyncio.wait_for(late._fill_batch(), 5)
    assert [lease.lease_id for lease in late._take_batch()] == [0]


async def test_a_sampler_that_cannot_reach_its_prompt_source_says_so_and_where(transport: Transport) -> None:
    """Nothing answers its Hello (a wrong or unreachable address): instead of silence, a
    line every ``unreachable_log_s`` names the address it waits on."""
    import logging

    from echo2.actors.sampler import Sampler, SamplerConfig

    said = asyncio.Event()
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "no answer from the PromptSource" in record.getMessage():
                lines.append(record.getMessage())
                if len(lines) == 2:
                    said.set()

    engine = {"seconds_per_token": 0.0, "success_rate": 0.5}
    sampler = Sampler(
        "lonely", SamplerConfig(engine="simulated", engine_kwargs=engine, unreachable_log_s=0.05), JobConfig()
    )
    handler = Catch()
    logging.getLogger("echo2.lonely").addHandler(handler)
    try:
        async with running(sampler, transport) as prefix:
            async with asyncio.timeout(10):
                await said.wait()
    finally:
        logging.getLogger("echo2.lonely").removeHandler(handler)
    assert f"inproc://{prefix}/peer-tasks" in lines[0] and "reachable" in lines[0], lines
    assert sampler.counters["groups_sent"] == 0
