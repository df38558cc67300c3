"""``python -m echo2.report``: plots and report.md of a run directory (the tool lives in :mod:`echo2.tools.report`)."""

from echo2.tools.report import main

if __name__ == "__main__":
    raise SystemExit(main())
