"""Ed25519 signatures on weight manifests: samplers install only the learner's weights.

A manifest's ``digest`` covers every chunk digest, and each chunk is checked against its
digest on arrival, so signing the manifest signs the whole snapshot. Sign once per version
(~80 us), verify once per version (~370 us); never per chunk. An HMAC key shared with
volunteer workers would let any of them forge weights; a public verification key does not.

Keys are PEM files made by ``python -m echo2.keys --sign DIR NAME``: ``NAME.sign.pem``
(private, stays with the learner) and ``NAME.sign.pub.pem`` (public, given to samplers).
``cryptography`` provides Ed25519 (a well-kept library; we write no crypto ourselves).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from echo2.errors import ConfigError
from echo2.messages import WeightManifest
from echo2.weights.chunks import ManifestRejected


def signed_payload(manifest: WeightManifest) -> bytes:
    """The bytes a signature covers: identity, layout and the snapshot digest, and for a
    sealed version the check that commits it to its content key (so a forged key in a
    signed manifest is refused; the key itself is secret and never signed)."""
    fields: list[object] = [
        b"echo2-manifest-v1",
        manifest.incarnation,
        manifest.version,
        manifest.total_bytes,
        manifest.chunk_bytes,
        manifest.digest_algorithm,
        manifest.digest,
        manifest.tensors,
    ]
    if manifest.seal_check:  # unsealed manifests sign exactly what they always did
        fields.append(manifest.seal_check)
    if manifest.adapter is not None:  # how the tensors act on the base model is attested too
        fields.append([b"lora", manifest.adapter.rank, manifest.adapter.alpha])
    if manifest.delta is not None:  # and dense ones too: the payload's digest is signed beside the state's
        d = manifest.delta
        signed = [b"delta", d.base_incarnation, d.base_version, d.total_bytes, d.digest]
        fields.append([*signed, d.chunk_bytes] if d.chunk_bytes else signed)
    return msgspec.msgpack.encode(fields)


def make_signing_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private = directory / f"{name}.sign.pem"
    public = directory / f"{name}.sign.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return public, private


class ManifestSigner:
    def __init__(self, private_key_path: str | Path) -> None:
        try:
            key = serialization.load_pem_private_key(Path(private_key_path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot load signing key {private_key_path}: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{private_key_path} is not an Ed25519 private key")
        self._key = key

    def sign(self, manifest: WeightManifest) -> WeightManifest:
        return msgspec.structs.replace(manifest, signature=self._key.sign(signed_payload(manifest)))


class ManifestVerifier:
    def __init__(self, public_key_path: str | Path) -> None:
        try:
            key = serialization.load_pem_public_key(Path(public_key_path).read_bytes())
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot load verification key {public_key_path}: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{public_key_path} is not an Ed25519 public key")
        self._key = key

    def verify(self, manifest: WeightManifest) -> None:
        """Raise ``ManifestRejected`` unless the learner's key signed this manifest."""
        if not manifest.signature:
            raise ManifestRejected("manifest is not signed")
        try:
            self._key.verify(manifest.signature, signed_payload(manifest))
        except InvalidSignature:
            raise ManifestRejected("bad manifest signature (not the learner's key, or altered)") from None
