"""The write-ahead log (echo2.journal) and the PromptSource state it carries across a
kill -9 (echo2.actors.lease_journal): what a restarted or resumed PromptSource continues from."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from tests.polling import until
from tests.test_actors import running

from echo2.actors import lease_journal as wal
from echo2.actors.prompt_source import PromptSource, PromptSourceConfig
from echo2.errors import JournalDamaged
from echo2.job import JobConfig
from echo2.journal import Journal
from echo2.messages import Hello, LearnerProgress, LeaseClosed, SayHello, TaskLease, Welcome, WorkRequest
from echo2.rundir import RunDir
from echo2.transport import Transport


class Note(msgspec.Struct, frozen=True, tag="note"):
    n: int


class Total(msgspec.Struct, frozen=True):
    total: int


def _journal(directory: Path) -> Journal[Note, Total]:
    return Journal(directory, "actor", Note, Total)


def test_records_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    assert journal.open() == (None, [])
    for n in range(5):
        journal.append(Note(n))
    journal.close()  # what a kill -9 leaves too: each append is one write(2)
    again = _journal(tmp_path)
    assert again.open() == (None, [Note(n) for n in range(5)])
    again.close()


def test_a_record_torn_by_a_crash_is_dropped_and_the_log_continues_after_the_last_whole_one(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.open()
    journal.append(Note(1))
    journal.append(Note(2))
    journal.close()
    log = journal.log_path(0)
    log.write_bytes(log.read_bytes()[:-1])  # died inside the second write
    again = _journal(tmp_path)
    assert again.open() == (None, [Note(1)])
    assert again.torn_records == 1
    again.append(Note(3))
    again.close()
    assert _journal(tmp_path).open() == (None, [Note(1), Note(3)])


def test_compaction_replaces_the_log_and_a_log_left_by_a_crash_mid_compaction_is_not_replayed(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.open()
    journal.append(Note(1))
    stale = journal.log_path(0).read_bytes()
    journal.compact(Total(1))
    journal.append(Note(2))
    journal.close()
    journal.log_path(0).write_bytes(stale)  # as if the crash came before the old log's removal
    again = _journal(tmp_path)
    assert again.open() == (Total(1), [Note(2)])
    assert not again.log_path(0).exists()
    again.close()


def test_a_record_that_does_not_decode_is_one_line_naming_the_file(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.open()
    journal.append(Note(1))
    journal.close()
    log = journal.log_path(0)
    log.write_bytes(log.read_bytes()[:4] + b"\xc1" * (len(log.read_bytes()) - 4))  # 0xc1: never valid msgpack
    with pytest.raises(JournalDamaged, match=r"actor\.0\.wal: record at byte 0"):
        _journal(tmp_path).open()


def test_recover_replays_issues_settlements_and_progress() -> None:
    def issued(lease: int, task: str, attempt: int, fresh: bool) -> wal.Issued:
        return wal.Issued(lease, wal.Task(task, "p", "a"), attempt, b"s", b"t", fresh)

    records: list[wal.Record] = [
        wal.Started(1),
        issued(1, "t0", 0, True),
        issued(2, "t1", 0, True),
        issued(3, "t2", 0, True),
        wal.Settled(1, stored=True),
        wal.Settled(2, requeue=True),  # expired: t1 again as attempt 1
        issued(4, "t1", 1, False),
        wal.Settled(3, requeue=True, front=True),  # its send failed: same attempt, first
        wal.Progress(trained=1, dropped_after_store=0, next_version=2, learner_incarnation=1),
        wal.Welcomed(name="s0", route=b"s0/1"),
        wal.Quarantined(name="forger"),
    ]
    out = wal.recover(None, records)
    assert (out.incarnation, out.issued_tasks, out.stored, out.trained) == (1, 3, 1, 1)
    assert (out.next_version, out.learner_incarnation) == (2, 1)  # the admission window
    assert out.samplers == {"s0": b"s0/1"} and out.quarantined == {"forger"}
    assert list(out.open) == [4]
    assert [(p.task.task_id, p.attempt) for p in out.retry] == [("t2", 0)]
    # A snapshot of that state recovers the same state.
    again = wal.recover(wal.snapshot(out), [])
    assert wal.snapshot(again) == wal.snapshot(out)


def test_lease_ids_carry_the_incarnation() -> None:
    assert wal.lease_incarnation(wal.lease_id(3, 17)) == 3
    assert wal.lease_id(2, 1) > wal.lease_id(1, 10**9)


async def _leases(transport: Transport, prefix: str, n: int, name: str = "s0") -> list[TaskLease]:
    from tests.test_bounds import _welcomed

    dealer = await _welcomed(transport, prefix, name)
    try:
        await dealer.send(WorkRequest(sampler_id=name, credits=n, incarnation=0, installed_version=0))
        leases = [await dealer.recv() for _ in range(n)]
    finally:
        dealer.close()
    assert all(isinstance(lease, TaskLease) for lease in leases)
    return leases  # type: ignore[return-value]


JOB = JobConfig(groups_per_step=4, staleness=1)
CONFIG = PromptSourceConfig(max_inflight_groups=100, end_notice_timeout_s=0.1)  # closed samplers never acknowledge


async def test_a_killed_prompt_source_continues_its_stream_and_keeps_its_open_leases(
    transport: Transport, tmp_path: Path
) -> None:
    crashed, restarted, resumed = tmp_path / "crashed", tmp_path / "restarted", tmp_path / "resumed"
    first = PromptSource("ps", CONFIG, JOB)
    async with running(first, transport, crashed, resume=False) as prefix:
        leases = await _leases(transport, prefix, 4)
        completions = transport.push(name="buf", connect=[f"inproc://{prefix}/completions"])
        try:
            stored = leases[0]
            await completions.send(
                LeaseClosed(lease_id=stored.lease_id, task_id=stored.task_id, attempt=0, outcome="stored")
            )
            await until(lambda: first.statistics().open_leases == 3)
        finally:
            completions.close()
        # A kill -9 now leaves the run directory as it is at this moment: copy it.
        for copy in (restarted, resumed):
            shutil.copytree(RunDir(crashed).checkpoints_dir, RunDir(copy).checkpoints_dir)
    assert {wal.lease_incarnation(lease.lease_id) for lease in leases} == {1}
    seen = {lease.task_id for lease in leases}

    # Restarted in a live run: the 3 open leases stay open for their holders; new work
    # continues the stream and carries the new incarnation.
    second = PromptSource("ps", CONFIG, JOB)
    async with running(second, transport, restarted, resume=False) as prefix:
        assert second.statistics().open_leases == 3
        # The sampler that holds them kept running: its next WorkRequest is not served but
        # answered with SayHello; its Hello is welcomed and its leases stay open.
        survivor = transport.dealer(name="s0", connect=[f"inproc://{prefix}/tasks"], identity=b"s0")
        try:
            await survivor.send(WorkRequest(sampler_id="s0", credits=1, incarnation=0, installed_version=0))
            assert isinstance(await survivor.recv(), SayHello)
            await survivor.send(Hello(peer_id="s0", role="sampler"))
            welcome = await survivor.recv()
            assert isinstance(welcome, Welcome) and welcome.accepted
        finally:
            survivor.close()
        assert second.statistics().open_leases == 3
        assert second.statistics().unwelcomed_dropped == {"WorkRequest": 1}
        [fresh] = await _leases(transport, prefix, 1, name="s1")
    assert wal.lease_incarnation(fresh.lease_id) == 2
    assert fresh.task_id not in seen and fresh.attempt == 0

    # Resumed after a stop (new samplers): the 3 are offered to the Buffer for expiry at
    # once. The Buffer (played here) says one of them was stored before the stop: only the
    # other two are re-issued, first, as attempt 1, once the resumed learner has reported.
    third = PromptSource("ps", CONFIG, JOB)
    async with running(third, transport, resumed, resume=True) as prefix:
        control = transport.pull(name="buf.control", bind=[f"inproc://{prefix}/peer-lease_control"])
        buffer = transport.push(name="buf", connect=[f"inproc://{prefix}/completions"])
        try:
            offered = [await control.recv() for _ in range(3)]
            assert sorted(m.lease_id for m in offered) == sorted(lease.lease_id for lease in leases[1:])
            for m, outcome in zip(offered, ["stored", "expired", "expired"], strict=True):
                await buffer.send(LeaseClosed(lease_id=m.lease_id, task_id=m.task_id, attempt=0, outcome=outcome))
            await buffer.send(
                LearnerProgress(next_version=0, groups_trained=0, groups_dropped_after_store=0, incarnation=1)
            )
            await until(lambda: third.statistics().open_leases == 0)
            again = await _leases(transport, prefix, 3)
        finally:
            control.close()
            buffer.close()
    assert sorted(lease.task_id for lease in again[:2]) == sorted(m.task_id for m in offered[1:])
    assert [lease.attempt for lease in again] == [1, 1, 0]
    assert again[2].task_id not in seen
