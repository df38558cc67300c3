"""Buffer: stores scored groups and hands the Learner admissible batches. The accountant.

Role: every group ends here exactly once, as stored (and later trained, or dropped as
stale) or as dropped on arrival with a reason: ``duplicate`` (task already stored or
trained), ``late`` (its lease had expired), ``stale`` (policy version below
``learner_version - S``), or the Rewarder's reason. Counts per reason are in every
``Batch`` reply and in ``statistics()`` (``BufferStats.dropped``).

Admission (bounded staleness): a group made by version ``v`` is admissible for a learner
at version ``t`` only if ``v >= t - S``; with ``S = 0`` only the current version trains.
Groups are handed out oldest first, which keeps staleness low.

Dynamic sampling (DAPO; ``drop_zero_variance``, off by default): a group whose rewards all
equal each other has advantage 0 for every completion and trains nothing, so it is dropped
on arrival as ``dropped`` with reason ``zero_variance`` (counted in ``BufferStats.dropped``;
its own outcome in the audit, not a loss). Its lease settles like any drop: the
PromptSource does not re-issue the task, and the freed window slot leases a new prompt,
so batches fill with groups that carry a gradient.

Rejections: a group the Rewarder refused at admission arrives as ``GroupRejected`` and is
counted by reason and sampler (``BufferStats.rejected``, ``rejected_by_sampler``; ledger
``rejected`` naming the sampler). When it was the lease holder's, the lease is closed as
``rejected`` (the PromptSource re-issues it at once); otherwise the lease is left alone,
since a group without the lease's token may be anyone's forgery.

Input: ``scored`` (PULL, bound) — ``ScoredGroup`` and ``GroupRejected`` from Rewarders; ``batch`` (ROUTER,
bound) — ``BatchRequest`` from the Learner; ``lease_control`` (PULL, bound) —
``ExpireLease`` from the PromptSource.
Output: ``Batch`` to the Learner; ``LeaseClosed`` and ``LearnerProgress`` on
``completions`` (PUSH, to the PromptSource).

Backpressure: a batch request waits until enough admissible groups exist (that wait is
the learner's bubble). The store is bounded by the PromptSource's in-flight window.

Durability (``echo2.actors.buffer_journal``): every change of its state is a record of its
write-ahead log (``checkpoints/<name>.*.wal``, ``echo2.journal``) written before the
change has an effect outside the process. Killed with SIGKILL and restarted
(``restart = "on-failure"``) or resumed (``--resume``), it replays the log and continues
with the same stored and handed groups, the same de-dup sets and lease outcomes, and the
same counters; it tells the PromptSource where the learner stands at once
(``LearnerProgress``). A request it had not answered is lost with it: the learner asks
again when its connection to the Buffer drops. A request for a version whose batch was
already handed (the learner lost it, or this Buffer died between handing and sending it)
is answered with the same groups, so the learner trains each batch once.

Shutdown: on ``stopping`` it returns; a pending batch request is not answered.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors import buffer_journal as wal
from echo2.actors.admission import rollout_group_max_bytes
from echo2.journal import FsyncPolicy, Journal
from echo2.messages import (
    ZERO_VARIANCE,
    Batch,
    BatchClampReason,
    BatchRequest,
    BufferStats,
    ExpireLease,
    GroupRejected,
    LearnerCheckpointed,
    LearnerProgress,
    LeaseClosed,
    LeaseOutcome,
    PolicyVersion,
    ScoredGroup,
)
from echo2.rundir import RunDir
from echo2.transport.endpoint import CONTROL_MAX_MESSAGE_BYTES

OTHER_SAMPLERS = "(other)"
"""``rejected_by_sampler`` key of forgeries claiming names beyond the first 64 seen."""


class BufferConfig(ActorConfig, frozen=True):
    max_groups: Annotated[int, Meta(ge=1)] = 4096
    """Most groups held; beyond it the oldest are dropped as ``overflow`` (a safety net:
    the PromptSource's window normally keeps the store far smaller)."""
    drop_zero_variance: bool = False
    """DAPO dynamic sampling: drop a group whose kept rewards all equal each other (no
    gradient) on arrival, reason ``zero_variance``; a new prompt takes its place. A task
    budget (``max_tasks``) is then spent faster than one group per trained group."""
    journal: bool = True
    """Keep the write-ahead log that lets a restarted or resumed Buffer continue with its
    groups and de-dup sets (``echo2.actors.buffer_journal``). Off: a restart of this
    process starts empty and loses what it held (for measurements only)."""
    journal_fsync: FsyncPolicy = "none"
    """When the journal reaches the disk: "none" (each record written before its effect:
    survives a kill -9 of this process) or "always" (fsync per record: survives a host
    crash). See ``echo2.journal``."""
    journal_compact_records: Annotated[int, Meta(ge=1)] = 10000
    """Records after which the journal is compacted into a snapshot (and not before the log
    outweighs the last snapshot: compaction rewrites every group held)."""


class Buffer(Actor):
    kind: ClassVar[str] = "buffer"
    Config = BufferConfig
    ports: ClassVar[dict[str, Port]] = {
        "scored": Port("pull", bind=True),  # a group's size: rollout_group_max_bytes(job)
        "batch": Port("router", bind=True, max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
        "lease_control": Port("pull", bind=True, max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
        "completions": Port("push", bind=False),
    }
    config: BufferConfig

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        self._book = wal.BufferBook(max_retained=self.config.max_groups)
        self._journal: Journal[wal.Record, wal.State] | None = None
        self._log_bytes_at_snapshot = 0
        self._snapshot_bytes = 0
        # Each peer's latest unanswered request, oldest first: one peer's request never
        # displaces another's (a stray request once stalled the learner's).
        self._pending: dict[bytes, BatchRequest] = {}
        self.batch_requests_clamped: dict[BatchClampReason, int] = {}
        self.batches_resent = 0
        self._scored = ctx.open("scored", max_message_bytes=rollout_group_max_bytes(self.job))
        self._batch = ctx.open("batch")
        self._control = ctx.open("lease_control")
        self._completions = ctx.open("completions")
        self._recovered = self._open_journal()

    # The book's state under the names the Buffer's readers use.
    @property
    def counters(self) -> dict[str, int]:
        return self._book.counters

    @property
    def dropped(self) -> dict[str, int]:
        return self._book.dropped

    @property
    def _store(self) -> deque[ScoredGroup]:
        return self._book.store

    # -- the journal (echo2.actors.buffer_journal) -------------------------------------

    def _open_journal(self) -> bool:
        """Recover what a previous incarnation held, then journal from here; True if there
        was anything to recover."""
        if self.ctx.run_dir is None or not self.config.journal:
            return False
        journal, state, records = Journal[wal.Record, wal.State].resumed(
            RunDir(self.ctx.run_dir).checkpoints_dir,
            self.name,
            wal.Record,
            wal.State,
            fsync=self.config.journal_fsync,
            resume=self.ctx.resume,
            warn=self.ctx.log.warning,
            otherwise="starting empty",
        )
        recovered = wal.BufferBook.restore(state, records, max_retained=self.config.max_groups)
        self._book, self._journal = recovered.book, journal
        # Killed between a record and its ledger lines: write them now, so that the ledger
        # says what the journal says.
        tail = ledger.tail(RunDir(self.ctx.run_dir).ledger_path(self.name))
        for event in wal.missing_events(recovered.last_events, tail):
            self.ctx.ledger(event)
        found = state is not None or bool(records)
        self._commit(wal.Started(incarnation=self._book.incarnation + 1))
        if found:
            book = self._book
            self.ctx.log.info(
                "incarnation %d recovered: %d groups stored, %d handed since the learner's fallback checkpoint, "
                "%d task ids seen (journal: %d records, %d torn)",
                book.incarnation, len(book.store), len(book.retained), len(book.seen_tasks), len(records),
                journal.torn_records,
            )  # fmt: skip
        return found

    def _commit(self, record: wal.Record, group: ScoredGroup | None = None) -> list[ledger.LedgerEvent]:
        """Journal ``record``, apply it, and write the ledger events it makes (returned):
        before its effect leaves the process."""
        if self._journal is not None:
            self._journal.append(record)
        events = self._book.apply(record, group)
        for event in events:
            self.ctx.ledger(event)
        if self._journal is not None and self._journal.records_written % self.config.journal_compact_records == 0:
            # Compaction rewrites every group held: not before the log outweighs it.
            if self._journal.bytes_written - self._log_bytes_at_snapshot >= self._snapshot_bytes:
                self._compact()
        return events

    def _compact(self) -> None:
        assert self._journal is not None
        state = self._book.snapshot()
        self._journal.compact(state)
        self._log_bytes_at_snapshot = self._journal.bytes_written
        self._snapshot_bytes = sum(len(g) for g in state.store) + sum(len(g) for _, _, g in state.retained)

    async def aclose(self) -> None:
        if not hasattr(self, "_book"):
            return
        # Groups still stored when the run ends were never trained: say so, so the audit
        # can tell them from lost ones.
        for g in self._book.store:
            self.ctx.ledger(ledger.Unconsumed(task=g.group.task_id, version=g.group.version))
        if self._journal is not None:
            self._compact()  # after the ledger lines: a resume has nothing to repair
            self._journal.close()

    def statistics(self) -> BufferStats:
        book = self._book
        return BufferStats(
            **book.counters,
            dropped=dict(book.dropped),
            reward_failures=dict(book.reward_failures),
            stored_now=len(book.store),
            learner_version=book.learner_version,
            rejected=dict(book.rejected),
            rejected_by_sampler={s: dict(r) for s, r in book.rejected_by_sampler.items()},
            batch_requests_clamped=dict(self.batch_requests_clamped),
        )

    async def run(self) -> None:
        if self._recovered:
            # A restarted PromptSource knows the learner's window from this at once.
            await self._report_progress(self._book.next_version)
        await run_until_stopped(
            self.ctx.stopping, self._receive_scored(), self._serve_batches(), self._receive_control()
        )

    # -- accounting ------------------------------------------------------------------

    def _admissible(self, made_by: PolicyVersion) -> bool:
        book = self._book
        if made_by.incarnation < book.learner_incarnation and made_by.version > book.resumed_from:
            return False  # made by weights of a crashed learner's lost future
        return made_by.version >= book.learner_version - self.job.staleness

    async def _settle(self, scored: ScoredGroup, outcome: LeaseOutcome, reason: str = "", seen: bool = False) -> None:
        g = scored.group
        if outcome == "stored":
            self._commit(wal.Stored(group=self._book.codec.encode(scored) if self._journal else b""), scored)
        else:
            self._commit(
                wal.Refused(
                    task=g.task_id,
                    lease=g.lease_id,
                    attempt=g.attempt,
                    version=g.version,
                    sampler=g.sampler_id,
                    outcome=outcome,
                    reason=reason,
                    seen=seen,
                    item_errors=dict(scored.item_errors),
                )
            )
        await self._completions.send(
            LeaseClosed(lease_id=g.lease_id, task_id=g.task_id, attempt=g.attempt, outcome=outcome, reason=reason)
        )

    async def _receive_scored(self) -> None:
        while True:
            for message in await self._scored.recv_many():
                if isinstance(message, ScoredGroup):
                    await self._accept(message)
                elif isinstance(message, GroupRejected):
                    await self._on_rejected(message)
            await self._answer_pending()

    async def _on_rejected(self, rejected: GroupRejected) -> None:
        book = self._book
        sampler = rejected.sampler_id
        if not rejected.holder and sampler not in book.rejected_by_sampler and len(book.rejected_by_sampler) >= 64:
            sampler = OTHER_SAMPLERS  # claimed names are free: do not let them grow the stats
        lease = rejected.lease_id
        # A forgery, or a lease already settled, changes nothing of the lease.
        settles = rejected.holder and book.lease_outcome(lease) is None
        self._commit(
            wal.AdmissionRejected(
                task=rejected.task_id,
                lease=lease,
                attempt=rejected.attempt,
                version=rejected.version,
                sampler=sampler,
                reason=rejected.reason,
                holder=rejected.holder,
                settles=settles,
            )
        )
        if settles:
            await self._completions.send(
                LeaseClosed(
                    lease_id=lease,
                    task_id=rejected.task_id,
                    attempt=rejected.attempt,
                    outcome="rejected",
                    reason=rejected.reason,
                )
            )

    async def _accept(self, scored: ScoredGroup) -> None:
        g = scored.group
        book = self._book
        if g.lease_id in book.expired_leases:
            await self._settle(scored, "late")
        elif g.task_id in book.seen_tasks:
            await self._settle(scored, "duplicate")
        elif scored.dropped_reason:
            await self._settle(scored, "dropped", scored.dropped_reason, seen=True)
        elif not self._admissible(g.policy_version):
            await self._settle(scored, "dropped", "stale", seen=True)
        elif self.config.drop_zero_variance and scored.zero_reward_variance:
            await self._settle(scored, "dropped", ZERO_VARIANCE, seen=True)
        else:
            await self._settle(scored, "stored")
            if len(book.store) > self.config.max_groups:
                self._commit(wal.Evicted(tasks=[book.store[0].group.task_id], reason="overflow"))

    async def _receive_control(self) -> None:
        while True:
            for message in await self._control.recv_many():
                if not isinstance(message, ExpireLease):
                    continue
                # Decided once: asked again (its answer was lost), the answer is the same.
                known = self._book.lease_outcome(message.lease_id)
                if known is None:
                    self._commit(wal.Expired(lease=message.lease_id, task=message.task_id))
                outcome, reason = known or ("expired", "")
                await self._completions.send(
                    LeaseClosed(
                        lease_id=message.lease_id,
                        task_id=message.task_id,
                        attempt=message.attempt,
                        outcome=outcome,
                        reason=reason,
                    )
                )

    # -- batches ---------------------------------------------------------------------

    async def _serve_batches(self) -> None:
        while True:
            for peer, message in await self._batch.recv_many():
                if isinstance(message, BatchRequest):
                    await self._on_request(peer, message)
                elif isinstance(message, LearnerCheckpointed):
                    self._commit(wal.Checkpointed(version=message.version))
            await self._answer_pending()

    async def _on_request(self, peer: bytes, request: BatchRequest) -> None:
        book = self._book
        if request.incarnation > book.learner_incarnation:
            # A resumed learner: what it trained after its checkpoint is lost; train it again.
            requeued = self._commit(wal.LearnerResumed(incarnation=request.incarnation, version=request.version))
            self.ctx.log.info(
                "learner incarnation %d resumes at version %d: %d groups requeued",
                request.incarnation, request.version, len(requeued),
            )  # fmt: skip
            # Admission refuses versions of an incarnation it has not heard of.
            await self._report_progress(request.version)
            # The previous incarnation is dead: its requests go unanswered.
            self._pending = {p: r for p, r in self._pending.items() if r.incarnation >= request.incarnation}
        elif request.incarnation < book.learner_incarnation:
            return  # a dead incarnation's
        elif again := book.handed_for(request.version, peer):
            # Its batch was handed already and never reached the learner (a dropped
            # connection, or this Buffer's previous incarnation died before sending it):
            # the same groups again, so that each is trained once whichever copy arrives.
            self._pending.pop(peer, None)
            self.batches_resent += 1
            await self._batch.send(peer, Batch(request_id=request.request_id, groups=again, buffer=self.statistics()))
            return
        self._pending.pop(peer, None)  # a peer's newer request replaces its older one
        self._pending[peer] = self._clamped(request)
        book.learner_version = max(book.learner_version, request.version)

    def _evict_stale(self) -> int:
        stale = [g.group.task_id for g in self._book.store if not self._admissible(g.group.policy_version)]
        if stale:
            self._commit(wal.Evicted(tasks=stale, reason="stale"))
        return len(stale)

    def _clamped(self, request: BatchRequest) -> BatchRequest:
        """At most what one step trains and what the store can hold: a request for more
        could never be answered, and the run would wait for it until its deadline."""
        reason: BatchClampReason = "above_groups_per_step"
        limit = self.job.groups_per_step
        if self.config.max_groups < limit:
            reason, limit = "above_capacity", self.config.max_groups
        if request.num_groups <= limit:
            return request
        count = self.batch_requests_clamped[reason] = self.batch_requests_clamped.get(reason, 0) + 1
        if count == 1:  # once per reason: the counter tells the rest
            self.ctx.log.warning("a BatchRequest for %d groups is served %d (%s)", request.num_groups, limit, reason)
        return msgspec.structs.replace(request, num_groups=limit)

    async def _answer_pending(self) -> None:
        """Answer pending requests, oldest first, while the store holds enough for one."""
        while self._pending and await self._answer_oldest():
            pass

    async def _answer_oldest(self) -> bool:
        peer, request = next(iter(self._pending.items()))
        evicted = self._evict_stale()
        book = self._book
        if len(book.store) < request.num_groups:
            if evicted:
                await self._report_progress(request.version)
            return False
        del self._pending[peer]
        tasks = [book.store[i].group.task_id for i in range(request.num_groups)]
        overflow = book.retained_overflow
        self._commit(wal.Handed(request_version=request.version, tasks=tasks, peer=peer))
        if overflow == 0 and book.retained_overflow:
            self.ctx.log.warning(
                "more than max_groups = %d groups handed since the learner's fallback checkpoint: a learner "
                "resume from it could not train the oldest again (checkpoint more often, or raise max_groups)",
                self.config.max_groups,
            )
        groups = book.handed_for(request.version, peer)
        await self._batch.send(peer, Batch(request_id=request.request_id, groups=groups, buffer=self.statistics()))
        await self._report_progress(request.version + 1)
        return True

    async def _report_progress(self, next_version: int) -> None:
        book = self._book
        await self._completions.send(
            LearnerProgress(
                next_version=next_version,
                groups_trained=book.counters["groups_trained"],
                groups_dropped_after_store=book.counters["groups_dropped_after_store"],
                delivered_by_sampler=dict(book.delivered_by_sampler),
                incarnation=book.learner_incarnation,
                buffer_incarnation=book.incarnation,
            )
        )
