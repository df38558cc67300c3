"""PromptSource: leases tasks to samplers that ask for work, and re-issues lost work.

Role: the only place work is created. A task is one prompt to be sampled ``group_size``
times; it is handed out as a lease (``lease_id``, ``attempt``, ``ttl_s``).

Input: ``tasks`` (ROUTER) — ``Hello`` and ``WorkRequest(credits)`` from Samplers;
``completions`` (PULL) — ``LeaseClosed`` and ``LearnerProgress`` from the Buffer.
Output: ``TaskLease`` to samplers with credit; ``ExpireLease`` to the Buffer (``lease_control``).

Backpressure: work is pulled, never pushed. A sampler states the leases it can hold and
the ones it holds (``WorkRequest`` as a work state, ``echo2.actors.work_state``); its credit
is what it can hold minus what it holds or has on its way (capped by
``max_credits_per_sampler``), set at each state and never added up, so a state or a lease
lost with a torn connection is repaired by the next state: leases sent before the
``WorkGrant`` a state acknowledges that the sampler never received are re-issued at once.
Samplers with credit are served one lease each in turn, and the whole pipeline holds at most ``max_inflight_groups`` groups that are
leased or stored but not yet trained, so generation cannot run ahead of the learner by
more than the staleness budget allows. Each lease carries ``min_version`` (the learner's
next version minus S): samplers wait for weights rather than make work that would arrive
too stale to train.

Loss recovery: a lease whose deadline passes is offered to the Buffer for expiry; the
Buffer answers ``stored`` (a result already landed: nothing to do) or ``expired`` (no
result can be trained any more: re-issue with ``attempt + 1``). A task is dropped after
``max_attempts``. A sampler that disconnects simply stops being offered work; its leases
expire, or, if it comes back (a link outage), its next work state re-issues the ones it
never received and restores its credit.

Activation (``echo2.capacity.scheduler``): the PromptSource binds the ``telemetry`` channel
and feeds the scheduler the heartbeats (sampler availability and price, the learner's
T_train), ``WeightsInstalled`` (T_bcast) and the Buffer's per-sampler delivery counts. With
``activation = "cost_aware"`` or ``"random"`` only the active samplers are served leases; a
parked sampler keeps its credits (served again once it is activated) and its weights
current, and finishes the leases it already holds (they are not revoked: one it had
started would come back as a duplicate of its re-issue). Every change of the active set is
recorded (``kind = "activation"``, with its reason and figures) and so, every
``activation_record_s``, is the state with the dollars spent so far.

Untrusted samplers (``echo2.actors.admission``): a lease carries the prompt text and a
random token, never the answer. The PromptSource keeps each open lease's record (prompt,
answer, meta, the trusted tokenization, holder, token) and answers the Rewarders'
``LeaseQuery`` on ``leases`` with it and the current ``AdmissionWindow``. A lease whose
holder's group failed admission comes back ``rejected`` and is re-issued at once. A
sampler with ``quarantine_rejections`` such rejections within ``quarantine_window_s`` is
quarantined: it gets no more leases (logged once, counted, ledger event ``quarantined``)
and its open leases are expired now. A sampler whose installed version (reported in
``WorkRequest``) is older than the learner's next version minus S gets no leases until it
reports a newer one: its work could not be trained.

Leaving: a sampler that says ``Goodbye`` (its process stopped in a run that goes on) has its
leases expired now, its credit and name forgotten and the scheduler told (``GoodbyeSeen``
answers it); workers joined with ``python -m echo2.join`` leave this way.

Shutdown: on ``stopping`` it stops issuing and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors import lease_journal as wal
from echo2.actors.admission import (
    QUARANTINE_EXEMPT,
    PromptCodec,
    RejectionTracker,
    lease_meta,
    trusted_prompt_codec,
)
from echo2.actors.work_state import GrantFences, reconcile
from echo2.capacity.scheduler import ActivationPolicy, Scheduler, SchedulerDecision
from echo2.envs.base import episode_seed
from echo2.job import JobConfig, JobObjects
from echo2.journal import FsyncPolicy, Journal
from echo2.messages import (
    HEARTBEAT_TOPIC,
    INSTALLED_TOPIC,
    PROTOCOL_VERSION,
    AdmissionWindow,
    ExpireLease,
    Goodbye,
    GoodbyeSeen,
    Heartbeat,
    Hello,
    LearnerProgress,
    LearnerStats,
    LeaseClosed,
    LeaseQuery,
    LeaseRecord,
    LeaseRecords,
    ModelIdentity,
    PromptSourceStats,
    RunEnded,
    RunEndedSeen,
    SayHello,
    TaskLease,
    WeightsInstalled,
    Welcome,
    WorkGrant,
    WorkRequest,
)
from echo2.rundir import RunDir
from echo2.tasks.base import Prompt, load_job_task, prompt_stream
from echo2.transport import SocketOptions
from echo2.transport.endpoint import CONTROL_MAX_MESSAGE_BYTES, TELEMETRY_MAX_MESSAGE_BYTES
from echo2.transport.peers import Claimed, PeerTable, Refusal


class PromptSourceConfig(ActorConfig, frozen=True):
    lease_ttl_s: Annotated[float, Meta(gt=0)] = 60.0
    """Seconds a sampler has to deliver a scored group before the task is re-issued."""
    max_attempts: Annotated[int, Meta(ge=1)] = 5
    """Issues of one task before it is dropped (counted as ``attempts_exhausted``)."""
    max_inflight_groups: Annotated[int, Meta(ge=0)] = 0
    """Groups leased or stored but not yet trained; 0 = groups_per_step * min(S + 1, 2)."""
    expiry_check_s: Annotated[float, Meta(gt=0)] = 0.5
    """Seconds between two checks of lease deadlines (granularity of expiry)."""
    end_notice_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    """Most seconds spent telling samplers the run is over (``RunEnded``) as it stops."""
    max_tasks: Annotated[int, Meta(ge=0)] = 0
    """Stop after this many distinct tasks (0 = unlimited)."""
    max_credits_per_sampler: Annotated[int, Meta(ge=1, le=65536)] = 64
    """Most leases one sampler may hold and ask for at once (its credit plus its open
    leases); a ``WorkRequest`` beyond it is clamped and counted
    (``PromptSourceStats.credits_clamped``). An honest sampler stays within its own
    ``credits`` setting (plus the leases it answered that are not yet closed): keep this
    at twice the largest of those."""
    activation: ActivationPolicy = "all"
    """Which samplers get work: "all", "cost_aware" (greedy by price per rollout/s, with
    hysteresis) or "random" (the ablation). See ``echo2.capacity.scheduler``."""
    learner_price_per_hour: Annotated[float, Meta(ge=0)] = 0.0
    """Dollars per hour of the learner, for cost per step."""
    activation_interval_s: Annotated[float, Meta(gt=0)] = 1.0
    """Seconds between scheduler decisions."""
    activation_record_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds between state records (changes are recorded at once)."""
    heartbeat_timeout_s: Annotated[float, Meta(gt=0)] = 3.0
    """Seconds without a heartbeat after which a sampler is unavailable."""
    warmup_s: Annotated[float, Meta(ge=0)] = 10.0
    """Seconds after the first sampler appears during which all are active (measuring)."""
    mu_window_s: Annotated[float, Meta(gt=0)] = 20.0
    """Window of the per-sampler throughput measurement, seconds."""
    shortfall_window_s: Annotated[float, Meta(ge=0)] = 5.0
    """Seconds a shortfall must last before samplers are added."""
    surplus_window_s: Annotated[float, Meta(ge=0)] = 30.0
    """Seconds a surplus must last before one sampler is released."""
    surplus_margin: Annotated[float, Meta(ge=0)] = 0.1
    """A sampler is released only if the rest still give target * (1 + surplus_margin)."""
    gamma: Annotated[float, Meta(ge=1)] = 1.1
    """Headroom of the target over mu_min (>= 1; the paper's 1.1)."""
    t_train_s: Annotated[float, Meta(ge=0)] = 0.0
    """Declared seconds per learner update; 0 = measured from the learner's heartbeats."""
    t_bcast_s: float = -1.0
    """Declared broadcast seconds; < 0 = measured (publisher stat, else publication to install)."""
    activation_seed: Annotated[int, Meta(ge=0)] = 0
    """Seed of the random policy."""
    quarantine_rejections: Annotated[int, Meta(ge=1)] = 8
    """Admission rejections of one sampler's own groups (stale ones aside) within
    ``quarantine_window_s`` after which it gets no more leases."""
    quarantine_window_s: Annotated[float, Meta(gt=0)] = 60.0
    """Seconds over which a sampler's rejections are counted for quarantine."""
    quarantine_mismatch: Annotated[float, Meta(ge=0)] = 1.0
    """|mean sampler - learner log-prob| per token (nats) above which a step counts against
    a sampler (the learner's ``mismatch_by_sampler``); 0 = off. Honest staleness moves it
    by hundredths on the built-in model; another model or invented log-probs by more."""
    quarantine_mismatch_steps: Annotated[int, Meta(ge=1)] = 5
    """Consecutive learner steps over ``quarantine_mismatch`` after which it is quarantined."""
    journal: bool = True
    """Keep the lease journal that lets a restarted or resumed PromptSource continue its
    stream and leases (``echo2.actors.lease_journal``). Off: a restart starts the stream
    over and forgets its leases (for measurements only)."""
    journal_fsync: FsyncPolicy = "none"
    """When the lease journal reaches the disk: "none" (each record written before its lease
    is sent: survives a kill -9 of this process) or "always" (fsync per record: survives a
    host crash). See ``echo2.journal``."""
    journal_compact_records: Annotated[int, Meta(ge=1)] = 10000
    """Records after which the lease journal is compacted into a snapshot."""


_MAX_KNOWN_SAMPLERS = 4096
"""Sampler names journaled for a restart's recall (names are free to claim: bounded)."""
_RECALL_RETRY_S = 0.5
"""Seconds between two attempts to reach a sampler after a restart."""


@dataclass
class _Lease:
    lease_id: int
    prompt: Prompt
    attempt: int
    sampler: bytes
    deadline: float
    record: LeaseRecord
    issued: wal.Issued
    expiring: bool = False
    restored: bool = False
    """Issued by a previous incarnation of this PromptSource (restart), still open."""


class PromptSource(Actor):
    kind: ClassVar[str] = "prompt_source"
    Config = PromptSourceConfig
    ports: ClassVar[dict[str, Port]] = {
        "tasks": Port("router", bind=True, max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
        "completions": Port("pull", bind=True, max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
        "lease_control": Port("push", bind=False),
        "telemetry": Port(
            "sub", bind=True, channel="telemetry", on_full="drop", max_message_bytes=TELEMETRY_MAX_MESSAGE_BYTES
        ),
        "leases": Port("router", bind=True, max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
    }
    config: PromptSourceConfig

    def setup_state(self, job_objects: JobObjects | None = None) -> None:
        job = self.job
        self._task = load_job_task(job, job_objects)
        self._prompts = self._task.prompts(job.seed)
        self._retry: deque[tuple[Prompt, int]] = deque()  # (prompt, attempt) to re-issue first
        self._credits: dict[bytes, int] = {}
        self._ready_samplers: deque[bytes] = deque()
        self._leases: dict[int, _Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._incarnation = 0
        self._lease_ids: Iterator[int] = itertools.count(1)
        self._journal: Journal[wal.Record, wal.State] | None = None
        self._next_version = 0
        self._learner_incarnation = 0
        self._buffer_incarnation = 0
        self._journaled_incarnation = 0
        self._resumed_learner_after: int | None = None
        """On --resume: issue nothing until a learner incarnation newer than this reports."""
        self._known_samplers: dict[str, bytes] = {}  # name -> route it was welcomed on (journaled)
        self._installed: dict[bytes, int] = {}  # peer -> installed version it reported
        self._quarantined: set[str] = set()  # by name: a reconnection gets a new routing id
        self._mismatch_streak: dict[str, int] = {}  # sampler -> consecutive steps far off
        self._mismatch_version = -1
        self._rejections = RejectionTracker(self.config.quarantine_rejections, self.config.quarantine_window_s)
        self._stored = self._trained = self._dropped_after_store = 0
        self._issued_tasks = 0
        self.counters = dict.fromkeys(
            (
                "leases_issued",
                "leases_reissued",
                "leases_expired",
                "leases_stored",
                "closed_duplicate",
                "closed_late",
                "closed_dropped",
                "attempts_exhausted",
                "refused_peers",
                "leases_of_restarted_samplers",
                "leases_rejected",
                "quarantined_samplers",
                "leases_withheld_old_version",
                "leases_lost_in_transit",
                "work_states",
                "samplers_left",
                "leases_returned_on_leaving",
            ),
            0,
        )
        limit = self.config.max_inflight_groups
        self._max_inflight = limit or job.groups_per_step * min(job.staleness + 1, 2)
        self._wakeup = asyncio.Event()
        cfg = self.config
        self.scheduler = Scheduler(
            policy=cfg.activation,
            rollouts_per_step=job.groups_per_step * job.group_size,
            staleness=job.staleness,
            learner_price_per_hour=cfg.learner_price_per_hour,
            gamma=cfg.gamma,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            warmup_s=cfg.warmup_s,
            mu_window_s=cfg.mu_window_s,
            shortfall_window_s=cfg.shortfall_window_s,
            surplus_window_s=cfg.surplus_window_s,
            surplus_margin=cfg.surplus_margin,
            t_train_s=cfg.t_train_s,
            t_bcast_s=cfg.t_bcast_s,
            seed=cfg.activation_seed,
        )
        self._decision: SchedulerDecision | None = None
        self.dollars_spent = 0.0
        self._unwelcomed_dropped: dict[str, int] = {}
        self._asked_hello: dict[bytes, float] = {}  # route -> when it was last sent SayHello
        self._credits_clamped: dict[str, int] = {}  # by sampler name: bounded by the peer table
        self._fences = GrantFences()  # per connection: which leases each WorkGrant follows

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        self.setup_state(ctx.job_objects)
        self._prompt_codec: PromptCodec = await asyncio.to_thread(trusted_prompt_codec, self.job)
        self._lease_queries = ctx.open("leases")
        self._tasks_ep = ctx.open("tasks")
        # A refused name is retried after one heartbeat timeout: by then ZeroMQ has dropped
        # a connection that went silent, and the name is free (echo2.transport.peers).
        self._peers = PeerTable(
            self._tasks_ep, server_id=self.name, retry_after_s=SocketOptions().heartbeat_timeout_ms / 1000
        )
        self._model = await asyncio.to_thread(_job_model_identity, self.job)
        if self._model is None:
            ctx.log.warning("the job's model %r cannot be read here: samplers' models are not checked", self.job.model)
        self._completions = ctx.open("completions")
        self._control = ctx.open("lease_control")
        self._telemetry = ctx.open("telemetry", subscribe=[HEARTBEAT_TOPIC, INSTALLED_TOPIC])
        self._open_journal()

    # -- the lease journal (echo2.actors.lease_journal) -------------------------------

    def _open_journal(self) -> None:
        """Recover what a previous incarnation issued and settled, then journal from here."""
        if self.ctx.run_dir is None or not self.config.journal:
            return  # embedded without a run directory: nothing to survive a restart with
        journal, state, records = Journal[wal.Record, wal.State].resumed(
            RunDir(self.ctx.run_dir).checkpoints_dir,
            self.name,
            wal.Record,
            wal.State,
            fsync=self.config.journal_fsync,
            resume=self.ctx.resume,
            warn=self.ctx.log.warning,
            otherwise="starting the stream over",
        )
        self._journal = journal
        recovered = wal.recover(state, records)
        self._incarnation = recovered.incarnation + 1
        self._lease_ids = (wal.lease_id(self._incarnation, n) for n in itertools.count(1))
        journal.append(wal.Started(incarnation=self._incarnation))
        if state is None and not records:
            return
        self._journaled_incarnation = recovered.learner_incarnation
        # The stream is deterministic per seed: continue it where it stopped.
        self._prompts = prompt_stream(self._task, self.job.seed, start=recovered.issued_tasks)
        self._issued_tasks = recovered.issued_tasks
        self._stored, self._trained = recovered.stored, recovered.trained
        self._dropped_after_store = recovered.dropped_after_store
        self._next_version, self._learner_incarnation = recovered.next_version, recovered.learner_incarnation
        self._retry.extend((p.task.prompt(), p.attempt) for p in recovered.retry)
        self._known_samplers = dict(recovered.samplers)
        self._quarantined |= recovered.quarantined
        if self.ctx.resume:
            # Nothing is issued before the resumed learner says where it resumed: a lease
            # asking for a version of the learner's lost future would wait for ever.
            self._resumed_learner_after = recovered.learner_incarnation
        now = time.monotonic()
        # Restarted under a live run, the holder of an open lease may still deliver; else it
        # expires. Resumed, the holders are gone: each is offered to the Buffer for expiry
        # now, and the Buffer says whether its group was stored before the stop.
        deadline = now if self.ctx.resume else now + self.config.lease_ttl_s
        for issued in recovered.open.values():
            prompt = issued.task.prompt()
            record = self._lease_record(issued.lease_id, prompt, issued.attempt, issued.sampler)
            # The holder has not said Hello to this incarnation yet: its name is the journal's.
            record = msgspec.structs.replace(
                record, token=issued.token, sampler_id=issued.sampler_name or record.sampler_id
            )
            self._leases[issued.lease_id] = _Lease(
                lease_id=issued.lease_id,
                prompt=prompt,
                attempt=issued.attempt,
                sampler=issued.sampler,
                deadline=deadline,
                record=record,
                issued=issued,
                restored=True,
            )
            heapq.heappush(self._deadlines, (deadline, issued.lease_id))
        self.ctx.log.info(
            "incarnation %d recovered: %d tasks issued, %d leases open, %d to re-issue (journal: %d records, %d torn)",
            self._incarnation, self._issued_tasks, len(self._leases), len(self._retry), len(records), journal.torn_records,
        )  # fmt: skip

    def _journal_append(self, record: wal.Record) -> None:
        if self._journal is None:
            return
        self._journal.append(record)
        if self._journal.records_written % self.config.journal_compact_records == 0:
            self._compact_journal()

    def _compact_journal(self) -> None:
        if self._journal is None:
            return
        self._journal.compact(
            wal.State(
                incarnation=self._incarnation,
                issued_tasks=self._issued_tasks,
                stored=self._stored,
                trained=self._trained,
                dropped_after_store=self._dropped_after_store,
                retry=[wal.Pending(wal.Task.of(p), a) for p, a in self._retry],
                open=[lease.issued for lease in self._leases.values()],
                next_version=self._next_version,
                learner_incarnation=self._learner_incarnation,
                samplers=dict(self._known_samplers),
                quarantined=sorted(self._quarantined),
            )
        )

    async def aclose(self) -> None:
        if hasattr(self, "_leases"):
            # What the run stopped in the middle of is unfinished, not lost (the audit checks
            # every leased task reaches an end); a --resume takes it up again.
            for lease in self._leases.values():
                self.ctx.ledger(
                    ledger.Outstanding(task=lease.prompt.task_id, lease=lease.lease_id, attempt=lease.attempt)
                )
            for prompt, attempt in self._retry:
                self.ctx.ledger(ledger.Outstanding(task=prompt.task_id, attempt=attempt))
        journal = getattr(self, "_journal", None)  # absent when setup failed before it
        if journal is not None:
            self._compact_journal()
            journal.close()

    def statistics(self) -> PromptSourceStats:
        return PromptSourceStats(
            **self.counters,
            open_leases=len(self._leases),
            inflight=self._inflight(),
            active_samplers=len(self._decision.active) if self._decision else 0,
            dollars_spent=self.dollars_spent,
            refused=dict(self._peers.refused),
            unwelcomed_dropped=dict(self._unwelcomed_dropped),
            credits_clamped=dict(self._credits_clamped),
        )

    def _inflight(self) -> int:
        return len(self._leases) + self._stored - self._trained - self._dropped_after_store

    # -- loops -----------------------------------------------------------------------

    async def run(self) -> None:
        await run_until_stopped(
            self.ctx.stopping,
            self._serve_samplers(),
            self._serve_completions(),
            self._expire_leases(),
            self._issue(),
            self._serve_telemetry(),
            self._schedule(),
            self._serve_lease_queries(),
            self._recall_samplers(),
        )
        self.ctx.record("activation_summary", **self._cost_values())
        await self._announce_end()

    async def _announce_end(self) -> None:
        """Tell every welcomed sampler that the run is over (``RunEnded``): samplers on other
        hosts stop, and so do their launchers."""
        ended = RunEnded(server_id=self.name, reason="the trusted side stopped the run")
        # Until each acknowledges (RunEndedSeen), re-sent every half second: over a lossy
        # path a last message can be lost when this process exits, and reading what the
        # samplers still send keeps the kernel from resetting the connections at close.
        unacknowledged = set(self._peers.routes())
        try:
            async with asyncio.timeout(self.config.end_notice_timeout_s):  # a gone peer must not hold the drain
                while unacknowledged:
                    for route in unacknowledged:
                        await self._tasks_ep.send(route, ended)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.5):
                            while unacknowledged:
                                for peer, message in await self._tasks_ep.recv_many():
                                    if isinstance(message, RunEndedSeen):
                                        unacknowledged.discard(peer)
                                    elif isinstance(message, Goodbye):  # leaving as the run ends
                                        await self._tasks_ep.send(peer, ended)
        except TimeoutError:
            self.ctx.log.warning(
                "%d sampler(s) did not acknowledge the end of the run within %g s",
                len(unacknowledged),
                self.config.end_notice_timeout_s,
            )

    # -- activation ------------------------------------------------------------------

    def _cost_values(self) -> dict[str, object]:
        steps = self._next_version
        return {
            "unix_s": round(time.time(), 3),
            "steps": steps,
            "dollars_total": round(self.dollars_spent, 6),
            "dollars_per_step": round(self.dollars_spent / steps, 6) if steps else None,
        }

    async def _serve_telemetry(self) -> None:
        while True:
            for message in await self._telemetry.recv_many():
                if isinstance(message, Heartbeat):
                    self.scheduler.observe_heartbeat(time.monotonic(), message.actor_stats)
                    for stats in message.actor_stats.values():
                        if isinstance(stats, LearnerStats):
                            self.observe_mismatch(stats.version, stats.mismatch_by_sampler)
                elif isinstance(message, WeightsInstalled):
                    self.scheduler.observe_install(message.sampler_id, message.version, message.time_s)

    async def _schedule(self) -> None:
        interval = self.config.activation_interval_s
        last_s = time.monotonic()
        last_record_s = -float("inf")
        while True:
            await asyncio.sleep(interval)  # a timer: decisions are periodic
            now = time.monotonic()
            decision = self.scheduler.decide(now)
            if self._decision is not None and self._next_version > 0:
                self.dollars_spent += self._decision.cost_per_hour * (now - last_s) / 3600.0
            last_s = now
            self._decision = decision
            if decision.changed or now - last_record_s >= self.config.activation_record_s:
                last_record_s = now
                self.ctx.record("activation", changed=decision.changed, **decision.record(), **self._cost_values())
                if decision.changed:
                    self.ctx.log.info(
                        "activation (%s): %d active, +%s -%s: %s",
                        decision.policy,
                        len(decision.active),
                        list(decision.activated),
                        list(decision.parked),
                        decision.reason,
                    )
            if decision.activated:
                self._wakeup.set()

    async def _serve_samplers(self) -> None:
        while True:
            for peer, message in await self._tasks_ep.recv_many():
                if isinstance(message, Hello):
                    await self._greet(peer, message)
                elif isinstance(message, Goodbye):
                    await self._farewell(peer, message)
                elif self._peers.name_of(peer) is None:
                    # Not welcomed (never said Hello, refused, or replaced by its restart):
                    # nothing it sends is served.
                    kind = type(message).__name__
                    self._unwelcomed_dropped[kind] = self._unwelcomed_dropped.get(kind, 0) + 1
                    await self._ask_hello(peer)
                elif isinstance(message, WorkRequest):
                    self._installed[peer] = message.installed_version
                    if message.states_work:
                        await self._reconcile(peer, message)
                    else:
                        self._add_credits(peer, message.credits)
                    self._wakeup.set()

    def _count_clamped(self, peer: bytes) -> None:
        name = self._sampler_name(peer)
        self._credits_clamped[name] = self._credits_clamped.get(name, 0) + 1

    def _add_credits(self, peer: bytes, credits: int) -> None:
        """The older form of ``WorkRequest``: ``credits`` more, adding up. Clamped: a peer
        asking for 10^6 leases would get every task the window admits, starving the other
        samplers until those leases expire."""
        held = sum(1 for lease in self._leases.values() if lease.sampler == peer)
        allowed = max(0, self.config.max_credits_per_sampler - held)
        wanted = self._credits.get(peer, 0) + max(0, credits)
        if wanted > allowed:
            self._count_clamped(peer)
            wanted = allowed
        self._credits[peer] = wanted

    async def _reconcile(self, peer: bytes, state: WorkRequest) -> None:
        """A work state (``echo2.actors.work_state``): set the connection's credit from what
        it can hold and holds, re-issue at once the leases it never received, and answer
        with the ``WorkGrant`` that fences the leases sent so far."""
        self.counters["work_states"] += 1
        mine = [lease for lease in self._leases.values() if lease.sampler == peer]
        fence = self._fences.fence_of(peer, state.acked) if state.acked else None
        judged = reconcile(
            state,
            (lease.lease_id for lease in mine if not lease.expiring),
            fence,
            self.config.max_credits_per_sampler,
        )
        if judged.clamped:
            self._count_clamped(peer)
        if judged.lost:
            # Sent before a grant that arrived, yet never received: lost with a torn
            # connection. Through the Buffer, like any expiry: it may have been stored.
            now = time.monotonic()
            for lease_id in judged.lost:
                self._leases[lease_id].deadline = now
                heapq.heappush(self._deadlines, (now, lease_id))
            self.counters["leases_lost_in_transit"] += len(judged.lost)
            self.ctx.log.info(
                "sampler %s never received %d lease(s) (a torn connection); re-issuing them",
                self._sampler_name(peer),
                len(judged.lost),
            )
        self._credits[peer] = judged.credits
        self._fences.granted(peer, state.sync, (lease.lease_id for lease in mine if lease.restored))
        grant = WorkGrant(
            server_id=self.name,
            sync=state.sync,
            credits=judged.credits,
            pending=judged.pending,
            reissued=len(judged.lost),
        )
        await self._tasks_ep.send(peer, grant)

    async def _farewell(self, peer: bytes, goodbye: Goodbye) -> None:
        """A sampler leaves: expire what it holds now, forget it, and say so (``GoodbyeSeen``).
        A connection never welcomed holds nothing; it is answered all the same."""
        name = self._peers.name_of(peer)
        self._credits.pop(peer, None)
        self._installed.pop(peer, None)
        self._fences.forget(peer)
        now = time.monotonic()
        held = [lease for lease in self._leases.values() if lease.sampler == peer and not lease.expiring]
        for lease in held:
            lease.deadline = now
            heapq.heappush(self._deadlines, (now, lease.lease_id))
        if name is not None:
            self._peers.release(peer)
            self.scheduler.observe_left(name)
            self.counters["samplers_left"] += 1
            self.counters["leases_returned_on_leaving"] += len(held)
            self.ctx.log.info("sampler %s left (%s); re-issuing its %d leases", name, goodbye.reason, len(held))
        await self._tasks_ep.send(peer, GoodbyeSeen(server_id=self.name, leases_returned=len(held)))

    async def _greet(self, peer: bytes, hello: Hello) -> None:
        """Welcome a sampler under its name, or refuse it (``echo2.transport.peers``)."""
        if hello.protocol_version != PROTOCOL_VERSION:
            outcome: Claimed | Refusal = self._peers.refuse(
                "protocol_version",
                f"protocol {hello.protocol_version} not supported (this PromptSource speaks {PROTOCOL_VERSION})",
            )
        else:
            outcome = await self._peers.claim(peer, hello.peer_id)
        if isinstance(outcome, Refusal):
            self.counters["refused_peers"] += 1
            self._credits.pop(peer, None)  # a connection refused now keeps nothing it had
            self._fences.forget(peer)
            if self._peers.name_of(peer) is not None:
                self._peers.release(peer)
            self.ctx.log.warning("refused sampler %s (%r): %s", hello.peer_id, peer, outcome.message)
            welcome = Welcome(
                server_id=self.name,
                accepted=False,
                reason=outcome.message,
                refusal=outcome.reason,
                retry_after_s=outcome.retry_after_s,
            )
            await self._tasks_ep.send(peer, welcome)
            return
        self.scheduler.observe_hello(hello.peer_id)
        # A (re)connecting sampler starts with no credit, and whatever it held before a
        # restart (on this connection or the one it replaces) is gone: expire its leases now
        # instead of waiting for their deadlines.
        self._credits[peer] = 0
        self._journal_welcomed(hello.peer_id, peer)
        previous = {peer} if outcome.replaced is None else {peer, outcome.replaced}
        if outcome.replaced is not None:
            self._credits.pop(outcome.replaced, None)
            self._fences.forget(outcome.replaced)
        now = time.monotonic()
        # Except the leases a previous incarnation of this PromptSource sent on this very
        # connection: the sampler kept running through our restart and may deliver them.
        held = [
            lease
            for lease in self._leases.values()
            if lease.sampler in previous and not lease.expiring and not (lease.restored and lease.sampler == peer)
        ]
        for lease in held:
            lease.deadline = now
            heapq.heappush(self._deadlines, (now, lease.lease_id))
        if held:
            self.counters["leases_of_restarted_samplers"] += len(held)
            self.ctx.log.info("sampler %s reconnected; expiring its %d leases", hello.peer_id, len(held))
        await self._tasks_ep.send(peer, Welcome(server_id=self.name, accepted=True, model=self._model))

    def _journal_welcomed(self, name: str, route: bytes) -> None:
        if self._known_samplers.get(name) == route or len(self._known_samplers) >= _MAX_KNOWN_SAMPLERS:
            return
        self._known_samplers[name] = route
        self._journal_append(wal.Welcomed(name=name, route=route))

    async def _recall_samplers(self) -> None:
        """Restarted in a live run: ask each sampler welcomed before the restart to say Hello
        again. One that holds no lease may have nothing to send us, and the credits it
        granted were lost with our process. Its connection may take a few seconds to come
        back (a send to it fails until then); tried until ``lease_ttl_s`` has passed."""
        if self.ctx.resume:
            return  # a resumed run's samplers are new: they say Hello by themselves
        waiting = set(self._known_samplers.values())
        give_up = time.monotonic() + max(self.config.lease_ttl_s, 5.0)
        while waiting and time.monotonic() < give_up:
            for route in list(waiting):
                if self._peers.name_of(route) is not None or route in self._asked_hello:
                    waiting.discard(route)  # welcomed again, or asked on its own message
                elif await self._tasks_ep.send(route, SayHello(server_id=self.name)):
                    self._asked_hello[route] = time.monotonic()
                    waiting.discard(route)
            await asyncio.sleep(_RECALL_RETRY_S)  # a timer: the connection comes back by itself

    async def _ask_hello(self, peer: bytes) -> None:
        """Tell a connection we do not know to say Hello (a sampler that outlived our
        restart keeps sending WorkRequests we would otherwise drop for ever); once a
        second per connection, and the table of when is bounded."""
        now = time.monotonic()
        if now - self._asked_hello.get(peer, -math.inf) < 1.0:
            return
        if len(self._asked_hello) >= 4096:
            self._asked_hello.clear()
        self._asked_hello[peer] = now
        await self._tasks_ep.send(peer, SayHello(server_id=self.name))

    def _sampler_name(self, peer: bytes) -> str:
        """The name a welcomed connection holds (its routing id is per connection)."""
        name = self._peers.name_of(peer)
        return name if name is not None else peer.decode(errors="replace")

    async def _serve_completions(self) -> None:
        while True:
            for message in await self._completions.recv_many():
                if isinstance(message, LeaseClosed):
                    self._on_closed(message)
                elif isinstance(message, LearnerProgress):
                    self._on_progress(message)
            self._wakeup.set()

    def _on_progress(self, progress: LearnerProgress) -> None:
        if progress.buffer_incarnation < self._buffer_incarnation:
            return  # a dead Buffer incarnation's
        self._buffer_incarnation = progress.buffer_incarnation
        if progress.incarnation > self._learner_incarnation:
            # A resumed learner restarts from a checkpoint: its next version may be lower
            # than the one its predecessor reached.
            self._learner_incarnation = progress.incarnation
            self._next_version = progress.next_version
        if self._resumed_learner_after is not None and progress.incarnation > self._resumed_learner_after:
            self._resumed_learner_after = None  # the resumed learner is known: issue again
        next_version = max(self._next_version, progress.next_version)
        # The Buffer's counters as they are (its journal keeps them across its restarts): a
        # learner resume puts the groups it trained after its checkpoint back in the store,
        # and groups_trained goes down by as many. Kept at their highest, the window would
        # count them out twice and issue that many tasks too many, for the rest of the run.
        window = (progress.groups_trained, progress.groups_dropped_after_store, next_version, self._learner_incarnation)
        if window != (self._trained, self._dropped_after_store, self._next_version, self._journaled_incarnation):
            self._journal_append(
                wal.Progress(
                    trained=progress.groups_trained,
                    dropped_after_store=progress.groups_dropped_after_store,
                    next_version=next_version,
                    learner_incarnation=self._learner_incarnation,
                )
            )
            self._journaled_incarnation = self._learner_incarnation
        self._trained, self._dropped_after_store = progress.groups_trained, progress.groups_dropped_after_store
        self._next_version = next_version
        self.scheduler.observe_delivered(progress.delivered_by_sampler)

    def _on_closed(self, closed: LeaseClosed) -> None:
        lease = self._leases.get(closed.lease_id)
        if closed.outcome == "late":
            self.counters["closed_late"] += 1
            return
        if lease is None:
            return  # already settled (e.g. a repeated answer to a repeated ExpireLease)
        del self._leases[closed.lease_id]
        requeue = closed.outcome in ("expired", "rejected") and lease.attempt + 1 < self.config.max_attempts
        self._journal_append(wal.Settled(lease_id=closed.lease_id, requeue=requeue, stored=closed.outcome == "stored"))
        self.ctx.ledger(
            ledger.LeaseClosed(task=closed.task_id, lease=closed.lease_id, outcome=closed.outcome, reason=closed.reason)
        )
        if closed.outcome == "stored":
            # Counted here, not from LearnerProgress, so that a stored group never leaves
            # the in-flight window before it is trained or dropped.
            self.counters["leases_stored"] += 1
            self._stored += 1
        elif closed.outcome == "expired":
            self.counters["leases_expired"] += 1
            if lease.attempt + 1 < self.config.max_attempts:
                self._retry.append((lease.prompt, lease.attempt + 1))
            else:
                self.counters["attempts_exhausted"] += 1
                self.ctx.ledger(ledger.TaskAbandoned(task=lease.prompt.task_id, attempts=lease.attempt + 1))
        elif closed.outcome == "duplicate":
            self.counters["closed_duplicate"] += 1
        elif closed.outcome == "dropped":
            self.counters["closed_dropped"] += 1
        elif closed.outcome == "rejected":
            self._on_rejected(lease, closed.reason)

    def _on_rejected(self, lease: _Lease, reason: str) -> None:
        """The holder's group failed admission: re-issue the task now, and count the
        rejection toward quarantining the holder."""
        self.counters["leases_rejected"] += 1
        if lease.attempt + 1 < self.config.max_attempts:
            self._retry.append((lease.prompt, lease.attempt + 1))
        else:
            self.counters["attempts_exhausted"] += 1
            self.ctx.ledger(ledger.TaskAbandoned(task=lease.prompt.task_id, attempts=lease.attempt + 1))
        name = self._sampler_name(lease.sampler)
        if reason in QUARANTINE_EXEMPT or name in self._quarantined:
            return
        if self._rejections.add(name):
            limits = f"{self.config.quarantine_rejections} rejected groups in {self.config.quarantine_window_s:g} s"
            self.quarantine(name, f"{limits} (last: {reason})")

    def observe_mismatch(self, version: int, mismatch_by_sampler: dict[str, float]) -> None:
        """The learner's last step's per-sampler log-prob mismatch (once per step: heartbeats
        repeat it); quarantine a sampler over the threshold ``quarantine_mismatch_steps``
        steps in a row."""
        threshold = self.config.quarantine_mismatch
        if not threshold or version <= self._mismatch_version:
            return
        self._mismatch_version = version
        for sampler, mismatch in mismatch_by_sampler.items():
            far = not math.isfinite(mismatch) or abs(mismatch) > threshold
            streak = self._mismatch_streak[sampler] = self._mismatch_streak.get(sampler, 0) + 1 if far else 0
            if streak >= self.config.quarantine_mismatch_steps:
                steps = self.config.quarantine_mismatch_steps
                self.quarantine(
                    sampler,
                    f"log-prob mismatch {mismatch:+.3f} nats/token beyond {threshold:g} for {steps} steps",
                )

    def quarantine(self, name: str, reason: str) -> None:
        """Give the sampler ``name`` no more leases, on any connection, and expire the ones
        it holds now so that their tasks are re-issued to someone else."""
        if name in self._quarantined:
            return
        self._quarantined.add(name)
        self._journal_append(wal.Quarantined(name=name))
        self.counters["quarantined_samplers"] += 1
        self.ctx.log.warning("quarantined sampler %s: %s", name, reason)
        self.ctx.ledger(ledger.Quarantined(sampler=name, reason=reason))
        now = time.monotonic()
        for held in self._leases.values():
            if self._sampler_name(held.sampler) == name and not held.expiring:
                held.deadline = now
                heapq.heappush(self._deadlines, (now, held.lease_id))

    # -- lease records (admission) ---------------------------------------------------

    def admission_window(self) -> AdmissionWindow:
        return AdmissionWindow(
            incarnation=self._learner_incarnation,
            newest=self._next_version,
            oldest=self._next_version - self.job.staleness,
            vocab_size=self._prompt_codec.vocab_size,
        )

    async def _serve_lease_queries(self) -> None:
        while True:
            for peer, message in await self._lease_queries.recv_many():
                if not isinstance(message, LeaseQuery):
                    continue
                records = [lease.record for i in message.lease_ids if (lease := self._leases.get(i)) is not None]
                reply = LeaseRecords(request_id=message.request_id, records=records, window=self.admission_window())
                await self._lease_queries.send(peer, reply)

    def _lease_record(self, lease_id: int, prompt: Prompt, attempt: int, peer: bytes) -> LeaseRecord:
        try:
            prompt_ids = self._prompt_codec.encode(prompt.text)
        except (ValueError, KeyError) as exc:
            # Every sampler's engine would fail the same way; the group is refused as a
            # prompt mismatch instead of the PromptSource failing.
            self.ctx.log.warning("task %s: the trusted tokenizer cannot encode its prompt: %s", prompt.task_id, exc)
            prompt_ids = []
        return LeaseRecord(
            lease_id=lease_id,
            task_id=prompt.task_id,
            attempt=attempt,
            sampler_id=self._sampler_name(peer),
            token=secrets.token_bytes(16),
            group_size=self.job.group_size,
            max_new_tokens=self.job.max_new_tokens,
            prompt=prompt.text,
            answer=prompt.answer,
            meta=msgspec.to_builtins(prompt.meta, enc_hook=str),  # plain values travel; others as text
            prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
            episode_seed=episode_seed(self.job.seed, prompt.task_id) if self.job.multi_turn else 0,
        )

    def _may_lease_to(self, peer: bytes) -> bool:
        """Active, not quarantined, and with weights whose work could still be trained."""
        name = self._sampler_name(peer)
        if name in self._quarantined or not self.scheduler.is_active(name):
            return False
        if self._installed.get(peer, -1) < self._next_version - self.job.staleness:
            self.counters["leases_withheld_old_version"] += 1
            return False
        return True

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.expiry_check_s)  # a timer, not a synchronisation
            now = time.monotonic()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                lease.expiring = True
                await self._control.send(
                    ExpireLease(lease_id=lease_id, task_id=lease.prompt.task_id, attempt=lease.attempt)
                )
                # Ask again later if the Buffer does not answer (it may be restarting).
                heapq.heappush(self._deadlines, (now + self.config.lease_ttl_s, lease_id))

    def _min_version(self) -> int:
        """Oldest policy whose work will still be admissible when the learner reaches it.

        Batches are served oldest first, so work issued now is trained after everything
        already stored or leased: about ``ahead`` batches after the learner's next version.
        """
        ahead = (len(self._leases) + self._stored - self._trained - self._dropped_after_store) // max(
            1, self.job.groups_per_step
        )
        return max(0, self._next_version + ahead - self.job.staleness)

    def _next_prompt(self) -> tuple[Prompt, int, bool] | None:
        """The next task to lease, its attempt, and whether it is new from the stream."""
        if self._retry:
            return (*self._retry.popleft(), False)
        if self.config.max_tasks and self._issued_tasks >= self.config.max_tasks:
            return None
        prompt = next(self._prompts, None)
        if prompt is None:  # a finite task (a dataset's last epoch) has issued everything
            return None
        self._issued_tasks += 1
        return prompt, 0, True

    async def _issue(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            # Round-robin, one lease per sampler per turn: the window is shared out among
            # the samplers that have credit, so one asking for many (up to
            # max_credits_per_sampler) cannot take every task the window admits.
            if self._resumed_learner_after is not None:
                continue  # resumed: the learner's version is not known yet
            waiting = deque(peer for peer, credit in self._credits.items() if credit > 0 and self._may_lease_to(peer))
            while waiting and self._inflight() < self._max_inflight:
                peer = waiting.popleft()
                if self._credits.get(peer, 0) <= 0:  # a work state or Hello meanwhile took it
                    continue
                outcome = await self._lease_one(peer)
                if outcome == "no_task":
                    break
                if outcome == "leased" and self._credits.get(peer, 0) > 0:
                    waiting.append(peer)

    async def _lease_one(self, peer: bytes) -> Literal["leased", "no_task", "gone"]:
        """Issue one task to ``peer`` out of its credit (parked, quarantined or too-old
        samplers were filtered out by the caller and keep their credit)."""
        item = self._next_prompt()
        if item is None:
            return "no_task"
        job = self.job
        prompt, attempt, fresh = item
        lease_id = next(self._lease_ids)
        record = self._lease_record(lease_id, prompt, attempt, peer)
        issued = wal.Issued(
            lease_id=lease_id,
            task=wal.Task.of(prompt),
            attempt=attempt,
            sampler=peer,
            token=record.token,
            fresh=fresh,
            sampler_name=record.sampler_id,
        )
        lease = _Lease(
            lease_id=lease_id,
            prompt=prompt,
            attempt=attempt,
            sampler=peer,
            deadline=time.monotonic() + self.config.lease_ttl_s,
            record=record,
            issued=issued,
        )
        message = TaskLease(
            lease_id=lease.lease_id,
            task_id=prompt.task_id,
            attempt=attempt,
            prompt=prompt.text,
            group_size=job.group_size,
            ttl_s=self.config.lease_ttl_s,
            temperature=job.temperature,
            top_p=job.top_p,
            max_new_tokens=job.max_new_tokens,
            min_version=self._min_version(),
            token=lease.record.token,
            episode_seed=record.episode_seed,
            episode_meta=lease_meta(record, job.episode.lease_fields),
        )
        # In the ledger, then open (and journaled), before it is sent: its group may be looked
        # up as soon as it is, and a kill -9 after the send leaves no lease the ledger lacks.
        self.ctx.ledger(
            ledger.Leased(task=prompt.task_id, lease=lease.lease_id, attempt=attempt, sampler=self._sampler_name(peer))
        )
        self._journal_append(issued)
        self._leases[lease.lease_id] = lease
        # Its credit is used before the send, which may wait: a work state judged meanwhile
        # counts this lease as on its way, and must not see the credit it took as well.
        if peer in self._credits:
            self._credits[peer] -= 1
        if not await self._tasks_ep.send(peer, message):
            # The sampler is gone (or its link is down): put the task back; its credit
            # comes back with its next work state.
            del self._leases[lease.lease_id]
            self._journal_append(wal.Settled(lease_id=lease_id, requeue=True, front=True))
            self.ctx.ledger(ledger.LeaseClosed(task=prompt.task_id, lease=lease_id, outcome="expired", reason="unsent"))
            self._retry.appendleft((prompt, attempt))
            if peer in self._credits:
                self._credits[peer] = 0
            return "gone"
        self._fences.lease_sent(peer, lease_id)
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        self.counters["leases_issued"] += 1
        if attempt:
            self.counters["leases_reissued"] += 1
        return "leased"


def _job_model_identity(job: JobConfig) -> ModelIdentity | None:
    """What every sampler must serve: the identity of the job's model (None when the model
    cannot be read here, e.g. a Hugging Face model without the ``hf`` extra: not checked)."""
    try:
        from echo2.models.identity import model_identity
    except ImportError:
        return None
    try:
        return model_identity(job.model, job.prompt_format)
    except (ImportError, OSError, ValueError):
        return None
