"""``python -m echo2.replay RUN_DIR ACTOR``: replay a recorded port into one actor (the tool
lives in :mod:`echo2.launch.replay`)."""

from echo2.launch.replay import main

if __name__ == "__main__":
    raise SystemExit(main())
