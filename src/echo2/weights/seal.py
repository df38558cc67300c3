"""Sealed weight versions: the content encrypted once at the publisher, opened once per member.

Under ``[security]`` a version's bytes are private without encrypting each hop. The
publisher draws a random 32-byte content key per version and encrypts every chunk once
(AES-256-CTR); the manifest's chunk digests are over that ciphertext, so relays verify and
forward it unchanged (no cryptography per hop) and a forged or altered chunk fails its
digest like any corrupt one (encrypt-then-MAC: the digest list is authenticated by the
CURVE channel the manifest travels on, and by its signature when signing is on). The key
travels only in the manifest (``WeightManifest.seal_key``), on the CURVE-encrypted
``weights`` ROUTER, never on a chunk stream. Each member opens each verified chunk once,
into its plaintext snapshot, in the verify thread that checked it
(``SnapshotAssembler``).

Nonce rule. AES-CTR must never reuse a (key, counter block) pair. Chunk ``index`` of
version (incarnation, version) starts at the 16-byte big-endian counter block

    incarnation mod 2**32 (u32) | version mod 2**32 (u32) | index (u32) | 0 (u32)

and ``cryptography`` increments the whole block per 16-byte AES block, so a chunk of at
most 2**32 blocks (``MAX_CHUNK_BYTES``, 64 GiB) never carries into the index field:
different chunks of a version use disjoint counter ranges. The key is fresh per version,
so across versions the pairs differ even where the prefix wraps.

``seal_check`` commits the manifest to its key (keyed BLAKE3 of the manifest digest): a
member holding any other key rejects the manifest before a byte is decrypted into garbage,
and because signing covers the check, a forged key in a signed manifest is refused too.

We write no cipher: ``cryptography`` (OpenSSL; already a dependency, for manifest signing)
does AES, with AES-NI (~7 GB/s per core here, ``update_into`` with no copy).
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
from collections.abc import Callable

import blake3
import msgspec
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from echo2.messages import Snapshot, WeightManifest
from echo2.weights.chunks import DEFAULT_CHUNK_BYTES, DEFAULT_DIGEST, ManifestRejected, digest, make_manifest

KEY_BYTES = 32
MAX_CHUNK_BYTES = 16 << 32
"""2**32 AES blocks: a chunk's counter never reaches the index field."""
MAX_CHUNKS = 1 << 32
_COUNTER = struct.Struct(">IIII")
_CHECK_CONTEXT = b"echo2 seal check v1"


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def counter_block(incarnation: int, version: int, index: int) -> bytes:
    """The AES-CTR initial counter block of one chunk (the nonce rule above)."""
    if not 0 <= index < MAX_CHUNKS:
        raise ValueError(f"chunk index {index} does not fit the nonce rule")
    return _COUNTER.pack(incarnation & 0xFFFFFFFF, version & 0xFFFFFFFF, index, 0)


def key_check(key: bytes, manifest_digest: bytes) -> bytes:
    """What ``seal_check`` holds: keyed BLAKE3 (key = the content key) of the manifest digest."""
    return blake3.blake3(_CHECK_CONTEXT + manifest_digest, key=key).digest()


def crypt_chunk(key: bytes, incarnation: int, version: int, index: int, src: np.ndarray, dst: np.ndarray) -> None:
    """Encrypt or decrypt (CTR is its own inverse) one chunk from ``src`` into ``dst``
    (same length; may be the same memory). Releases the GIL while it runs."""
    if src.nbytes > MAX_CHUNK_BYTES:
        raise ValueError("chunk too large for the nonce rule")
    cipher = Cipher(algorithms.AES(key), modes.CTR(counter_block(incarnation, version, index)))
    crypt = cipher.encryptor()
    crypt.update_into(src.data.cast("B"), dst.data.cast("B"))
    crypt.finalize()


def seal_version(
    snapshot: Snapshot,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    algorithm: str = DEFAULT_DIGEST,
    *,
    key: bytes | None = None,
    threads: int = 2,
    out: np.ndarray | None = None,
) -> tuple[Snapshot, WeightManifest]:
    """Encrypt ``snapshot`` under a fresh content key; returns the sealed snapshot (same
    layout, ciphertext data: what is streamed, repaired and written to shared memory) and
    its manifest (digests over the ciphertext, ``seal_key`` and ``seal_check`` set).

    Chunks are encrypted and then hashed in ``threads`` worker threads, each chunk hashed
    while it is still in cache (both calls release the GIL). ``out``: memory for the
    ciphertext (``total_bytes`` of uint8, never used before: pass it prefaulted, as a
    fresh allocation's page faults cost more than the encryption).
    """
    if chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError("chunk_bytes too large for the nonce rule")
    key = new_key() if key is None else key
    plain = snapshot.data.reshape(-1)
    sealed = np.empty_like(plain) if out is None else out
    if sealed.dtype != np.uint8 or sealed.shape != plain.shape:
        raise ValueError("out must be total_bytes of uint8")
    inc, ver = snapshot.incarnation, snapshot.version
    starts = range(0, plain.nbytes, chunk_bytes)

    def seal_one(start: int) -> bytes:
        src, dst = plain[start : start + chunk_bytes], sealed[start : start + chunk_bytes]
        crypt_chunk(key, inc, ver, start // chunk_bytes, src, dst)
        return digest(dst, algorithm)

    with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="seal") as pool:
        chunk_digests = list(pool.map(seal_one, starts))
    sealed_snapshot = Snapshot(
        incarnation=inc,
        version=ver,
        tensors=snapshot.tensors,
        data=sealed,
        created_at_s=snapshot.created_at_s,
        adapter=snapshot.adapter,
    )
    manifest = make_manifest(sealed_snapshot, chunk_bytes, algorithm, chunk_digests=chunk_digests)
    return sealed_snapshot, _with_key(manifest, key)


def _with_key(manifest: WeightManifest, key: bytes) -> WeightManifest:
    return msgspec.structs.replace(manifest, seal_key=key, seal_check=key_check(key, manifest.digest))


Opener = Callable[[int, np.ndarray, np.ndarray], None]
"""(index, ciphertext, plaintext destination) -> None: opens one verified chunk."""


def opener_for(manifest: WeightManifest) -> Opener | None:
    """How a member opens this version's chunks (None: not sealed); raises
    ``ManifestRejected`` for a key that is malformed or not the one the manifest commits to."""
    if not manifest.seal_key and not manifest.seal_check:
        return None
    if len(manifest.seal_key) != KEY_BYTES:
        raise ManifestRejected(f"content key is {len(manifest.seal_key)} bytes, not {KEY_BYTES}")
    if manifest.chunk_bytes > MAX_CHUNK_BYTES:
        raise ManifestRejected("chunk_bytes too large for the nonce rule")
    if key_check(manifest.seal_key, manifest.digest) != manifest.seal_check:
        raise ManifestRejected("content key does not open this version (seal_check mismatch)")
    key, inc, ver = manifest.seal_key, manifest.incarnation, manifest.version

    def open_chunk(index: int, sealed: np.ndarray, plain: np.ndarray) -> None:
        crypt_chunk(key, inc, ver, index, sealed, plain)

    return open_chunk


__all__ = [
    "KEY_BYTES",
    "MAX_CHUNK_BYTES",
    "Opener",
    "counter_block",
    "crypt_chunk",
    "key_check",
    "new_key",
    "opener_for",
    "seal_version",
]
