"""The launcher's side of ``python -m echo2.join``: it answers ``JoinRequest`` on the join port.

A host with ``[hosts.NAME] join_port = P`` has its launcher bind a ROUTER on ``tcp://*:P``
(a CURVE server with the host's key pair under ``[security] curve``: only allowed keys get an
answer, or even a connection). Each ``JoinRequest`` gets a ``JoinInfo`` built from the
resolved topology's ``joined`` entry: unique sampler names, the job, the declared samplers'
portable config, where each Sampler port connects (derived with the stand-in
``JOINED_SAMPLER``, so every channel a sampler uses is reachable over tcp) and the CURVE
public keys to pin. Nothing in it is secret: the PromptSource still welcomes each sampler
by name (and by key under CURVE), and admission still checks what it sends. Once the run
is stopping, requests are refused (``accepted = False``) so that no worker joins a run
that is ending.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable

import msgspec

from echo2.messages import PROTOCOL_VERSION, JoinInfo, JoinPort, JoinRequest
from echo2.topology import ResolvedTopology
from echo2.transport import Transport
from echo2.transport.auth import CurveServer, CurveSettings
from echo2.transport.endpoint import CONTROL_MAX_MESSAGE_BYTES, RouterEndpoint, SocketOptions

log = logging.getLogger("echo2.launch.join")

MAX_SAMPLERS_PER_JOIN = 1024
"""Most samplers one ``JoinRequest`` may ask for (one worker process runs them all)."""
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def joined_names(base: str, count: int, grant: str) -> list[str]:
    """``count`` sampler names from a requested base: safe characters only, and a random
    ``grant`` per request, so that two workers asking for the same base (two processes on
    one machine, a worker restarted while its old connections linger) never collide."""
    safe = _NAME_UNSAFE.sub("-", base).strip("-")[:40] or "joined"
    return [f"{safe}-{grant}-{index}" for index in range(count)]


class JoinServer:
    """Answers ``JoinRequest``s for one run (see the module docstring)."""

    def __init__(
        self,
        resolved: ResolvedTopology,
        *,
        curve: CurveSettings | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        if resolved.joined is None:
            raise ValueError("the topology has no join_port")
        self.resolved = resolved
        self.host = resolved.joined.host
        self.port = resolved.hosts[self.host].join_port
        self._curve = curve
        self._stopping = stopping
        self.answered = 0
        self.refused = 0

    def answer(self, request: JoinRequest) -> JoinInfo:
        """The ``JoinInfo`` for one request: accepted with fresh names, or refused."""
        server_id = f"{self.resolved.run_id}/join"
        if request.protocol_version != PROTOCOL_VERSION:
            reason = f"protocol {request.protocol_version} not supported (this run speaks {PROTOCOL_VERSION})"
            return JoinInfo(server_id=server_id, accepted=False, reason=reason)
        if not 1 <= request.samplers <= MAX_SAMPLERS_PER_JOIN:
            reason = f"samplers: {request.samplers} is not within 1..{MAX_SAMPLERS_PER_JOIN}"
            return JoinInfo(server_id=server_id, accepted=False, reason=reason)
        if self._stopping():
            return JoinInfo(server_id=server_id, accepted=False, reason="the run is stopping")
        joined = self.resolved.joined
        assert joined is not None
        (stand_in,) = joined.actors
        ports = {
            name: JoinPort(
                connect=list(port.connect), curve_servers=list(port.curve_servers), stream_dial=list(port.stream_dial)
            )
            for name, port in stand_in.ports.items()
        }
        telemetry = JoinPort(connect=list(joined.telemetry_connect), curve_servers=list(joined.telemetry_curve_servers))
        keys: dict[str, str] = {}
        if self._curve is not None:
            named = {h for port in (*ports.values(), telemetry) for h in port.curve_servers if h}
            keys = {h: self._curve.server_keys[h].decode() for h in sorted(named) if h in self._curve.server_keys}
        return JoinInfo(
            server_id=server_id,
            accepted=True,
            run_id=self.resolved.run_id,
            names=joined_names(request.name, request.samplers, secrets.token_hex(3)),
            job=msgspec.to_builtins(self.resolved.job),
            sampler_config=dict(stand_in.config),
            ports=ports,
            telemetry=telemetry,
            curve=self._curve is not None,
            curve_public_keys=keys,
            heartbeat_s=self.resolved.run.heartbeat_s,
            drain_timeout_s=self.resolved.run.drain_timeout_s,
        )

    def open(self, transport: Transport) -> RouterEndpoint:
        """Bind the join port (a CURVE server admitting every allowed key under CURVE)."""
        curve = None
        if self._curve is not None:
            transport.enable_curve(self._curve.allowed)
            curve = CurveServer(self._curve.keys)
        return transport.router(
            name="launcher.join",
            bind=[f"tcp://*:{self.port}"],
            options=SocketOptions(max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
            curve=curve,
        )

    async def serve(self, endpoint: RouterEndpoint) -> None:
        """Answer requests until cancelled; anything else on the port is dropped (counted by
        the endpoint as it decodes)."""
        while True:
            for peer, message in await endpoint.recv_many():
                if not isinstance(message, JoinRequest):
                    continue
                info = self.answer(message)
                if info.accepted:
                    self.answered += 1
                    log.info(
                        "join: %d sampler(s) for %s (host %s, pid %d): %s",
                        len(info.names), message.name, message.host or "?", message.pid, ", ".join(info.names),
                    )  # fmt: skip
                else:
                    self.refused += 1
                    log.warning("join: refused %s (host %s): %s", message.name, message.host or "?", info.reason)
                await endpoint.send(peer, info)


__all__ = ["MAX_SAMPLERS_PER_JOIN", "JoinServer", "joined_names"]
