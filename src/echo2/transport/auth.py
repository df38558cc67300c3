"""CURVE encryption and ZAP authentication for endpoints that leave the host.

A remote worker proves who it is with its CURVE key pair; the server side accepts only
public keys on the allow-list, and the peer's identity is that public key (the ``User-Id``
ZeroMQ attaches to every message), never a client-chosen routing id.

Facts this follows (transport-facts.md): a CURVE server with no ZAP handler accepts any
client, so the authenticator starts before any CURVE socket binds, server sockets set
``ZAP_DOMAIN`` and ``ZAP_ENFORCE_DOMAIN`` (a missing handler then refuses everyone), and
CURVE costs ~5x on loopback throughput, so it is used only where a link leaves the host.

Keys are ZeroMQ certificate files (``NAME.key`` public, ``NAME.key_secret`` both halves),
made by ``python -m echo2.keys``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
import zmq.auth.asyncio

from echo2.errors import ConfigError

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"echo2"


@dataclasses.dataclass(frozen=True)
class CurveKeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


@dataclasses.dataclass(frozen=True)
class CurveServer:
    """This socket accepts CURVE clients whose keys the process's authenticator allows:
    ``admits`` only, when given (a port of trusted actors), else every allowed key."""

    keys: CurveKeyPair
    admits: frozenset[bytes] | None = None  # z85 public keys


@dataclasses.dataclass(frozen=True)
class CurveClient:
    """This socket connects as a CURVE client; ``server_keys[url]`` pins each server."""

    keys: CurveKeyPair
    server_keys: dict[str, bytes]


def make_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_keypair(path: str | Path) -> CurveKeyPair:
    """Both halves from a ``.key_secret`` file."""
    try:
        public, secret = zmq.auth.load_certificate(Path(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE key pair {path}: {exc}") from exc
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (use the .key_secret file)")
    return CurveKeyPair(public=public, secret=secret)


def load_public_key(path: str | Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(Path(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load CURVE public key {path}: {exc}") from exc
    return public


def load_public_keys(paths: Iterable[str | Path]) -> set[bytes]:
    """Public keys from files, or from every ``*.key`` in a directory."""
    keys: set[bytes] = set()
    for path in map(Path, paths):
        files = sorted(path.glob("*.key")) if path.is_dir() else [path]
        keys.update(load_public_key(f) for f in files)
    return keys


def zap_domain(server: CurveServer) -> bytes:
    """The ZAP domain a server socket authenticates in: one per set of admitted keys."""
    if server.admits is None:
        return ZAP_DOMAIN
    digest = hashlib.blake2b(b"\n".join(sorted(server.admits)), digest_size=8).hexdigest()
    return ZAP_DOMAIN + b"-only-" + digest.encode()


def apply_server(socket: zmq.Socket, server: CurveServer) -> None:
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, server.keys.secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, server.keys.public)
    socket.setsockopt(zmq.ZAP_DOMAIN, zap_domain(server))
    socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def apply_client(socket: zmq.Socket, client: CurveClient) -> None:
    socket.setsockopt(zmq.CURVE_SECRETKEY, client.keys.secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, client.keys.public)


@dataclasses.dataclass(frozen=True)
class CurveSettings:
    """One process's CURVE material: its host's key pair, servers' public keys, allow-list."""

    keys: CurveKeyPair
    server_keys: dict[str, bytes]  # host -> public key
    allowed: set[bytes]

    @classmethod
    def load(cls, keys_dir: str | Path, host: str, hosts: Iterable[str], allowed: Sequence[str]) -> CurveSettings:
        keys_dir = Path(keys_dir)
        server_keys = {h: load_public_key(keys_dir / f"{h}.key") for h in hosts if (keys_dir / f"{h}.key").exists()}
        allowed_paths = list(allowed) or [str(keys_dir / "allowed")]
        return cls(
            keys=load_keypair(keys_dir / f"{host}.key_secret"),
            server_keys=server_keys,
            allowed=load_public_keys(allowed_paths),
        )

    def for_urls(
        self, curve_server: bool, connect: Sequence[str], servers: Sequence[str], clients: Sequence[str] = ()
    ) -> CurveServer | CurveClient | None:
        """The CURVE role of a socket from its resolved addresses (``clients``: the hosts a
        server admits; none: every allowed key)."""
        if curve_server:
            if not clients:
                return CurveServer(self.keys)
            missing = [host for host in clients if host not in self.server_keys]
            if missing:
                raise ConfigError(f"no public key for host {missing[0]!r} (expected {missing[0]}.key in the keys dir)")
            return CurveServer(self.keys, admits=frozenset(self.server_keys[host] for host in clients))
        pinned = {}
        for url, host in zip(connect, servers, strict=False):
            if host:
                if host not in self.server_keys:
                    raise ConfigError(f"no public key for host {host!r} (expected {host}.key in the keys dir)")
                pinned[url] = self.server_keys[host]
        if not pinned:
            return None
        if len(pinned) != len(connect):
            raise ConfigError(f"a socket connects to CURVE and plain servers at once: {list(connect)}")
        return CurveClient(self.keys, pinned)

    def for_port(self, addresses: Any) -> CurveServer | CurveClient | None:
        return self.for_urls(
            addresses.curve_server, addresses.connect, addresses.curve_servers, addresses.curve_clients
        )


class Authenticator:
    """The process's ZAP handler: allows exactly the listed CURVE public keys.

    Start it before binding any CURVE server socket (``Transport.enable_curve`` does).
    """

    def __init__(self, context: zmq.Context, allowed: set[bytes]) -> None:
        self.allowed = set(allowed)
        self.refused = 0
        self._only: dict[str, frozenset[bytes]] = {}  # ZAP domain -> the keys it admits
        self._zap = zmq.auth.asyncio.AsyncioAuthenticator(context)
        self._zap.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=self)

    def serve(self, server: CurveServer) -> None:
        """Authenticate ``server``'s domain: call before the socket binds."""
        if server.admits is not None:
            domain = zap_domain(server).decode()
            if domain not in self._only:
                self._only[domain] = server.admits
                self._zap.configure_curve_callback(domain=domain, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: does this (z85) client public key get in here?"""
        only = self._only.get(domain)
        allowed = key in self.allowed if only is None else key in only
        if not allowed:
            self.refused += 1
            what = "an unknown key" if key not in self.allowed else "a key not admitted on this port"
            log.warning("refused a CURVE client with %s (%d refused so far)", what, self.refused)
        return allowed

    def start(self) -> None:
        self._zap.start()

    def stop(self) -> None:
        self._zap.stop()
