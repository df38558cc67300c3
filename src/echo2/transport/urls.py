"""tcp URLs and IP literals: IPv6 addresses go in brackets, and a socket needs to know.

One rule for every layer that writes or opens a tcp URL (addresses derived from the
topology, relay inboxes, ZeroMQ sockets): ``tcp://[2001:db8::1]:28100``, never the bare
literal, whose colons would read as a port.
"""

from __future__ import annotations

import ipaddress


def is_ipv6_literal(address: str) -> bool:
    """True for an IPv6 address, bracketed or not (a hostname is not one)."""
    try:
        return ipaddress.ip_address(address.strip("[]")).version == 6
    except ValueError:
        return False


def url_host(address: str) -> str:
    """``address`` as the host part of a URL: an IPv6 literal in brackets."""
    return f"[{address}]" if is_ipv6_literal(address) and not address.startswith("[") else address


def url_host_of(url: str) -> str:
    """The host part of ``scheme://host:port`` (brackets kept)."""
    return url.split("://", 1)[-1].rpartition(":")[0]


def is_ipv6_url(url: str) -> bool:
    """A tcp URL whose host is an IPv6 literal (a ZeroMQ socket needs ``IPV6`` for it)."""
    return url.startswith("tcp://") and url_host_of(url).startswith("[")


__all__ = ["is_ipv6_literal", "is_ipv6_url", "url_host", "url_host_of"]
