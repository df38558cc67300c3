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

Shutdown: on ``stopping`` it returns; a pending batch request is not answered.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors.admission import rollout_group_max_bytes
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
    RejectReason,
    ScoredGroup,
)
from echo2.rundir import RunDir
from echo2.transport.codec import Codec
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
        self._store: deque[ScoredGroup] = deque()
        self._seen_tasks: set[str] = set()  # stored or trained task ids
        self._stored_leases: set[int] = set()
        self._expired_leases: set[int] = set()
        self._learner_version = 0
        self._incarnation = 0
        self._resumed_from = 0
        # Groups handed to the learner since its last checkpoint: a crashed learner resumes
        # from that checkpoint and must train them again, so they are kept until then.
        self._retained: deque[tuple[int, ScoredGroup]] = deque()
        # Each peer's latest unanswered request, oldest first: one peer's request never
        # displaces another's (a stray request once stalled the learner's).
        self._pending: dict[bytes, BatchRequest] = {}
        self.batch_requests_clamped: dict[BatchClampReason, int] = {}
        self.counters: dict[str, int] = {
            "groups_stored": 0,
            "groups_trained": 0,
            "groups_dropped_after_store": 0,
            "batches_served": 0,
        }
        self.dropped: dict[str, int] = {}
        self.reward_failures: dict[str, int] = {}  # completions, by the Rewarder's reason
        self.rejected: dict[RejectReason, int] = {}
        self.rejected_by_sampler: dict[str, dict[RejectReason, int]] = {}
        self.delivered_by_sampler: dict[str, int] = {}  # rollouts stored, per sampler
        self._scored = ctx.open("scored", max_message_bytes=rollout_group_max_bytes(self.job))
        self._batch = ctx.open("batch")
        self._control = ctx.open("lease_control")
        self._completions = ctx.open("completions")
        self._codec = Codec(ScoredGroup)  # the state file holds ScoredGroups
        if ctx.resume:
            self._load_state()

    async def aclose(self) -> None:
        if not hasattr(self, "_store"):
            return
        self._save_state()
        # Groups still stored when the run ends were never trained: say so, so the audit
        # can tell them from lost ones.
        for g in self._store:
            self.ctx.ledger(ledger.Unconsumed(task=g.group.task_id, version=g.group.version))

    # -- checkpoint ------------------------------------------------------------------

    def _state_path(self) -> Path | None:
        return None if self.ctx.run_dir is None else RunDir(self.ctx.run_dir).state_path(self.name, ".state")

    def _encode_group(self, group: ScoredGroup) -> list[bytes]:
        return [bytes(memoryview(frame).cast("B")) for frame in self._codec.encode(group)]

    def _save_state(self) -> None:
        """Stored and retained groups plus every dedup set, written atomically."""
        path = self._state_path()
        if path is None:
            return
        state = {
            "seen": sorted(self._seen_tasks),
            "stored_leases": sorted(self._stored_leases),
            "expired_leases": sorted(self._expired_leases),
            "learner_version": self._learner_version,
            "incarnation": self._incarnation,
            "resumed_from": self._resumed_from,
            "counters": self.counters,
            "dropped": self.dropped,
            "reward_failures": self.reward_failures,
            "rejected": self.rejected,
            "rejected_by_sampler": self.rejected_by_sampler,
            "store": [self._encode_group(g) for g in self._store],
            "retained": [[v, self._encode_group(g)] for v, g in self._retained],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode(state))
        tmp.replace(path)

    def _load_state(self) -> None:
        path = self._state_path()
        if path is None or not path.exists():
            self.ctx.log.warning("--resume: no buffer state at %s; starting empty", path)
            return
        state = msgspec.msgpack.decode(path.read_bytes())
        self._seen_tasks = set(state["seen"])
        self._stored_leases = set(state["stored_leases"])
        self._expired_leases = set(state["expired_leases"])
        self._learner_version = state["learner_version"]
        self._incarnation = state["incarnation"]
        self._resumed_from = state["resumed_from"]
        self.counters.update(state["counters"])
        self.dropped.update(state["dropped"])
        self.reward_failures.update(state.get("reward_failures", {}))  # (absent in earlier states)
        self.rejected.update(state.get("rejected", {}))  # (absent in states of earlier versions)
        self.rejected_by_sampler.update(state.get("rejected_by_sampler", {}))
        decode = self._codec.decode
        self._store = deque(decode(frames) for frames in state["store"])
        self._retained = deque((v, decode(frames)) for v, frames in state["retained"])
        self.ctx.log.info(
            "resumed: %d groups stored, %d awaiting a learner checkpoint, %d task ids seen",
            len(self._store), len(self._retained), len(self._seen_tasks),
        )  # fmt: skip

    def _on_checkpoint(self, done: LearnerCheckpointed) -> None:
        while self._retained and self._retained[0][0] < done.version:
            self._retained.popleft()
        self._save_state()

    def _on_new_incarnation(self, request: BatchRequest) -> None:
        """A resumed learner: what it trained after its checkpoint is lost; train it again."""
        self._incarnation, self._resumed_from = request.incarnation, request.version
        self._learner_version = request.version
        again = [g for v, g in self._retained if v >= request.version]
        self._retained.clear()
        self._store.extendleft(reversed(again))
        self.counters["groups_trained"] -= len(again)  # back in the store, not trained
        for g in again:
            self.ctx.ledger(ledger.Requeued(task=g.group.task_id, version=g.group.version))
        self.ctx.log.info(
            "learner incarnation %d resumes at version %d: %d groups requeued",
            request.incarnation, request.version, len(again),
        )  # fmt: skip

    def statistics(self) -> BufferStats:
        return BufferStats(
            **self.counters,
            dropped=dict(self.dropped),
            reward_failures=dict(self.reward_failures),
            stored_now=len(self._store),
            learner_version=self._learner_version,
            rejected=dict(self.rejected),
            rejected_by_sampler={s: dict(r) for s, r in self.rejected_by_sampler.items()},
            batch_requests_clamped=dict(self.batch_requests_clamped),
        )

    async def run(self) -> None:
        await run_until_stopped(
            self.ctx.stopping, self._receive_scored(), self._serve_batches(), self._receive_control()
        )

    # -- accounting ------------------------------------------------------------------

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def _admissible(self, made_by: PolicyVersion) -> bool:
        if made_by.incarnation < self._incarnation and made_by.version > self._resumed_from:
            return False  # made by weights of a crashed learner's lost future
        return made_by.version >= self._learner_version - self.job.staleness

    async def _close(self, group: ScoredGroup, outcome: LeaseOutcome, reason: str = "") -> None:
        g = group.group
        if outcome == "stored":
            self.ctx.ledger(ledger.Accepted(task=g.task_id, lease=g.lease_id, version=g.version, sampler=g.sampler_id))
        else:
            self.ctx.ledger(
                ledger.Rejected(
                    task=g.task_id,
                    lease=g.lease_id,
                    version=g.version,
                    outcome=outcome,
                    reason=reason,
                    sampler=g.sampler_id,
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
        reason, sampler = rejected.reason, rejected.sampler_id
        if not rejected.holder and sampler not in self.rejected_by_sampler and len(self.rejected_by_sampler) >= 64:
            sampler = OTHER_SAMPLERS  # claimed names are free: do not let them grow the stats
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        by_reason = self.rejected_by_sampler.setdefault(sampler, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self.ctx.ledger(
            ledger.Rejected(
                task=rejected.task_id,
                lease=rejected.lease_id,
                version=rejected.version,
                outcome="rejected",
                reason=reason,
                sampler=sampler,
                holder=rejected.holder,
            )
        )
        lease = rejected.lease_id
        if not rejected.holder or lease in self._stored_leases or lease in self._expired_leases:
            return  # nothing of the lease changes: a forgery, or a lease already settled
        self._expired_leases.add(lease)  # another group for it is late
        await self._completions.send(
            LeaseClosed(
                lease_id=lease, task_id=rejected.task_id, attempt=rejected.attempt, outcome="rejected", reason=reason
            )
        )

    async def _accept(self, scored: ScoredGroup) -> None:
        g = scored.group
        for reason, n in scored.item_errors.items():
            self.reward_failures[reason] = self.reward_failures.get(reason, 0) + n
        if g.lease_id in self._expired_leases:
            self._drop("late")
            await self._close(scored, "late")
        elif g.task_id in self._seen_tasks:
            self._drop("duplicate")
            await self._close(scored, "duplicate")
        elif scored.dropped_reason:
            self._drop(scored.dropped_reason)
            self._seen_tasks.add(g.task_id)
            await self._close(scored, "dropped", scored.dropped_reason)
        elif not self._admissible(g.policy_version):
            self._drop("stale")
            self._seen_tasks.add(g.task_id)
            await self._close(scored, "dropped", "stale")
        elif self.config.drop_zero_variance and scored.zero_reward_variance:
            self._drop(ZERO_VARIANCE)
            self._seen_tasks.add(g.task_id)
            await self._close(scored, "dropped", ZERO_VARIANCE)
        else:
            self._store.append(scored)
            self._seen_tasks.add(g.task_id)
            self._stored_leases.add(g.lease_id)
            self.counters["groups_stored"] += 1
            self.delivered_by_sampler[g.sampler_id] = self.delivered_by_sampler.get(g.sampler_id, 0) + g.group_size
            await self._close(scored, "stored")
            if len(self._store) > self.config.max_groups:
                evicted = self._store.popleft()
                self.ctx.ledger(
                    ledger.Dropped(task=evicted.group.task_id, reason="overflow", version=evicted.group.version)
                )
                self._drop("overflow")
                self.counters["groups_dropped_after_store"] += 1

    async def _receive_control(self) -> None:
        while True:
            for message in await self._control.recv_many():
                if not isinstance(message, ExpireLease):
                    continue
                outcome: LeaseOutcome
                if message.lease_id in self._stored_leases:
                    outcome = "stored"
                else:
                    self._expired_leases.add(message.lease_id)
                    outcome = "expired"
                    self.ctx.ledger(ledger.LeaseExpired(task=message.task_id, lease=message.lease_id))
                await self._completions.send(
                    LeaseClosed(
                        lease_id=message.lease_id,
                        task_id=message.task_id,
                        attempt=message.attempt,
                        outcome=outcome,
                    )
                )

    # -- batches ---------------------------------------------------------------------

    async def _serve_batches(self) -> None:
        while True:
            for peer, message in await self._batch.recv_many():
                if isinstance(message, BatchRequest):
                    if message.incarnation > self._incarnation:
                        self._on_new_incarnation(message)
                        # Admission refuses versions of an incarnation it has not heard of.
                        await self._report_progress(message.version)
                        # The previous incarnation is dead: its requests go unanswered.
                        self._pending = {p: r for p, r in self._pending.items() if r.incarnation >= message.incarnation}
                    self._pending.pop(peer, None)  # a peer's newer request replaces its older one
                    self._pending[peer] = self._clamped(message)
                    self._learner_version = max(self._learner_version, message.version)
                elif isinstance(message, LearnerCheckpointed):
                    self._on_checkpoint(message)
            await self._answer_pending()

    def _evict_stale(self) -> int:
        kept: deque[ScoredGroup] = deque()
        for g in self._store:
            if self._admissible(g.group.policy_version):
                kept.append(g)
            else:
                self.ctx.ledger(ledger.Dropped(task=g.group.task_id, reason="stale", version=g.group.version))
        evicted = len(self._store) - len(kept)
        if evicted:
            self._store = kept
            self._drop("stale", evicted)
            self.counters["groups_dropped_after_store"] += evicted
        return evicted

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
        if len(self._store) < request.num_groups:
            if evicted:
                await self._report_progress(request.version)
            return False
        del self._pending[peer]
        groups = [self._store.popleft() for _ in range(request.num_groups)]
        for g in groups:
            self.ctx.ledger(
                ledger.Handed(task=g.group.task_id, version=g.group.version, request_version=request.version)
            )
            self._retained.append((request.version, g))
        while len(self._retained) > self.config.max_groups:  # no checkpoints: bound the memory
            self._retained.popleft()
        self.counters["groups_trained"] += len(groups)
        self.counters["batches_served"] += 1
        await self._batch.send(peer, Batch(request_id=request.request_id, groups=groups, buffer=self.statistics()))
        await self._report_progress(request.version + 1)
        return True

    async def _report_progress(self, next_version: int) -> None:
        await self._completions.send(
            LearnerProgress(
                next_version=next_version,
                groups_trained=self.counters["groups_trained"],
                groups_dropped_after_store=self.counters["groups_dropped_after_store"],
                delivered_by_sampler=dict(self.delivered_by_sampler),
                incarnation=self._incarnation,
            )
        )
