"""Delta-coded weight versions: a version as its changes from a base version a member holds.

Step to step, most elements of a policy keep their exact bit pattern (bf16 especially: an
update smaller than half a unit in the last place leaves the element as it was). A delta
version sends only the changed elements, against a base version the member has committed
(verified and complete), and the member rebuilds the full state from its copy of the base.

Encoding, per segment (a tensor, cut into pieces of at most ``segment_bytes``), on the
wire dtype's bit patterns viewed as unsigned integers of the element's width (so NaN, inf
and -0.0 are just bit patterns, compared and restored exactly):

* ``SAME``: no element changed (no bytes).
* ``GAPS``: zstd of the gaps between changed elements (gap = elements skipped since the
  previous change) as unsigned integers of the smallest width that holds the largest
  (1, 2 or 4 bytes), then the changed elements XOR their base values; both byte-plane
  shuffled (all high bytes, then all low bytes: small gaps and small updates leave the
  high planes mostly zero, so they compress; decoding is a cumulative sum, no varints).
* ``BITMAP``: the same with a bitmap of changed elements instead of gaps, chosen when it is
  smaller (above ~1 change in 8-16 elements).
* ``RAW``: the segment's bytes as they are: the fallback whenever the coded form would not
  be smaller (dense updates, or a density at which delta loses).

Payload layout (little-endian): ``HEADER`` (magic b"E2DL", format u8 = 2, 3 pad bytes,
segment count u32, 4 pad bytes), then one ``SEGMENT`` record per segment (mode u8,
itemsize u8, gap width u8, 5 pad bytes, state offset u64, state bytes u64, changed
elements u64, index bytes u64, record bytes u64), then the records back to back. Segments
cover the state in order, exactly: decoding writes every byte of the new state.

The payload travels as an ordinary chunked, digested (signed) byte buffer
(``echo2.weights.broadcaster``), in chunks of ``payload_chunk_bytes`` (smaller than a dense
version's when the payload is small, so that it arrives as many pieces). A member rebuilds
the state while the payload arrives (:class:`DeltaRebuild`): each segment is decoded as
soon as the chunks holding its record verified, and each chunk of the rebuilt state is
checked against the full-state digests of the signed manifest as soon as its segments are
decoded (while its bytes are still in cache), so that little is left to do when the last
payload chunk lands. Anything inconsistent raises (or fails the rebuild with)
``DeltaError``; nothing is installed until every chunk of the rebuilt state verified.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import zstandard

from echo2.messages import PolicyVersion, TensorSpec, WeightChunk, WeightDelta, WeightManifest
from echo2.weights.chunks import SnapshotAssembler, digest

HEADER = struct.Struct("<4sB3xI4x")
MAGIC = b"E2DL"
FORMAT = 2
SEGMENT = struct.Struct("<BBB5xQQQQQ")
_TABLE = np.dtype(
    [
        ("mode", "u1"),
        ("itemsize", "u1"),
        ("width", "u1"),
        ("pad", "V5"),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("count", "<u8"),
        ("index_bytes", "<u8"),
        ("length", "<u8"),
    ]
)
assert _TABLE.itemsize == SEGMENT.size
SAME, RAW, GAPS, BITMAP = 0, 1, 2, 3
DEFAULT_SEGMENT_BYTES = 1 << 20
ZSTD_LEVEL = 1
"""Fast: the payload is a few percent of the state, so level 1 keeps encoding off the
critical path; higher levels saved under 5% more here."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
PAYLOAD_CHUNKS = 64
"""A payload travels in at least about this many chunks (``payload_chunk_bytes``): the
rebuild overlaps its arrival, so what is left after the last chunk is ~1/64 of it."""
MIN_PAYLOAD_CHUNK_BYTES = 16 * 1024


class DeltaError(ValueError):
    """A delta payload that does not decode against the state it claims to rebuild."""


@dataclasses.dataclass(frozen=True)
class DeltaStats:
    """What one encoding found: elements changed, and the sizes it chose between."""

    elements: int
    changed: int
    state_bytes: int
    payload_bytes: int
    raw_segments: int
    segments: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def ratio(self) -> float:
        """Payload bytes per state byte (what a delta version costs on the wire vs dense)."""
        return self.payload_bytes / self.state_bytes if self.state_bytes else 0.0


@dataclasses.dataclass(frozen=True)
class _Segment:
    offset: int
    nbytes: int
    itemsize: int


def segments(tensors: Sequence[TensorSpec], segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> list[_Segment]:
    """Each tensor, cut into pieces of at most ``segment_bytes`` (whole elements)."""
    out = []
    for spec in tensors:
        itemsize = np.dtype(spec.dtype).itemsize
        if itemsize not in _UINT or spec.nbytes % itemsize:
            itemsize = 1  # an odd dtype: compared byte by byte
        step = max(itemsize, segment_bytes // itemsize * itemsize)
        for start in range(0, spec.nbytes, step):
            out.append(_Segment(spec.offset + start, min(step, spec.nbytes - start), itemsize))
    return out


def _shuffle(values: np.ndarray) -> bytes:
    """Byte planes, most significant first (little-endian storage: reversed). One plane at
    a time: a transposing copy of the whole is several times slower."""
    width = values.itemsize
    items = values.view(np.uint8).reshape(-1, width)
    planes = np.empty((width, len(values)), dtype=np.uint8)
    for plane in range(width):
        planes[plane] = items[:, width - 1 - plane]
    return planes.tobytes()


def _unshuffle(raw: np.ndarray, itemsize: int, count: int) -> np.ndarray:
    planes = raw.reshape(itemsize, count)
    items = np.empty((count, itemsize), dtype=np.uint8)
    for plane in range(itemsize):
        items[:, itemsize - 1 - plane] = planes[plane]
    return items.view(_UINT[itemsize]).reshape(-1)


def _gap_width(largest: int) -> int:
    return 1 if largest < 1 << 8 else 2 if largest < 1 << 16 else 4


# -- segments ----------------------------------------------------------------------------


def _encode_segment(new: np.ndarray, base: np.ndarray, seg: _Segment) -> tuple[int, int, int, int, bytes]:
    """(mode, gap width, changed, index bytes, record) of one segment."""
    kind = _UINT[seg.itemsize]
    a = new[seg.offset : seg.offset + seg.nbytes].view(kind)
    b = base[seg.offset : seg.offset + seg.nbytes].view(kind)
    changed = np.flatnonzero(a != b)
    count = len(changed)
    if count == 0:
        return SAME, 0, 0, 0, b""
    if count * seg.itemsize >= seg.nbytes:  # the changed values alone are the whole segment
        return RAW, 0, count, 0, a.tobytes()
    gaps = np.diff(changed, prepend=-1) - 1
    width = _gap_width(int(gaps.max()))
    elements = len(a)
    if count * width <= -(-elements // 8):
        mode, index = GAPS, _shuffle(gaps.astype(_UINT[width]))
    else:
        mask = np.zeros(elements, dtype=bool)
        mask[changed] = True
        mode, width, index = BITMAP, 0, np.packbits(mask, bitorder="little").tobytes()
    values = _shuffle(a[changed] ^ b[changed])
    record = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(index + values)
    if len(record) >= seg.nbytes:
        return RAW, 0, count, 0, a.tobytes()
    return mode, width, count, len(index), record


def _decode_segment(out: np.ndarray, base: np.ndarray, record: np.ndarray, entry: np.void) -> None:
    """Write segment ``entry`` (a row of the table, checked by ``_parse_table``) of the new
    state into ``out`` from its ``record`` and the base."""
    mode, itemsize, width = int(entry["mode"]), int(entry["itemsize"]), int(entry["width"])
    offset, nbytes, count, index_bytes = (int(entry[f]) for f in ("offset", "nbytes", "count", "index_bytes"))
    region = out[offset : offset + nbytes]
    if mode == RAW:
        region[:] = record
        return
    region[:] = base[offset : offset + nbytes]
    if mode == SAME:
        return
    elements = nbytes // itemsize
    expected = index_bytes + count * itemsize
    try:
        raw = zstandard.ZstdDecompressor().decompress(record.data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"segment does not decompress: {exc}") from None
    if len(raw) != expected:
        raise DeltaError("segment decompresses to the wrong size")
    body = np.frombuffer(raw, dtype=np.uint8)
    index = body[:index_bytes]
    if mode == GAPS:
        gaps = _unshuffle(index, width, count).astype(np.int64)
        positions = np.cumsum(gaps + 1) - 1
        if positions[-1] >= elements:
            raise DeltaError("changed element out of range")
    else:
        positions = np.flatnonzero(np.unpackbits(index, count=elements, bitorder="little"))
        if len(positions) != count:
            raise DeltaError("bitmap does not match the changed count")
    values = _unshuffle(body[index_bytes:], itemsize, count)
    view = region.view(_UINT[itemsize])
    view[positions] ^= values


# -- payloads ----------------------------------------------------------------------------


def encode(
    new: np.ndarray,
    base: np.ndarray,
    tensors: Sequence[TensorSpec],
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    threads: int = 2,
) -> tuple[np.ndarray, DeltaStats]:
    """The payload that rebuilds ``new`` from ``base`` (both the flat uint8 state of the
    layout ``tensors``), and what it found. Pure; numpy and zstd release the GIL, so
    ``threads`` segments are encoded at once."""
    if new.shape != base.shape or new.dtype != np.uint8 or base.dtype != np.uint8:
        raise ValueError("new and base must be flat uint8 states of the same size")
    segs = segments(tensors, segment_bytes)
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        coded = list(pool.map(lambda s: _encode_segment(new, base, s), segs))
    table = bytearray(HEADER.pack(MAGIC, FORMAT, len(segs)))
    for seg, (mode, width, count, index_bytes, record) in zip(segs, coded, strict=True):
        table += SEGMENT.pack(mode, seg.itemsize, width, seg.offset, seg.nbytes, count, index_bytes, len(record))
    payload = np.empty(len(table) + sum(len(c[4]) for c in coded), dtype=np.uint8)
    payload[: len(table)] = np.frombuffer(table, dtype=np.uint8)
    at = len(table)
    for *_, record in coded:
        payload[at : at + len(record)] = np.frombuffer(record, dtype=np.uint8)
        at += len(record)
    stats = DeltaStats(
        elements=sum(s.nbytes // s.itemsize for s in segs),
        changed=sum(c[2] for c in coded),
        state_bytes=int(new.nbytes),
        payload_bytes=int(payload.nbytes),
        raw_segments=sum(c[0] == RAW for c in coded),
        segments=len(segs),
    )
    return payload, stats


def _table_bytes(head: np.ndarray) -> int:
    """Bytes of header and segment table, from the payload's first ``HEADER.size`` bytes."""
    magic, fmt, n = HEADER.unpack_from(head.tobytes())
    if magic != MAGIC or fmt != FORMAT:
        raise DeltaError("not a delta payload (magic or format)")
    return HEADER.size + n * SEGMENT.size


def _parse_table(table: np.ndarray, payload_bytes: int, state_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment table, each record's start in the payload) from the payload's header and
    table bytes; ``DeltaError`` unless the segments cover the state and the records the
    payload exactly, in order, with counts and sizes every mode allows."""
    entries = np.frombuffer(table, dtype=_TABLE, offset=HEADER.size)
    mode, itemsize, width = (entries[f].astype(np.int64) for f in ("mode", "itemsize", "width"))
    offset, nbytes, count, index_bytes, length = (
        entries[f].astype(np.uint64) for f in ("offset", "nbytes", "count", "index_bytes", "length")
    )
    if np.any((nbytes == 0) | ~np.isin(itemsize, list(_UINT)) | ~np.isin(mode, (SAME, RAW, GAPS, BITMAP))):
        raise DeltaError("a segment of no bytes, an unknown element size or mode")
    sizes = itemsize.astype(np.uint64)
    if np.any(nbytes % sizes) or np.any(nbytes > np.uint64(state_bytes)) or np.any(length > np.uint64(payload_bytes)):
        raise DeltaError("a segment of a size out of range")
    ends = np.cumsum(nbytes, dtype=np.uint64)
    covered = int(ends[-1]) if len(entries) else 0
    if np.any(offset != ends - nbytes) or covered != state_bytes:
        raise DeltaError("segments do not cover the state exactly")
    starts = np.cumsum(length, dtype=np.uint64) - length + np.uint64(len(table))
    if (int(starts[-1] + length[-1]) if len(entries) else len(table)) != payload_bytes:
        raise DeltaError("segment records do not cover the payload exactly")
    elements = nbytes // sizes
    same, raw, coded = mode == SAME, mode == RAW, (mode == GAPS) | (mode == BITMAP)
    bitmap_bytes = (elements + np.uint64(7)) // np.uint64(8)
    bad = (
        (same & ((count != 0) | (length != 0)))
        | (raw & (length != nbytes))
        | (coded & ((count == 0) | (count > elements)))
        | ((mode == GAPS) & (~np.isin(width, (1, 2, 4)) | (index_bytes != count * width.astype(np.uint64))))
        | ((mode == BITMAP) & (index_bytes != bitmap_bytes))
    )
    if np.any(bad):
        raise DeltaError(f"segment {int(np.flatnonzero(bad)[0])} is inconsistent with its mode")
    return entries, starts.astype(np.int64)


def decode(payload: np.ndarray, base: np.ndarray, out: np.ndarray) -> None:
    """Rebuild the new state into ``out`` (uint8, the size of ``base``) from the whole
    ``payload`` at once; ``DeltaError`` if the payload is inconsistent (``out`` is then
    partly written). A member rebuilds while the payload arrives: ``DeltaRebuild``."""
    if out.shape != base.shape:
        raise ValueError("out must be the size of base")
    if payload.nbytes < HEADER.size:
        raise DeltaError("payload shorter than its header")
    at = _table_bytes(payload[: HEADER.size])
    if at > payload.nbytes:
        raise DeltaError("segment table runs past the payload")
    entries, starts = _parse_table(payload[:at], payload.nbytes, base.nbytes)
    for entry, start in zip(entries, starts.tolist(), strict=True):
        _decode_segment(out, base, payload[start : start + int(entry["length"])], entry)


# -- rebuilding while the payload arrives ------------------------------------------------


class DeltaRebuild:
    """A delta version's full state, rebuilt from the base while its payload arrives.

    ``payload`` is the assembler of the payload's chunks (relayed, repaired and verified
    like any version's); each chunk it stores calls back here (in the verifying thread).
    Once the chunks holding the segment table are in, every segment whose record is held
    is decoded by a job handed to ``submit`` (the receiver's verify pool), and each chunk
    of the rebuilt state (``state``, against the manifest's full-state digests) is
    verified by the job that decoded its last segment. ``result`` resolves to True when
    every chunk of the rebuilt state verified, False at the first inconsistency (``error``
    says which); the base is only read.
    """

    def __init__(
        self,
        manifest: WeightManifest,
        base: np.ndarray,
        submit: Callable[[Callable[[], None]], Any],
        *,
        out: np.ndarray | None = None,
    ) -> None:
        if base.nbytes != manifest.total_bytes:
            raise ValueError("the base is not the size of the state")
        self.manifest = manifest
        self._base = base
        self._submit = submit
        self.payload = SnapshotAssembler(payload_manifest(manifest), on_stored=self._landed)
        self.state = SnapshotAssembler(manifest, out)
        self.result: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self.error = ""
        self._lock = threading.Lock()
        self._chunk = self.payload.manifest.chunk_bytes
        self._held = np.zeros(len(self.payload.manifest.chunk_digests), dtype=bool)
        self._table: np.ndarray | None = None
        self._starts = self._ends = self._pending = np.zeros(0, dtype=np.int64)
        self._first = self._last = self._remaining = np.zeros(0, dtype=np.int64)

    @property
    def key(self) -> PolicyVersion:
        return self.manifest.policy_version

    def _landed(self, index: int) -> None:
        """Payload chunk ``index`` is stored and verified: decode what it completes."""
        with self._lock:
            if self.result.done():
                return
            self._held[index] = True
            try:
                ready = self._ready_after(index)
            except DeltaError as exc:
                self._fail(str(exc))
                return
        if len(ready):
            try:
                self._submit(lambda: self._decode(ready))
            except RuntimeError as exc:  # the pool shut down: the receiver is closing
                with self._lock:
                    self._fail(f"cannot rebuild: {exc}")

    def _ready_after(self, index: int) -> np.ndarray:
        """Segments whose records are all held now (under the lock), each returned once."""
        if self._table is None:
            return self._parse()
        lo = int(np.searchsorted(self._ends, index * self._chunk, side="right"))
        hi = int(np.searchsorted(self._starts, (index + 1) * self._chunk, side="left"))
        hit = np.arange(lo, hi)[self._ends[lo:hi] > self._starts[lo:hi]]  # records with bytes
        self._pending[hit] -= 1
        return hit[self._pending[hit] == 0]

    def _parse(self) -> np.ndarray:
        """The table, once the chunks holding it are in; then every segment already whole."""
        buffer, size = self.payload.buffer, self._chunk
        if buffer.nbytes < HEADER.size:
            raise DeltaError("payload shorter than its header")
        if not self._held[: -(-HEADER.size // size)].all():
            return np.zeros(0, dtype=np.int64)
        at = _table_bytes(buffer[: HEADER.size])
        if at > buffer.nbytes:
            raise DeltaError("segment table runs past the payload")
        if not self._held[: -(-at // size)].all():
            return np.zeros(0, dtype=np.int64)
        table, starts = _parse_table(buffer[:at], buffer.nbytes, self.manifest.total_bytes)
        ends = starts + table["length"].astype(np.int64)
        # Payload chunks each record still waits for.
        missing = np.concatenate([[0], np.cumsum(~self._held)])
        whole = ends > starts
        first, last = starts[whole] // size, (ends[whole] - 1) // size
        self._pending = np.zeros(len(table), dtype=np.int64)
        self._pending[whole] = missing[last + 1] - missing[first]
        # Segments each chunk of the rebuilt state waits for.
        state_chunk = self.manifest.chunk_bytes
        offsets = table["offset"].astype(np.int64)
        self._first = offsets // state_chunk
        self._last = (offsets + table["nbytes"].astype(np.int64) - 1) // state_chunk
        counts = np.zeros(len(self.manifest.chunk_digests) + 1, dtype=np.int64)
        np.add.at(counts, self._first, 1)
        np.add.at(counts, self._last + 1, -1)
        self._remaining = np.cumsum(counts)[:-1]
        self._table, self._starts, self._ends = table, starts, ends
        return np.flatnonzero(self._pending == 0)

    def _decode(self, ready: np.ndarray) -> None:
        """Decode ``ready`` segments, verifying each state chunk they complete (a pool job)."""
        assert self._table is not None
        payload = self.payload.buffer
        try:
            for i in ready.tolist():
                if self.result.done():
                    return
                entry = self._table[i]
                _decode_segment(self.state.buffer, self._base, payload[self._starts[i] : self._ends[i]], entry)
                with self._lock:
                    span = slice(int(self._first[i]), int(self._last[i]) + 1)
                    self._remaining[span] -= 1
                    whole = np.flatnonzero(self._remaining[span] == 0) + span.start
                for k in whole.tolist():
                    self._verify(k)
        except (DeltaError, ValueError, IndexError) as exc:  # a payload that passed its digests but lies
            with self._lock:
                self._fail(str(exc))

    def _verify(self, index: int) -> None:
        m = self.manifest
        size = min(m.chunk_bytes, m.total_bytes - index * m.chunk_bytes)
        region = self.state.destination(index, size)
        if region is None or self.state.offer(WeightChunk(m.incarnation, m.version, index, region)) != "stored":
            raise DeltaError(f"rebuilt chunk {index} does not match the manifest's digest")
        if self.state.complete:
            with self._lock:
                if not self.result.done():
                    self.result.set_result(True)

    def _fail(self, error: str) -> None:
        """(Under the lock.)"""
        if not self.result.done():
            self.error = error
            self.result.set_result(False)


# -- manifests ---------------------------------------------------------------------------


def payload_chunk_bytes(payload_bytes: int, chunk_bytes: int) -> int:
    """Chunk size of a payload: a power of two giving it about ``PAYLOAD_CHUNKS`` chunks,
    at least ``MIN_PAYLOAD_CHUNK_BYTES`` and at most the dense ``chunk_bytes``."""
    want = max(MIN_PAYLOAD_CHUNK_BYTES, 1 << max(0, (payload_bytes // PAYLOAD_CHUNKS).bit_length()))
    return min(chunk_bytes, want)


def delta_manifest(
    manifest: WeightManifest,
    base: PolicyVersion,
    payload: np.ndarray,
    stats: DeltaStats,
    *,
    chunk_bytes: int = 0,
) -> WeightManifest:
    """``manifest`` (the full state's, unsigned or not) as a delta version against ``base``
    whose chunks (of ``chunk_bytes``; by default ``payload_chunk_bytes``) carry
    ``payload``; unsigned (sign it again: the signature covers the payload digest too)."""
    algorithm = manifest.digest_algorithm
    size = chunk_bytes or payload_chunk_bytes(int(payload.nbytes), manifest.chunk_bytes)
    digests = [digest(payload[i : i + size], algorithm) for i in range(0, payload.nbytes, size)]
    return msgspec.structs.replace(
        manifest,
        signature=b"",
        delta=WeightDelta(
            base_incarnation=base.incarnation,
            base_version=base.version,
            total_bytes=int(payload.nbytes),
            chunk_digests=digests,
            digest=digest(b"".join(digests), algorithm),
            changed_fraction=stats.changed_fraction,
            chunk_bytes=size if size != manifest.chunk_bytes else 0,
        ),
    )


def base_of(manifest: WeightManifest) -> PolicyVersion | None:
    d = manifest.delta
    return PolicyVersion(d.base_incarnation, d.base_version) if d is not None else None


def payload_manifest(manifest: WeightManifest) -> WeightManifest:
    """The manifest a delta version's payload is assembled under: one uint8 tensor, the
    payload's chunking and chunk digests (same version, so its chunks are the version's
    chunks)."""
    d = manifest.delta
    if d is None:
        raise ValueError("not a delta manifest")
    return msgspec.structs.replace(
        manifest,
        total_bytes=d.total_bytes,
        chunk_bytes=d.chunk_bytes or manifest.chunk_bytes,
        tensors=[TensorSpec("delta-payload", "|u1", (d.total_bytes,), 0, d.total_bytes)],
        chunk_digests=d.chunk_digests,
        digest=d.digest,
        delta=None,
        signature=b"",
        seal_key=b"",
        seal_check=b"",
    )
