"""Weight dissemination: verified chunks, peer-assisted pipelined relay, repair.

The subsystem, by module: ``chunks`` (snapshots, manifests, digests, assembly), ``plan``
(relay plans, placement by measurement, and addresses), ``broadcaster`` (publisher side), ``receiver`` (sampler side),
``stream`` (chunk streams: bytes straight into place; under ``[security]`` inboxes admit
only the plan's senders), ``lanes`` (a hop over parallel chunk streams), ``dial`` (chunk
streams a member behind NAT opens to the publisher), ``pacing`` (deadlines from measured
rate and RTT, repair pacing, how many streams a hop uses and the chunk size that follows), ``delta`` (a version coded
as its changes from a base the member holds), ``seal`` (under ``[security]``: versions encrypted once at the
publisher, opened once per member), ``shm`` (shared memory on one host), ``signing``
(Ed25519 manifests), ``link`` (link emulation: caps and latency).

Two components on top of the pure chunk layer (``echo2.weights.chunks``):

* ``WeightBroadcaster`` (publisher side, owns the ``weights`` ROUTER). Samplers lease
  membership with ``WeightSubscribe`` (repeated every ``announce_s``, naming the address of
  their relay inbox). Per version it computes a plan from the live members
  (``relay_plan``: star, a relay chain, or, beyond ``max_depth`` members, one relay tree
  per stripe whose fan-out grows with N so that no member is more than ``max_depth``
  hops from the publisher; striped chains or trees), members placed by what it measured
  of earlier versions (``Placement``: a member whose ``WeightsReceived`` lags its feeders'
  goes to a chain's tail or a tree's leaves). It sends each member its own place in the
  plan (``member_view``: a ``RelayPlan`` as large as its fan-out) and then the
  ``WeightManifest`` over the ROUTER (ordered, never dropped: ROUTER_MANDATORY counts a
  gone peer as unroutable), the seeds first, and streams each chunk to the seeds of its
  stripe through a PUSH connected to each seed's inbox while the other members' plans go
  out. It answers ``ChunkRequest`` (repair) with
  chunks over the ROUTER, sends the latest manifest to a member that joins late, and
  measures T_bcast from the members' ``WeightsInstalled`` (sent on the same reliable
  channel, not on lossy telemetry).
* ``WeightReceiver`` (sampler side). It binds a relay inbox (over tcp a chunk stream,
  ``echo2.weights.stream``, whose bytes land straight in the assembly buffer; else,
  or with ``data_plane="zmq"``, a ZeroMQ PULL), assembles a version into memory
  allocated once (``SnapshotAssembler``), verifies every chunk against the manifest (in the
  process's verify threads, one per core, shared by its receivers: hashing releases the GIL), forwards every verified chunk of the stripes
  it relays to its successors the moment it lands (a PUSH per successor), reports the
  version received (``WeightsReceived``) and hands it, complete and verified, to
  ``on_complete``. Gap detection, in bytes: when no byte of
  the version arrives on any path for max(``gap_timeout_s``, K x RTT) the missing chunks
  are requested from the publisher (dropped, corrupt, or a dead predecessor in the chain:
  all end the same way), paced (``echo2.weights.pacing``): at most a window of repair bytes
  outstanding, each chunk asked for again only after its own deadline (K x the bytes queued
  ahead of it / the measured rate). The publisher serves each member's repairs on that
  member's chunk stream when it has one (else on the control channel), one worker per
  member, and drops indices still queued for that member. Repaired chunks are forwarded
  too, so a chain heals behind a dead relay.

Paths that one TCP stream cannot fill (``echo2.weights.lanes``, ``echo2.weights.pacing``):
every hop (publisher to seed, member to successor, repairs) sends over up to
``max_streams`` parallel chunk streams, one at first, more while the kernel's measurements
(retransmissions without a standing queue, each stream within a few times its Mathis
share) say loss holds each stream back, fewer when a queue stands or more bought nothing;
the publisher feeds each seed at its own pace. Each version is cut into chunks of at most
half a second of one stream's rate (256 KB while a member's path is unknown). A
connection the peer closes gives back the chunks its kernel held unacknowledged. A
member drops a stream stuck mid-chunk (quiet for max(K x RTT, ``gap_timeout_s`` / 2), or
among the version's last chunks on it for 2 x ``gap_timeout_s``) and repairs that chunk
on the publisher's other streams. A member that holds half a version when a newer one
arrives finishes it first if it is fewer than ``finish_within`` (the job's staleness)
versions older; the publisher keeps that version for its repairs. A member that accepts
no inbound connection (``[hosts] inbound = false``) dials the publisher, which sends its
chunks down those connections (``echo2.weights.dial``).

Nothing is lost silently: PUSH and ROUTER sends block at the high-water mark instead of
dropping, a chunk stream that takes no byte for ``send_timeout_s`` (a ZeroMQ send that
cannot complete in it: a dead peer) is counted and that peer skipped for the version, and
every gap ends in a repair. A slow path is not a dead one: a chunk may take longer than
any timeout as long as its bytes keep moving.

Delta versions (optional, ``delta_anchor_every``): the publisher also codes each version
against the one before (``WeightBroadcaster.prepare_delta``, off the event loop); members
that announced that base installed get a plan and a manifest whose chunks carry the delta
payload (relayed and repaired like any chunks), the others the dense manifest, repaired
like late joiners. A member rebuilds the state into fresh memory while the payload
arrives (``delta.DeltaRebuild``: each segment as its record's chunks verify) and verifies
each rebuilt chunk against the manifest's full-state digests before ``on_complete``; it
keeps the last state as a base only while the publisher codes deltas (``delta_base``).
LoRA runs publish adapter versions (``WeightManifest.adapter``), which engines install as
adapters on the base they serve (``echo2.models.adapters``). A member without the base, or
whose rebuild fails, keeps what it has installed and asks for the dense form
(``ChunkRequest.dense``). Every K-th version is a dense anchor.

Shared memory (optional, ``shm_dir`` on both sides): members on the publisher's host map
each version from a file the publisher writes once (``echo2.weights.shm``) and verify it
in place; they take no part in relay chains.

Link emulation (``LinkSpec``): the publisher's uplink, and each receiver's uplink and
downlink, pace every byte on the weight path (chunks streamed, forwarded and repaired);
``latency_ms`` delays each chunk a receiver takes in, pipelined.

Buffers: chunks are views into the snapshot (publisher), into received ZeroMQ frames, or
into verified regions of the assembly buffer (relays); none is ever written again, so a
buffer ZeroMQ or the kernel still holds is never mutated.
Deviation: repair is served by the publisher only, not by peers (the publisher holds
every chunk of the latest version; peers would spread the repair load).
"""

from echo2.weights.broadcaster import WeightBroadcaster
from echo2.weights.plan import (
    DATA_PLANES,
    GAMMA,
    MODES,
    NO_LINK,
    announce_url,
    bcast_threshold,
    relay_bind_url,
    relay_plan,
)
from echo2.weights.receiver import WeightReceiver

__all__ = [
    "DATA_PLANES",
    "GAMMA",
    "MODES",
    "NO_LINK",
    "WeightBroadcaster",
    "WeightReceiver",
    "announce_url",
    "bcast_threshold",
    "relay_bind_url",
    "relay_plan",
]
