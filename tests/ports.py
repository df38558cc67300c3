"""TCP port ranges for tests that run several hosts of a topology on this machine."""

from __future__ import annotations

import random
import socket

SPAN = 32
"""Ports one host's binders may take (the tests' topologies need a handful)."""
_LOW, _HIGH = 20000, 32000
"""Below Linux's ephemeral range (32768-60999): no outgoing connection takes a port here
between choosing a range and binding it, as one did to 47000 in CI."""


def port_bases(count: int, span: int = SPAN) -> list[int]:
    """``count`` port bases whose ranges of ``span`` ports do not overlap and are free now."""
    bases: list[int] = []
    for _ in range(1000):
        base = random.randrange(_LOW, _HIGH - span)
        if any(abs(base - other) < span for other in bases) or not ports_free(base, span):
            continue
        bases.append(base)
        if len(bases) == count:
            return bases
    raise RuntimeError(f"no {count} free ranges of {span} tcp ports in {_LOW}-{_HIGH}")


def ports_free(base: int, span: int) -> bool:
    for port in range(base, base + span):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq's listener
            try:
                probe.bind(("", port))
            except OSError:
                return False
    return True
