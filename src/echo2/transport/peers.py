"""Who is behind each connection of a ROUTER: names bound to routing ids (and CURVE keys).

A client's routing id identifies one *connection*, never a name: echo2's clients use
``connection_routing_id(name)``, the name plus a random nonce, and claim the name in a
message (``Hello.peer_id``, ``WeightSubscribe.sampler_id``). The server binds each name to
the routing id that claimed it (``PeerTable``) and serves a name only on its bound
connection.

Why not the name as routing id with ``ZMQ_ROUTER_HANDOVER`` (echo2 before): handover makes
the ROUTER terminate the pipe of the live connection holding an id as soon as another
connection presents the same id. With traffic in flight on the old connection, libzmq 4.3.5
then aborts the whole process (``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``, libzmq issues #4841/#4852: an output event dispatched
to an engine that already failed), so any client knowing a sampler's name could kill the
learner's or the data process. Without handover a duplicate id is ignored by libzmq
(no eviction, no abort), and a nonce per connection means an honest restart never collides.

Telling a restart from a live duplicate, without a sleep: when a new connection claims a
bound name, the table probes the old connection (``Probe``; ROUTER_MANDATORY makes a send to
a connection that is gone fail at once). Gone: the name moves to the new connection (a
restart). Still up: the claim is refused with ``name_in_use`` and a retry delay of one
heartbeat timeout, after which a connection that went silent (host lost) has been dropped
by ZeroMQ's heartbeats and the retry succeeds.

Under CURVE a name is also bound to the public key (``User-Id``) that first held it in this
run: another key claiming it is refused (``name_bound_to_another_key``), even once the first
connection is gone.

Known limit (libzmq 4.3.5, no socket option avoids it): a ROUTER gives a client that sets
no routing id the next value of a counter (``0x00`` + 4 bytes) and aborts if a client
already chose that value. A client that takes the next ids and then connects without one
can therefore still abort a ROUTER reachable without CURVE (``tests/test_identity.py``
keeps a strict xfail for it); under CURVE only allowed keys get that far.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

from echo2.messages import Probe, RefusalReason
from echo2.transport.endpoint import RouterEndpoint

PROBE_TIMEOUT_S = 1.0
"""A probe that cannot be queued within this long (the old connection's pipe is full)
counts as "still up": a full pipe belongs to a connection that was receiving."""
PROBE_INTERVAL_S = 1.0
"""A connection found up is not probed again for this long: a client repeating claims to a
live peer's name costs that peer at most one ``Probe`` a second."""


def connection_routing_id(name: str) -> bytes:
    """The routing id a client sets on a connection: ``name/nonce`` (nonce: 12 hex digits).

    Unique per connection, so that a restarted client never presents the id of its previous
    connection; the name in it is for logs only, servers never read a name from it.
    """
    return f"{name}/{secrets.token_hex(6)}".encode()


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A claim refused: why (typed, counted) and what the client is told."""

    reason: RefusalReason
    message: str
    retry_after_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A claim granted. ``replaced``: the routing id the name was bound to before (a
    restarted peer's previous connection), or None."""

    replaced: bytes | None = None


class PeerTable:
    """Names bound to routing ids on one ROUTER, with the probe that settles a contested name."""

    def __init__(self, router: RouterEndpoint, *, server_id: str, retry_after_s: float) -> None:
        self._router = router
        self._server_id = server_id
        self._retry_after_s = retry_after_s
        self._route_of: dict[str, bytes] = {}
        self._name_of: dict[bytes, str] = {}
        self._key_of: dict[str, str] = {}  # name -> CURVE User-Id that first held it
        self._found_up_s: dict[bytes, float] = {}  # route -> when a probe last found it up
        self.refused: dict[str, int] = {}
        """Claims refused, by ``RefusalReason``."""

    def name_of(self, route: bytes) -> str | None:
        """The name bound to this connection, or None (never claimed, refused or replaced)."""
        return self._name_of.get(route)

    def routes(self) -> list[bytes]:
        """The connections that hold a name now."""
        return list(self._route_of.values())

    def route_of(self, name: str) -> bytes | None:
        return self._route_of.get(name)

    def holds(self, route: bytes, name: str) -> bool:
        """True if ``name`` is bound to this connection."""
        return self._route_of.get(name) == route

    async def claim(self, route: bytes, name: str) -> Claimed | Refusal:
        """Bind ``name`` to ``route`` if no other live connection (or other key) holds it."""
        key = self._router.user_id(route)
        owner = self._key_of.get(name)
        if key is not None and owner is not None and owner != key:
            return self.refuse(
                "name_bound_to_another_key",
                f"name {name!r} belongs to another CURVE key in this run; this key may not claim it",
            )
        old = self._route_of.get(name)
        if old is not None and old != route:
            if await self._is_up(old):
                # The holder's routing id stays here: the refused client learns nothing of it.
                return self.refuse(
                    "name_in_use",
                    f"name {name!r} is held by another connection that is still up; "
                    f"retry after {self._retry_after_s:g} s if that one was yours",
                    self._retry_after_s,
                )
            del self._name_of[old]
            self._found_up_s.pop(old, None)
        previous = self._name_of.get(route)
        if previous is not None and previous != name:
            del self._route_of[previous]  # one name per connection: the latest claim
        self._route_of[name] = route
        self._name_of[route] = name
        if key is not None:
            self._key_of.setdefault(name, key)
        return Claimed(replaced=old if old != route else None)

    def release(self, route: bytes) -> None:
        """Forget a connection: the name it held is free."""
        self._found_up_s.pop(route, None)
        name = self._name_of.pop(route, None)
        if name is not None and self._route_of.get(name) == route:
            del self._route_of[name]

    async def _is_up(self, route: bytes) -> bool:
        now = time.monotonic()
        if now - self._found_up_s.get(route, -PROBE_INTERVAL_S) < PROBE_INTERVAL_S:
            return True
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                up = await self._router.send(route, Probe(server_id=self._server_id))
        except TimeoutError:
            up = True
        if up:
            self._found_up_s[route] = now
        return up

    def refuse(self, reason: RefusalReason, message: str, retry_after_s: float = 0.0) -> Refusal:
        """A refusal, counted in ``refused`` by reason (also for reasons decided outside
        the table, such as a protocol version)."""
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return Refusal(reason, message, retry_after_s)
