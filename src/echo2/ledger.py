"""The accounting ledger's one vocabulary: every event an actor writes and the audit reads.

Each event is a record below, tagged with its name (``"ev"``); an actor writes one with
``ctx.ledger(ledger.Trained(...))`` and ``python -m echo2.audit`` decodes the same records,
so a misspelt event or field fails where it is written (a type error, or a ``TypeError``
at once), never as an event the audit silently does not count.

File format: one JSON object per line in ``run_dir/ledger/<actor>.jsonl``,
``{"t": unix seconds, "ev": name, field: value, ...}``. Line-buffered, so a process killed
with SIGKILL loses at most the line being written (the reader skips a cut line).

Who writes what, in the order a task's group meets them:

=================  ==============  ===========================================================
event              writer          meaning
=================  ==============  ===========================================================
``leased``         PromptSource    a task was leased to a sampler (``attempt`` counts issues)
``submitted``      Sampler         a rollout group was sent on for scoring
``accepted``       Buffer          the group was stored (decided once per task)
``rejected``       Buffer          the group was refused on arrival (``LeaseOutcome`` + reason;
                                   ``rejected``: failed admission, ``sampler`` names who)
``lease_expired``  Buffer          the lease's deadline passed with nothing stored
``lease_closed``   PromptSource    the lease was settled (the Buffer's outcome)
``task_abandoned`` PromptSource    a task expired ``max_attempts`` times and is given up
``outstanding``    PromptSource    the run stopped while the task was leased (``lease``) or
                                   queued for re-issue (``lease`` 0): not lost, unfinished
``handed``         Buffer          a stored group went to the learner in a batch
``requeued``       Buffer          a group handed to a crashed learner went back in the store
``trained``        Learner         a group was trained (after its step committed)
``dropped``        Buffer          a stored group was dropped (stale while waiting, overflow)
``unconsumed``     Buffer          a group was still stored when the run ended
``resumed``        Learner         a learner resumed from a checkpoint under a new incarnation
``quarantined``    PromptSource    a sampler gets no more leases (``reason``)
=================  ==============  ===========================================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from echo2.messages import LeaseOutcome
from echo2.rundir import RunDir, read_jsonl

DroppedReason = Literal["stale", "overflow"]
"""Why a group already stored was dropped: it became inadmissible (``stale``) while
waiting, or the store overflowed (``overflow``: the oldest is evicted)."""


def _event_name(class_name: str) -> str:
    """``LeaseExpired`` -> ``lease_expired``: an event's name is its record's class name."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()


class LedgerEvent(msgspec.Struct, tag_field="ev", tag=_event_name, frozen=True, kw_only=True, gc=False):
    """Base of ledger events (not itself written)."""


class Leased(LedgerEvent, frozen=True):
    task: str
    lease: int
    attempt: int
    sampler: str


class Submitted(LedgerEvent, frozen=True):
    task: str
    lease: int
    version: int


class Accepted(LedgerEvent, frozen=True):
    task: str
    lease: int
    version: int
    sampler: str


class Rejected(LedgerEvent, frozen=True):
    task: str
    lease: int
    version: int
    outcome: LeaseOutcome
    reason: str = ""
    """Why a ``dropped`` or ``rejected`` group was refused ("" for the other outcomes)."""
    sampler: str = ""
    """Who sent it: the lease holder when ``holder``, else the name the group claimed."""
    holder: bool = False
    """The group echoed its open lease's token (``sampler`` is then trustworthy)."""

    @property
    def label(self) -> str:
        """``outcome``, or ``dropped:<reason>``: how the audit counts rejections."""
        return f"{self.outcome}:{self.reason}" if self.reason else self.outcome


class LeaseExpired(LedgerEvent, frozen=True):
    task: str
    lease: int


class LeaseClosed(LedgerEvent, frozen=True):
    task: str
    lease: int
    outcome: LeaseOutcome
    reason: str = ""


class TaskAbandoned(LedgerEvent, frozen=True):
    task: str
    attempts: int


class Outstanding(LedgerEvent, frozen=True):
    task: str
    lease: int = 0
    """The open lease; 0 when the task waited in the re-issue queue."""
    attempt: int = 0


class Handed(LedgerEvent, frozen=True):
    task: str
    version: int
    request_version: int
    """The learner version of the batch request the group answered."""


class Requeued(LedgerEvent, frozen=True):
    task: str
    version: int


class Trained(LedgerEvent, frozen=True):
    task: str
    version: int
    """Policy version that generated the group."""
    learner_version: int
    """Learner version of the step that trained it."""
    incarnation: int
    """The learner's incarnation (a resumed learner voids its predecessor's later steps)."""
    sampler: str = ""
    """The sampler the group came from (so that the audit can name it)."""


class Dropped(LedgerEvent, frozen=True):
    task: str
    reason: DroppedReason
    version: int


class Unconsumed(LedgerEvent, frozen=True):
    task: str
    version: int


class Resumed(LedgerEvent, frozen=True):
    incarnation: int
    previous_incarnation: int
    from_version: int
    """Trainings of every earlier incarnation at learner versions >= this are void (the
    checkpoint resumed from holds none of them; ``previous_incarnation`` is the newest that ran)."""


class Quarantined(LedgerEvent, frozen=True):
    sampler: str
    reason: str


AnyLedgerEvent = (
    Leased
    | Submitted
    | Accepted
    | Rejected
    | LeaseExpired
    | LeaseClosed
    | TaskAbandoned
    | Outstanding
    | Handed
    | Requeued
    | Trained
    | Dropped
    | Unconsumed
    | Resumed
    | Quarantined
)
EVENT_TYPES: tuple[type[LedgerEvent], ...] = AnyLedgerEvent.__args__
EVENT_NAMES: tuple[str, ...] = tuple(str(t.__struct_config__.tag) for t in EVENT_TYPES)
"""The event names (``"ev"``), one per record type."""


def event_record(event: LedgerEvent, unix_s: float) -> dict[str, Any]:
    """The JSON object of one ledger line for ``event`` written at ``unix_s``."""
    if not isinstance(event, LedgerEvent):
        raise TypeError(f"a ledger event is one of echo2.ledger's records, got {type(event).__name__}")
    return {"t": round(unix_s, 4), **msgspec.to_builtins(event, enc_hook=_plain)}


def encode_line(event: LedgerEvent, unix_s: float) -> str:
    """One ledger line (with its newline) for ``event`` written at ``unix_s``."""
    return json.dumps(event_record(event, unix_s)) + "\n"


def _plain(value: Any) -> Any:
    """numpy scalars (a group's version read from an array) as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not a ledger value: {type(value).__name__}")


class LedgerContents(msgspec.Struct, kw_only=True):
    """What ``read`` found: the events, and lines that are no event (see ``read``)."""

    events: list[AnyLedgerEvent]
    cut_lines: int = 0
    """Lines that are not complete JSON: the last line of a process killed mid-write."""
    unknown_lines: list[str] = []
    """Complete JSON lines that are no event of this vocabulary (another version's, or
    hand-edited): ``file:line: why``."""


def read(run_dirs: Sequence[Path]) -> LedgerContents:
    """Every event in the ledgers of ``run_dirs`` (one per host of a multi-host run)."""
    contents = LedgerContents(events=[])
    for path in ledger_files(run_dirs):
        lines = read_jsonl(path)
        contents.cut_lines += lines.skipped
        for number, record in zip(lines.line_numbers, lines.records, strict=True):
            try:
                contents.events.append(msgspec.convert(record, AnyLedgerEvent))
            except msgspec.ValidationError as exc:
                contents.unknown_lines.append(f"{path}:{number}: {exc}")
    return contents


def tail(path: Path, max_bytes: int = 1 << 18) -> list[AnyLedgerEvent]:
    """The events in the last ``max_bytes`` of one ledger file, oldest first (a first line
    cut by the window, and lines that are no event, are left out)."""
    if not path.is_file():
        return []
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        file.seek(max(0, size - max_bytes))
        data = file.read()
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]
    events: list[AnyLedgerEvent] = []
    for line in lines:
        try:
            record = json.loads(line)
            events.append(msgspec.convert(record, AnyLedgerEvent))
        except (ValueError, msgspec.ValidationError):
            continue  # empty, cut, or not an event
    return events


def ledger_files(run_dirs: Sequence[Path]) -> Iterator[Path]:
    for run_dir in run_dirs:
        yield from RunDir(run_dir).ledger_paths()
