"""``python -m echo2.join ADDRESS``: start samplers that join a running job from outside its topology.

::

    python -m echo2.join HOST:PORT [--samplers N] [--name NAME] [--price-per-hour X] [--capacity R]
                         [--set FIELD=VALUE]... [--key KEYPAIR --server-key PUBLIC_KEY]
                         [--run-dir DIR] [--torch-threads T] [--metrics-port P] [--wait-s S]

``HOST:PORT`` is the job's join port (``[hosts.NAME] join_port`` of the host whose launcher
answers it). The worker asks it (``JoinRequest``) for what its samplers need and gets a
``JoinInfo`` (``echo2.launch.join_server``): their names, the job, the declared samplers'
portable config, where each of their ports connects, and the CURVE public keys to pin. It
then runs ``N`` Samplers in this process as a launched process would (``ProcessRuntime``):
each says Hello to the PromptSource (which checks the model it serves), installs the
current weights from the WeightPublisher, and is admitted by the activation scheduler like
a declared sampler: it is measured from its heartbeats, priced at ``--price-per-hour``, and
estimated at ``--capacity`` rollouts/s until measured.

* ``--set FIELD=VALUE`` sets a field of the samplers' config (``engine=simulated``,
  ``credits=4``, ``engine_kwargs={...}``, ``relay_host=...``), or with ``job.`` a field of
  the job as this machine sees it (``job.model=/path/to/the/model``: where the job's model
  lies here; the PromptSource still checks it is the job's).
* An address the topology gives as loopback (a one-machine topology) is replaced by the
  host this worker dialled: the join host's endpoints are where the join port is.
* With ``[security] curve = true`` the join port and every endpoint are CURVE servers:
  ``--key`` is this worker's key pair (``python -m echo2.keys``; its public half must be in
  the job's allowed keys) and ``--server-key`` the join host's public key. Only allowed
  keys get an answer.
* Leaving: Ctrl-C or SIGTERM drains the samplers; each says ``Goodbye`` and the
  PromptSource re-issues its leases at once (not at their deadlines). Exit 130 / 143. When
  the run ends the PromptSource says so (``RunEnded``) and this exits 0.
* Exit codes (``echo2.launch.exits``): 2 for a bad option or a refusal (one line), 1 when
  the join port did not answer within ``--wait-s`` or a sampler failed (e.g. a model that is
  not the job's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from echo2.actor import PortAddresses
from echo2.actors.sampler import Sampler
from echo2.config import convert_config
from echo2.errors import ActorFailed, ConfigError, one_line
from echo2.job import JobConfig
from echo2.launch import exits
from echo2.launch.child import set_torch_threads
from echo2.messages import JoinInfo, JoinPort, JoinRequest
from echo2.rundir import RunDir
from echo2.runtime import ProcessRuntime
from echo2.topology.schema import parse_override
from echo2.transport import Transport
from echo2.transport.auth import CurveClient, CurveKeyPair, CurveSettings, load_keypair, load_public_key
from echo2.transport.endpoint import CONTROL_MAX_MESSAGE_BYTES, SocketOptions

log = logging.getLogger("echo2.join")

PROG = "python -m echo2.join"
_WAIT_LOG_S = 5.0
"""Seconds between two lines saying the join port has not answered yet."""
_LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def _parser() -> exits.OneLineParser:
    parser = exits.OneLineParser(prog=PROG, description="Join a running echo2 job with samplers it does not declare.")
    parser.add_argument("address", help="the job's join port: HOST:PORT ([hosts.NAME] join_port)")
    parser.add_argument("--samplers", type=int, default=1, help="samplers to run in this process (default 1)")
    parser.add_argument("--name", default="", help="base of the samplers' names (default: this host's name)")
    parser.add_argument("--price-per-hour", type=float, help="what this worker costs, dollars per hour")
    parser.add_argument(
        "--capacity",
        type=float,
        help="rollouts per second each sampler delivers (the scheduler's estimate until measured)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a sampler config field (engine=simulated) or, with job., a job field as seen here (job.model=DIR)",
    )
    parser.add_argument("--key", type=Path, help="this worker's CURVE key pair (.key_secret), with [security] curve")
    parser.add_argument("--server-key", type=Path, help="the join host's CURVE public key (.key)")
    parser.add_argument("--run-dir", type=Path, help="write this worker's logs, metrics and ledger under DIR")
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="torch threads of this process (0: torch's default)"
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="serve /metrics and /health on this port (0: off)")
    parser.add_argument(
        "--wait-s", type=float, default=300.0, help="give up when the join port has not answered in this many seconds"
    )
    return parser


def join_url(address: str) -> str:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``) -> the tcp URL of the join port; ``ConfigError`` if malformed."""
    text = address if "://" in address else f"tcp://{address}"
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path:
        raise ConfigError(f"{address!r}: expected HOST:PORT, the job's join port")
    return f"tcp://{parts.netloc}"


def rewrite_loopback(url: str, dialled_host: str) -> str:
    """A loopback endpoint of the topology is on the machine the join port is on: reach it
    at the host this worker dialled (a one-machine topology joined from elsewhere)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "tcp" or not host.startswith(_LOOPBACK) or parts.port is None:
        return url
    return f"tcp://{dialled_host}:{parts.port}"


def port_addresses(port: JoinPort, dialled_host: str) -> PortAddresses:
    return PortAddresses(
        connect=tuple(rewrite_loopback(url, dialled_host) for url in port.connect),
        curve_servers=tuple(port.curve_servers),
        stream_dial=tuple(rewrite_loopback(url, dialled_host) for url in port.stream_dial),
    )


def build_samplers(
    info: JoinInfo, overrides: Sequence[str], *, price_per_hour: float | None, capacity: float | None
) -> list[Sampler]:
    """The samplers ``info`` admits, configured by the run, this command line's ``--set``s,
    price and capacity; ``ConfigError`` (one line, naming the field) for a bad value."""
    job_raw: dict[str, Any] = dict(info.job)
    config_raw: dict[str, Any] = dict(info.sampler_config)
    for override in overrides:
        keys, value = parse_override(override)
        if keys[0] == "job":
            if len(keys) != 2:
                raise ConfigError(f"--set {override!r}: set a job field as job.FIELD=VALUE")
            job_raw[keys[1]] = value
        elif len(keys) == 1:
            config_raw[keys[0]] = value
        else:
            raise ConfigError(f"--set {override!r}: expected FIELD=VALUE (a sampler config field) or job.FIELD=VALUE")
    if price_per_hour is not None:
        config_raw["price_per_hour"] = price_per_hour
    if capacity is not None:
        config_raw["capacity"] = capacity
    job = convert_config(job_raw, JobConfig, "job")
    config = Sampler.parse_config(config_raw, "sampler")
    return [Sampler(name, config, job) for name in info.names]


async def request_join(
    url: str,
    request: JoinRequest,
    *,
    keys: CurveKeyPair | None,
    server_key: bytes | None,
    wait_s: float,
) -> JoinInfo:
    """Ask the join port; a line every few seconds while it does not answer; ``TimeoutError``
    past ``wait_s``."""
    transport = Transport()
    try:
        curve = CurveClient(keys, {url: server_key}) if keys is not None and server_key is not None else None
        dealer = transport.dealer(
            name="join.request",
            connect=[url],
            options=SocketOptions(max_message_bytes=CONTROL_MAX_MESSAGE_BYTES),
            curve=curve,
        )
        started = time.monotonic()
        async with asyncio.timeout(wait_s):
            sent = False
            while True:
                try:
                    async with asyncio.timeout(_WAIT_LOG_S):
                        # The send waits for a connection (no peer, no queue: ZMQ_IMMEDIATE).
                        sent = sent or await dealer.send(request)
                        while not isinstance(reply := await dealer.recv(), JoinInfo):
                            pass
                        return reply
                except TimeoutError:
                    hint = "" if curve is not None else " (a run with [security] curve needs --key and --server-key)"
                    log.warning(
                        "no answer from the join port %s for %.0f s: is the job running, with that join_port, "
                        "and the port reachable from here?%s",
                        url,
                        time.monotonic() - started,
                        hint,
                    )
    finally:
        transport.close()


def _curve_settings(keys: CurveKeyPair | None, info: JoinInfo) -> CurveSettings | None:
    if not info.curve:
        return None
    if keys is None:
        raise ConfigError("this run uses CURVE ([security] curve): pass --key and --server-key")
    servers = {host: key.encode() for host, key in info.curve_public_keys.items()}
    return CurveSettings(keys=keys, server_keys=servers, allowed=set())


def _run_dir(parent: Path | None, info: JoinInfo) -> Path | None:
    if parent is None:
        return None
    run = RunDir.create(parent, f"{info.run_id}-{info.names[0].rsplit('-', 1)[0]}")
    run.metrics_dir.mkdir(exist_ok=True)
    run.ledger_dir.mkdir(exist_ok=True)
    return run.root


async def _run(args: argparse.Namespace, url: str, keys: CurveKeyPair | None, server_key: bytes | None) -> int:
    dialled = urlsplit(url).hostname or ""
    request = JoinRequest(
        name=args.name or socket.gethostname(),
        samplers=args.samplers,
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    try:
        info = await request_join(url, request, keys=keys, server_key=server_key, wait_s=args.wait_s)
    except TimeoutError:
        print(f"{PROG}: the join port {url} did not answer within {args.wait_s:g} s", file=sys.stderr)
        return exits.FAILED
    if not info.accepted:
        print(f"{PROG}: {info.server_id} refused to let these samplers join: {info.reason}", file=sys.stderr)
        return exits.BAD_CONFIG
    try:
        samplers = build_samplers(info, args.overrides, price_per_hour=args.price_per_hour, capacity=args.capacity)
        curve = _curve_settings(keys, info)
    except ConfigError as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return exits.BAD_CONFIG
    addresses: Mapping[str, Mapping[str, PortAddresses]] = {
        sampler.name: {port: port_addresses(join_port, dialled) for port, join_port in info.ports.items()}
        for sampler in samplers
    }
    telemetry = port_addresses(info.telemetry, dialled)
    set_torch_threads(args.torch_threads)
    log.info("joining run %s as %s", info.run_id, ", ".join(info.names))
    runtime = ProcessRuntime(
        samplers,
        addresses,
        process=f"join-{info.names[0].rsplit('-', 1)[0]}",
        run_dir=_run_dir(args.run_dir, info),
        drain_timeout_s=info.drain_timeout_s,
        heartbeat_s=info.heartbeat_s,
        telemetry_connect=telemetry.connect,
        telemetry_curve_servers=telemetry.curve_servers,
        curve=curve,
        metrics_port=args.metrics_port,
    )
    try:
        await runtime.run(install_signal_handlers=True)
    except ActorFailed as exc:
        log.error("exiting: %s", exc)
        return exits.FAILED
    for sig in (signal.SIGINT, signal.SIGTERM):
        if runtime.stop_reason == signal.Signals(sig).name:
            return exits.SIGNAL_BASE + sig
    return exits.OK


def main(argv: Sequence[str] | None = None) -> int:
    """Join a running job; returns the exit code (see the module docstring)."""
    logging.basicConfig(
        level=os.environ.get("ECHO2_LOG_LEVEL", "INFO"),
        format="%(asctime)s join %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        url = join_url(args.address)
        if args.samplers < 1:
            raise ConfigError(f"--samplers: {args.samplers}: at least 1")
        if (args.key is None) != (args.server_key is None):
            raise ConfigError("--key and --server-key go together (a run with [security] curve needs both)")
        keys = load_keypair(args.key) if args.key is not None else None
        server_key = load_public_key(args.server_key) if args.server_key is not None else None
    except (exits.UsageError, ConfigError) as exc:
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return exits.BAD_CONFIG
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        return asyncio.run(_run(args, url, keys, server_key))
    except KeyboardInterrupt:  # Ctrl-C while asking the join port: nothing had started
        return exits.SIGINT


if __name__ == "__main__":
    sys.exit(main())
