"""``python -m echo2.audit``: reconcile a run's ledger (the tool lives in :mod:`echo2.tools.audit`)."""

from echo2.tools.audit import main

if __name__ == "__main__":
    raise SystemExit(main())
