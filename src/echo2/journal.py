"""A write-ahead log with snapshots: an actor's state that survives a kill -9 of its process.

An actor appends one typed record (a msgspec ``Struct`` of a tagged union, msgpack, never
pickle) for each change of the state it must not lose, *before* the change has an effect
outside the process (a message sent). A restarted actor reads the newest snapshot and
replays the records written after it.

Files, in the directory given (the run directory's ``checkpoints/``)::

    <name>.snapshot      the state at the last compaction (msgpack, written atomically)
    <name>.<gen>.wal     records since that snapshot: 4-byte little-endian length + msgpack

Compaction (``compact(state)``): the snapshot names the generation of the log that follows
it, so a crash between writing the snapshot and removing the old log never replays a record
twice: the old generation's log is simply ignored (and removed at the next open).

A torn last record (the process died inside a ``write``) is dropped and counted
(``torn_records``); a record that does not decode is an error naming the file and offset.

Durability (``fsync``):
- ``"none"`` (default): each record is one ``os.write`` to the page cache before its
  effect is sent. That survives a kill -9 (or any crash) of the *process*: the kernel
  keeps the written bytes. It does not survive a crash of the host.
- ``"always"``: ``fsync`` after every record: survives a host crash, at the cost measured by
  ``benchmarks/journal.py``.
Snapshots are always fsynced before they replace the previous one.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import msgspec

from echo2.errors import JournalDamaged

FsyncPolicy = Literal["none", "always"]
"""When records reach stable storage (see the module docstring)."""

_LENGTH = struct.Struct("<I")


class _Snapshot(msgspec.Struct, frozen=True):
    generation: int
    """The generation of the log whose records follow this snapshot."""
    state: msgspec.Raw


R = TypeVar("R")
S = TypeVar("S")


class Journal(Generic[R, S]):
    """One actor's log of ``R`` records (a tagged union type) and its snapshots of type ``S``.

    Use: ``state, records = journal.open()``, apply them, then ``append`` as the state
    changes and ``compact(state)`` now and then. ``close()`` releases the file.
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        record_type: Any,
        state_type: type[S],
        *,
        fsync: FsyncPolicy = "none",
    ) -> None:
        self.directory = directory
        self.name = name
        self.fsync = fsync
        self._encoder = msgspec.msgpack.Encoder()
        self._record_decoder = msgspec.msgpack.Decoder(record_type)
        self._state_decoder = msgspec.msgpack.Decoder(state_type)
        self._generation = 0
        self._fd: int | None = None
        self.torn_records = 0
        """Records found cut short at the end of the log (the process died mid-write)."""
        self.records_written = 0
        self.bytes_written = 0

    @property
    def snapshot_path(self) -> Path:
        return self.directory / f"{self.name}.snapshot"

    def log_path(self, generation: int) -> Path:
        return self.directory / f"{self.name}.{generation}.wal"

    def exists(self) -> bool:
        """True if a previous incarnation left a snapshot or a log here."""
        return self.snapshot_path.exists() or any(self.directory.glob(f"{self.name}.*.wal"))

    def open(self) -> tuple[S | None, list[R]]:
        """The last snapshot (None if none) and the records written after it; the log is
        then open for appending."""
        self.directory.mkdir(parents=True, exist_ok=True)
        state: S | None = None
        if self.snapshot_path.exists():
            try:
                snapshot = msgspec.msgpack.decode(self.snapshot_path.read_bytes(), type=_Snapshot)
                state = self._state_decoder.decode(snapshot.state)
            except msgspec.DecodeError as exc:
                raise JournalDamaged(f"{self.snapshot_path}: not a readable snapshot: {exc}") from exc
            self._generation = snapshot.generation
        records = list(self._read(self.log_path(self._generation)))
        for stale in self.directory.glob(f"{self.name}.*.wal"):
            if stale != self.log_path(self._generation):
                stale.unlink()  # a log a snapshot already covers
        self._fd = os.open(self.log_path(self._generation), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return state, records

    def _read(self, path: Path) -> Iterator[R]:
        if not path.exists():
            return
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            if offset + _LENGTH.size > len(data):
                break
            (length,) = _LENGTH.unpack_from(data, offset)
            end = offset + _LENGTH.size + length
            if end > len(data):
                break
            try:
                yield self._record_decoder.decode(data[offset + _LENGTH.size : end])
            except msgspec.DecodeError as exc:
                raise JournalDamaged(f"{path}: record at byte {offset} does not decode: {exc}") from exc
            offset = end
        if offset < len(data):
            # Died inside a write: the effect of that record was never sent. Cut it off so
            # that records appended now follow the last whole one.
            self.torn_records += 1
            with open(path, "r+b") as file:
                file.truncate(offset)

    def append(self, record: R) -> None:
        """Write one record (and fsync it under ``fsync = "always"``) before its effect."""
        assert self._fd is not None, "Journal.open() first"
        body = self._encoder.encode(record)
        frame = _LENGTH.pack(len(body)) + body
        written = os.write(self._fd, frame)
        while written < len(frame):
            # A short write (the disk filled up mid-record): the next write raises, and the
            # torn record is cut off at the next open.
            written += os.write(self._fd, memoryview(frame)[written:])
        if self.fsync == "always":
            os.fsync(self._fd)
        self.records_written += 1
        self.bytes_written += len(frame)

    def compact(self, state: S) -> None:
        """Replace snapshot and log by one snapshot of ``state`` (atomically)."""
        assert self._fd is not None, "Journal.open() first"
        generation = self._generation + 1
        body = self._encoder.encode(_Snapshot(generation=generation, state=msgspec.Raw(self._encoder.encode(state))))
        tmp = self.snapshot_path.with_suffix(".tmp")
        with open(tmp, "wb") as file:
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        new_fd = os.open(self.log_path(generation), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        tmp.replace(self.snapshot_path)  # from here on the new generation is the log
        os.close(self._fd)
        self.log_path(self._generation).unlink(missing_ok=True)
        self._fd, self._generation = new_fd, generation

    @classmethod
    def resumed(
        cls,
        directory: Path,
        name: str,
        record_type: Any,
        state_type: type[S],
        *,
        fsync: FsyncPolicy,
        resume: bool,
        warn: Callable[[str], None],
        otherwise: str,
    ) -> tuple[Journal[R, S], S | None, list[R]]:
        """An actor's journal, opened: (journal, snapshot, records). On ``--resume`` (``resume``)
        a missing journal is said with ``warn``: ``--resume: no journal of NAME in DIR; OTHERWISE``."""
        journal: Journal[R, S] = cls(directory, name, record_type, state_type, fsync=fsync)
        if resume and not journal.exists():
            warn(f"--resume: no journal of {name} in {directory}; {otherwise}")
        state, records = journal.open()
        return journal, state, records

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
