"""The Buffer's write-ahead records and the book they keep: what a Buffer killed with SIGKILL
and restarted (or resumed) continues from.

Event-sourced: every change of the Buffer's state is one record below. The Buffer writes
it to its journal (``echo2.journal``) *before* the change has an effect outside the process
(a ``LeaseClosed`` or a ``Batch`` sent), then applies it to its ``BufferBook``; a restarted
Buffer replays the snapshot and the records after it through the very same ``apply``. The
ledger events the audit reads are derived from the records too (``apply`` returns them),
so the ledger says what the journal says: a Buffer killed between writing a record and
its ledger lines writes the missing lines when it recovers (``missing_events``).

What is kept: the groups stored and not yet handed to the learner, the groups handed since
the checkpoint a learner resume would fall back to (a resumed learner trains them again),
every task id stored or settled (a task is trained at most once), how each lease was
settled (a lease is decided once: a group arriving after its expiry is late), the learner's
incarnation and version, and the counters the PromptSource paces issuance with
(``groups_trained``, ``groups_dropped_after_store``: exact across a restart).

Groups travel in records as one codec frame (``Codec``, every array inline): the wire
format, no pickle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from echo2 import ledger
from echo2.messages import LeaseOutcome, RejectReason, ScoredGroup
from echo2.transport.codec import Codec

_ALL_INLINE = 1 << 62
"""A codec whose arrays all ride in the header: a group is one bytes frame."""


class GroupCodec:
    """A ``ScoredGroup`` as one frame of bytes and back (the wire codec, arrays inline)."""

    def __init__(self) -> None:
        self._codec = Codec(ScoredGroup, inline_limit=_ALL_INLINE, max_header_bytes=_ALL_INLINE)

    def encode(self, group: ScoredGroup) -> bytes:
        [frame] = self._codec.encode(group)
        return bytes(frame)

    def decode(self, frame: bytes) -> ScoredGroup:
        return self._codec.decode([frame])


# -- records ---------------------------------------------------------------------------


class Started(msgspec.Struct, frozen=True, tag="started"):
    """A Buffer incarnation began (its number orders it after every earlier one)."""

    incarnation: int


class Stored(msgspec.Struct, frozen=True, tag="stored"):
    """A group was accepted into the store (``group``: ``GroupCodec`` frame)."""

    group: bytes


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """A group arrived and was not stored: ``outcome`` late, duplicate or dropped (``reason``).
    ``seen``: its task is settled by it (a drop), so a later group of the task is a duplicate."""

    task: str
    lease: int
    attempt: int
    version: int
    sampler: str
    outcome: LeaseOutcome
    reason: str = ""
    seen: bool = False
    item_errors: dict[str, int] = {}


class AdmissionRejected(msgspec.Struct, frozen=True, tag="admission_rejected"):
    """The Rewarder refused a group (``GroupRejected``); ``settles``: it was the open
    lease's holder's, and the lease is closed as ``rejected`` by it."""

    task: str
    lease: int
    attempt: int
    version: int
    sampler: str
    """As counted: a forgery's claimed name beyond the first 64 is ``(other)``."""
    reason: RejectReason
    holder: bool
    settles: bool


class Expired(msgspec.Struct, frozen=True, tag="expired"):
    """A lease's deadline passed with nothing stored: a group for it is now late."""

    lease: int
    task: str


class Handed(msgspec.Struct, frozen=True, tag="handed"):
    """The first ``len(tasks)`` stored groups went to the learner for ``request_version``
    (``peer``: the routing id of the connection that asked)."""

    request_version: int
    tasks: list[str]
    peer: bytes = b""


class Evicted(msgspec.Struct, frozen=True, tag="evicted"):
    """Stored groups dropped before training (``stale`` while waiting, ``overflow``)."""

    tasks: list[str]
    reason: ledger.DroppedReason


class Checkpointed(msgspec.Struct, frozen=True, tag="checkpointed"):
    """A resume starts at ``version`` or later: groups handed for earlier versions are durable."""

    version: int


class LearnerResumed(msgspec.Struct, frozen=True, tag="learner_resumed"):
    """A learner incarnation resumed at ``version``: what was handed for that version or
    later is in no model any more and goes back to the store, oldest first."""

    incarnation: int
    version: int


Record = Started | Stored | Refused | AdmissionRejected | Expired | Handed | Evicted | Checkpointed | LearnerResumed


# -- the snapshot ----------------------------------------------------------------------


class State(msgspec.Struct, frozen=True):
    """The book at a compaction (groups as ``GroupCodec`` frames)."""

    incarnation: int = 0
    learner_incarnation: int = 0
    resumed_from: int = 0
    learner_version: int = 0
    next_version: int = 0
    store: list[bytes] = []
    retained: list[tuple[int, bytes, bytes]] = []
    """(request version, peer, group)."""
    seen_tasks: list[str] = []
    stored_leases: list[int] = []
    expired_leases: list[int] = []
    settled: dict[int, tuple[LeaseOutcome, str]] = {}
    counters: dict[str, int] = {}
    dropped: dict[str, int] = {}
    reward_failures: dict[str, int] = {}
    rejected: dict[RejectReason, int] = {}
    rejected_by_sampler: dict[str, dict[RejectReason, int]] = {}
    delivered_by_sampler: dict[str, int] = {}


COUNTERS = ("groups_stored", "groups_trained", "groups_dropped_after_store", "batches_served")


class BufferBook:
    """The Buffer's state; changed only by ``apply``, live and in replay alike."""

    def __init__(self, *, max_retained: int) -> None:
        self.codec = GroupCodec()
        self.max_retained = max_retained
        """Most handed groups kept (without checkpoints nothing else bounds them)."""
        self.retained_overflow = 0
        """Handed groups let go before a checkpoint made them durable (a learner resume
        from that checkpoint cannot train them again)."""
        self.incarnation = 0
        """This Buffer's incarnation (one more per restart or resume)."""
        self.learner_incarnation = 0
        self.resumed_from = 0
        """The version the newest learner incarnation resumed at."""
        self.learner_version = 0
        """The newest version the learner asked a batch for."""
        self.next_version = 0
        """The learner's next version, as far as this Buffer knows (what it reports)."""
        self.store: deque[ScoredGroup] = deque()
        self.retained: deque[tuple[int, bytes, ScoredGroup]] = deque()
        """(request version, peer, group) handed since the checkpoint a resume would fall back to."""
        self.seen_tasks: set[str] = set()
        self.stored_leases: set[int] = set()
        self.expired_leases: set[int] = set()
        self.settled: dict[int, tuple[LeaseOutcome, str]] = {}
        """How leases whose group was not stored were settled (duplicate, dropped, rejected)."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.dropped: dict[str, int] = {}
        self.reward_failures: dict[str, int] = {}
        self.rejected: dict[RejectReason, int] = {}
        self.rejected_by_sampler: dict[str, dict[RejectReason, int]] = {}
        self.delivered_by_sampler: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------------

    def lease_outcome(self, lease: int) -> tuple[LeaseOutcome, str] | None:
        """How ``lease`` was settled, or None while it is open."""
        if lease in self.stored_leases:
            return "stored", ""
        if lease in self.settled:
            return self.settled[lease]
        if lease in self.expired_leases:
            return "expired", ""
        return None

    def handed_for(self, version: int, peer: bytes) -> list[ScoredGroup]:
        """The groups handed to ``peer`` for a request at ``version`` (the batch a repeated
        request gets)."""
        return [g for v, p, g in self.retained if v == version and p == peer]

    # -- changes ---------------------------------------------------------------------

    def apply(self, record: Record, group: ScoredGroup | None = None) -> list[ledger.LedgerEvent]:
        """Apply ``record`` (``group``: a ``Stored`` record's group, already decoded) and
        return the ledger events it makes."""
        match record:
            case Started(incarnation=incarnation):
                self.incarnation = max(self.incarnation, incarnation)
                return []
            case Stored():
                return self._stored(group if group is not None else self.codec.decode(record.group))
            case Refused():
                return self._refused(record)
            case AdmissionRejected():
                return self._admission_rejected(record)
            case Expired(lease=lease, task=task):
                self.expired_leases.add(lease)
                return [ledger.LeaseExpired(task=task, lease=lease)]
            case Handed(request_version=version, tasks=tasks, peer=peer):
                groups = self._take(tasks)
                self.retained.extend((version, peer, g) for g in groups)
                while len(self.retained) > self.max_retained:
                    self.retained.popleft()
                    self.retained_overflow += 1
                self.counters["groups_trained"] += len(groups)
                self.counters["batches_served"] += 1
                self.learner_version = max(self.learner_version, version)
                self.next_version = max(self.next_version, version + 1)
                return [
                    ledger.Handed(task=g.group.task_id, version=g.group.version, request_version=version)
                    for g in groups
                ]
            case Evicted(tasks=tasks, reason=reason):
                groups = self._take(tasks)
                self.dropped[reason] = self.dropped.get(reason, 0) + len(groups)
                self.counters["groups_dropped_after_store"] += len(groups)
                return [ledger.Dropped(task=g.group.task_id, reason=reason, version=g.group.version) for g in groups]
            case Checkpointed(version=version):
                while self.retained and self.retained[0][0] < version:
                    self.retained.popleft()
                return []
            case LearnerResumed(incarnation=incarnation, version=version):
                return self._learner_resumed(incarnation, version)
        raise TypeError(f"not a Buffer record: {record!r}")

    def _stored(self, scored: ScoredGroup) -> list[ledger.LedgerEvent]:
        g = scored.group
        self._count_item_errors(scored.item_errors)
        self.store.append(scored)
        self.seen_tasks.add(g.task_id)
        self.stored_leases.add(g.lease_id)
        self.counters["groups_stored"] += 1
        self.delivered_by_sampler[g.sampler_id] = self.delivered_by_sampler.get(g.sampler_id, 0) + g.group_size
        return [ledger.Accepted(task=g.task_id, lease=g.lease_id, version=g.version, sampler=g.sampler_id)]

    def _refused(self, r: Refused) -> list[ledger.LedgerEvent]:
        self._count_item_errors(r.item_errors)
        reason = r.reason or r.outcome
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if r.seen:
            self.seen_tasks.add(r.task)
        if r.outcome != "late":  # a late group's lease was settled by its expiry
            self.settled[r.lease] = (r.outcome, r.reason)
        return [
            ledger.Rejected(
                task=r.task,
                lease=r.lease,
                version=r.version,
                outcome=r.outcome,
                reason=r.reason,
                sampler=r.sampler,
            )
        ]

    def _admission_rejected(self, r: AdmissionRejected) -> list[ledger.LedgerEvent]:
        self.rejected[r.reason] = self.rejected.get(r.reason, 0) + 1
        by_reason = self.rejected_by_sampler.setdefault(r.sampler, {})
        by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
        if r.settles:
            self.expired_leases.add(r.lease)  # another group for it is late
            self.settled[r.lease] = ("rejected", r.reason)
        return [
            ledger.Rejected(
                task=r.task,
                lease=r.lease,
                version=r.version,
                outcome="rejected",
                reason=r.reason,
                sampler=r.sampler,
                holder=r.holder,
            )
        ]

    def _learner_resumed(self, incarnation: int, version: int) -> list[ledger.LedgerEvent]:
        self.learner_incarnation, self.resumed_from = incarnation, version
        self.learner_version = self.next_version = version
        again = [g for v, _, g in self.retained if v >= version]
        self.retained = deque(r for r in self.retained if r[0] < version)
        self.store.extendleft(reversed(again))
        self.counters["groups_trained"] -= len(again)  # back in the store, not trained
        return [ledger.Requeued(task=g.group.task_id, version=g.group.version) for g in again]

    def _count_item_errors(self, item_errors: dict[str, int]) -> None:
        for reason, n in item_errors.items():
            self.reward_failures[reason] = self.reward_failures.get(reason, 0) + n

    def _take(self, tasks: list[str]) -> list[ScoredGroup]:
        """Remove the stored groups of ``tasks`` (in that order)."""
        n = len(tasks)
        if len(self.store) >= n and all(self.store[i].group.task_id == t for i, t in enumerate(tasks)):
            return [self.store.popleft() for _ in range(n)]  # the usual case: the oldest
        wanted = set(tasks)
        by_task = {g.group.task_id: g for g in self.store if g.group.task_id in wanted}
        self.store = deque(g for g in self.store if g.group.task_id not in wanted)
        return [by_task[t] for t in tasks if t in by_task]

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> State:
        encode = self.codec.encode
        return State(
            incarnation=self.incarnation,
            learner_incarnation=self.learner_incarnation,
            resumed_from=self.resumed_from,
            learner_version=self.learner_version,
            next_version=self.next_version,
            store=[encode(g) for g in self.store],
            retained=[(v, p, encode(g)) for v, p, g in self.retained],
            seen_tasks=sorted(self.seen_tasks),
            stored_leases=sorted(self.stored_leases),
            expired_leases=sorted(self.expired_leases),
            settled=dict(self.settled),
            counters=dict(self.counters),
            dropped=dict(self.dropped),
            reward_failures=dict(self.reward_failures),
            rejected=dict(self.rejected),
            rejected_by_sampler={s: dict(r) for s, r in self.rejected_by_sampler.items()},
            delivered_by_sampler=dict(self.delivered_by_sampler),
        )

    @classmethod
    def restore(cls, state: State | None, records: Iterable[Record], *, max_retained: int) -> Recovered:
        """The book after ``records`` applied to ``state``, and the ledger events of the last
        record (those a kill may have cut off)."""
        book = cls(max_retained=max_retained)
        if state is not None:
            book._load(state)
        last: list[ledger.LedgerEvent] = []
        for record in records:
            last = book.apply(record)
        return Recovered(book=book, last_events=last)

    def _load(self, s: State) -> None:
        decode = self.codec.decode
        self.incarnation, self.learner_incarnation = s.incarnation, s.learner_incarnation
        self.resumed_from, self.learner_version, self.next_version = s.resumed_from, s.learner_version, s.next_version
        self.store = deque(decode(frame) for frame in s.store)
        self.retained = deque((v, p, decode(frame)) for v, p, frame in s.retained)
        self.seen_tasks = set(s.seen_tasks)
        self.stored_leases, self.expired_leases = set(s.stored_leases), set(s.expired_leases)
        self.settled = dict(s.settled)
        self.counters.update(s.counters)
        self.dropped, self.reward_failures = dict(s.dropped), dict(s.reward_failures)
        self.rejected = dict(s.rejected)
        self.rejected_by_sampler = {k: dict(v) for k, v in s.rejected_by_sampler.items()}
        self.delivered_by_sampler = dict(s.delivered_by_sampler)


@dataclass
class Recovered:
    book: BufferBook
    last_events: list[ledger.LedgerEvent]


def missing_events(
    expected: Sequence[ledger.LedgerEvent], tail: Sequence[ledger.LedgerEvent]
) -> list[ledger.LedgerEvent]:
    """Of ``expected`` (the last record's events), those the ledger's ``tail`` lacks: none if
    they appear in it in order, else what follows the longest prefix of them at its end."""
    expected, tail = list(expected), list(tail)
    n = len(expected)
    if not n:
        return []
    for start in range(len(tail) - n, -1, -1):
        if tail[start : start + n] == expected:
            return []
    for k in range(min(n, len(tail)), 0, -1):
        if tail[-k:] == expected[:k]:
            return expected[k:]
    return expected
