"""Shared-memory snapshots for samplers on the publisher's host.

A sampler beside its publisher need not receive a version over TCP at all: the publisher
writes the snapshot once into a file in a shared-memory directory (``/dev/shm``) and names
it to every local member (``WeightShm``); each maps it copy-on-write, verifies every chunk
against the manifest where it lies, and installs it. Any number of local samplers share
one copy of the bytes, and nothing is trusted: a chunk that fails verification is repaired
over the usual channel.

"Local" means sharing the directory, not the host name: containers on one machine may
each have their own ``/dev/shm``. Both sides compute ``shm_identity`` (the boot id plus the
directory's device and inode) and the publisher uses the path only for members whose
identity equals its own.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

DEFAULT_SHM_DIR = "/dev/shm"


def default_shm_dir() -> str | None:
    return DEFAULT_SHM_DIR if os.path.isdir(DEFAULT_SHM_DIR) and os.access(DEFAULT_SHM_DIR, os.W_OK) else None


def shm_identity(directory: str | None) -> str:
    """Equal for two processes iff they see the same ``directory`` on the same boot of the
    same machine; "" when there is none to share."""
    if not directory:
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(directory)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def write_snapshot(directory: str, name: str, data: np.ndarray) -> str:
    """Write ``data`` (uint8) to ``directory/name`` (created private to this user); returns
    the path. Never rewritten afterwards: a new version gets a new file."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # write(2), not a mapping: the kernel fills fresh tmpfs pages without a fault each
        view = np.ascontiguousarray(data).reshape(-1).data.cast("B")
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def map_snapshot(path: str, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``path`` mapped copy-on-write: readable in place, and writable (a
    repaired chunk lands in this process's private copy of that page only). Raises OSError
    when the file is gone or has another size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        if nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        # No MAP_POPULATE: on a private writable mapping it would copy every page.
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping outlives the descriptor (and the file's unlinking)
    return np.frombuffer(mapped, dtype=np.uint8)


__all__ = ["DEFAULT_SHM_DIR", "default_shm_dir", "map_snapshot", "shm_identity", "write_snapshot"]
