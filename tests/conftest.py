"""Shared fixtures: a Transport that fails the test on leaked endpoints, and URLs per medium.

``url_factory`` is parametrized over the three media, so a test that takes it runs once per
transport. Bind to ``url_factory()``; connect to ``endpoint.endpoints[0]`` (for tcp that is
the address the OS picked for port 0).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from echo2.transport import Transport

TRANSPORTS = ("inproc", "ipc", "tcp")
_IPC_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, less elsewhere
_names = itertools.count()


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    """A fresh Transport; a test that leaves an endpoint open fails at teardown."""
    t = Transport()
    yield t
    leaked = sorted(endpoint.name for endpoint in t.open_endpoints)
    t.close()
    if leaked:
        pytest.fail(f"endpoints left open at teardown: {leaked}", pytrace=False)


class UrlFactory:
    """Makes bind URLs for one medium: ``scheme`` is "inproc", "ipc" or "tcp"."""

    def __init__(self, scheme: str, ipc_dir: Path) -> None:
        self.scheme = scheme
        self._ipc_dir = ipc_dir

    def __call__(self, name: str = "ep") -> str:
        n = next(_names)
        if self.scheme == "inproc":
            return f"inproc://{name}-{n}"
        if self.scheme == "ipc":
            return f"ipc://{self._ipc_dir}/{name}-{n}.sock"
        return "tcp://127.0.0.1:0"


@pytest.fixture(params=TRANSPORTS)
def url_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UrlFactory]:
    ipc_dir, short_dir = tmp_path, None
    if len(str(tmp_path)) > _IPC_PATH_MAX - 20:  # a deep TMPDIR would overflow sun_path
        ipc_dir = short_dir = Path(tempfile.mkdtemp(prefix="e2-", dir="/tmp"))
    yield UrlFactory(request.param, ipc_dir)
    if short_dir is not None:
        shutil.rmtree(short_dir, ignore_errors=True)
