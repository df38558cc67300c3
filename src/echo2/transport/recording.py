"""Recordings: the exact frames that crossed one endpoint, in a file a replay reads back.

A recorded port (``[run] record = ["learner.batch"]``) appends every message it receives,
and every message it sends, to ``RUN_DIR/recordings/<actor>.<port>.rec``. What is stored is
the codec's frames (``codec.py``) as they crossed the socket, never a pickle: a replay
decodes them with the same typed decoder, so a message that was malformed on the wire is
malformed in the replay too. Sends are kept so that a replay can pair a request/reply
channel's replies with the requests that caused them.

File layout (all integers little-endian)::

    b"ECHO2REC" format_version (u8) header_length (u32) header (msgpack map, RecordingHeader)
    record*:  direction (u8: 0 received, 1 sent) time_s (f64, since the header)
              frame_count (u16) then per frame: length (u32) bytes

Frames are the multipart message as the socket saw it: a ROUTER's records start with the
peer's routing id, a SUB's or XPUB's with the topic (``RecordingHeader.envelope_frames``).

Size is bounded: past ``max_bytes`` the recorder writes one log line and records nothing
more (``truncated``), so a recording never fills a disk silently. Writes are buffered and
flushed every ``flush_s``: a process killed with SIGKILL loses at most that much, and a
reader drops a record cut mid-write (``Recording.cut_tail``). A process that records a port
whose file exists (restarted, resumed) writes ``<file>.1``, ``<file>.2``, ...; a replay
reads the first, the traffic of an actor that started from nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec

from echo2.errors import DecodeError
from echo2.messages import PROTOCOL_VERSION

log = logging.getLogger(__name__)

MAGIC = b"ECHO2REC"
FORMAT_VERSION = 1
RECEIVED = 0
SENT = 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_FLUSH_S = 0.5
_PREFIX = struct.Struct("<BdH")  # direction, time_s, frame count
_LENGTH = struct.Struct("<I")
_FILE_HEAD = struct.Struct("<8sBI")  # magic, format version, header length
_JOIN_MAX_BYTES = 64 * 1024

Direction = Literal["received", "sent"]


class RecordingHeader(msgspec.Struct, forbid_unknown_fields=False, frozen=True, kw_only=True):
    """What a reader needs before the first record (new fields get defaults)."""

    protocol_version: int
    """``PROTOCOL_VERSION`` of the process that recorded (frames carry it too)."""
    actor: str
    port: str
    socket: str
    """The recorded endpoint's socket kind ("dealer", "pull", ...)."""
    envelope_frames: int = 0
    """Leading frames of each record that are routing data (a ROUTER's peer, a topic)."""
    message_types: list[str] = []
    """Tags of the message types the endpoint's codec decodes."""
    started_unix_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RecordedMessage:
    """One record: which way it went, when, and its frames (envelope included)."""

    direction: Direction
    time_s: float
    frames: list[bytes]


@dataclasses.dataclass(frozen=True)
class RecordingSettings:
    """Which ports a process records (``"actor.port"``) and each file's size cap."""

    channels: frozenset[str] = frozenset()
    max_bytes: int = DEFAULT_MAX_BYTES

    def records(self, actor: str, port: str) -> bool:
        return f"{actor}.{port}" in self.channels


class Recorder:
    """Appends one endpoint's traffic to a recording file. Not thread-safe (one endpoint)."""

    def __init__(
        self,
        path: Path,
        header: RecordingHeader,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        flush_s: float = DEFAULT_FLUSH_S,
    ) -> None:
        self.path = _unused_path(Path(path))
        self.max_bytes = max_bytes
        self.truncated = False
        """True once the cap was reached: nothing after that point is in the file."""
        self.records = 0
        self._flush_s = flush_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        encoded = msgspec.msgpack.encode(header)
        self._file: BinaryIO | None = open(self.path, "xb")
        self._file.write(_FILE_HEAD.pack(MAGIC, FORMAT_VERSION, len(encoded)) + encoded)
        self.bytes_written = _FILE_HEAD.size + len(encoded)
        self._started = time.monotonic()
        self._last_flush = self._started

    def received(self, frames: Sequence[Any]) -> None:
        self._append(RECEIVED, frames)

    def sent(self, frames: Sequence[Any]) -> None:
        self._append(SENT, frames)

    def _append(self, direction: int, frames: Sequence[Any]) -> None:
        file = self._file
        if file is None:
            return
        views = [memoryview(f) for f in frames]
        size = _PREFIX.size + sum(_LENGTH.size + v.nbytes for v in views)
        if self.bytes_written + size > self.max_bytes:
            self.truncated = True
            log.warning(
                "%s: recording stopped at its cap of %.1f MB after %d messages (run.record_max_mb)",
                self.path,
                self.max_bytes / 1e6,
                self.records,
            )
            self.close()
            return
        now = time.monotonic()
        parts: list[Any] = [_PREFIX.pack(direction, now - self._started, len(views))]
        for view in views:
            parts.append(_LENGTH.pack(view.nbytes))
            parts.append(view)
        if size <= _JOIN_MAX_BYTES:
            file.write(b"".join(parts))  # one call: the per-call cost dominates small records
        else:
            for part in parts:  # large arrays are written from their frames, not copied
                file.write(part)
        self.bytes_written += size
        self.records += 1
        if now - self._last_flush >= self._flush_s:
            file.flush()
            self._last_flush = now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _unused_path(path: Path) -> Path:
    """``path``, or when a recording is there already (a restarted or resumed process),
    ``path.1``, ``path.2``, ...: an earlier incarnation's traffic is never overwritten."""
    if not path.exists():
        return path
    for index in range(1, 10_000):
        candidate = path.with_name(f"{path.name}.{index}")
        if not candidate.exists():
            log.info("%s exists (an earlier incarnation's); recording to %s", path, candidate)
            return candidate
    raise FileExistsError(f"{path}: no free name for another recording")


@dataclasses.dataclass(frozen=True)
class Recording:
    """A recording file read back: its header and records in order."""

    header: RecordingHeader
    messages: list[RecordedMessage]
    cut_tail: bool
    """True when the last record was cut mid-write (a killed process) and was dropped."""

    @classmethod
    def read(cls, path: Path) -> Recording:
        """Read a recording; ``DecodeError`` naming the file if it is not one."""
        data = Path(path).read_bytes()
        if len(data) < _FILE_HEAD.size:
            raise DecodeError(f"{path}: not an echo2 recording (too short)")
        magic, version, header_length = _FILE_HEAD.unpack_from(data)
        if magic != MAGIC:
            raise DecodeError(f"{path}: not an echo2 recording (bad magic)")
        if version != FORMAT_VERSION:
            raise DecodeError(f"{path}: recording format {version}, this echo2 reads {FORMAT_VERSION}")
        start = _FILE_HEAD.size
        try:
            header = msgspec.msgpack.decode(data[start : start + header_length], type=RecordingHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(f"{path}: bad recording header: {exc}") from exc
        messages, cut_tail = _records(memoryview(data), start + header_length)
        return cls(header=header, messages=messages, cut_tail=cut_tail)


def _records(data: memoryview, offset: int) -> tuple[list[RecordedMessage], bool]:
    """The records from ``offset`` on, and whether the last one was cut mid-write."""
    out: list[RecordedMessage] = []
    end = len(data)
    while offset < end:
        if offset + _PREFIX.size > end:
            return out, True
        direction, time_s, count = _PREFIX.unpack_from(data, offset)
        position = offset + _PREFIX.size
        frames: list[bytes] = []
        for _ in range(count):
            if position + _LENGTH.size > end:
                break
            (length,) = _LENGTH.unpack_from(data, position)
            position += _LENGTH.size
            if position + length > end:
                break
            frames.append(bytes(data[position : position + length]))
            position += length
        if len(frames) != count or direction not in (RECEIVED, SENT):
            return out, True
        out.append(RecordedMessage("received" if direction == RECEIVED else "sent", time_s, frames))
        offset = position
    return out, False


def recording_header(actor: str, port: str, socket: str, envelope_frames: int, types: Any) -> RecordingHeader:
    """The header of a new recording of ``actor.port`` (``types``: the codec's union)."""
    members = typing.get_args(types) or (types,)
    tags = [str(t.__struct_config__.tag) for t in members if isinstance(t, type) and issubclass(t, msgspec.Struct)]
    return RecordingHeader(
        protocol_version=PROTOCOL_VERSION,
        actor=actor,
        port=port,
        socket=socket,
        envelope_frames=envelope_frames,
        message_types=tags,
        started_unix_s=time.time(),
    )


__all__ = [
    "DEFAULT_MAX_BYTES",
    "RecordedMessage",
    "Recorder",
    "Recording",
    "RecordingHeader",
    "RecordingSettings",
    "recording_header",
]
