"""Make CURVE key pairs for remote workers and servers.

    python -m echo2.keys DIR NAME [NAME ...]

Writes ``DIR/NAME.key`` (public: share it, put it on the server's allow-list) and
``DIR/NAME.key_secret`` (both halves: keep it on the machine that owns the name, mode 0600).
An existing pair is never overwritten.
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
