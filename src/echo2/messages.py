"""Every message echo2 puts on the wire, and the protocol version.

Each message is a ``msgspec.Struct`` tagged with its class name (the ``"type"`` key of the
msgpack map). Numpy arrays are never msgpack lists: the codec sends them as raw buffers,
inline in the header when small and as separate zero-copy frames when large (see
``docs/protocol.md``). Schema evolution: new fields get defaults; a field never changes type;
a breaking change bumps ``PROTOCOL_VERSION``.

Policy versions are two integers: ``incarnation`` (bumped each time a learner starts or
resumes, so versions published before a crash never collide with later ones) and
``version`` (the learner's update count when the snapshot was taken).
"""

from __future__ import annotations

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

# -- protocol constants ------------------------------------------------------------------

TELEMETRY_CHANNEL = "telemetry"
"""The channel every process publishes heartbeats on (PUB -> the SUB that binds it)."""
HEARTBEAT_TOPIC = b"hb|"
"""Topic frame of ``Heartbeat`` on the telemetry channel (topics end in ``|``: SUB matches prefixes)."""
INSTALLED_TOPIC = b"installed|"
"""Topic frame of ``WeightsInstalled`` on the telemetry channel."""


class Message(msgspec.Struct, tag=True, frozen=True, kw_only=True, gc=False):
    """Base class of wire messages (not itself sent).

    ``gc=False``: messages are immutable data and cannot form reference cycles, so the
    garbage collector need not track them. Receivers decode messages in batches; tracked,
    they made the collector's passes cost more than decoding (about 2x fewer 64-record
    messages per second in ``benchmarks/transport.py``).
    """


# -- control -------------------------------------------------------------------------


class Hello(Message):
    """First message a client sends on a request/reply channel (DEALER -> ROUTER)."""

    peer_id: str
    role: str
    protocol_version: int = PROTOCOL_VERSION
    pid: int = 0
    host: str = ""


class Welcome(Message):
    """Answer to ``Hello``: accepted, or refused with a reason the client logs and exits on."""

    server_id: str
    accepted: bool
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION


class EndOfStreamMsg(Message):
    """A producer will send nothing more on this channel."""

    producer_id: str


class Heartbeat(Message):
    """Application heartbeat on the telemetry topic: proves the event loop is alive.

    ``loop_lag_s`` is how late the heartbeat timer fired; a stuck loop shows up as a missing
    heartbeat, a busy one as lag. ``stats`` carries per-actor counters (flat name -> number).
    """

    process: str
    actors: list[str]
    pid: int
    host: str
    seq: int
    time_s: float
    loop_lag_s: float
    stats: dict[str, float] = {}


class MetricsRecord(Message):
    """A structured metrics event (one JSON line in the run directory)."""

    source: str
    kind: str
    time_s: float
    values: dict[str, float | int | str | bool | None] = {}


# -- work: PromptSource <-> Sampler --------------------------------------------------


class WorkRequest(Message):
    """A sampler grants ``credits`` more tasks of work (credit-based flow control)."""

    sampler_id: str
    credits: int
    incarnation: int = 0
    installed_version: int = -1


class TaskLease(Message):
    """One prompt to sample ``group_size`` times, leased until ``deadline_s`` from issue.

    ``attempt`` counts issues of the same task; ``lease_id`` is unique per issue. A result is
    accepted only for the lease that is open when it arrives.
    """

    lease_id: int
    task_id: str
    attempt: int
    prompt: str
    answer: str
    group_size: int
    ttl_s: float
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    min_version: int = 0
    """Generate with policy version >= this (else wait for weights): work made by an older
    policy would be too stale to train when it arrives."""


class LeaseRevoked(Message):
    """The PromptSource took a lease back (expired or sampler parked); drop the work."""

    lease_id: int
    reason: str


# -- rollouts: Sampler -> Rewarder -> Buffer ------------------------------------------


class RolloutGroup(Message):
    """G completions of one leased prompt, as ragged arrays.

    Sample ``i`` owns ``token_ids[offsets[i]:offsets[i+1]]`` and the same slice of
    ``logprobs`` (log-probability of each sampled token under the distribution actually
    sampled from, after temperature and top-p).
    """

    lease_id: int
    task_id: str
    attempt: int
    sampler_id: str
    incarnation: int
    version: int
    prompt: str
    answer: str
    prompt_token_ids: np.ndarray  # int32 (P,)
    token_ids: np.ndarray  # int32 (sum_i T_i,)
    logprobs: np.ndarray  # float32 (sum_i T_i,)
    offsets: np.ndarray  # int32 (G + 1,)
    texts: list[str]
    finish_reasons: list[str]
    generate_s: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.offsets) - 1


class ScoredGroup(Message):
    """A rollout group with one reward per completion, or the reason it was dropped.

    ``keep`` marks completions whose reward could be computed; a completion whose reward
    function raised or timed out is kept out of training and counted in ``item_errors``.
    """

    group: RolloutGroup
    rewards: np.ndarray  # float32 (G,)
    keep: np.ndarray  # bool (G,)
    dropped_reason: str = ""
    item_errors: dict[str, int] = {}
    reward_s: float = 0.0


class ExpireLease(Message):
    """PromptSource -> Buffer: the lease's deadline passed. The Buffer decides, once, whether
    the group was already stored (``LeaseClosed(outcome="stored")``) or the lease is now
    expired (``outcome="expired"``; later results for it are rejected as late), so a task is
    re-issued only when no result for it can still be trained."""

    lease_id: int
    task_id: str
    attempt: int


class LearnerProgress(Message):
    """Buffer -> PromptSource after each batch: cumulative counters that pace issuance."""

    next_version: int
    groups_stored: int
    groups_trained: int
    groups_dropped_after_store: int
    delivered_by_sampler: dict[str, int] = {}
    """Rollouts each sampler has had stored, cumulative (the scheduler's mu_i)."""


class LeaseClosed(Message):
    """Buffer -> PromptSource: the lease is done, with what happened to the group."""

    lease_id: int
    task_id: str
    attempt: int
    outcome: str  # "stored" | "duplicate" | "expired" | "late" | "dropped:<reason>"


# -- batches: Learner <-> Buffer ------------------------------------------------------


class BatchRequest(Message):
    """The learner at ``version`` asks for ``num_groups`` admissible groups."""

    request_id: int
    incarnation: int
    version: int
    num_groups: int


class Batch(Message):
    """Admissible groups for a ``BatchRequest``, with the buffer's counters at reply time."""

    request_id: int
    groups: list[ScoredGroup]
    buffer_stats: dict[str, int] = {}


class LearnerCheckpointed(Message):
    """Learner -> Buffer: a checkpoint at ``version`` is on disk. Groups handed for earlier
    versions are durable in the model; later ones are kept until the next checkpoint, so a
    resumed learner trains them again instead of losing them."""

    incarnation: int
    version: int


class TrainedReport(Message):
    """Learner -> Buffer: these task ids were trained at ``version`` (closes accounting)."""

    version: int
    task_ids: list[str]


# -- weights: Learner -> WeightPublisher -> Samplers ----------------------------------


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor lives in the flat snapshot: ``data[offset:offset+nbytes]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Snapshot(Message):
    """Learner -> WeightPublisher: an immutable copy of the policy, flat, with its layout.

    In one process this travels over inproc without a copy: ``data`` is referenced, and the
    learner never reuses the buffer.
    """

    incarnation: int
    version: int
    tensors: list[TensorSpec]
    data: np.ndarray  # uint8 (total_bytes,)
    created_at_s: float


class WeightManifest(Message):
    """Describes one snapshot: layout, chunking and digests (``digest_algorithm``: echo2
    publishes "blake3"; "sha256", the field's default for peers that leave it out, and
    "blake2b-256" are also accepted)."""

    incarnation: int
    version: int
    total_bytes: int
    chunk_bytes: int
    tensors: list[TensorSpec]
    chunk_digests: list[bytes]
    digest: bytes
    published_at_s: float
    digest_algorithm: str = "sha256"
    signature: bytes = b""
    """Ed25519 over ``echo2.weights.signing.signed_payload`` when signing is on."""


class WeightChunk(Message):
    """Bytes ``[index * chunk_bytes, ...)`` of snapshot (incarnation, version)."""

    incarnation: int
    version: int
    index: int
    data: np.ndarray  # uint8 (<= chunk_bytes,)


class WeightsInstalled(Message):
    """A sampler installed a version (telemetry; T_bcast is measured from these)."""

    sampler_id: str
    incarnation: int
    version: int
    install_s: float
    time_s: float


class WeightSubscribe(Message):
    """Sampler -> WeightPublisher on ``weights`` (DEALER -> ROUTER), repeated as a lease:
    "I am alive, send versions to me; my relay inbox (PULL) is at ``relay_address``"."""

    sampler_id: str
    relay_address: str
    incarnation: int = -1
    installed_version: int = -1
    shm_id: str = ""
    """Identity of the shared-memory directory this sampler can map (``transport.shm``);
    "" for none. A publisher with the same identity hands it versions as ``WeightShm``."""


class RelayChain(msgspec.Struct, frozen=True, array_like=True):
    """One chain of a relay plan: stripe ``stripe``'s chunks flow publisher -> members[0]
    -> members[1] -> ... (each forwards every verified chunk of the stripe it receives)."""

    stripe: int
    members: list[str]


class RelayPlan(Message):
    """WeightPublisher -> each member, before the manifest of (incarnation, version).

    Chunk ``i`` belongs to stripe ``i % stripes``. A star is ``stripes = 1`` with one chain
    of one member per sampler; a relay is one chain of every sampler; striped relay is
    ``stripes`` chains of every sampler in rotated orders. ``addresses`` maps member ->
    relay inbox address.
    """

    incarnation: int
    version: int
    stripes: int
    chains: list[RelayChain]
    addresses: dict[str, str] = {}


class WeightShm(Message):
    """WeightPublisher -> a member sharing its host, before the manifest: the version's
    bytes are in the file ``path`` (shared memory); map it and verify it there instead of
    waiting for a stream. The member is in no relay chain for this version."""

    incarnation: int
    version: int
    path: str


class ChunkRequest(Message):
    """Repair: a sampler asks for chunks it lacks (missing or corrupt) of a version."""

    sampler_id: str
    incarnation: int
    version: int
    indices: list[int]


AnyMessage = (
    Hello
    | Welcome
    | EndOfStreamMsg
    | Heartbeat
    | MetricsRecord
    | WorkRequest
    | TaskLease
    | LeaseRevoked
    | ExpireLease
    | LearnerProgress
    | RolloutGroup
    | ScoredGroup
    | LeaseClosed
    | BatchRequest
    | Batch
    | TrainedReport
    | LearnerCheckpointed
    | Snapshot
    | WeightManifest
    | WeightChunk
    | WeightsInstalled
    | WeightSubscribe
    | RelayPlan
    | ChunkRequest
    | WeightShm
)

MESSAGE_TYPES: tuple[type[Message], ...] = AnyMessage.__args__  # type: ignore[attr-defined]
