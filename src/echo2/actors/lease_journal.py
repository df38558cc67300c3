"""The PromptSource's write-ahead records: issued and settled leases, and where the prompt
stream stands, so that a PromptSource killed with SIGKILL and restarted continues the run.

Records go through ``echo2.journal`` (msgpack, one ``os.write`` each, before the lease or
its settlement has any effect outside the process). ``recover`` folds a snapshot and the
records after it back into the state the PromptSource runs from; ``snapshot`` is the
inverse, written at compaction.

Lease ids carry the incarnation of the PromptSource that issued them
(``lease_id(incarnation, n)``): a restarted PromptSource never reuses an id, and a result
of a previous incarnation's lease is told apart (``lease_incarnation``). What happens to a
previous incarnation's open leases depends on why this one started:

- restarted in a live run (the samplers kept running): each stays open with a fresh
  deadline; a result for it is accepted as usual if it still can be (the Buffer's
  dedup by task makes sure it is trained at most once), and if none comes it expires and
  the task is re-issued;
- ``--resume`` of a stopped run (the samplers are new): each is offered to the Buffer for
  expiry at once; the Buffer, whose own journal survived too, answers ``stored`` (its
  group landed before the stop: nothing to do) or ``expired`` (re-issued with
  ``attempt + 1``), so no task issued but never trained is dropped or trained twice.

Welcomed samplers are journaled by name (``Welcomed``): a PromptSource restarted in a live
run asks each to say Hello again, including samplers that hold no lease and owe nothing,
whose credits would otherwise be lost with the process.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from echo2.tasks.base import Prompt

INCARNATION_SHIFT = 40
"""Low bits of a lease id count leases within one incarnation (10^12 per incarnation)."""


def lease_id(incarnation: int, n: int) -> int:
    """The id of the ``n``-th lease (from 1) that incarnation ``incarnation`` issues."""
    return (incarnation << INCARNATION_SHIFT) | n


def lease_incarnation(lease: int) -> int:
    """The PromptSource incarnation that issued lease id ``lease``."""
    return lease >> INCARNATION_SHIFT


class Task(msgspec.Struct, frozen=True):
    """A prompt as the journal keeps it (meta as plain values)."""

    task_id: str
    text: str
    answer: str
    meta: dict[str, Any] = {}

    @classmethod
    def of(cls, prompt: Prompt) -> Task:
        meta = msgspec.to_builtins(prompt.meta, enc_hook=str)  # plain values; others as text
        return cls(task_id=prompt.task_id, text=prompt.text, answer=prompt.answer, meta=meta)

    def prompt(self) -> Prompt:
        return Prompt(task_id=self.task_id, text=self.text, answer=self.answer, meta=dict(self.meta))


class Started(msgspec.Struct, frozen=True, tag="started"):
    """A PromptSource incarnation began."""

    incarnation: int


class Issued(msgspec.Struct, frozen=True, tag="issued"):
    """A lease about to be sent. ``fresh``: its task is new from the prompt stream (else a
    re-issue taken from the retry queue)."""

    lease_id: int
    task: Task
    attempt: int
    sampler: bytes
    """The routing id of the connection it was sent to."""
    token: bytes
    fresh: bool
    sampler_name: str = ""
    """The name that connection was welcomed under (what the holder's groups claim)."""


class Settled(msgspec.Struct, frozen=True, tag="settled"):
    """A lease closed: ``requeue`` says whether its task went back to the retry queue
    (``front``: ahead of the rest, a lease whose send failed)."""

    lease_id: int
    requeue: bool = False
    front: bool = False
    stored: bool = False


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """The Buffer's counters the in-flight window is computed from, and where the learner
    stands (the admission window a restarted PromptSource answers Rewarders with)."""

    trained: int
    dropped_after_store: int
    next_version: int = 0
    learner_incarnation: int = 0


class Welcomed(msgspec.Struct, frozen=True, tag="welcomed"):
    """A sampler was welcomed on connection ``route``: a restarted PromptSource asks it to
    say Hello again even if it has nothing to send."""

    name: str
    route: bytes


class Quarantined(msgspec.Struct, frozen=True, tag="quarantined"):
    """A sampler gets no more leases; a restart does not forgive it."""

    name: str


Record = Started | Issued | Settled | Progress | Welcomed | Quarantined


class Pending(msgspec.Struct, frozen=True):
    task: Task
    attempt: int


class State(msgspec.Struct, frozen=True):
    """A snapshot: everything ``recover`` rebuilds."""

    incarnation: int = 0
    issued_tasks: int = 0
    stored: int = 0
    trained: int = 0
    dropped_after_store: int = 0
    retry: list[Pending] = []
    open: list[Issued] = []
    next_version: int = 0
    learner_incarnation: int = 0
    samplers: dict[str, bytes] = {}
    quarantined: list[str] = []


@dataclass
class Recovered:
    incarnation: int = 0
    issued_tasks: int = 0
    stored: int = 0
    trained: int = 0
    dropped_after_store: int = 0
    retry: deque[Pending] = field(default_factory=deque)
    open: dict[int, Issued] = field(default_factory=dict)
    next_version: int = 0
    learner_incarnation: int = 0
    samplers: dict[str, bytes] = field(default_factory=dict)
    """Sampler name -> the route it was last welcomed on."""
    quarantined: set[str] = field(default_factory=set)


def recover(state: State | None, records: list[Record]) -> Recovered:
    """The state after ``records``, applied in order to ``state``."""
    s = state or State()
    out = Recovered(
        incarnation=s.incarnation,
        issued_tasks=s.issued_tasks,
        stored=s.stored,
        trained=s.trained,
        dropped_after_store=s.dropped_after_store,
        retry=deque(s.retry),
        open={r.lease_id: r for r in s.open},
        next_version=s.next_version,
        learner_incarnation=s.learner_incarnation,
        samplers=dict(s.samplers),
        quarantined=set(s.quarantined),
    )
    for record in records:
        match record:
            case Started(incarnation=incarnation):
                out.incarnation = max(out.incarnation, incarnation)
            case Issued():
                out.open[record.lease_id] = record
                if record.fresh:
                    out.issued_tasks += 1
                else:
                    _take_retry(out.retry, record.task.task_id, record.attempt)
            case Settled():
                issued = out.open.pop(record.lease_id, None)
                if issued is None:
                    continue
                out.stored += record.stored
                if record.requeue:
                    # A failed send puts the same attempt back in front; a settled lease's
                    # task comes back as its next attempt.
                    pending = Pending(issued.task, issued.attempt if record.front else issued.attempt + 1)
                    if record.front:
                        out.retry.appendleft(pending)
                    else:
                        out.retry.append(pending)
            case Progress():
                # The Buffer's counters as they are (a learner resume lowers groups_trained).
                out.trained, out.dropped_after_store = record.trained, record.dropped_after_store
                out.next_version, out.learner_incarnation = record.next_version, record.learner_incarnation
            case Welcomed(name=name, route=route):
                out.samplers[name] = route
            case Quarantined(name=name):
                out.quarantined.add(name)
    return out


def _take_retry(retry: deque[Pending], task_id: str, attempt: int) -> None:
    for i, pending in enumerate(retry):
        if pending.task.task_id == task_id and pending.attempt == attempt:
            del retry[i]
            return


def snapshot(r: Recovered) -> State:
    return State(
        incarnation=r.incarnation,
        issued_tasks=r.issued_tasks,
        stored=r.stored,
        trained=r.trained,
        dropped_after_store=r.dropped_after_store,
        retry=list(r.retry),
        open=list(r.open.values()),
        next_version=r.next_version,
        learner_incarnation=r.learner_incarnation,
        samplers=dict(r.samplers),
        quarantined=sorted(r.quarantined),
    )
