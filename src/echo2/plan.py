"""``python -m echo2.plan``: the capacity plan of a topology (the tool lives in :mod:`echo2.tools.plan`)."""

from echo2.tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
