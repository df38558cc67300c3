"""Secure chunk streams: mutual TLS, certificates from one run CA, identities by name.

Under ``[security]`` every weight chunk stream (``echo2.weights.stream``) runs inside TLS
1.3 with certificates on both ends: the inbox proves to its sender that it is the member
the plan names, and the sender proves to the inbox that it is the publisher or one of the
inbox's predecessors in the current plan (``ChunkStreamServer``'s ``admit``). A peer's
identity is the common name of its certificate, which is its actor name
(``weight_publisher``, ``sampler-3``): the names relay plans are made of, so admission is a
set lookup and no address or host mapping is trusted.

Keys: ``python -m echo2.keys --tls DIR NAME ...`` makes the run CA once
(``DIR/stream-ca.crt``, and ``DIR/stream-ca.key``: keep it where certificates are issued,
never on a worker) and, per name, ``NAME.stream.crt`` and ``NAME.stream.key`` (mode 0600)
signed by it. A process needs the CA certificate and its own pair; nothing else is
distributed, and adding a worker means issuing one certificate. ECDSA P-256 keys; the
cipher is what TLS 1.3 negotiates (AES-GCM, with AES-NI on every x86 host we run on).

Why TLS and not CURVE on the data plane (``benchmarks/secure_streams.py``: 32 MB
versions in 1 MB chunks, loopback, uncapped, same run, interleaved, medians of 5; 2
shared cores; ``benchmarks/results/secure-streams-2026-12-01.json``): TLS 0.31x and
CURVE (ZeroMQ PUSH/PULL) 0.27x the plain chunk stream (plain ZeroMQ: 0.63x); an
earlier run gave 0.29x and 0.33x. Neither meets issue 14's 0.7x floor on this machine.
They cost the same, so the choice rests on the rest: TLS keeps the stream's bodies
landing in place (asyncio's SSL transport calls our ``BufferedProtocol``'s
``get_buffer`` and ``SSLObject.read`` decrypts into it; CURVE adds a copy out of each
ZeroMQ frame), identifies peers by the names plans are made of (CURVE keys are per
host), and needs nothing but the standard library. Where the time goes: not the cipher
(OpenSSL's AES-256-GCM runs at ~2.6 GB/s each way in this process through memory BIOs)
but asyncio's SSL pipeline, which passes every byte through two memory BIOs and a
Python-level loop per read; a blocking ``SSLSocket`` per connection was slower still
(~350 MB/s: one syscall per 16 KB record). Left to do for the floor: encrypt and
decrypt off the event loop (the ``ssl`` module releases the GIL in ``SSLObject``) or
kernel TLS.

We write no cryptography: the standard library's ``ssl`` (OpenSSL) runs the protocol and
``cryptography`` (already a dependency, for manifest signing) makes the certificates.
"""

from __future__ import annotations

import dataclasses
import datetime
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from echo2.errors import ConfigError

CA_CERT = "stream-ca.crt"
CA_KEY = "stream-ca.key"
VALID_DAYS = 3650


def cert_path(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"{name}.stream.crt"


def key_path(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"{name}.stream.key"


# -- issuing ---------------------------------------------------------------------------


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.touch(mode=0o600, exist_ok=False)  # never readable by others, not even briefly
    path.write_bytes(data)


def _builder(subject: str, issuer: str, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of other hosts
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def make_stream_ca(directory: str | Path) -> tuple[Path, Path]:
    """The run CA (``stream-ca.crt``, ``stream-ca.key``) in ``directory``; an existing one
    is kept. Returns (certificate, key)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key_file = directory / CA_CERT, directory / CA_KEY
    if cert.exists() and key_file.exists():
        return cert, key_file
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        _builder("echo2 stream CA", "echo2 stream CA", key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    _write_key(key_file, key)
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert, key_file


def make_stream_cert(directory: str | Path, name: str) -> tuple[Path, Path]:
    """``NAME.stream.crt`` and ``NAME.stream.key`` signed by the CA in ``directory``
    (made first if missing). Returns (certificate, key)."""
    directory = Path(directory)
    ca_cert_file, ca_key_file = make_stream_ca(directory)
    ca_key = serialization.load_pem_private_key(ca_key_file.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(ca_cert_file.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    issuer = ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    certificate = (
        _builder(name, str(issuer), key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert, key_file = cert_path(directory, name), key_path(directory, name)
    _write_key(key_file, key)
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert, key_file


# -- using -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamTLS:
    """One actor's TLS for chunk streams: ``server`` for its inbox, ``client`` for sending."""

    identity: str
    server: ssl.SSLContext
    client: ssl.SSLContext


def _context(purpose: ssl.Purpose, ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    side = ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT
    context = ssl.SSLContext(side)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED  # both ends: mutual authentication
    # Peers are named by their certificate's common name, checked by the caller against
    # the plan (``peer_identity``), not by a host name: inboxes are reached by address.
    context.check_hostname = False
    context.load_verify_locations(cafile=ca)
    context.load_cert_chain(cert, key)
    return context


def load_stream_tls(directory: str | Path, name: str) -> StreamTLS:
    """``name``'s TLS from ``directory``; a missing or mismatched file is one ConfigError line."""
    ca, cert, key = Path(directory) / CA_CERT, cert_path(directory, name), key_path(directory, name)
    for path in (ca, cert, key):
        if not path.is_file():
            raise ConfigError(
                f"no {path.name} in {directory} for chunk stream TLS "
                f"(make it with: python -m echo2.keys --tls {directory} {name})"
            )
    try:
        identity = certificate_identity(cert)
        if identity != name:
            raise ConfigError(f"{cert} is issued to {identity!r}, not {name!r}")
        _check_issued_by(cert, ca)
        server = _context(ssl.Purpose.CLIENT_AUTH, ca, cert, key)
        client = _context(ssl.Purpose.SERVER_AUTH, ca, cert, key)
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise ConfigError(f"cannot load chunk stream TLS for {name!r} from {directory}: {exc}") from exc
    return StreamTLS(identity=name, server=server, client=client)


def certificate_identity(cert: Path) -> str:
    certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _check_issued_by(cert: Path, ca: Path) -> None:
    """At load, not at the first handshake: a certificate from another run's CA is a
    config error, found by ``--dry-run``."""
    certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    authority = x509.load_pem_x509_certificate(ca.read_bytes())
    try:
        certificate.verify_directly_issued_by(authority)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise ConfigError(f"{cert} is not signed by {ca} (another CA's certificate?)") from exc


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str:
    """The verified peer's name (its certificate's common name); "" when there is none."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    subject: tuple[tuple[tuple[str, str], ...], ...] = (cert or {}).get("subject", ())  # type: ignore[assignment]
    for rdn in subject:
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


__all__ = [
    "CA_CERT",
    "StreamTLS",
    "cert_path",
    "certificate_identity",
    "key_path",
    "load_stream_tls",
    "make_stream_ca",
    "make_stream_cert",
    "peer_identity",
]
