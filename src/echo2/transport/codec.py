"""Messages <-> ZeroMQ frames: a small msgpack header plus raw array buffers.

Frame layout (``docs/protocol.md`` is the normative description)::

    frame 0   b"\\xe2" + PROTOCOL_VERSION (1 byte) + msgpack map (the tagged message)
    frame 1.. raw little-endian buffers of large arrays, in order of reference

A bundle is several small messages in one frame 0: the msgpack map of each, in order,
inside one msgpack array (``b"\xe2" + version + array``), with no further frames. Senders
form bundles from messages sent back to back (``PushEndpoint``): one ZeroMQ message and one
decode call instead of many is what lets a receiver keep up with a stream of small records.

An array field is a msgpack ext value: type 1 refers to a separate frame
(``[frame_index, dtype, shape]``), type 2 carries the bytes inline (``[dtype, shape, bin]``).
Arrays of at least ``inline_limit`` bytes travel as their own frames, zero-copy on both
sides (a received array is a read-only numpy view on the ZeroMQ frame); smaller ones ride
in the header, since a frame costs a few microseconds and only pays off for large buffers.

Decoding is the first line of defence against hostile peers: the typed msgspec decoder
rejects wrong shapes and types without building large object graphs, dtypes come from a
short allow-list, every byte count is checked against the declared shape, and every extra
frame must be referenced exactly once. Any failure raises ``DecodeError``.
"""

from __future__ import annotations

import math
import types as types_module
import typing
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, overload

import msgspec
import numpy as np

from echo2.errors import DecodeError, ProtocolMismatch
from echo2.messages import PROTOCOL_VERSION, AnyMessage, Message

MAGIC = 0xE2
EXT_ARRAY_FRAME = 1
EXT_ARRAY_INLINE = 2
DEFAULT_INLINE_LIMIT = 64 * 1024
MAX_ARRAY_DIMS = 8

# Fixed-width numeric dtypes only: an "object" dtype would let a peer smuggle pointers.
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str for t in ("u1", "i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8", "?")
)

_PREAMBLE = bytes([MAGIC, PROTOCOL_VERSION])
_DECODE_FAILURES = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    ValueError,
    TypeError,
    UnicodeDecodeError,
    OverflowError,
    IndexError,
    KeyError,
)


M = TypeVar("M", bound=Message)


def _as_wire_array(array: np.ndarray) -> np.ndarray:
    """Little-endian and C-contiguous, copying only when it is not already."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray unconditionally: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


class Codec(Generic[M]):
    """Encodes and decodes one endpoint's messages. Not thread-safe: one per endpoint.

    ``types`` is the union of message classes this endpoint accepts; users with their own
    messages pass a union that includes them. Given one class, decoding returns that class
    (``Codec(ScoredGroup).decode`` is typed ``ScoredGroup``) and rejects any other.
    """

    @overload
    def __init__(self: Codec[M], types: type[M], *, inline_limit: int = ..., max_header_bytes: int = ...) -> None: ...
    @overload
    def __init__(
        self: Codec[Message], types: Any = ..., *, inline_limit: int = ..., max_header_bytes: int = ...
    ) -> None: ...
    def __init__(
        self,
        types: Any = AnyMessage,
        *,
        inline_limit: int = DEFAULT_INLINE_LIMIT,
        max_header_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.types = types
        """The message class or union this codec decodes (a recording's header names them)."""
        self.inline_limit = inline_limit
        self.max_header_bytes = max_header_bytes
        self._out_frames: list[Any] = []
        self._in_frames: Sequence[Any] = ()
        self._in_used: list[bool] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(types, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        # A bundle is told from a message by its msgpack array marker, which needs every
        # message type to encode as a map (the default for echo2's tagged messages).
        self.bundles = _all_map_structs(types)
        self._bundle_decoder = (
            msgspec.msgpack.Decoder(list[types], ext_hook=self._ext_hook, dec_hook=self._dec_hook)
            if self.bundles
            else None
        )

    # -- encode ----------------------------------------------------------------------

    def encode(self, message: Message) -> list[Any]:
        """Return the frames of ``message``: the header, then any large array buffers.

        Large arrays are referenced, not copied: the caller must not mutate them until the
        send completes (ZeroMQ holds them).
        """
        self._out_frames = frames = [b""]
        try:
            frames[0] = _PREAMBLE + self._encoder.encode(message)
        finally:
            self._out_frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            array = _as_wire_array(obj)
            if array.dtype.str not in ALLOWED_DTYPES:
                raise TypeError(f"dtype {array.dtype} cannot travel on the wire")
            shape = list(array.shape)
            if array.nbytes >= self.inline_limit:
                self._out_frames.append(array.data if array.ndim else array.tobytes())
                index = len(self._out_frames) - 1
                payload = msgspec.msgpack.encode([index, array.dtype.str, shape])
                return msgspec.msgpack.Ext(EXT_ARRAY_FRAME, payload)
            payload = msgspec.msgpack.encode([array.dtype.str, shape, array.tobytes()])
            return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, payload)
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")

    # -- decode ----------------------------------------------------------------------

    @staticmethod
    def bundle(headers: Sequence[bytes]) -> bytes:
        """Frame 0 of a bundle of single-frame messages (``headers``: their frame 0s)."""
        n = len(headers)
        if n < 2:
            raise ValueError("a bundle holds at least two messages")
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return b"".join([_PREAMBLE, head, *[h[2:] for h in headers]])

    def decode(self, frames: Sequence[Any]) -> M:
        """Decode frames (bytes, memoryviews or ``zmq.Frame``) into a message.

        Raises ``DecodeError`` (or ``ProtocolMismatch``) on anything malformed, a bundle
        included (``decode_any`` accepts both).
        """
        message = self.decode_any(frames)
        if isinstance(message, list):
            raise DecodeError(f"a bundle of {len(message)} messages where one was expected")
        return message

    def decode_any(self, frames: Sequence[Any]) -> M | list[M]:
        """A message, or the list of messages of a bundle. Raises ``DecodeError``."""
        if not frames:
            raise DecodeError("no frames")
        header = memoryview(frames[0])
        if len(header) < 3:
            raise DecodeError("header frame too short")
        if len(header) > self.max_header_bytes:
            raise DecodeError(f"header frame of {len(header)} bytes exceeds the limit")
        if header[0] != MAGIC:
            raise DecodeError("not an echo2 frame (bad magic byte)")
        if header[1] != PROTOCOL_VERSION:
            raise ProtocolMismatch(f"peer speaks protocol {header[1]}, this process speaks {PROTOCOL_VERSION}")
        marker = header[2]
        if (0x90 <= marker <= 0x9F or marker in (0xDC, 0xDD)) and self._bundle_decoder is not None:
            if len(frames) != 1:
                raise DecodeError(f"wrong frame count: a bundle has no data frames, got {len(frames) - 1}")
            self._in_frames = frames
            try:
                messages = self._bundle_decoder.decode(header[2:])
            except _DECODE_FAILURES as exc:
                raise DecodeError(f"bundle: {type(exc).__name__}: {exc}") from exc
            finally:
                self._in_frames = ()
            if len(messages) < 2:
                raise DecodeError(f"a bundle of {len(messages)} messages")
            return messages
        self._in_frames = frames
        self._in_used = [False] * len(frames)
        try:
            message = self._decoder.decode(header[2:])
        except DecodeError:
            raise
        except _DECODE_FAILURES as exc:
            raise DecodeError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._in_frames = ()
        if not all(self._in_used[1:]):
            raise DecodeError(f"wrong frame count: {len(frames) - 1} data frames, {sum(self._in_used[1:])} referenced")
        return message

    def _ext_hook(self, code: int, data: memoryview) -> np.ndarray:
        if code == EXT_ARRAY_FRAME:
            index, dtype_str, shape = msgspec.msgpack.decode(data, type=tuple[int, str, list[int]])
            if not 1 <= index < len(self._in_frames) or self._in_used[index]:
                raise DecodeError(f"array refers to frame {index}, which is missing or reused")
            self._in_used[index] = True
            return _array_view(self._in_frames[index], dtype_str, shape)
        if code == EXT_ARRAY_INLINE:
            dtype_str, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, list[int], bytes])
            return _array_view(raw, dtype_str, shape)
        raise DecodeError(f"unknown msgpack ext type {code}")

    @staticmethod
    def _dec_hook(expected: type, obj: Any) -> Any:
        if expected is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected {getattr(expected, '__name__', expected)}, got {type(obj).__name__}")


def _all_map_structs(types: Any) -> bool:
    """True if every type in ``types`` (a class or a Union) is a map-encoded msgspec Struct."""
    members = typing.get_args(types) if typing.get_origin(types) in (typing.Union, types_module.UnionType) else (types,)
    return all(
        isinstance(t, type) and issubclass(t, msgspec.Struct) and not t.__struct_config__.array_like for t in members
    )


def _array_view(buffer: Any, dtype_str: str, shape: list[int]) -> np.ndarray:
    if dtype_str not in ALLOWED_DTYPES:
        raise DecodeError(f"dtype {dtype_str!r} is not allowed")
    if len(shape) > MAX_ARRAY_DIMS or any(d < 0 for d in shape):
        raise DecodeError(f"bad array shape {shape}")
    dtype = np.dtype(dtype_str)
    view = memoryview(buffer)
    count = math.prod(shape)
    if count * dtype.itemsize != view.nbytes:
        raise DecodeError(
            f"array of shape {shape} and dtype {dtype_str} needs {count * dtype.itemsize} "
            f"bytes, frame has {view.nbytes}"
        )
    array = np.frombuffer(view, dtype=dtype, count=count).reshape(shape)
    array.flags.writeable = False
    return array
