"""Command-line tools over a topology or a run directory; none is imported by the library.

- ``python -m echo2.audit RUN_DIR``: reconcile the ledger (lost, duplicated, stale-trained).
- ``python -m echo2.report RUN_DIR``: plots and ``report.md``.
- ``python -m echo2.plan TOPOLOGY``: the capacity plan, before or after a run.
- ``python -m echo2.keys DIR NAME...``: CURVE and manifest-signing key pairs.
"""
