"""Delta-coded weight versions: a version as its changes from a base version a member holds.

Step to step, most elements of a policy keep their exact bit pattern (bf16 especially: an
update smaller than half a unit in the last place leaves the element as it was). A delta
version sends only the changed elements, against a base version the member has committed
(verified and complete), and the member rebuilds the full state from its copy of the base.

Encoding, per segment (a tensor, cut into pieces of at most ``segment_bytes``), on the
wire dtype's bit patterns viewed as unsigned integers of the element's width (so NaN, inf
and -0.0 are just bit patterns, compared and restored exactly):

* ``SAME``: no element changed (no bytes).
* ``GAPS``: zstd of the gaps between changed elements as LEB128 varints (gap = elements
  skipped since the previous change), then the changed elements XOR their base values,
  byte-plane shuffled (all high bytes, then all low bytes: small updates leave sign and
  exponent alone, so the high plane is mostly zero and compresses).
* ``BITMAP``: the same with a bitmap of changed elements instead of gaps, chosen when it is
  smaller (above ~1 change in 8 elements).
* ``RAW``: the segment's bytes as they are: the fallback whenever the coded form would not
  be smaller (dense updates, or a density at which delta loses).

Payload layout (little-endian): ``HEADER`` (magic b"E2DL", format u8 = 1, 3 pad bytes,
segment count u32, 4 pad bytes), then one ``SEGMENT`` record per segment (mode u8,
itemsize u8, 6 pad bytes, state offset u64, state bytes u64, changed elements u64, index
bytes u64, record bytes u64), then the records back to back. Segments cover the state in
order, exactly: decoding writes every byte of the new state.

The payload travels as an ordinary chunked, digested (signed, sealed) byte buffer
(``echo2.weights.broadcaster``); ``decode`` checks the table against the state's size and
raises ``DeltaError`` on anything inconsistent, and the caller verifies the rebuilt state
against the full-state digests of the signed manifest before anything is installed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import struct
from collections.abc import Sequence

import msgspec
import numpy as np
import zstandard

from echo2.messages import PolicyVersion, TensorSpec, WeightDelta, WeightManifest
from echo2.weights.chunks import digest

HEADER = struct.Struct("<4sB3xI4x")
MAGIC = b"E2DL"
FORMAT = 1
SEGMENT = struct.Struct("<BB6xQQQQQ")
SAME, RAW, GAPS, BITMAP = 0, 1, 2, 3
DEFAULT_SEGMENT_BYTES = 1 << 20
ZSTD_LEVEL = 1
"""Fast: the payload is a few percent of the state, so level 1 keeps encoding off the
critical path; higher levels saved under 5% more here."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_VARINT_MAX_BYTES = 10


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


# -- index coding ------------------------------------------------------------------------


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative integers, vectorised; uint8."""
    v = values.astype(np.uint64, copy=False)
    lengths = np.ones(len(v), dtype=np.int64)
    for k in range(1, _VARINT_MAX_BYTES):
        lengths += v >= np.uint64(1 << (7 * k)) if 7 * k < 64 else 0
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for k in range(int(lengths.max(initial=0))):
        has = lengths > k
        group = (v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (group | more).astype(np.uint8)
    return out


def varint_decode(data: np.ndarray, count: int) -> np.ndarray:
    """``count`` LEB128 integers from ``data`` (exactly), as int64; DeltaError otherwise."""
    ends = np.flatnonzero((data & 0x80) == 0)
    if len(ends) != count or (count and ends[-1] != len(data) - 1):
        raise DeltaError("index varints do not match the changed count")
    starts = np.empty(count, dtype=np.int64)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if count and lengths.max() > 9:  # 9 x 7 bits covers every int64 index
        raise DeltaError("index varint too long")
    out = np.zeros(count, dtype=np.int64)
    for k in range(int(lengths.max(initial=0))):
        has = lengths > k
        out[has] |= (data[starts[has] + k] & 0x7F).astype(np.int64) << (7 * k)
    return out


def _shuffle(values: np.ndarray) -> bytes:
    """Byte planes, most significant first (little-endian storage: reversed)."""
    planes = values.view(np.uint8).reshape(-1, values.itemsize)[:, ::-1]
    return np.ascontiguousarray(planes.T).tobytes()


def _unshuffle(raw: np.ndarray, itemsize: int, count: int) -> np.ndarray:
    planes = raw.reshape(itemsize, count)[::-1].T
    return np.ascontiguousarray(planes).view(_UINT[itemsize]).reshape(-1)


# -- segments ----------------------------------------------------------------------------


def _encode_segment(new: np.ndarray, base: np.ndarray, seg: _Segment) -> tuple[int, int, int, bytes]:
    """(mode, changed, index bytes, record) of one segment."""
    kind = _UINT[seg.itemsize]
    a = new[seg.offset : seg.offset + seg.nbytes].view(kind)
    b = base[seg.offset : seg.offset + seg.nbytes].view(kind)
    changed = np.flatnonzero(a != b)
    count = len(changed)
    if count == 0:
        return SAME, 0, 0, b""
    if count * seg.itemsize >= seg.nbytes:  # the changed values alone are the whole segment
        return RAW, count, 0, a.tobytes()
    gaps = np.diff(changed, prepend=-1) - 1
    gap_bytes = int(np.count_nonzero(gaps >= 0)) + sum(
        int(np.count_nonzero(gaps >= (1 << (7 * k)))) for k in range(1, 5)
    )  # varint length, exactly for gaps < 2**35
    elements = len(a)
    if gap_bytes <= -(-elements // 8):
        mode, index = GAPS, varint_encode(gaps).tobytes()
    else:
        mask = np.zeros(elements, dtype=bool)
        mask[changed] = True
        mode, index = BITMAP, np.packbits(mask, bitorder="little").tobytes()
    values = _shuffle(a[changed] ^ b[changed])
    record = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(index + values)
    if len(record) >= seg.nbytes:
        return RAW, count, 0, a.tobytes()
    return mode, count, len(index), record


def _decode_segment(
    out: np.ndarray, base: np.ndarray, record: memoryview, seg: _Segment, mode: int, count: int, index_bytes: int
) -> None:
    region = out[seg.offset : seg.offset + seg.nbytes]
    if mode == RAW:
        if len(record) != seg.nbytes:
            raise DeltaError("raw segment of the wrong size")
        region[:] = np.frombuffer(record, dtype=np.uint8)
        return
    region[:] = base[seg.offset : seg.offset + seg.nbytes]
    if mode == SAME:
        if count or len(record):
            raise DeltaError("unchanged segment with a body")
        return
    if mode not in (GAPS, BITMAP) or seg.itemsize not in _UINT:
        raise DeltaError(f"unknown segment mode {mode}")
    elements = seg.nbytes // seg.itemsize
    if not 0 < count < elements + 1:
        raise DeltaError("changed count out of range")
    if index_bytes > _VARINT_MAX_BYTES * count + -(-elements // 8):
        raise DeltaError("index larger than any coding of the changed count")  # bounds what zstd may allocate
    expected = index_bytes + count * seg.itemsize
    try:
        raw = zstandard.ZstdDecompressor().decompress(record, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"segment does not decompress: {exc}") from None
    if len(raw) != expected:
        raise DeltaError("segment decompresses to the wrong size")
    body = np.frombuffer(raw, dtype=np.uint8)
    index = body[:index_bytes]
    if mode == GAPS:
        positions = np.cumsum(varint_decode(index, count) + 1) - 1
    else:
        if index_bytes != -(-elements // 8):
            raise DeltaError("bitmap of the wrong size")
        positions = np.flatnonzero(np.unpackbits(index, count=elements, bitorder="little"))
        if len(positions) != count:
            raise DeltaError("bitmap does not match the changed count")
    if count and (positions.min() < 0 or positions.max() >= elements):
        raise DeltaError("changed element out of range")
    values = _unshuffle(body[index_bytes:], seg.itemsize, count)
    view = region.view(_UINT[seg.itemsize])
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
    for seg, (mode, count, index_bytes, record) in zip(segs, coded, strict=True):
        table += SEGMENT.pack(mode, seg.itemsize, seg.offset, seg.nbytes, count, index_bytes, len(record))
    payload = np.empty(len(table) + sum(len(c[3]) for c in coded), dtype=np.uint8)
    payload[: len(table)] = np.frombuffer(table, dtype=np.uint8)
    at = len(table)
    for _, _, _, record in coded:
        payload[at : at + len(record)] = np.frombuffer(record, dtype=np.uint8)
        at += len(record)
    stats = DeltaStats(
        elements=sum(s.nbytes // s.itemsize for s in segs),
        changed=sum(c[1] for c in coded),
        state_bytes=int(new.nbytes),
        payload_bytes=int(payload.nbytes),
        raw_segments=sum(c[0] == RAW for c in coded),
        segments=len(segs),
    )
    return payload, stats


def decode(payload: np.ndarray, base: np.ndarray, out: np.ndarray, *, threads: int = 2) -> None:
    """Rebuild the new state into ``out`` (uint8, the size of ``base``) from ``payload``;
    ``DeltaError`` if the payload is inconsistent (``out`` is then partly written)."""
    if out.shape != base.shape:
        raise ValueError("out must be the size of base")
    data = payload.data.cast("B")
    if len(data) < HEADER.size:
        raise DeltaError("payload shorter than its header")
    magic, fmt, n = HEADER.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT:
        raise DeltaError("not a delta payload (magic or format)")
    at = HEADER.size + n * SEGMENT.size
    if at > len(data):
        raise DeltaError("segment table runs past the payload")
    jobs = []
    covered = 0
    for i in range(n):
        mode, itemsize, offset, nbytes, count, index_bytes, length = SEGMENT.unpack_from(
            data, HEADER.size + i * SEGMENT.size
        )
        if offset != covered or nbytes == 0 or itemsize not in _UINT or nbytes % itemsize:
            raise DeltaError(f"segment {i} does not continue the state")
        if at + length > len(data):
            raise DeltaError(f"segment {i} runs past the payload")
        covered += nbytes
        jobs.append((data[at : at + length], _Segment(offset, nbytes, itemsize), mode, count, index_bytes))
        at += length
    if covered != out.nbytes or at != len(data):
        raise DeltaError("segments do not cover the state exactly")
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for future in [pool.submit(_decode_segment, out, base, *job) for job in jobs]:
            future.result()


# -- manifests ---------------------------------------------------------------------------


def delta_manifest(
    manifest: WeightManifest, base: PolicyVersion, payload: np.ndarray, stats: DeltaStats
) -> WeightManifest:
    """``manifest`` (the full state's, unsigned or not) as a delta version against ``base``
    whose chunks carry ``payload``; unsigned (sign it again: the signature covers the
    payload digest too)."""
    size, algorithm = manifest.chunk_bytes, manifest.digest_algorithm
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
        ),
    )


def base_of(manifest: WeightManifest) -> PolicyVersion | None:
    d = manifest.delta
    return PolicyVersion(d.base_incarnation, d.base_version) if d is not None else None


def payload_manifest(manifest: WeightManifest) -> WeightManifest:
    """The manifest a delta version's payload is assembled under: one uint8 tensor, the
    payload's chunk digests (same version, so its chunks are the version's chunks)."""
    d = manifest.delta
    if d is None:
        raise ValueError("not a delta manifest")
    return msgspec.structs.replace(
        manifest,
        total_bytes=d.total_bytes,
        tensors=[TensorSpec("delta-payload", "|u1", (d.total_bytes,), 0, d.total_bytes)],
        chunk_digests=d.chunk_digests,
        digest=d.digest,
        delta=None,
        signature=b"",
        seal_key=b"",
        seal_check=b"",
    )
