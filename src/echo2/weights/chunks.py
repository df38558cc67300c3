"""Weight snapshots as verified chunks: flatten, chunk, digest, assemble, verify.

A snapshot is one flat byte buffer plus a layout (``TensorSpec`` per tensor). The
publisher cuts it into ``chunk_bytes`` pieces and sends a ``WeightManifest`` (layout, one
digest per chunk, and a digest over the concatenated chunk digests) before the
chunks. A subscriber assembles into memory allocated once per version, checks each chunk
against the manifest as it lands, and hands out the tensors only when every chunk is
present and verified, so an engine never sees a partial or corrupt version.

The digest is BLAKE3 by default (``digest_algorithm`` in the manifest). Verification is
what bounds a receiver's uncapped throughput, and BLAKE3 (the ``blake3`` package, the
reference Rust implementation) hashes ~5 GB/s per core here against ~1.7 for OpenSSL's
SHA-256 with the CPU's SHA extensions and ~0.6 for BLAKE2b: at SHA-256's rate a single
subscriber could not take more than about half of what loopback TCP carries. It is a
cryptographic hash, which matters because chunks also arrive from peers (relay, repair):
a peer cannot forge a chunk that matches the publisher's (signed) manifest. "sha256" and
"blake2b-256" are still understood, for peers without the package.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import blake3
import numpy as np

from echo2.messages import PolicyVersion, Snapshot, TensorSpec, WeightChunk, WeightManifest

DEFAULT_CHUNK_BYTES = 1 << 20

_process_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_process_pools_lock = threading.Lock()


def _process_pool(role: str) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of threads for ``role``, one per core it may run on, shared by
    every receiver in it (hashing and decoding release the GIL, so they run in parallel):
    many samplers in one process must not each start a pool of as many threads as cores."""
    with _process_pools_lock:
        pool = _process_pools.get(role)
        if pool is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            pool = _process_pools[role] = concurrent.futures.ThreadPoolExecutor(max(1, cores), thread_name_prefix=role)
        return pool


def verify_pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's threads for verifying chunks (shared by its receivers)."""
    return _process_pool("verify")


def rebuild_pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's threads for rebuilding delta versions (shared by its receivers; apart
    from the verify threads, so a chunk's verification, and with it its forwarding down the
    chain, never queues behind decoding)."""
    return _process_pool("rebuild")


DEFAULT_DIGEST = "blake3"
DIGESTS = ("blake3", "sha256", "blake2b-256")


def digest(data: memoryview | bytes | np.ndarray, algorithm: str = DEFAULT_DIGEST) -> bytes:
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    if algorithm == "blake3":
        return blake3.blake3(view).digest()
    if algorithm == "sha256":
        return hashlib.sha256(view).digest()
    if algorithm == "blake2b-256":
        return hashlib.blake2b(view, digest_size=32).digest()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def flatten_tensors(
    tensors: Mapping[str, np.ndarray],
) -> tuple[list[TensorSpec], np.ndarray]:
    """Copy named arrays into one fresh uint8 buffer; returns (layout, buffer)."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, array in tensors.items():
        nbytes = int(array.nbytes)
        specs.append(TensorSpec(name, array.dtype.str, tuple(array.shape), offset, nbytes))
        offset += nbytes
    flat = np.empty(offset, dtype=np.uint8)
    for spec, array in zip(specs, tensors.values(), strict=True):
        flat[spec.offset : spec.offset + spec.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    return specs, flat


def prefaulted_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 with every page already mapped.

    A fresh allocation is mapped lazily: the first write to each page faults into the
    kernel, which zeroes it. For a snapshot that is tens of thousands of faults (30-300 ms
    per 256 MB here, varying with how fragmented memory is) paid in the middle of a
    broadcast; touching the pages ahead of time moves that cost out of the transfer.
    """
    buffer = np.empty(nbytes, dtype=np.uint8)
    buffer[:: mmap.PAGESIZE] = 0
    return buffer


def unflatten(specs: list[TensorSpec], flat: np.ndarray) -> dict[str, np.ndarray]:
    """Views (no copy) of each tensor inside ``flat``."""
    out = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        count = spec.nbytes // dtype.itemsize
        out[spec.name] = np.frombuffer(flat, dtype=dtype, count=count, offset=spec.offset).reshape(spec.shape)
    return out


def make_manifest(
    snapshot: Snapshot,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    algorithm: str = DEFAULT_DIGEST,
    *,
    chunk_digests: list[bytes] | None = None,
) -> WeightManifest:
    """``chunk_digests``: already computed (``echo2.weights.seal`` hashes as it encrypts)."""
    data = snapshot.data.data.cast("B")
    if chunk_digests is None:
        chunk_digests = [digest(data[i : i + chunk_bytes], algorithm) for i in range(0, len(data), chunk_bytes)]
    return WeightManifest(
        incarnation=snapshot.incarnation,
        version=snapshot.version,
        total_bytes=len(data),
        chunk_bytes=chunk_bytes,
        tensors=snapshot.tensors,
        chunk_digests=chunk_digests,
        digest=digest(b"".join(chunk_digests), algorithm),
        published_at_s=time.time(),
        digest_algorithm=algorithm,
        adapter=snapshot.adapter,
    )


def iter_chunks(snapshot: Snapshot, manifest: WeightManifest) -> Iterator[WeightChunk]:
    """Chunks as views into the snapshot (zero-copy; the snapshot must stay immutable)."""
    data = snapshot.data
    for index in range(len(manifest.chunk_digests)):
        start = index * manifest.chunk_bytes
        yield WeightChunk(
            incarnation=manifest.incarnation,
            version=manifest.version,
            index=index,
            data=data[start : start + manifest.chunk_bytes],
        )


class ManifestRejected(ValueError):
    """A manifest is inconsistent with itself (sizes, digests, layout)."""


def check_manifest(manifest: WeightManifest) -> None:
    n_chunks = -(-manifest.total_bytes // manifest.chunk_bytes) if manifest.chunk_bytes > 0 else -1
    if manifest.chunk_bytes <= 0 or n_chunks != len(manifest.chunk_digests):
        raise ManifestRejected("chunk count does not match total_bytes / chunk_bytes")
    if manifest.digest_algorithm not in DIGESTS:
        raise ManifestRejected(f"unknown digest algorithm {manifest.digest_algorithm!r}")
    if digest(b"".join(manifest.chunk_digests), manifest.digest_algorithm) != manifest.digest:
        raise ManifestRejected("snapshot digest does not match the chunk digests")
    end = 0
    for spec in manifest.tensors:
        itemsize = np.dtype(spec.dtype).itemsize
        if spec.offset != end or spec.nbytes != itemsize * math.prod(spec.shape):
            raise ManifestRejected(f"tensor {spec.name!r} has an inconsistent layout")
        end = spec.offset + spec.nbytes
    if end != manifest.total_bytes:
        raise ManifestRejected("tensors do not cover the snapshot exactly")


class SnapshotAssembler:
    """Collects one version's chunks; ``complete`` once every chunk is in and verified."""

    def __init__(
        self,
        manifest: WeightManifest,
        buffer: np.ndarray | None = None,
        *,
        opener: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
        plaintext: np.ndarray | None = None,
        on_stored: Callable[[int], None] | None = None,
    ) -> None:
        """``buffer``: memory to assemble into (``total_bytes`` of uint8, owned by this
        assembler from now on); by default a fresh allocation.

        A sealed version (``manifest.seal_key``) needs ``opener``
        (``echo2.weights.seal.opener_for``): ``buffer`` then holds the verified
        ciphertext (what is forwarded) and each chunk is opened once, as it is stored,
        into ``plaintext`` (same size; by default a fresh allocation), which ``tensors``
        views.

        ``on_stored(index)`` is called once per chunk as it is stored, in the thread that
        stored it (a delta payload's rebuild decodes what the chunk completes)."""
        check_manifest(manifest)
        if bool(manifest.seal_key) != (opener is not None):
            raise ValueError("a sealed manifest needs an opener, and only a sealed one takes one")
        self.manifest = manifest
        self.key: PolicyVersion = manifest.policy_version
        """The version being assembled."""
        self.buffer = self._own(buffer, manifest.total_bytes)
        self._opener = opener
        self.plaintext = self._own(plaintext, manifest.total_bytes) if opener is not None else self.buffer
        """The version's bytes in the clear (``buffer`` itself unless sealed)."""
        self.chunks_opened = 0
        self._have = np.zeros(len(manifest.chunk_digests), dtype=bool)
        # A chunk's region has at most one writer: a copy being verified, or a chunk stream
        # receiving into it (``destination``). Set and cleared under the lock.
        self._claimed = np.zeros(len(manifest.chunk_digests), dtype=bool)
        self._lock = threading.Lock()
        self.corrupt_chunks = 0
        self.started_at = time.monotonic()
        self._on_stored = on_stored

    @staticmethod
    def _own(buffer: np.ndarray | None, nbytes: int) -> np.ndarray:
        if buffer is None:
            return np.empty(nbytes, dtype=np.uint8)
        if buffer.dtype != np.uint8 or buffer.shape != (nbytes,):
            raise ValueError("buffer must be total_bytes of uint8")
        return buffer

    @property
    def complete(self) -> bool:
        return bool(self._have.all())

    def missing(self) -> list[int]:
        return np.flatnonzero(~self._have).tolist()

    def held(self) -> list[int]:
        """Indices of chunks stored and verified so far."""
        return np.flatnonzero(self._have).tolist()

    def chunk(self, index: int) -> WeightChunk:
        """A held chunk as a read-only view into the buffer (stored chunks are never
        written again, so the view can be handed to ZeroMQ)."""
        if not self._have[index]:
            raise KeyError(index)
        m = self.manifest
        start = index * m.chunk_bytes
        view = self.buffer[start : min(start + m.chunk_bytes, m.total_bytes)].view()
        view.flags.writeable = False
        return WeightChunk(incarnation=m.incarnation, version=m.version, index=index, data=view)

    def add(self, chunk: WeightChunk) -> bool:
        """Store a chunk if it is new and verifies; returns True if it was stored."""
        return self.offer(chunk) == "stored"

    def destination(self, index: int, nbytes: int) -> np.ndarray | None:
        """The region of chunk ``index``, claimed for a writer that receives the chunk
        straight into it (a chunk stream); None if the chunk is held, already being
        written, out of range or of the wrong size. The writer then ``offer``s a chunk
        whose data is this region (verified in place, never copied), or ``release``s it."""
        m = self.manifest
        if not 0 <= index < len(self._have):
            return None
        start = index * m.chunk_bytes
        if nbytes != min(m.chunk_bytes, m.total_bytes - start):
            return None
        with self._lock:
            if self._have[index] or self._claimed[index]:
                return None
            self._claimed[index] = True
        return self.buffer[start : start + nbytes]

    def release(self, chunk: WeightChunk) -> None:
        """Give back a region from ``destination`` whose chunk never arrived whole (no-op
        for a chunk that is not its region)."""
        if self._in_place(chunk):
            with self._lock:
                self._claimed[chunk.index] = False

    def _in_place(self, chunk: WeightChunk) -> bool:
        """Whether ``chunk``'s data is its own region of the buffer (same memory)."""
        m = self.manifest
        if chunk.policy_version != self.key or not 0 <= chunk.index < len(self._have):
            return False
        start = chunk.index * m.chunk_bytes
        return (
            chunk.data.nbytes == min(m.chunk_bytes, m.total_bytes - start)
            and chunk.data.__array_interface__["data"][0] == self.buffer[start:].__array_interface__["data"][0]
        )

    def offer(self, chunk: WeightChunk) -> str:
        """Like ``add``, with the outcome: "stored", "duplicate", "corrupt" (wrong size or
        digest; counted in ``corrupt_chunks``) or "foreign" (another version, bad index).

        A chunk whose data is its own region (from ``destination``) is verified where it
        lies; any other is verified, then copied in. A chunk whose region is being written
        by another writer counts as a duplicate. Safe to call from several threads for
        different chunks (hashing releases the GIL).
        """
        m = self.manifest
        if chunk.policy_version != self.key or not 0 <= chunk.index < len(self._have):
            return "foreign"
        index = chunk.index
        start = index * m.chunk_bytes
        expected_len = min(m.chunk_bytes, m.total_bytes - start)
        region = self.buffer[start : start + expected_len]
        in_place = self._in_place(chunk)
        if not in_place:
            with self._lock:
                if self._have[index] or self._claimed[index]:
                    return "duplicate"
                self._claimed[index] = True
        try:
            if chunk.data.nbytes != expected_len or digest(chunk.data, m.digest_algorithm) != m.chunk_digests[index]:
                self.corrupt_chunks += 1
                return "corrupt"
            if not in_place:
                region[:] = chunk.data
            if self._opener is not None:
                # Opened before it counts as held: ``complete`` means every chunk is in the clear.
                self._opener(index, region, self.plaintext[start : start + expected_len])
            with self._lock:
                self._have[index] = True
                self.chunks_opened += self._opener is not None
            if self._on_stored is not None:
                self._on_stored(index)
            return "stored"
        finally:
            with self._lock:
                self._claimed[index] = False

    def tensors(self) -> dict[str, np.ndarray]:
        if not self.complete:
            raise RuntimeError("snapshot is incomplete")
        return unflatten(self.manifest.tensors, self.plaintext)
