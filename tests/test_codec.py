"""Codec properties: every message round-trips; every malformed input is a ``DecodeError``.

Strategies are derived from the Structs themselves (``msgspec.inspect``), so a message or a
field added to ``echo2.messages`` is covered without touching this file. Arrays come from
``hypothesis.extra.numpy`` in every allowed dtype, both small (inline in the header) and
>= 64 KiB (a separate, zero-copy frame). Hostile input is crafted at three levels: raw bytes,
msgpack trees (structure-aware), and edits of valid encodings. The only acceptable outcomes
are a decoded message (an edit can produce another valid message) or ``DecodeError``.
"""

from __future__ import annotations

import inspect
import math
import random
import re
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from echo2.errors import DecodeError, ProtocolMismatch
from echo2.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    STATISTICS_TYPES,
    EndpointHealth,
    Message,
    WeightChunk,
    WorkRequest,
)
from echo2.transport.codec import (
    ALLOWED_DTYPES,
    DEFAULT_INLINE_LIMIT,
    EXT_ARRAY_FRAME,
    EXT_ARRAY_INLINE,
    MAGIC,
    MAX_ARRAY_DIMS,
    Codec,
)

ROUND_TRIP = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings(ROUND_TRIP, max_examples=1000)  # random bytes and mutations
CRAFTED = settings(ROUND_TRIP, max_examples=400)  # targeted malformations, one rule each

DTYPES = sorted(ALLOWED_DTYPES)
PREAMBLE = bytes([MAGIC, PROTOCOL_VERSION])
TYPE_INFO = {cls: mi.type_info(cls) for cls in MESSAGE_TYPES}
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- strategies from types


def arrays(large: bool | None = None) -> st.SearchStrategy[np.ndarray]:
    """Arrays of every allowed dtype; ``large`` ones (>= 64 KiB) travel as their own frame."""

    def of(dtype_str: str, big: bool) -> st.SearchStrategy[np.ndarray]:
        dtype = np.dtype(dtype_str)
        if big:
            lo = -(-DEFAULT_INLINE_LIMIT // dtype.itemsize)  # ceil: at least the limit
            shape = st.integers(lo, lo + 4096).map(lambda n: (n,)) | st.just((256, -(-lo // 256)))
        else:
            shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)
        return hnp.arrays(dtype, shape)

    sizes = [large] if large is not None else [False, False, False, True]
    return st.tuples(st.sampled_from(DTYPES), st.sampled_from(sizes)).flatmap(lambda a: of(*a))


def for_type(info: mi.Type, big_arrays: bool | None) -> st.SearchStrategy[Any]:
    """A strategy for values of one msgspec type (as reported by ``msgspec.inspect``)."""
    match info:
        case mi.CustomType(cls=cls) if cls is np.ndarray:
            return arrays(big_arrays)
        case mi.StructType():
            return struct_of(info, big_arrays)
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else None)
            high = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else None)
            return st.integers(
                min_value=-(2**63) if low is None else low,
                max_value=2**64 - 1 if high is None else high,
            )
        case mi.FloatType():
            return st.floats(
                allow_nan=False,
                min_value=info.ge if info.ge is not None else info.gt,
                max_value=info.le if info.le is not None else info.lt,
                exclude_min=info.gt is not None,
                exclude_max=info.lt is not None,
            )
        case mi.StrType(pattern=str() as pattern):
            return st.from_regex(pattern, fullmatch=True)
        case mi.StrType():
            return st.text(min_size=info.min_length or 0, max_size=info.max_length or 12)
        case mi.BytesType():
            return st.binary(max_size=40)
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(info.values)
        case mi.ListType() | mi.VarTupleType():
            items = st.lists(for_type(info.item_type, big_arrays), max_size=3)
            return items.map(tuple) if isinstance(info, mi.VarTupleType) else items
        case mi.TupleType():
            return st.tuples(*(for_type(t, big_arrays) for t in info.item_types))
        case mi.DictType():
            return st.dictionaries(
                for_type(info.key_type, big_arrays),
                for_type(info.value_type, big_arrays),
                max_size=3,
            )
        case mi.UnionType():
            return st.one_of(*(for_type(t, big_arrays) for t in info.types))
        case mi.AnyType():  # free-form data (``LeaseRecord.meta``): plain msgpack values
            return st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8))
    raise NotImplementedError(f"no strategy for {info!r}: extend tests/test_codec.py")


def struct_of(info: mi.StructType, big_arrays: bool | None) -> st.SearchStrategy[Any]:
    """Required fields always, fields with defaults sometimes (then the default is used)."""
    fields = {f.name: (f, for_type(f.type, big_arrays)) for f in info.fields}
    required = {name: strategy for name, (f, strategy) in fields.items() if f.required}
    optional = {name: strategy for name, (f, strategy) in fields.items() if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: info.cls(**kw))


def messages(cls: type[Message] | None = None, big_arrays: bool | None = None) -> st.SearchStrategy[Message]:
    if cls is not None:
        return struct_of(TYPE_INFO[cls], big_arrays)
    return st.sampled_from(MESSAGE_TYPES).flatmap(lambda c: struct_of(TYPE_INFO[c], big_arrays))


# ----------------------------------------------------------------------------- helpers


def assert_same(a: Any, b: Any, path: str = "$") -> None:
    """Deep equality that understands numpy arrays (Struct ``==`` does not)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert b.dtype == a.dtype and b.shape == a.shape, path
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
        assert a.tobytes() == b.tobytes(), path  # bit-exact, NaN payloads included
    elif isinstance(a, msgspec.Struct):
        assert type(b) is type(a), path
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, list | tuple):
        assert type(b) is type(a) and len(b) == len(a), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert type(b) is dict and b.keys() == a.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    else:
        assert type(b) is type(a) and b == a, f"{path}: {a!r} != {b!r}"


def iter_arrays(value: Any) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, msgspec.Struct):
        return [x for name in value.__struct_fields__ for x in iter_arrays(getattr(value, name))]
    if isinstance(value, list | tuple):
        return [x for item in value for x in iter_arrays(item)]
    if isinstance(value, dict):
        return [x for item in value.values() for x in iter_arrays(item)]
    return []


def decodes_or_rejects(codec: Codec, frames: list[Any]) -> None:
    """The contract for arbitrary input: a message, or DecodeError; any other error fails."""
    try:
        message = codec.decode(frames)
    except DecodeError:
        return
    assert isinstance(message, MESSAGE_TYPES)


def raw_tree(header: bytes) -> Any:
    """A valid header as plain msgpack values, ext values kept as ``Ext`` for editing."""
    return msgspec.msgpack.decode(header[2:], ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data)))


def header_of(tree: Any) -> bytes:
    return PREAMBLE + msgspec.msgpack.encode(tree)


def inline(dtype: str, shape: list[int], raw: bytes) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, msgspec.msgpack.encode([dtype, shape, raw]))


def by_frame(index: int, dtype: str, shape: list[int]) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(EXT_ARRAY_FRAME, msgspec.msgpack.encode([index, dtype, shape]))


# The (message type, field) pairs whose value is an array directly under the message map.
ARRAY_FIELDS = [
    (cls, f.encode_name)
    for cls, info in TYPE_INFO.items()
    for f in info.fields
    if isinstance(f.type, mi.CustomType) and f.type.cls is np.ndarray
]


# ------------------------------------------------------- a corpus of valid messages to corrupt


def random_value(info: mi.Type, rng: random.Random, big: bool) -> Any:
    """A random valid value of one msgspec type, without hypothesis (to build a corpus)."""
    match info:
        case mi.CustomType(cls=cls) if cls is np.ndarray:
            dtype = np.dtype(rng.choice(DTYPES))
            if big:
                shape: tuple[int, ...] = (-(-DEFAULT_INLINE_LIMIT // dtype.itemsize) + rng.randrange(64),)
            else:
                shape = tuple(rng.randrange(4) for _ in range(rng.randrange(3)))
            raw = rng.randbytes(math.prod(shape) * dtype.itemsize)
            return np.frombuffer(raw, dtype).reshape(shape)
        case mi.StructType():
            return info.cls(
                **{f.name: random_value(f.type, rng, big) for f in info.fields if f.required or rng.random() < 0.5}
            )
        case mi.BoolType():
            return rng.random() < 0.5
        case mi.IntType():
            low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else -(2**63))
            high = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else 2**64 - 1)
            return rng.choice([low, high, rng.randint(max(low, -999), min(high, 999))])
        case mi.FloatType():
            return rng.choice([0.0, -2.5, 1e300, rng.uniform(-1e6, 1e6)])
        case mi.StrType(pattern=None):
            return "".join(rng.choice("az09 |\x00\u00e9\u2603\U0001f600") for _ in range(rng.randrange(9)))
        case mi.BytesType():
            return rng.randbytes(rng.randrange(20))
        case mi.NoneType() | mi.AnyType():
            return None
        case mi.LiteralType():
            return rng.choice(info.values)
        case mi.ListType() | mi.VarTupleType():
            items = [random_value(info.item_type, rng, big) for _ in range(rng.randrange(3))]
            return tuple(items) if isinstance(info, mi.VarTupleType) else items
        case mi.TupleType():
            return tuple(random_value(t, rng, big) for t in info.item_types)
        case mi.DictType():
            return {
                random_value(info.key_type, rng, big): random_value(info.value_type, rng, big)
                for _ in range(rng.randrange(3))
            }
        case mi.UnionType():
            return random_value(rng.choice(info.types), rng, big)
    raise NotImplementedError(f"no generator for {info!r}: extend tests/test_codec.py")


def build_corpus(per_type: int, big: bool) -> list[Message]:
    rng = random.Random(0xE2)
    return [random_value(info, rng, big) for info in TYPE_INFO.values() for _ in range(per_type)]


CORPUS = build_corpus(per_type=6, big=False)
CORPUS_BIG = [m for m in build_corpus(per_type=2, big=True) if iter_arrays(m)]


def seeds(big_arrays: bool = False) -> st.SearchStrategy[Message]:
    """Valid messages to corrupt, from a fixed corpus: these tests run thousands of examples
    and drawing nested messages with hypothesis costs milliseconds each."""
    return st.sampled_from(CORPUS + CORPUS_BIG if big_arrays else CORPUS)


# -------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
@ROUND_TRIP
def test_every_message_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    codec = Codec()
    message = data.draw(messages(cls))
    frames = codec.encode(message)
    arrays_in = iter_arrays(message)
    large = [a for a in arrays_in if a.nbytes >= DEFAULT_INLINE_LIMIT]
    assert len(frames) == 1 + len(large)
    assert bytes(frames[0][:2]) == PREAMBLE
    decoded = codec.decode(frames)
    assert_same(message, decoded)
    assert not any(a.flags.writeable for a in iter_arrays(decoded))
    # The same frames after a trip through the wire (plain bytes) decode identically.
    assert_same(message, codec.decode([bytes(memoryview(f).cast("B")) for f in frames]))


@given(message=messages(big_arrays=True))
@settings(ROUND_TRIP, max_examples=40)
def test_large_arrays_always_travel_as_frames(message: Message) -> None:
    frames = Codec().encode(message)
    assert len(frames) == 1 + len(iter_arrays(message))
    assert_same(message, Codec().decode(frames))


def test_every_message_type_is_covered() -> None:
    assert len(MESSAGE_TYPES) == len(set(MESSAGE_TYPES)) >= 17
    assert ARRAY_FIELDS, "no message has a top-level array field to attack"


def test_large_array_is_a_read_only_view_of_its_frame() -> None:
    codec = Codec()
    data = np.arange(256 * 1024, dtype=np.uint8)
    frames = codec.encode(WeightChunk(incarnation=1, version=2, index=3, data=data))
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), data)  # sender: no copy
    wire = bytearray(memoryview(frames[1]))
    decoded = codec.decode([frames[0], wire])
    assert np.shares_memory(decoded.data, np.frombuffer(wire, np.uint8))  # receiver: no copy
    assert not decoded.data.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        decoded.data[0] = 1
    frame = zmq.Frame(bytes(wire))
    from_zmq = codec.decode([frames[0], frame])
    assert np.shares_memory(from_zmq.data, np.frombuffer(frame.buffer, np.uint8))
    assert np.array_equal(from_zmq.data, data)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(7, dtype=">i4"),  # big-endian: sent little-endian
        np.arange(40, dtype=np.float64)[::3],  # strided
        np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        np.arange(70_000, dtype=">f4")[::2],  # large, strided and big-endian
        np.array(5, dtype=np.int64),  # zero-dimensional
    ],
    ids=["big-endian", "strided", "fortran", "large-strided-big-endian", "0-d"],
)
def test_arrays_are_normalised_to_little_endian_c_order(array: np.ndarray) -> None:
    message = WeightChunk(incarnation=0, version=0, index=0, data=array)
    decoded = Codec().decode(Codec().encode(message)).data
    assert decoded.dtype == array.dtype.newbyteorder("<")
    assert decoded.shape == array.shape and np.array_equal(decoded, array)


@pytest.mark.parametrize("dtype", ["O", "<c16", "<M8[ns]", "S3", "<U2", "V4"])
def test_encoding_a_disallowed_dtype_fails_at_the_sender(dtype: str) -> None:
    array = np.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match="cannot travel"):
        Codec().encode(WeightChunk(incarnation=0, version=0, index=0, data=array))


# ---------------------------------------------------------------------- hostile input


@given(frames=st.lists(st.binary(max_size=300), min_size=0, max_size=4))
@FUZZ
def test_random_bytes_are_rejected(frames: list[bytes]) -> None:
    decodes_or_rejects(Codec(), frames)


@given(body=st.binary(max_size=300), extra=st.lists(st.binary(max_size=64), max_size=2))
@FUZZ
def test_random_bytes_after_a_valid_preamble_are_rejected(body: bytes, extra: list[bytes]) -> None:
    decodes_or_rejects(Codec(), [PREAMBLE + body, *extra])


# msgpack trees shaped like messages: maps with a real type tag, random values, random exts.
MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=24))
)
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def message_shaped_trees(draw: st.DrawFn) -> dict[str, Any]:
    cls = draw(st.sampled_from(MESSAGE_TYPES))
    names = [f.encode_name for f in TYPE_INFO[cls].fields]
    tree = {"type": cls.__name__}
    for name in draw(st.lists(st.sampled_from(names), unique=True, max_size=4)):
        tree[name] = draw(MSGPACK_VALUES)
    return tree


@given(tree=message_shaped_trees(), extra=st.lists(st.binary(max_size=32), max_size=2))
@FUZZ
def test_message_shaped_msgpack_with_random_values_is_rejected(tree: dict[str, Any], extra: list[bytes]) -> None:
    decodes_or_rejects(Codec(), [header_of(tree), *extra])


@given(message=seeds(), cut=st.integers(0, 1 << 20))
@CRAFTED
def test_truncated_headers_are_rejected(message: Message, cut: int) -> None:
    frames = Codec().encode(message)
    header = bytes(frames[0])
    with pytest.raises(DecodeError):
        Codec().decode([header[: cut % len(header)], *frames[1:]])


@st.composite
def mutated_encodings(draw: st.DrawFn) -> list[bytes]:
    frames = [bytes(memoryview(f).cast("B")) for f in Codec().encode(draw(seeds(big_arrays=True)))]
    header = bytearray(frames[0])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "frames"]))
        at = draw(st.integers(0, len(header)))
        if op == "flip" and at < len(header):
            header[at] ^= draw(st.integers(1, 255))
        elif op == "insert":
            header[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and at < len(header):
            del header[at : at + draw(st.integers(1, 4))]
        elif op == "frames":
            edit = draw(st.sampled_from(["drop", "add", "duplicate", "swap", "shrink"]))
            data = frames[1:]
            if edit == "drop" and data:
                data.pop(draw(st.integers(0, len(data) - 1)))
            elif edit == "add":
                data.append(draw(st.binary(max_size=64)))
            elif edit == "duplicate" and data:
                data.append(data[0])
            elif edit == "swap" and len(data) > 1:
                data[0], data[-1] = data[-1], data[0]
            elif edit == "shrink" and data:
                data[-1] = data[-1][:-1]
            frames = [frames[0], *data]
    return [bytes(header), *frames[1:]]


@given(frames=mutated_encodings())
@FUZZ
def test_mutated_encodings_decode_or_are_rejected(frames: list[bytes]) -> None:
    decodes_or_rejects(Codec(), frames)


@given(message=messages(big_arrays=True), extra=st.binary(max_size=64))
@settings(ROUND_TRIP, max_examples=30)
def test_extra_and_missing_frames_are_rejected(message: Message, extra: bytes) -> None:
    codec = Codec()
    frames = codec.encode(message)
    with pytest.raises(DecodeError, match="frame"):
        codec.decode([*frames, extra])
    if len(frames) > 1:
        with pytest.raises(DecodeError, match="frame"):
            codec.decode(frames[:-1])


@given(version=st.integers(0, 255).filter(lambda v: v != PROTOCOL_VERSION), message=seeds())
@settings(ROUND_TRIP, max_examples=100)
def test_another_protocol_version_is_a_protocol_mismatch(version: int, message: Message) -> None:
    frames = Codec().encode(message)
    header = bytes([MAGIC, version]) + bytes(frames[0][2:])
    with pytest.raises(ProtocolMismatch):
        Codec().decode([header, *frames[1:]])


def test_bad_magic_short_and_empty_input_are_rejected() -> None:
    header = Codec().encode(WorkRequest(sampler_id="s", credits=1))[0]
    for frames in ([], [b""], [b"\xe2"], [b"\xe2\x01"], [b"\x00" + header[1:]], [header + b"\x00"]):
        with pytest.raises(DecodeError):
            Codec().decode(frames)


def test_a_codec_for_one_class_decodes_it_and_rejects_others() -> None:
    chunk = WeightChunk(incarnation=1, version=2, index=0, data=np.arange(8, dtype=np.uint8))
    codec = Codec(WeightChunk)
    decoded = codec.decode(Codec().encode(chunk))
    assert type(decoded) is WeightChunk and decoded.index == 0
    np.testing.assert_array_equal(decoded.data, chunk.data)
    with pytest.raises(DecodeError):
        codec.decode(Codec().encode(WorkRequest(sampler_id="s", credits=1)))


def test_oversized_headers_are_rejected() -> None:
    message = WorkRequest(sampler_id="x" * 5000, credits=1)
    header = Codec().encode(message)[0]
    with pytest.raises(DecodeError, match="exceeds the limit"):
        Codec(max_header_bytes=4096).decode([header])
    assert Codec(max_header_bytes=len(header)).decode([header]) == message
    huge = PREAMBLE + msgspec.msgpack.encode({"type": "WorkRequest", "sampler_id": "y" * (16 << 20)})
    with pytest.raises(DecodeError, match="exceeds the limit"):
        Codec().decode([huge])


@st.composite
def bad_array_values(draw: st.DrawFn) -> tuple[msgspec.msgpack.Ext, list[bytes]]:
    """An array ext that must be refused, with the data frames that come with it."""
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = np.dtype(dtype).itemsize
    n = draw(st.integers(0, 16))
    raw = bytes(n * itemsize)
    kind = draw(
        st.sampled_from(
            [
                "unknown-ext",
                "bad-dtype",
                "byte-count",
                "negative-shape",
                "too-many-dims",
                "inline-garbage",
                "frame-index",
                "frame-reused",
                "frame-size",
                "frame-garbage",
            ]
        )
    )
    if kind == "unknown-ext":
        code = draw(st.integers(-128, 127).filter(lambda c: c not in (1, 2)))
        return msgspec.msgpack.Ext(code, draw(st.binary(max_size=32))), []
    if kind == "bad-dtype":
        bad = draw(
            st.sampled_from(["O", "|O", "<c16", ">i4", "<M8[ns]", "V4", "S4", "<U1", "int32", ""])
            | st.text(max_size=6).filter(lambda s: s not in ALLOWED_DTYPES)
        )
        if draw(st.booleans()):
            return inline(bad, [n], raw), []
        return by_frame(1, bad, [n]), [raw]
    if kind == "byte-count":
        wrong = draw(st.integers(0, 32).filter(lambda m: m != n))
        if draw(st.booleans()):
            return inline(dtype, [wrong], raw), []
        return by_frame(1, dtype, [wrong]), [raw]
    if kind == "negative-shape":
        shape = draw(st.lists(st.integers(-(2**63), 2**20), min_size=1, max_size=4))
        assume(any(d < 0 for d in shape))
        return inline(dtype, shape, raw), []
    if kind == "too-many-dims":
        shape = [1] * draw(st.integers(MAX_ARRAY_DIMS + 1, 64)) + [n]
        return inline(dtype, shape, raw), []
    if kind == "inline-garbage":
        return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, draw(MSGPACK_VALUES.map(msgspec.msgpack.encode))), []
    if kind == "frame-index":
        index = draw(st.integers(-(2**63), 2**64 - 1).filter(lambda i: i != 1))
        return by_frame(index, dtype, [n]), [raw]
    if kind == "frame-reused":
        return by_frame(1, dtype, [n]), [raw, raw]  # frame 2 is never referenced
    if kind == "frame-size":
        return by_frame(1, dtype, [n]), [raw + b"\x00" * draw(st.integers(1, itemsize * 2))]
    return msgspec.msgpack.Ext(EXT_ARRAY_FRAME, draw(MSGPACK_VALUES.map(msgspec.msgpack.encode))), [raw]


@given(
    target=st.sampled_from(ARRAY_FIELDS).flatmap(
        lambda cf: st.tuples(st.sampled_from([m for m in CORPUS if type(m) is cf[0]]), st.just(cf[1]))
    ),
    bad=bad_array_values(),
)
@CRAFTED
def test_bad_array_values_are_rejected(
    target: tuple[Message, str], bad: tuple[msgspec.msgpack.Ext, list[bytes]]
) -> None:
    message, field = target
    tree = raw_tree(Codec().encode(message)[0])
    value, frames = bad
    tree[field] = value
    with pytest.raises(DecodeError):
        Codec().decode([header_of(tree), *frames])


MULTI_ARRAY = [(cls, fields) for cls in MESSAGE_TYPES if len(fields := [f for c, f in ARRAY_FIELDS if c is cls]) >= 2]


@pytest.mark.skipif(not MULTI_ARRAY, reason="no message has two array fields")
@given(
    target=st.sampled_from(MULTI_ARRAY).flatmap(
        lambda cf: st.tuples(st.sampled_from([m for m in CORPUS if type(m) is cf[0]]), st.just(cf[1]))
    )
)
@settings(ROUND_TRIP, max_examples=20)
def test_one_frame_referenced_twice_is_rejected(target: tuple[Message, list[str]]) -> None:
    message, fields = target
    tree = raw_tree(Codec().encode(message)[0])
    tree[fields[0]] = tree[fields[1]] = by_frame(1, "|u1", [4])
    with pytest.raises(DecodeError, match="missing or reused"):
        Codec().decode([header_of(tree), b"abcd"])


def wrong_value_for(info: mi.Type) -> Any:
    """A msgpack value that no value of type ``info`` accepts."""
    return [1, "two"] if _takes_a_map(info) else {"not": ["this"]}


def _takes_a_map(info: mi.Type) -> bool:
    if isinstance(info, mi.UnionType):
        return any(_takes_a_map(t) for t in info.types)
    return isinstance(info, mi.DictType) or (isinstance(info, mi.StructType) and not info.array_like)


@given(
    message=seeds(),
    data=st.data(),
)
@CRAFTED
def test_wrong_field_types_and_missing_fields_are_rejected(message: Message, data: st.DataObject) -> None:
    info = TYPE_INFO[type(message)]
    tree = raw_tree(Codec().encode(message)[0])
    choices = [f for f in info.fields] + ["tag"]
    if any(f.required for f in info.fields):
        choices.append("missing")
    choice = data.draw(st.sampled_from(choices))
    if choice == "tag":
        tree["type"] = data.draw(
            st.sampled_from([None, 1, b"WorkRequest", "workrequest", "Message", ""])
            | st.text(max_size=12).filter(lambda s: s not in {c.__name__ for c in MESSAGE_TYPES})
        )
    elif choice == "missing":
        required = [f.encode_name for f in info.fields if f.required]
        del tree[data.draw(st.sampled_from(required))]
    else:
        tree[choice.encode_name] = wrong_value_for(choice.type)
    with pytest.raises(DecodeError):
        Codec().decode([header_of(tree)])


@given(blob=st.binary(max_size=40), count=st.integers(0, 2**32 - 1))
@settings(ROUND_TRIP, max_examples=200)
def test_length_prefixes_larger_than_the_input_are_rejected_cheaply(blob: bytes, count: int) -> None:
    """A map/array/str header that claims 4 G items must not allocate them."""
    for prefix in (b"\xdf", b"\xdd", b"\xdb", b"\xc6"):  # map32, array32, str32, bin32
        header = PREAMBLE + b"\x82\xa4type\xabWorkRequest\xaasampler_id" + prefix
        header += count.to_bytes(4, "big") + blob
        decodes_or_rejects(Codec(), [header])


# -------------------------------------------------------------------- docs stay in sync


def field_table() -> str:
    """The field table of docs/protocol.md, generated from the Structs: every message, then
    the statistics records and ``EndpointHealth`` that heartbeats carry.

    An ndarray's expected dtype and shape come from the comment after its field in
    ``echo2/messages.py`` (``token_ids: np.ndarray  # int32 (sum_i T_i,)``).
    """
    lines = ["| message | field | type | default |", "|---|---|---|---|"]
    for cls in (*MESSAGE_TYPES, *STATISTICS_TYPES, EndpointHealth):
        notes = dict(re.findall(r"^\s+(\w+): np\.ndarray\s+#\s*(.+?)\s*$", inspect.getsource(cls), re.M))
        for f in mi.type_info(cls).fields:
            default = "required" if f.required else _default_text(f)
            kind = _type_text(f.type)
            if f.name in notes:
                kind += f", {notes[f.name]}"
            lines.append(f"| `{cls.__name__}` | `{f.encode_name}` | {kind} | {default} |")
    return "\n".join(lines)


def _default_text(f: mi.Field) -> str:
    if f.default_factory is not msgspec.NODEFAULT:
        return f"`{f.default_factory()!r}`"
    return f"`{f.default!r}`"


def _type_text(info: mi.Type) -> str:
    names: dict[type, str] = {
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.StrType: "str",
        mi.BoolType: "bool",
        mi.BytesType: "bin",
        mi.NoneType: "nil",
        mi.AnyType: "any msgpack value",
    }
    match info:
        case mi.CustomType(cls=cls) if cls is np.ndarray:
            return "ndarray"
        case mi.StructType(array_like=True):
            return (
                f"{info.cls.__name__} (as array: "
                + ", ".join(f"{f.encode_name}: {_type_text(f.type)}" for f in info.fields)
                + ")"
            )
        case mi.StructType():
            return f"`{info.cls.__name__}` map"
        case mi.LiteralType():
            return "str, one of " + ", ".join(f"`{v!r}`" for v in info.values)
        case mi.ListType() | mi.VarTupleType():
            return f"array of {_type_text(info.item_type)}"
        case mi.DictType():
            return f"map {_type_text(info.key_type)} -> {_type_text(info.value_type)}"
        case mi.UnionType():
            return " or ".join(_type_text(t) for t in info.types)
    return names[type(info)]


def test_protocol_doc_field_table_matches_the_code() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    found = re.search(r"<!-- fields:begin -->\n(.*?)\n<!-- fields:end -->", doc, re.S)
    assert found, "docs/protocol.md lost its <!-- fields:begin/end --> markers"
    expected = field_table()
    assert found.group(1).strip() == expected, (
        "docs/protocol.md is out of date with echo2.messages; replace the table with:\n" + expected
    )


def test_protocol_doc_constants_match_the_code() -> None:
    doc = (REPO / "docs" / "protocol.md").read_text()
    assert f"0x{MAGIC:02X}" in doc and f"version byte | `{PROTOCOL_VERSION}`" in doc
    for dtype in ALLOWED_DTYPES:
        assert f"`{dtype}`" in doc, dtype
    assert f"{DEFAULT_INLINE_LIMIT} bytes" in doc
