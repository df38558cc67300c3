"""The WAN test bed's network: namespaces, veths, a switch, rate caps, delay and loss per link.

One network namespace per host and one for the switch. Each host has one link: a veth pair
whose host end is ``eth0`` (the host's address, /24, or /64 for an IPv6 address) and whose
switch end is ``p-<index>``. A host behind NAT (``nat``: name -> private address) sits in
its namespace with only that private address, behind a router namespace
(``<prefix>-<name>-nat``) that holds the link and the public address: nftables masquerades
what leaves and drops every connection that does not (no forwarded port), as a home router
does.
Frames cross the switch through ``relay.py`` (one-way delay and Bernoulli loss per link and
direction, total outages on command); rate caps are kernel tbf qdiscs on both ends of a
link (the host's egress: its uplink; the switch port's egress: its downlink). ARP is
replaced by permanent neighbour entries (IPv6's neighbour discovery too, and duplicate
address detection is off) and IPv6 is off unless a host has an IPv6 address, so the only
frames on a link are the hosts' traffic, and offloads (TSO, GSO, GRO, checksum) are off on every veth so
every frame the relay sees is one wire packet.

A path's one-way delay is the sum of its two links' (edge -> learner: the edge's plus the
learner's), and so is its loss, approximately. ``Bed`` is a context manager: leaving it,
an exception, Ctrl-C, SIGTERM or interpreter exit (atexit) deletes every namespace it made
(which deletes their veths and qdiscs) after stopping the relay and every process the bed
started; a bed left by a crashed run (namespaces named ``<prefix>-*``) is removed when the
next one starts, after killing what still runs inside them.

``python -m benchmarks.wan.netbed offloads IFNAME...`` (inside a namespace) turns a veth's
offloads off; there is no ethtool binary on these machines, so it is the ioctl itself.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = "e2wan"
_SIOCETHTOOL = 0x8946
# linux/ethtool.h legacy set commands, each taking struct ethtool_value {u32 cmd; u32 data}.
_ETHTOOL_OFF = {"tx-checksum": 0x17, "scatter-gather": 0x19, "tso": 0x1F, "gso": 0x24, "gro": 0x2C}
_ETHTOOL_GET = {"tx-checksum": 0x16, "scatter-gather": 0x18, "tso": 0x1E, "gso": 0x23, "gro": 0x2B}


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """One host's link, each direction alike: rate cap, one-way delay, random loss."""

    rate_mbit: float = 0.0
    """tbf rate cap of the link's both directions, Mbit/s (0: uncapped)."""
    delay_ms: float = 0.0
    """One-way delay added by the relay to every frame crossing this link, milliseconds."""
    loss: float = 0.0
    """Probability that the relay drops a frame crossing this link (each direction)."""
    queue_ms: float = 50.0
    """tbf queue of a capped link, in milliseconds at its rate (the router buffer)."""


@dataclasses.dataclass(frozen=True)
class HostNet:
    """A host of the bed: its namespace, address, MAC and switch port."""

    name: str
    namespace: str
    """Where its processes run."""
    address: str
    """Its address on the switch (the public one, behind NAT)."""
    mac: str
    switch_port: str
    shape: LinkShape
    private: str = ""
    """Behind NAT: the only address its namespace has (the router holds ``address``)."""

    @property
    def link_namespace(self) -> str:
        """The namespace at the switch end of its link: its router's behind NAT."""
        return f"{self.namespace}-nat" if self.private else self.namespace

    @property
    def ipv6(self) -> bool:
        return ":" in self.address

    @property
    def prefix_len(self) -> int:
        return 64 if self.ipv6 else 24


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespaces_with_prefix(prefix: str) -> list[str]:
    out = _ip("-j", "netns", "list", check=False).stdout.strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return [name for name in names if name.startswith(f"{prefix}-")]


def remove_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces a crashed bed left, first killing the processes still inside them."""
    stale = namespaces_with_prefix(prefix)
    for ns in stale:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # processes a previous bed started in its own namespace
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
    return stale


def nat_available() -> str | None:
    """Why the bed cannot put a host behind NAT here, or None if it can."""
    if shutil.which("nft") is None:
        return "a NAT'd host in the WAN test bed needs the 'nft' command (apt-get install nftables)"
    return None


def available() -> str | None:
    """Why the bed cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "the WAN test bed needs root (network namespaces, veths, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN test bed needs the {tool!r} command (iproute2)"
    probe = f"{DEFAULT_PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Bed:
    """Namespaces for ``hosts`` joined by a switch; see the module docstring."""

    def __init__(
        self,
        hosts: Mapping[str, tuple[str, LinkShape]],
        *,
        prefix: str = DEFAULT_PREFIX,
        congestion_control: str = "",
        seed: int = 0,
        nat: Mapping[str, str] | None = None,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        """``hosts``: name -> (address, link shape); all IPv4 addresses in one /24, all
        IPv6 ones in one /64. ``nat``: hosts behind NAT -> their private IPv4 address (a
        /24 of its own, the router at .1). ``sysctls``: set in every host's namespace (a
        host's own tuning, e.g. ``net.ipv4.tcp_slow_start_after_idle``)."""
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.congestion_control = congestion_control
        self.sysctls = dict(sysctls or {})
        self.seed = seed
        self.hosts: dict[str, HostNet] = {}
        for index, (name, (address, shape)) in enumerate(hosts.items()):
            mac = "02:77:00:00:00:%02x" % (index + 1)
            private = (nat or {}).get(name, "")
            self.hosts[name] = HostNet(name, f"{prefix}-{name}", address, mac, f"p-{index}", shape, private)
        self._relay: subprocess.Popen[str] | None = None
        self.relay_cpu: dict[str, Any] = {}
        """The relay's ``cpu_s`` (CPU seconds since it started) and ``realtime`` (SCHED_RR),
        as of the last ``relay_counters``."""
        self._processes: list[subprocess.Popen[Any]] = []
        self._closed = True

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Bed:
        remove_stale(self.prefix)
        self._closed = False
        atexit.register(self.close)
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._build()
            self._start_relay()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop what the bed started and delete its namespaces; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for proc in self._processes:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.stop_relay()
        for ns in [self.switch, *(h.namespace for h in self.hosts.values())]:
            _ip("netns", "del", ns, check=False)
        for host in self.hosts.values():
            if host.private:
                _ip("netns", "del", host.link_namespace, check=False)
        atexit.unregister(self.close)
        with contextlib.suppress(ValueError, TypeError):  # not the main thread
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _build(self) -> None:
        ipv6 = any(h.ipv6 for h in self.hosts.values())
        _ip("netns", "add", self.switch)
        self._exec(self.switch, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for host in self.hosts.values():
            namespaces = [host.namespace, *([host.link_namespace] if host.private else [])]
            for ns in namespaces:
                _ip("netns", "add", ns)
                self._sysctls(ns, ipv6=ipv6 and not host.private)
                _ip("-n", ns, "link", "set", "lo", "up")
            ns = host.link_namespace
            _ip(
                "link",
                "add",
                host.switch_port,
                "netns",
                self.switch,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", ns, "link", "set", "eth0", "address", host.mac)
            _ip(
                "-n",
                ns,
                "addr",
                "add",
                f"{host.address}/{host.prefix_len}",
                "dev",
                "eth0",
                *(["nodad"] if host.ipv6 else []),
            )
            for name, link_ns in (("eth0", ns), (host.switch_port, self.switch)):
                self._exec(link_ns, [sys.executable, "-m", "benchmarks.wan.netbed", "offloads", name])
                _ip("-n", link_ns, "link", "set", name, "up")
            if host.shape.rate_mbit > 0:
                for dev, link_ns in (("eth0", ns), (host.switch_port, self.switch)):
                    self._tbf(link_ns, dev, host.shape)
            if host.private:
                self._nat(host)
        for host in self.hosts.values():
            for other in self.hosts.values():
                if other is not host and other.ipv6 == host.ipv6:
                    family = ["-6"] if host.ipv6 else []
                    _ip(*family, "-n", host.link_namespace, "neigh", "replace", other.address, "lladdr", other.mac,
                        "nud", "permanent", "dev", "eth0")  # fmt: skip

    def _sysctls(self, ns: str, *, ipv6: bool) -> None:
        settings = [f"net.ipv6.conf.all.disable_ipv6={0 if ipv6 else 1}"]
        if ipv6:  # addresses usable at once; no router solicitations on the links
            settings += ["net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0",
                         "net.ipv6.conf.default.router_solicitations=0"]  # fmt: skip
        if self.congestion_control:
            settings.append(f"net.ipv4.tcp_congestion_control={self.congestion_control}")
        settings += [f"{key}={value}" for key, value in self.sysctls.items()]
        self._exec(ns, ["sysctl", "-qw", *settings])

    def _nat(self, host: HostNet) -> None:
        """``host`` behind a router: a LAN veth to it, masquerade out, nothing in."""
        router, private = host.link_namespace, host.private
        gateway = private.rsplit(".", 1)[0] + ".1"
        _ip("link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _ip("-n", router, "addr", "add", f"{gateway}/24", "dev", "lan0")
        _ip("-n", host.namespace, "addr", "add", f"{private}/24", "dev", "eth0")
        for name, link_ns in (("lan0", router), ("eth0", host.namespace)):
            self._exec(link_ns, [sys.executable, "-m", "benchmarks.wan.netbed", "offloads", name])
            _ip("-n", link_ns, "link", "set", name, "up")
        _ip("-n", host.namespace, "route", "add", "default", "via", gateway)
        self._exec(router, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        rules = (
            "table ip echo2nat {\n"
            '  chain postrouting { type nat hook postrouting priority srcnat; oifname "eth0" masquerade; }\n'
            "  chain forward { type filter hook forward priority filter; policy drop;\n"
            '    ct state established,related accept; iifname "lan0" accept; }\n'
            "  chain input { type filter hook input priority filter; policy accept;\n"
            '    iifname "eth0" ct state new drop; }\n'
            "}\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"in {router}: nft: {done.stderr.strip()}")

    def _tbf(self, ns: str, dev: str, shape: LinkShape) -> None:
        rate_bytes = shape.rate_mbit * 1e6 / 8
        burst = max(16_000, int(rate_bytes / 250))  # >= rate / HZ, or tbf cannot reach its rate
        limit = int(rate_bytes * shape.queue_ms / 1000) + burst
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{shape.rate_mbit}mbit",
             "burst", str(burst), "limit", str(limit)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def _exec(self, ns: str, argv: Sequence[str]) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, cwd=REPO_ROOT, env=self.env()
        )
        if done.returncode != 0:
            raise RuntimeError(f"in {ns}: {' '.join(argv)}: {done.stderr.strip()}")

    # -- the relay -------------------------------------------------------------------

    def _start_relay(self) -> None:
        config = {
            "seed": self.seed,
            "ports": [
                {
                    "host": h.name,
                    "ifname": h.switch_port,
                    "mac": h.mac,
                    "delay_ms": h.shape.delay_ms,
                    "loss": h.shape.loss,
                }
                for h in self.hosts.values()
            ],
        }
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-m", "benchmarks.wan.relay", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=self.env(),
        )  # fmt: skip
        assert self._relay.stdout is not None
        line = self._relay.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the relay did not start: {line!r} (exit {self._relay.poll()})")

    def _relay_command(self, command: str) -> str:
        relay = self._relay
        if relay is None or relay.poll() is not None:
            raise RuntimeError("the relay is not running")
        assert relay.stdin is not None and relay.stdout is not None
        relay.stdin.write(command + "\n")
        relay.stdin.flush()
        return relay.stdout.readline()

    def set_link(self, host: str, *, up: bool) -> None:
        """Start or end a total outage of ``host``'s link (both directions)."""
        reply = self._relay_command(f"{'up' if up else 'down'} {host}")
        if not reply.startswith("ok"):
            raise RuntimeError(f"relay: {reply.strip()}")

    def relay_counters(self) -> dict[str, dict[str, int]]:
        """Per host link: frames and bytes into and out of the switch, and drops by cause.
        The relay's own CPU seconds so far and whether it runs real-time go to ``relay_cpu``."""
        counters: dict[str, dict[str, Any]] = json.loads(self._relay_command("stats"))
        self.relay_cpu = counters.pop("relay", {})
        return counters

    def stop_relay(self) -> dict[str, dict[str, int]] | None:
        relay, self._relay = self._relay, None
        if relay is None:
            return None
        try:  # closes its stdin: the relay prints its final counters and exits
            out, _ = relay.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()
            return None
        for line in out.splitlines():
            if line.startswith('{"final"'):
                final: dict[str, dict[str, Any]] = json.loads(line)["final"]
                self.relay_cpu = final.pop("relay", {})
                return final
        return None

    # -- hosts ---------------------------------------------------------------------------

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Kernel byte counters of each host's ``eth0``: tx (uploaded) and rx (downloaded)."""
        result = {}
        for host in self.hosts.values():
            (link,) = json.loads(_ip("-n", host.namespace, "-j", "-s", "link", "show", "eth0").stdout)
            stats = link["stats64"]
            result[host.name] = {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]}
        return result

    def env(self) -> dict[str, str]:
        """Environment of processes the bed starts: this repository's benchmarks importable."""
        env = dict(os.environ)
        paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; the bed kills it at close if still running."""
        kwargs.setdefault("cwd", REPO_ROOT)
        kwargs.setdefault("env", self.env())
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].namespace, *argv], **kwargs)
        self._processes.append(proc)
        return proc


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def disable_offloads(ifname: str) -> dict[str, int]:
    """Turn off a device's offloads (this namespace's); returns each one's state after."""
    name = ifname.encode()[:15].ljust(16, b"\0")
    state = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for command in _ETHTOOL_OFF.values():
            value = (ctypes.c_uint32 * 2)(command, 0)
            ifreq = name + struct.pack("P", ctypes.addressof(value)) + b"\0" * 16
            with contextlib.suppress(OSError):  # a feature the device cannot change
                fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
        for feature, command in _ETHTOOL_GET.items():
            value = (ctypes.c_uint32 * 2)(command, 0)
            ifreq = name + struct.pack("P", ctypes.addressof(value)) + b"\0" * 16
            fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
            state[feature] = int(value[1])
    return state


def _main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "offloads":
        for ifname in argv[1:]:
            state = disable_offloads(ifname)
            if any(state.values()):
                print(f"{ifname}: offloads still on: {state}", file=sys.stderr)
                return 1
        return 0
    print("usage: python -m benchmarks.wan.netbed offloads IFNAME...", file=sys.stderr)
    return 2


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes (for external state: files, links)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


__all__ = [
    "DEFAULT_PREFIX",
    "Bed",
    "HostNet",
    "LinkShape",
    "available",
    "disable_offloads",
    "nat_available",
    "remove_stale",
    "wait_for",
]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
