"""``python -m echo2.launch TOPOLOGY``: see :mod:`echo2.launch.supervisor`."""

from echo2.launch.supervisor import main

if __name__ == "__main__":
    raise SystemExit(main())
