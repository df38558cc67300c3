"""``python -m echo2.join HOST:PORT``: samplers join a running job (the tool lives in :mod:`echo2.launch.join`)."""

from echo2.launch.join import main

if __name__ == "__main__":
    raise SystemExit(main())
