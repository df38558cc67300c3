"""ZeroMQ transport: codec (messages <-> frames), endpoints (fast async path), Transport."""

from echo2.transport.codec import Codec
from echo2.transport.context import Transport
from echo2.transport.endpoint import (
    DealerEndpoint,
    Endpoint,
    EndpointStats,
    PublisherEndpoint,
    PullEndpoint,
    PushEndpoint,
    RouterEndpoint,
    SocketOptions,
    SubscriberEndpoint,
)

__all__ = [
    "Codec",
    "DealerEndpoint",
    "Endpoint",
    "EndpointStats",
    "PublisherEndpoint",
    "PullEndpoint",
    "PushEndpoint",
    "RouterEndpoint",
    "SocketOptions",
    "SubscriberEndpoint",
    "Transport",
]
