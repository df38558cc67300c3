"""The topology: where actors run, read from TOML, validated, and resolved for one run.

Three steps, one module each:

1. ``schema``: ``load_topology(path, overrides)`` reads the TOML tables into typed Structs
   and validates them into a ``Topology`` (one-line ``ConfigError`` naming the field).
2. ``addresses``: ``derive_addresses(placements, hosts, run_id)`` gives every port its URLs
   from placement alone (inproc, ipc or tcp).
3. ``resolve``: ``resolve(topology, run_id, run_dir)`` fixes everything a process needs into
   the ``ResolvedTopology`` written to the run directory; ``build_process`` turns one
   process of it into actors.

Before it starts anything the launcher runs ``preflight.check_before_launch(topology,
processes)``: relations between tables, addresses, and what the processes it starts need on
this machine (engines and their kwargs, models, keys). It is imported from
``echo2.topology.preflight`` (not re-exported here, so that a child process does not import
every built-in actor's module).
"""

from echo2.topology.addresses import Addresses, derive_addresses, ipc_dir_for, is_local_address
from echo2.topology.resolve import (
    ResolvedActor,
    ResolvedProcess,
    ResolvedTopology,
    build_process,
    resolve,
    torch_threads,
)
from echo2.topology.schema import (
    DEFAULT_HOST,
    ActorSpec,
    HostSpec,
    PlacedActor,
    Placement,
    ProcessSpec,
    RestartPolicy,
    RunSpec,
    SecuritySpec,
    Topology,
    apply_overrides,
    channel_of,
    check_channels,
    load_topology,
    parse_override,
    placements,
    validate,
)

__all__ = [
    "DEFAULT_HOST",
    "ActorSpec",
    "Addresses",
    "HostSpec",
    "PlacedActor",
    "Placement",
    "ProcessSpec",
    "ResolvedActor",
    "ResolvedProcess",
    "ResolvedTopology",
    "RestartPolicy",
    "RunSpec",
    "SecuritySpec",
    "Topology",
    "apply_overrides",
    "build_process",
    "channel_of",
    "check_channels",
    "derive_addresses",
    "ipc_dir_for",
    "is_local_address",
    "load_topology",
    "parse_override",
    "placements",
    "resolve",
    "torch_threads",
    "validate",
]
