"""``python -m echo2.keys``: make CURVE and signing key pairs (the tool lives in :mod:`echo2.tools.keys`)."""

from echo2.tools.keys import main

if __name__ == "__main__":
    raise SystemExit(main())
