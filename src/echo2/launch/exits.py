"""How the launcher and the processes it starts end: exit codes, their words, the signals.

The launcher's code says how the run ended (``python -m echo2.launch``'s docstring lists
them); a child's says how its process ended, and the launcher reads it. One table, so that
the two sides and the tests agree.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

OK = 0
FAILED = 1
"""A process failed, or the run directory could not be written."""
BAD_CONFIG = 2
"""A bad topology or option: one line, nothing started."""
STORAGE = 74
"""A child's actor could not write the run directory (full, read-only): EX_IOERR of sysexits.h."""
DEADLINE = 124
"""``run.deadline_s`` passed before the run completed (as ``timeout(1)`` exits)."""
SIGNAL_BASE = 128
"""Stopped by signal N: 128 + N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), as shells report it."""
SIGINT = SIGNAL_BASE + signal.SIGINT
LAUNCHER_KILLED = SIGNAL_BASE + signal.SIGKILL
"""``status.json``'s code when the launcher died without writing it (a launcher stops only
by SIGKILL that way); its processes, which drained by themselves, write it."""

LAUNCHER_DIED = signal.SIGHUP
"""What the kernel sends a child when its launcher dies (``PR_SET_PDEATHSIG``, which the
launcher sets). Not SIGTERM, which the launcher sends to stop a child: the child must tell
the two apart at once, since what it writes after the launcher died goes into a pipe nobody
reads (during the launcher's exit its pid can still be the child's parent's). Children run
in their own session, so no terminal's hang-up reaches them."""

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""Write errors that say the run directory cannot take more, not that the program is wrong."""


def outcome(code: int) -> str:
    """The launcher's last line's word for how the run ended."""
    if code == OK:
        return "ok"
    if code == DEADLINE:
        return "INCOMPLETE"
    if code > SIGNAL_BASE:
        return "interrupted"
    return "FAILED"


def cannot_write(path: Path | str, exc: OSError) -> str:
    """One line for a write that failed: ``cannot write PATH: No space left on device (ENOSPC)``."""
    code = errno.errorcode.get(exc.errno or 0)
    return f"cannot write {path}: {exc.strerror or exc}" + (f" ({code})" if code else "")


def exit_process(code: int) -> NoReturn:
    """End a process the launcher started with ``code`` once its runtime has closed all it
    owns (sockets, the ZeroMQ context, run-directory files): flush the logs and the output,
    then leave without the interpreter's finalization, as ``multiprocessing`` ends its
    children.

    Finalization races with native threads: an executor thread that ran torch code (the
    learner's steps and evaluations, ``asyncio.to_thread``) runs its thread-local
    destructors after Python's join of it has returned, and one that needs the GIL once
    finalization began unwinds through C++ frames with ``pthread_exit``: ``terminate called
    without an active exception``, SIGABRT, and a finished run reported FAILED (pytorch
    issue 117762; ``tests/test_launch.py`` reproduces it)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or lost stream: nothing to keep
            stream.flush()
    os._exit(code)


class UsageError(Exception):
    """A bad command line: printed as one line, exit ``BAD_CONFIG``."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise ``UsageError`` (one line, exit 2) instead of printing the
    usage and exiting itself, so that every echo2 command reports a bad option alike."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
