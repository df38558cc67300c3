"""Exit codes of the launcher and of the processes it starts, and the words that go with them.

The launcher's code says how the run ended (``python -m echo2.launch``'s docstring lists
them); a child's says how its process ended, and the launcher reads it. One table, so that
the two sides and the tests agree.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path

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
