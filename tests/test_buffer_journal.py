"""The Buffer's write-ahead log (echo2.actors.buffer_journal): a Buffer killed with SIGKILL and
restarted continues with what it held, decides nothing twice, and its ledger says what its
journal says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tests.polling import until
from tests.test_actors import _scored, running

from echo2 import ledger
from echo2.actors import buffer_journal as wal
from echo2.actors.buffer import Buffer, BufferConfig
from echo2.job import JobConfig
from echo2.messages import Batch, BatchRequest, ExpireLease, LearnerProgress, LeaseClosed, Message
from echo2.rundir import RunDir
from echo2.transport import Transport

pytestmark = pytest.mark.timeout(30)


# -- the book, without sockets ---------------------------------------------------------


def _records() -> list[wal.Record]:
    codec = wal.GroupCodec()
    return [
        wal.Started(incarnation=1),
        *[wal.Stored(group=codec.encode(_scored(f"t{i}", 1, lease_id=i))) for i in range(4)],
        wal.Refused(
            task="t9", lease=9, attempt=0, version=1, sampler="s", outcome="dropped", reason="no_reward", seen=True
        ),
        wal.Expired(lease=7, task="t7"),
        wal.Handed(request_version=1, tasks=["t0", "t1"]),
        wal.Evicted(tasks=["t3"], reason="stale"),
        wal.Handed(request_version=2, tasks=["t2"]),
        wal.Checkpointed(version=2),
        wal.LearnerResumed(incarnation=1, version=2),
    ]


def test_a_replay_rebuilds_the_state_and_a_snapshot_round_trips() -> None:
    recovered = wal.BufferBook.restore(None, _records(), max_retained=100)
    book = recovered.book
    # t0, t1 trained before the checkpoint at 2: durable. t2 was handed for version 2, which
    # the resumed learner starts at: back in the store. t3 went stale.
    assert [g.group.task_id for g in book.store] == ["t2"]
    assert book.retained == type(book.retained)()
    assert book.seen_tasks == {"t0", "t1", "t2", "t3", "t9"}
    assert (book.lease_outcome(0), book.lease_outcome(9), book.lease_outcome(7), book.lease_outcome(5)) == (
        ("stored", ""),
        ("dropped", "no_reward"),
        ("expired", ""),
        None,
    )
    assert book.counters == {
        "groups_stored": 4,
        "groups_trained": 2,
        "groups_dropped_after_store": 1,
        "batches_served": 2,
    }
    assert (book.incarnation, book.learner_incarnation, book.next_version) == (1, 1, 2)
    assert recovered.last_events == [ledger.Requeued(task="t2", version=1)]
    again = wal.BufferBook.restore(book.snapshot(), [], max_retained=100).book
    assert again.snapshot() == book.snapshot()


def test_the_ledger_lines_a_kill_cut_off_are_found() -> None:
    handed = [ledger.Handed(task=f"t{i}", version=0, request_version=1) for i in range(3)]
    before = [ledger.Accepted(task="t0", lease=0, version=0, sampler="s")]
    assert wal.missing_events(handed, before) == handed  # killed before the first line
    assert wal.missing_events(handed, before + handed[:1]) == handed[1:]  # ... inside them
    assert wal.missing_events(handed, before + handed) == []  # after them
    assert wal.missing_events(handed, [*handed, ledger.Unconsumed(task="t5", version=0)]) == []


# -- the actor, killed and restarted ---------------------------------------------------


def _kill_9(run: Path, copy: Path) -> None:
    """What a kill -9 leaves: the run directory as it is now (every record is one write)."""
    for part in (RunDir(run).checkpoints_dir, RunDir(run).ledger_dir):
        shutil.copytree(part, copy / part.name)


async def _next(endpoint, kind: type[Message]):  # type: ignore[no-untyped-def]
    while not isinstance(message := await endpoint.recv(), kind):
        pass
    return message


JOB = JobConfig(staleness=2, groups_per_step=2)


async def test_a_killed_buffer_restarts_with_its_groups_and_decides_nothing_twice(
    transport: Transport, tmp_path: Path
) -> None:
    first_run, restarted = tmp_path / "first", tmp_path / "restarted"
    first = Buffer("buf", BufferConfig(), JOB)
    async with running(first, transport, first_run) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        scored = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        control = transport.push(name="ps.control", connect=[f"inproc://{p}/lease_control"])
        learner = transport.dealer(name="learner", connect=[f"inproc://{p}/batch"], identity=b"learner")
        try:
            for i in range(3):
                await scored.send(_scored(f"t{i}", 1, lease_id=i))
            await scored.send(_scored("t3", 1, lease_id=3, reason="no_reward"))
            for _ in range(4):
                await _next(completions, LeaseClosed)
            await learner.send(BatchRequest(request_id=1, incarnation=0, version=1, num_groups=2))
            handed = await _next(learner, Batch)
            await control.send(ExpireLease(lease_id=5, task_id="t5", attempt=0))
            assert (await _next(completions, LeaseClosed)).outcome == "expired"
            # Killed now; and once more as if the kill came between the expiry's record and
            # its ledger line.
            _kill_9(first_run, restarted)
            _kill_9(first_run, tmp_path / "cut")
        finally:
            for endpoint in (completions, scored, control, learner):
                endpoint.close()
    cut = RunDir(tmp_path / "cut").ledger_path("buf")
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:-1]))
    assert [g.group.task_id for g in handed.groups] == ["t0", "t1"]

    second = Buffer("buf", BufferConfig(), JOB)
    async with running(second, transport, restarted) as p:
        completions = transport.pull(name="ps.completions", bind=[f"inproc://{p}/peer-completions"])
        scored = transport.push(name="rw.scored", connect=[f"inproc://{p}/scored"])
        control = transport.push(name="ps.control", connect=[f"inproc://{p}/lease_control"])
        learner = transport.dealer(name="learner", connect=[f"inproc://{p}/batch"], identity=b"learner")
        try:
            # At once, where the learner stands: a restarted PromptSource's window.
            progress = await _next(completions, LearnerProgress)
            assert (progress.next_version, progress.groups_trained, progress.buffer_incarnation) == (2, 2, 2)
            # The learner never got its batch (this Buffer died before sending it): asked
            # again, it gets the same groups, not the next ones.
            await learner.send(BatchRequest(request_id=2, incarnation=0, version=1, num_groups=2))
            assert [g.group.task_id for g in (await _next(learner, Batch)).groups] == ["t0", "t1"]
            assert second.batches_resent == 1
            await learner.send(BatchRequest(request_id=3, incarnation=0, version=2, num_groups=1))
            assert [g.group.task_id for g in (await _next(learner, Batch)).groups] == ["t2"]
            # Every lease is decided once: a group of a stored task is a duplicate, one of the
            # expired lease is late; asked again, each lease's outcome is the same.
            await scored.send(_scored("t0", 1, lease_id=10))
            await scored.send(_scored("t5", 1, lease_id=5))
            for lease in (0, 3, 5):
                await control.send(ExpireLease(lease_id=lease, task_id="?", attempt=0))
            outcomes = {}
            while len(outcomes) < 5:
                closed = await _next(completions, LeaseClosed)
                outcomes[(closed.lease_id, closed.task_id)] = (closed.outcome, closed.reason)
            assert outcomes == {
                (10, "t0"): ("duplicate", ""),
                (5, "t5"): ("late", ""),
                (0, "?"): ("stored", ""),
                (3, "?"): ("dropped", "no_reward"),
                (5, "?"): ("expired", ""),
            }
            assert second.statistics().groups_stored == 3
        finally:
            for endpoint in (completions, scored, control, learner):
                endpoint.close()
    events = ledger.read([restarted]).events
    assert sum(isinstance(e, ledger.Accepted) for e in events) == 3  # nothing accepted twice
    assert sum(isinstance(e, ledger.LeaseExpired) for e in events) == 1

    # The kill came between the expiry's record and its ledger line: the line is written
    # by the restarted Buffer, once.
    third = Buffer("buf", BufferConfig(), JOB)
    async with running(third, transport, tmp_path / "cut"):
        await until(lambda: third.statistics().groups_stored == 3)
    events = ledger.read([tmp_path / "cut"]).events
    assert [e for e in events if isinstance(e, ledger.LeaseExpired)] == [ledger.LeaseExpired(task="t5", lease=5)]
