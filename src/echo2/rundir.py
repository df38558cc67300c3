"""The run directory: where each file of a run lives, and the JSON-lines format of its logs.

Every writer and reader of a run directory (the launcher, the actors, ``echo2.report``,
``echo2.audit``, ``echo2.plan``, the benchmarks) takes its paths from :class:`RunDir`, so
the layout is written down once::

    RUN_DIR/                      <run.run_dir>/<run.name>-<YYYYmmdd-HHMMSS>[-N]
      topology.resolved.json      what the first launch resolved (never rewritten by a resume)
      resumes.jsonl               one line per ``--resume``: when, its topology, the changes
                                  allowed against the previous one (``echo2.topology.changes``)
      resumes/N.topology.resolved.json   what the processes of resume N read
      pids.json                   the launcher's and its children's PIDs
      status.json                 exit code, reason, per-process exit codes (at the end)
      logs/<process>.log          each process's output
      metrics/<actor>.jsonl       ``ActorContext.record`` lines: {"time_s", "kind", ...}
      ledger/<actor>.jsonl        ``ActorContext.ledger`` events: {"t", "ev", ...}
      checkpoints/step_NNNNNN/    the learner's checkpoint after step NNNNNN: the trainer's files,
                                  trained_tasks.json, manifest.json (digests; the commit mark;
                                  ``echo2.training.checkpoint``)
      checkpoints/.tmp-step_*/    a checkpoint being written (renamed into place when complete)
      checkpoints/<actor><ext>    other actors' saved state
      checkpoints/<actor>.snapshot, <actor>.<gen>.wal
                                  an actor's write-ahead log and its last compaction
                                  (``echo2.journal``: the PromptSource's leases, the Buffer's
                                  groups)
      summary.json                the learner's summary (at the end)
      recordings/<actor>.<port>.rec  a recorded port's frames (``[run] record``,
                                  ``echo2.transport.recording``; replayed by ``echo2.replay``)
      replays/<actor>.<port>-<time>/  a replay's own metrics/, ledger/, summary.json
      report/                     plots and report.md (``python -m echo2.report``)

JSON lines are appended by processes that may be killed with SIGKILL at any moment, so
the last line of a file can be cut mid-write. :func:`read_jsonl` skips (and counts) every
line that is not one JSON object, wherever it is; :class:`JsonLinesWriter` ends such a cut
line before appending, so a resumed writer's first record is not glued to the fragment.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TextIO

TOPOLOGY_FILE = "topology.resolved.json"
RESUMES_FILE = "resumes.jsonl"
RESUMES_DIR = "resumes"
PIDS_FILE = "pids.json"
STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
LOGS_DIR = "logs"
METRICS_DIR = "metrics"
LEDGER_DIR = "ledger"
CHECKPOINTS_DIR = "checkpoints"
REPORT_DIR = "report"
RECORDINGS_DIR = "recordings"
RECORDING_SUFFIX = ".rec"
REPLAYS_DIR = "replays"
JSONL_SUFFIX = ".jsonl"
_CHECKPOINT_PREFIX = "step_"
_MAX_SUFFIX = 1000
"""Most ``-N`` suffixes tried for a fresh run directory whose name is taken."""


def new_run_id(name: str, now: float | None = None) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>`` in local time (``now``: unix seconds, default the clock)."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created by asking for a path)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def create(cls, parent: Path, run_id: str) -> RunDir:
        """A fresh run directory ``parent/run_id`` (``run_id-1``, ... if taken) with ``logs/``.

        Raises ``FileExistsError`` when every candidate name is taken."""
        parent = Path(parent).absolute()
        parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(_MAX_SUFFIX):
            root = parent / (run_id if attempt == 0 else f"{run_id}-{attempt}")
            try:
                root.mkdir()
            except FileExistsError:
                continue
            run = cls(root)
            run.logs_dir.mkdir()
            return run
        raise FileExistsError(f"cannot make a fresh run directory under {parent}")

    @property
    def name(self) -> str:
        """The directory's name: the run id."""
        return self.root.name

    def is_run_dir(self) -> bool:
        """True if the launcher has written this run's resolved topology here."""
        return self.topology_path.is_file()

    # -- files the launcher and the learner write ---------------------------------------

    @property
    def topology_path(self) -> Path:
        return self.root / TOPOLOGY_FILE

    @property
    def resume_history_path(self) -> Path:
        return self.root / RESUMES_FILE

    def resume_history(self) -> list[dict[str, Any]]:
        """The ``resumes.jsonl`` records, oldest first ([] for a run never resumed)."""
        path = self.resume_history_path
        return read_jsonl(path).records if path.is_file() else []

    def resume_topology_path(self, resume: int) -> Path:
        """``resumes/N.topology.resolved.json``: what the processes of resume ``N`` (from 1) read."""
        return self.root / RESUMES_DIR / f"{resume}.{TOPOLOGY_FILE}"

    def current_topology_path(self) -> Path:
        """The topology the run last ran with: the newest resume's, else the first launch's."""
        for record in reversed(self.resume_history()):
            resume = record.get("resume")
            if isinstance(resume, int) and (path := self.resume_topology_path(resume)).is_file():
                return path
        return self.topology_path

    @property
    def pids_path(self) -> Path:
        return self.root / PIDS_FILE

    @property
    def status_path(self) -> Path:
        return self.root / STATUS_FILE

    @property
    def summary_path(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS_DIR

    def log_path(self, process: str) -> Path:
        return self.logs_dir / f"{process}.log"

    @property
    def recordings_dir(self) -> Path:
        return self.root / RECORDINGS_DIR

    @property
    def replays_dir(self) -> Path:
        """``python -m echo2.replay``'s outputs, one directory per replay."""
        return self.root / REPLAYS_DIR

    def recording_path(self, actor: str, port: str) -> Path:
        """Where ``[run] record = ["actor.port"]`` writes that port's traffic."""
        return self.recordings_dir / f"{actor}.{port}{RECORDING_SUFFIX}"

    def log_paths(self) -> list[Path]:
        """Every process log, by name."""
        return sorted(self.logs_dir.glob("*.log")) if self.logs_dir.is_dir() else []

    @property
    def report_dir(self) -> Path:
        return self.root / REPORT_DIR

    # -- JSON lines the actors append ---------------------------------------------------

    @property
    def metrics_dir(self) -> Path:
        return self.root / METRICS_DIR

    def metrics_path(self, actor: str) -> Path:
        return self.metrics_dir / f"{actor}{JSONL_SUFFIX}"

    def metrics_paths(self) -> list[Path]:
        """Every actor's metrics file, by actor name."""
        return _jsonl_files(self.metrics_dir)

    def metrics(self, actor: str, kind: str | None = None) -> list[dict[str, Any]]:
        """The records of one actor's metrics file (of one ``kind``); [] if it has none."""
        path = self.metrics_path(actor)
        records = read_jsonl(path).records if path.is_file() else []
        return records if kind is None else [r for r in records if r.get("kind") == kind]

    def all_metrics(self, kind: str) -> list[dict[str, Any]]:
        """The records of one ``kind`` in every actor's metrics file, file by file."""
        return [r for r in read_jsonl_files(self.metrics_paths()) if r.get("kind") == kind]

    @property
    def ledger_dir(self) -> Path:
        return self.root / LEDGER_DIR

    def ledger_path(self, actor: str) -> Path:
        return self.ledger_dir / f"{actor}{JSONL_SUFFIX}"

    def ledger_paths(self) -> list[Path]:
        """Every actor's ledger file, by actor name."""
        return _jsonl_files(self.ledger_dir)

    # -- checkpoints --------------------------------------------------------------------

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def checkpoint_dir(self, step: int) -> Path:
        """``checkpoints/step_NNNNNN``: the learner's checkpoint after ``step``."""
        return self.checkpoints_dir / f"{_CHECKPOINT_PREFIX}{step:06d}"

    def checkpoint_dirs(self) -> list[Path]:
        """The learner's checkpoint directories, oldest step first (verified or not: see
        ``echo2.training.checkpoint.newest_good_checkpoint``)."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [
            (int(path.name.removeprefix(_CHECKPOINT_PREFIX)), path)
            for path in self.checkpoints_dir.glob(f"{_CHECKPOINT_PREFIX}*")
            if path.is_dir() and path.name.removeprefix(_CHECKPOINT_PREFIX).isdigit()
        ]
        return [path for _, path in sorted(found)]

    def state_path(self, actor: str, suffix: str) -> Path:
        """``checkpoints/<actor><suffix>``: an actor's saved state other than the learner's."""
        return self.checkpoints_dir / f"{actor}{suffix}"


def _jsonl_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{JSONL_SUFFIX}")) if directory.is_dir() else []


# -- the JSON-lines format ------------------------------------------------------------------


class JsonLines(NamedTuple):
    """What :func:`read_jsonl` found: the objects, and how many non-blank lines were not one."""

    records: list[dict[str, Any]]
    skipped: int
    line_numbers: list[int] = []
    """The 1-based line of each record in its file (for messages that point at a line)."""


def read_jsonl(path: Path) -> JsonLines:
    """The JSON objects of a JSON-lines file, in file order.

    Blank lines are ignored; a line that does not parse (cut by a SIGKILLed writer) or is
    not an object is skipped and counted; undecodable bytes are replaced, never fatal.
    Raises ``OSError`` when the file cannot be read."""
    records: list[dict[str, Any]] = []
    line_numbers: list[int] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(value, dict):
                records.append(value)
                line_numbers.append(number)
            else:
                skipped += 1
    return JsonLines(records, skipped, line_numbers)


def read_jsonl_files(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """The objects of several JSON-lines files, file after file (one file in memory at a time)."""
    for path in paths:
        yield from read_jsonl(path).records


class JsonLinesWriter:
    """Appends one JSON object per line to a file, flushed line by line.

    Opened lazily on the first :meth:`write` (the directory is made then). A file whose
    last line was cut by a killed writer gets its line ended first, so the cut line stays
    one unreadable line instead of swallowing this writer's first record.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            self._file = self._open()
        self._file.write(json.dumps(record, default=_json_default) + "\n")

    def _open(self) -> TextIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a", encoding="utf-8", buffering=1)
        if file.tell() > 0 and not _ends_with_newline(self.path):
            file.write("\n")
        return file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


def _json_default(value: Any) -> Any:
    """numpy (and torch) scalars and arrays as JSON numbers and lists."""
    if hasattr(value, "tolist"):  # a scalar's tolist() is a Python number
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
