"""Make CURVE key pairs for remote workers and servers.

    python -m echo2.keys DIR NAME [NAME ...]

Writes ``DIR/NAME.key`` (public: share it, put it on the server's allow-list) and
``DIR/NAME.key_secret`` (both halves: keep it on the machine that owns the name, mode 0600).
An existing pair is never overwritten.

    python -m echo2.keys --tls DIR NAME [NAME ...]

Chunk stream TLS under ``[security]`` (``echo2.weights.secure``): the run CA
(``DIR/stream-ca.crt``; ``DIR/stream-ca.key`` stays where certificates are issued) once,
then per actor name (the weight publisher's and each sampler's: ``sampler-0`` ...)
``NAME.stream.crt`` and ``NAME.stream.key`` (mode 0600) signed by it. Give each process
the CA certificate and its actors' pairs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from echo2.transport.auth import make_keypair


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo2.keys", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("names", nargs="+")
    parser.add_argument(
        "--sign",
        action="store_true",
        help="make Ed25519 manifest-signing pairs (NAME.sign.pem, NAME.sign.pub.pem) instead",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="make chunk stream TLS certificates (NAME.stream.crt/.key, signed by DIR/stream-ca.crt) instead",
    )
    args = parser.parse_args(argv)
    if args.tls:
        return _make_stream_certs(args.directory, args.names)
    if args.sign:
        from echo2.weights.signing import make_signing_keypair

        for name in args.names:
            if (args.directory / f"{name}.sign.pem").exists():
                print(f"echo2.keys: {args.directory / name}.sign.pem exists; not overwriting", file=sys.stderr)
                return 2
        for name in args.names:
            public, private = make_signing_keypair(args.directory, name)
            print(f"{name}: public {public}  private {private}")
        return 0
    for name in args.names:
        if (args.directory / f"{name}.key_secret").exists():
            print(f"echo2.keys: {args.directory / name}.key_secret exists; not overwriting", file=sys.stderr)
            return 2
    for name in args.names:
        public, secret = make_keypair(args.directory, name)
        print(f"{name}: public {public}  secret {secret}")
    return 0


def _make_stream_certs(directory: Path, names: Sequence[str]) -> int:
    from echo2.weights.secure import cert_path, make_stream_cert

    for name in names:
        if cert_path(directory, name).exists():
            print(f"echo2.keys: {cert_path(directory, name)} exists; not overwriting", file=sys.stderr)
            return 2
    for name in names:
        cert, key = make_stream_cert(directory, name)
        print(f"{name}: certificate {cert}  key {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
