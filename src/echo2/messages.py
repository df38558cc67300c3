"""Every message echo2 puts on the wire, and the protocol version.

Each message is a ``msgspec.Struct`` tagged with its class name (the ``"type"`` key of the
msgpack map). Numpy arrays are never msgpack lists: the codec sends them as raw buffers,
inline in the header when small and as separate zero-copy frames when large (see
``docs/protocol.md``). Schema evolution: new fields get defaults; a field never changes type;
a breaking change bumps ``PROTOCOL_VERSION``.

A policy version is a ``PolicyVersion(incarnation, version)``: ``incarnation`` is bumped
each time a learner starts or resumes, so versions published before a crash never collide
with later ones; ``version`` is the learner's update count when the snapshot was taken.
On the wire they stay two integer fields; every message that names a version has a
``policy_version`` property, and code compares those, never rebuilt tuples.

Actor statistics travel in ``Heartbeat.actor_stats`` as typed records, one per actor, tagged
with the record's class name (``LearnerStats``, ``SamplerStats``, ...). An actor of your own
reports ``CustomStats(values={...})``. A new field of a record gets a default (older peers
ignore it); a new record type is a new wire type (older peers count the heartbeat that
carries it as a decode error), so prefer fields to new records.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np

PROTOCOL_VERSION = 1

# -- protocol constants ------------------------------------------------------------------

TELEMETRY_CHANNEL = "telemetry"
WEIGHTS_CHANNEL = "weights"
"""The channel weight receivers (DEALER) and the weight publisher (ROUTER) meet on; its
members also reach each other's chunk-stream listeners (``PortAddresses.stream_bind``)."""
"""The channel every process publishes heartbeats on (PUB -> the SUB that binds it)."""
HEARTBEAT_TOPIC = b"hb|"
"""Topic frame of ``Heartbeat`` on the telemetry channel (topics end in ``|``: SUB matches prefixes)."""
INSTALLED_TOPIC = b"installed|"
"""Topic frame of ``WeightsInstalled`` on the telemetry channel."""
LEARNER_METRICS_TOPIC = b"learner|"
"""Topic frame of ``LearnerMetrics`` on the telemetry channel (one per step and evaluation)."""


class PolicyVersion(NamedTuple):
    """One policy version, ordered: a later incarnation orders after every version of an
    earlier one. Hashable, and equal to the plain tuple ``(incarnation, version)``."""

    incarnation: int
    version: int


NO_VERSION = PolicyVersion(-1, -1)
"""Orders before every published version (nothing installed yet)."""


class _Versioned:
    """Mixin of messages about one policy version (fields ``incarnation`` and ``version``)."""

    __slots__ = ()
    incarnation: int
    version: int

    @property
    def policy_version(self) -> PolicyVersion:
        return PolicyVersion(self.incarnation, self.version)


LeaseOutcome = Literal["stored", "duplicate", "expired", "late", "dropped", "rejected"]
"""How the Buffer settled a lease (``LeaseClosed.outcome``): ``stored`` (the group is in
the store), ``duplicate`` (its task was already stored or trained), ``expired`` (the
deadline passed with no result: re-issue), ``late`` (a result for a lease already
expired), ``dropped`` (not trainable; ``LeaseClosed.reason`` says why), ``rejected`` (the
lease holder's group failed admission, ``reason`` is a ``RejectReason``: re-issue at once)."""

ZERO_VARIANCE = "zero_variance"
"""``LeaseClosed.reason`` (outcome ``dropped``) of a group the Buffer dropped because its
rewards all equal each other (DAPO dynamic sampling, ``BufferConfig.drop_zero_variance``):
the task is settled, not re-issued, and its place in the window goes to a new prompt."""

RejectReason = Literal[
    "unknown_lease",
    "wrong_token",
    "wrong_task",
    "wrong_group_size",
    "unpublished_version",
    "stale_version",
    "prompt_mismatch",
    "bad_shape",
    "token_out_of_vocab",
    "too_long",
    "bad_logprobs",
    "bad_segments",
    "observation_mismatch",
    "untrusted_episode",
    "environment_raised",
    "environment_timeout",
]
"""Why admission (``echo2.actors.admission``) refused a rollout group before scoring:
``unknown_lease`` (no open lease has that id), ``wrong_token`` (the lease's token was not
echoed: the group is not the holder's), ``wrong_task`` (task id, attempt or sampler id
differ from the lease), ``wrong_group_size``, ``unpublished_version`` (a version the
learner has not reached, or negative), ``stale_version`` (older than the staleness bound
allows), ``prompt_mismatch`` (prompt token ids differ from the trusted tokenization),
``bad_shape`` (arrays of the wrong dtype, rank or length, offsets not monotone, text
counts off), ``token_out_of_vocab``, ``too_long`` (a completion over the lease's
``max_new_tokens``), ``bad_logprobs`` (non-finite or positive). Multi-turn episodes
(``echo2.envs``): ``bad_segments`` (turn segments malformed, over the episode's limits, or
turn versions out of order), ``observation_mismatch`` (the trusted replay of the episode
produced other environment tokens), ``untrusted_episode`` (an episode of an environment
that cannot be replayed, from a sampler not listed as trusted), and the sampler's own
report that its environment failed (``EpisodeFailed``) or the trusted replay's: ``environment_raised``,
``environment_timeout`` (re-issued, never a reward of 0)."""

EnvironmentFailure = Literal["environment_raised", "environment_timeout"]
"""Why a sampler's episode failed (``EpisodeFailed.reason``): the environment raised, or a
reset or step ran past ``job.episode.turn_timeout_s``."""


class Message(msgspec.Struct, tag=True, frozen=True, kw_only=True, gc=False):
    """Base class of wire messages (not itself sent).

    ``gc=False``: messages are immutable data and cannot form reference cycles, so the
    garbage collector need not track them. Receivers decode messages in batches; tracked,
    they made the collector's passes cost more than decoding (about 2x fewer 64-record
    messages per second in ``benchmarks/transport.py``).
    """


# -- control -------------------------------------------------------------------------


RefusalReason = Literal["protocol_version", "name_in_use", "name_bound_to_another_key"]
"""Why a server refused a peer's claim to a name (``Welcome.refusal``, counted per reason):
``protocol_version`` (it speaks another ``PROTOCOL_VERSION``: permanent), ``name_in_use``
(another connection that is still up holds the name: retry after ``retry_after_s``, e.g. a
restart whose old connection has not closed yet), ``name_bound_to_another_key`` (under
CURVE the name belongs to another public key: permanent)."""


class ModelIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The model a worker must serve, computed by the trusted side from its configured model
    (``echo2.models.identity``) and carried in ``Welcome``.

    Token ids on the wire are this tokenizer's ids, each ``< vocab_size``. A worker compares
    the three digests and ``vocab_size`` with its own model's and must not generate when one
    differs; ``model_id`` is a label for messages (``"echo2-tiny"``, ``"smollm2"``, a
    directory's name), not compared.
    """

    model_id: str
    tokenizer_digest: str
    """BLAKE3 (hex) of the tokenizer's vocabulary, special ids and prompt template."""
    architecture_digest: str
    """BLAKE3 (hex) of the model's configuration (config.json's fields, canonical JSON)."""
    vocab_size: int
    """Rows of the model's token embedding: every token id is ``< vocab_size``."""


class Hello(Message, frozen=True):
    """First message a client sends on a request/reply channel (DEALER -> ROUTER).

    ``peer_id`` is the name the client claims (a sampler's actor name); the server binds it
    to the connection's routing id, which must be unique per connection (docs/protocol.md).
    """

    peer_id: str
    role: str
    protocol_version: int = PROTOCOL_VERSION
    pid: int = 0
    host: str = ""


class Welcome(Message, frozen=True):
    """Answer to ``Hello``: accepted, or refused with a reason the client logs.

    Refused with ``retry_after_s > 0``: the client may send ``Hello`` again after that many
    seconds (the name is held by a connection that is still up); with 0 it must stop.
    Until a ``Welcome(accepted=True)`` nothing the client sends is served.
    """

    server_id: str
    accepted: bool
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION
    refusal: RefusalReason | None = None
    retry_after_s: float = 0.0
    model: ModelIdentity | None = None
    """The model to serve (None: the server does not say; e.g. a transport-only job)."""


class RunEnded(Message, frozen=True):
    """PromptSource -> every welcomed Sampler on ``tasks``, as the trusted side stops: the
    run is over. The sampler stops and its process exits 0, so a launcher holding only
    workers (a remote host) ends too instead of running, and billing, until its deadline."""

    server_id: str
    reason: str = ""


class RunEndedSeen(Message, frozen=True):
    """Sampler -> PromptSource on ``tasks``: the acknowledgement of ``RunEnded`` (until it
    comes, the PromptSource re-sends ``RunEnded``, for a bounded time)."""

    sampler_id: str


class Probe(Message, frozen=True):
    """Server -> a connection it already knows, to learn whether that connection is still
    up (a send to a closed one fails at once). Carries nothing; clients ignore it."""

    server_id: str


class SayHello(Message, frozen=True):
    """Server -> a connection it has not welcomed that sent it work traffic: the server
    restarted (and so knows no names) or never heard this client's ``Hello``. Nothing that
    connection sent was served; the client says ``Hello`` again and, once welcomed,
    re-grants the credits it is still owed. Sent at most once a second per connection."""

    server_id: str


class Goodbye(Message, frozen=True):
    """Sampler -> PromptSource on ``tasks``, as the sampler leaves a run that goes on (its
    process stopped: Ctrl-C, SIGTERM, an elastic worker scaled down). The leases it holds go
    back now, not at their deadlines: the PromptSource expires them at once (the Buffer
    still settles each, so a group already stored stays stored and one still on its way
    arrives late and is not trained), forgets the sampler's credit and name, tells the
    activation scheduler it is gone, and answers ``GoodbyeSeen``."""

    sampler_id: str
    reason: str = ""


class GoodbyeSeen(Message, frozen=True):
    """PromptSource -> Sampler on ``tasks``: the answer to ``Goodbye``; ``leases_returned``
    leases of that sampler were expired for re-issue."""

    server_id: str
    leases_returned: int = 0


# -- joining a running job (python -m echo2.join) --------------------------------------


class JoinRequest(Message, frozen=True):
    """A worker outside the topology -> the join port of a running job's launcher
    (``[hosts.NAME] join_port``; over CURVE when ``[security] curve``): what it needs to
    start ``samplers`` samplers in the run. ``name`` is the base of their names (the
    worker's host name by default); the launcher makes them unique."""

    name: str
    samplers: int = 1
    host: str = ""
    pid: int = 0
    protocol_version: int = PROTOCOL_VERSION


class JoinPort(msgspec.Struct, frozen=True, kw_only=True):
    """Where one port of a joined sampler connects: a URL per binder of its channel and,
    per URL, the topology host whose CURVE public key to pin ("" = plain tcp)."""

    connect: list[str] = []
    curve_servers: list[str] = []
    stream_dial: list[str] = []
    """Per connect URL, the chunk-stream listener to dial for weights (the ``weights``
    port: a joined sampler receives weights over connections it opens)."""


class JoinInfo(Message, frozen=True):
    """The launcher's answer to ``JoinRequest``: accepted with everything a sampler needs
    to join (addresses, the job, the declared samplers' portable settings, the CURVE public
    keys of the hosts it connects to), or refused with a reason. The model's identity is
    checked at the PromptSource's ``Welcome``; weights come on the ``weights`` channel,
    the current version first."""

    server_id: str
    accepted: bool
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION
    run_id: str = ""
    names: list[str] = []
    """One unique name per sampler asked for."""
    job: dict[str, Any] = {}
    """The ``[job]`` table as the run resolved it (``echo2.job.JobConfig``)."""
    sampler_config: dict[str, Any] = {}
    """The first declared sampler's config, less the settings of its own machine (its
    ``Sampler.host_local_fields``): defaults the worker's ``--set`` overrides."""
    ports: dict[str, JoinPort] = {}
    """Port name of a Sampler -> where it connects."""
    telemetry: JoinPort = msgspec.field(default_factory=JoinPort)
    """Where heartbeats go (the activation scheduler measures workers from them)."""
    curve: bool = False
    curve_public_keys: dict[str, str] = {}
    """Host -> its CURVE public key (Z85), for the hosts named in ``curve_servers``."""
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 10.0


class EndOfStreamMsg(Message, frozen=True):
    """A producer will send nothing more on this channel."""

    producer_id: str


# -- statistics records (carried in heartbeats) -----------------------------------------


class Statistics(msgspec.Struct, tag=True, frozen=True, kw_only=True, gc=False):
    """Base of the per-actor statistics records (not itself sent). Counters are cumulative
    since the actor started; ``*_s`` fields are seconds."""


class LearnerStats(Statistics, frozen=True):
    """The Learner's progress and the capacity model's inputs (the scheduler reads them)."""

    version: int = 0
    rollouts_trained: int = 0
    bubble_ratio: float = 0.0
    """Fraction of the learner's time spent waiting for batches."""
    staleness_max: int = 0
    train_s_mean: float = 0.0
    """Mean seconds of a training step, recent steps (T_train; 0 until measured)."""
    step_s_mean: float = 0.0
    """Mean seconds of a whole step (wait + train), recent steps."""
    kappa: int = 0
    """Steps between published snapshots."""
    published_version: int = -1
    published_at_s: float = 0.0
    """Unix seconds at which ``published_version`` was handed to the publisher."""
    mismatch_by_sampler: dict[str, float] = {}
    """The last step's mean (sampler log-prob - learner log-prob) per token, per sampler
    (``rl.step.StepStats``): the PromptSource quarantines a sampler that stays far off."""


class SamplerStats(Statistics, frozen=True):
    """A Sampler's generation counters, its weight path and its price."""

    groups_sent: int = 0
    samples_generated: int = 0
    tokens_generated: int = 0
    installs: int = 0
    manifests_rejected: int = 0
    corrupt_chunks: int = 0
    weight_repair_requests: int = 0
    weight_chunks_forwarded: int = 0
    weight_shm_versions: int = 0
    weight_missing_bytes: int = 0
    """Bytes of the distinct chunks missing when this sampler first requested them (repair
    is needed for at most these)."""
    weight_repair_bytes_requested: int = 0
    """Repair bytes requested, re-requests included."""
    weight_requested_bytes_received: int = 0
    """Bytes received, on any path and duplicates included, for chunks this sampler had
    requested (the publisher's ``repair_bytes_sent`` are those of repair alone)."""
    weight_stream_bytes: int = 0
    """Bytes received on chunk streams (the publisher's and predecessors')."""
    weight_forward_failures: int = 0
    """Successors skipped for a version: their stream took no byte in the forward timeout,
    or could not be opened."""
    work_states: int = 0
    """Work states sent (``WorkRequest`` with ``max_leases``: ``echo2.actors.work_state``)."""
    work_restates_for_loss: int = 0
    """Of those, sent at once because leases a grant said were on their way never came."""
    weight_versions_finished: int = 0
    """Versions finished before a newer one that arrived meanwhile (``WeightReceiver``)."""
    weight_versions_abandoned: int = 0
    """Versions given up while finishing them (the publisher had moved on)."""
    installed_version: int = -1
    generate_s: float = 0.0
    """Seconds spent generating (the denominator of the scheduler's mu_i)."""
    wait_weights_s: float = 0.0
    price_per_hour: float = 0.0
    """Dollars per hour this worker costs (cost-aware activation)."""
    declared_rollouts_per_s: float = 0.0
    """Rollouts per second this worker says it delivers (``SamplerConfig.capacity``): the
    scheduler's estimate of it until it is measured (0: not declared)."""
    episodes_played: int = 0
    """Multi-turn episodes finished (``echo2.envs``)."""
    episodes_failed: int = 0
    """Multi-turn episodes whose environment raised or timed out (their lease reported failed)."""
    env_stuck_threads: int = 0
    """Environment calls that timed out and still hold their thread."""


BatchClampReason = Literal["above_groups_per_step", "above_capacity"]
"""Why the Buffer served a ``BatchRequest`` fewer groups than it asked for."""


class BufferStats(Statistics, frozen=True):
    """The Buffer's accounting (also sent with every ``Batch``)."""

    groups_stored: int = 0
    groups_trained: int = 0
    groups_dropped_after_store: int = 0
    batches_served: int = 0
    dropped: dict[str, int] = {}
    """Groups dropped, by reason (``duplicate``, ``late``, ``stale``, ``overflow``,
    ``zero_variance`` (dynamic sampling), the Rewarder's reasons)."""
    stored_now: int = 0
    learner_version: int = 0
    reward_failures: dict[str, int] = {}
    """Completions whose reward failed (kept out of training), by the Rewarder's reason
    (``raised:<Type>``, ``timeout``, ``not_a_number``, ``not_finite``, ``out_of_range``),
    from every scored group, trained or dropped."""
    rejected: dict[RejectReason, int] = {}
    """Groups refused at admission, by reason (never scored, never trained)."""
    rejected_by_sampler: dict[str, dict[RejectReason, int]] = {}
    """The same, per sampler: the lease holder's name when the group echoed its lease's
    token, else the name the group claims (self-claimed, so never grounds for quarantine)."""
    batch_requests_clamped: dict[BatchClampReason, int] = {}
    """``BatchRequest``s asking for more groups than one step trains (``groups_per_step``)
    or the Buffer holds (``max_groups``), served that many instead, by reason."""


class PromptSourceStats(Statistics, frozen=True):
    """The PromptSource's lease counters, in-flight window and activation."""

    leases_issued: int = 0
    leases_reissued: int = 0
    leases_expired: int = 0
    leases_stored: int = 0
    closed_duplicate: int = 0
    closed_late: int = 0
    closed_dropped: int = 0
    attempts_exhausted: int = 0
    refused_peers: int = 0
    leases_of_restarted_samplers: int = 0
    leases_rejected: int = 0
    """Leases whose holder's group failed admission (re-issued at once)."""
    quarantined_samplers: int = 0
    """Samplers given no more leases (repeated rejections); see the ``quarantined`` ledger event."""
    leases_withheld_old_version: int = 0
    """Times a sampler with credit was passed over because its installed version is too old."""
    leases_lost_in_transit: int = 0
    """Leases a sampler's work state showed it never received (sent before a grant it
    acknowledged: lost with a torn connection), re-issued at once."""
    work_states: int = 0
    """Work states (``WorkRequest`` with ``max_leases``) reconciled."""
    samplers_left: int = 0
    """Samplers that said ``Goodbye`` (left a run that goes on)."""
    leases_returned_on_leaving: int = 0
    """Their leases, expired for re-issue when they left instead of at their deadlines."""
    refused: dict[str, int] = {}
    """Hellos refused, by ``RefusalReason``."""
    unwelcomed_dropped: dict[str, int] = {}
    """Messages from connections never welcomed (or refused), dropped unserved, by type."""
    credits_clamped: dict[str, int] = {}
    """``WorkRequest``s whose credits would exceed ``max_credits_per_sampler``, by sampler:
    clamped to it."""
    open_leases: int = 0
    inflight: int = 0
    active_samplers: int = 0
    dollars_spent: float = 0.0


class RewarderStats(Statistics, frozen=True):
    """The Rewarder's scoring counters."""

    groups_scored: int = 0
    groups_dropped: int = 0
    items_scored: int = 0
    item_errors: dict[str, int] = {}
    """Completions whose reward failed, by reason (``timeout``, ``raised:<type>``, ...)."""
    stuck_threads: int = 0
    groups_rejected: int = 0
    """Groups refused at admission before scoring (the Buffer counts them by reason)."""
    lease_lookup_retries: int = 0
    """Lease lookups the PromptSource did not answer in time (asked again)."""
    episodes_replayed: int = 0
    """Multi-turn episodes replayed on the trusted side (``echo2.envs.replay``)."""
    episode_failures: dict[str, int] = {}
    """Episodes whose environment failed, by where and why: ``sampler:environment_raised``,
    ``sampler:environment_timeout`` (reported by samplers), ``replay:raised:<Type>``,
    ``replay:timeout`` (the trusted replay). Either way the lease is re-issued."""


class PublisherStats(Statistics, frozen=True):
    """The WeightPublisher's snapshots and its broadcaster's counters."""

    snapshots: int = 0
    skipped: int = 0
    """Snapshots superseded by a newer one before they were broadcast."""
    published: int = 0
    superseded: int = 0
    chunks_sent: int = 0
    stream_bytes: int = 0
    send_failures: int = 0
    repair_requests: int = 0
    repair_chunks_sent: int = 0
    repair_bytes_sent: int = 0
    repair_duplicates_dropped: int = 0
    """Chunk indices asked for again while still queued for that member (not re-sent)."""
    late_joiner_manifests: int = 0
    unroutable: int = 0
    members_expired: int = 0
    installs: int = 0
    shm_versions_written: int = 0
    shm_failures: int = 0
    delta_versions: int = 0
    """Versions streamed in delta form (``echo2.weights.delta``)."""
    delta_fallbacks: int = 0
    """Versions whose delta form saved too little (``DELTA_MAX_RATIO``): sent dense."""
    delta_dense_requests: int = 0
    """Members that asked for the dense form of a delta version (base lost, rebuild failed)."""
    members: int = 0
    dialed_streams: int = 0
    """Chunk-stream connections dialed in by members that accept none (``echo2.weights.dial``)."""
    max_streams: int = 0
    """Most parallel chunk streams open to one member now (``echo2.weights.lanes``)."""
    uplink_bytes: int = 0
    latest_version: int = -1
    t_bcast_s: float = -1.0
    """Broadcast time (publication to ceil(active / gamma) installs): the median of the
    recent versions that reached it, or, when recent versions stop short of it (superseded,
    slow members), the longest one streamed without reaching it (a lower bound:
    ``t_bcast_lower_bound``); -1: none yet."""
    t_bcast_lower_bound: bool = False
    held: int = 0
    """Times a newer snapshot waited for the version in flight to land (adaptive publication)."""
    broadcast_bound: bool = False
    """T_bcast exceeds kappa x T_train: broadcast, not training, sets the pace."""
    refused_subscribers: dict[str, int] = {}
    """``WeightSubscribe`` claims to a name refused, by ``RefusalReason``."""
    unbound_dropped: dict[str, int] = {}
    """Messages dropped because their connection does not hold the name they carry, by type."""


class CustomStats(Statistics, frozen=True):
    """Statistics of an actor of your own: ``statistics()`` returns
    ``CustomStats(values={"name": number, ...})``. echo2 carries them and reads none."""

    values: dict[str, float] = {}


ActorStats = (
    LearnerStats | SamplerStats | BufferStats | PromptSourceStats | RewarderStats | PublisherStats | CustomStats
)
STATISTICS_TYPES: tuple[type[Statistics], ...] = ActorStats.__args__


class EndpointHealth(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Input an endpoint threw away: malformed messages, and messages dropped at its HWM."""

    decode_errors: int = 0
    dropped: int = 0
    disconnects: int = 0
    """Peer connections closed (bound sockets): by the peer, or by libzmq for a frame over
    the socket's maximum message size."""
    inconsistent: dict[str, int] = {}
    """Well-formed messages whose fields contradict each other, by check (also in
    ``decode_errors``)."""


class Heartbeat(Message, frozen=True):
    """Application heartbeat on the telemetry topic: proves the event loop is alive.

    ``loop_lag_s`` is how late the heartbeat timer fired; a stuck loop shows up as a missing
    heartbeat, a busy one as lag. ``actor_stats`` maps actor name -> that actor's statistics
    record (actors with nothing to report are absent); ``endpoints`` maps endpoint name
    (``<actor>.<port>``) -> what it discarded.
    """

    process: str
    actors: list[str]
    pid: int
    host: str
    seq: int
    time_s: float
    loop_lag_s: float
    actor_stats: dict[str, ActorStats] = {}
    endpoints: dict[str, EndpointHealth] = {}


class LearnerMetrics(Message, frozen=True):
    """The Learner's numbers, on the telemetry channel (topic ``learner|``): one after each
    step, and one for an evaluation outside a step (the initial one at ``step`` 0, the
    final one when the last step did not evaluate: ``reward_mean`` and ``loss`` None). For a watching
    actor: subscribe to ``LEARNER_METRICS_TOPIC`` on a SUB bound to channel ``telemetry``.
    Lossy like all telemetry (dropped at the high-water mark); ``summary.json`` and
    ``metrics/<learner>.jsonl`` are the complete record."""

    learner: str
    incarnation: int
    step: int
    """The learner's version after this step (0: before training)."""
    time_s: float
    """Unix seconds when it was sent."""
    reward_mean: float | None = None
    """Mean training reward of the step's rollouts; None: no step (an evaluation alone)."""
    loss: float | None = None
    """The step's GRPO loss; None: no step (an evaluation alone)."""
    rollouts: int = 0
    """Rollouts trained by this step."""
    evaluated: bool = False
    """True when this step ran a held-out evaluation (the ``eval_*`` fields below)."""
    eval_pass_at_1: float | None = None
    """Held-out pass@1, greedy, by the task's correctness predicate; None: not evaluated,
    or the task declares no predicate."""
    eval_mean_reward: float | None = None
    """Mean training reward of the greedy held-out completions."""
    eval_pass_at_k: float | None = None
    """Held-out pass@k from sampled completions (unbiased estimator); None: not sampled."""
    eval_k: int = 0
    """k of ``eval_pass_at_k`` (0: not sampled)."""


class MetricsRecord(Message, frozen=True):
    """A structured metrics event (one JSON line in the run directory)."""

    source: str
    kind: str
    time_s: float
    values: dict[str, float | int | str | bool | None] = {}


# -- work: PromptSource <-> Sampler --------------------------------------------------


class WorkRequest(Message, frozen=True):
    """A sampler asks for work (credit-based flow control) and says which policy version it
    has installed ((-1, -1): none). A sampler whose installed version is older than the
    staleness bound admits is given no leases until it reports a newer one.

    Two forms. With ``max_leases >= 0`` it is a *work state*, idempotent: the sampler states
    how many leases it can hold (``max_leases``), the leases it holds (``held``: received, not
    yet answered) and the ones it answered lately (``submitted``); the PromptSource sets its
    credit to ``max_leases`` minus what it holds, re-issues at once the leases it sent that
    the sampler never received, and answers with ``WorkGrant(sync)``. ``acked`` names the
    last ``WorkGrant`` received: every lease sent before it has arrived or was lost, so
    only those are judged lost. A lost state or grant is repaired by the next state; a
    sampler sends one after each batch, each install, and every few seconds while it holds
    fewer than ``max_leases``. With ``max_leases = -1`` (the older form) ``credits`` more leases
    are granted, adding up; a request lost with a torn connection stays lost."""

    sampler_id: str
    credits: int = 0
    incarnation: int = -1
    installed_version: int = -1
    max_leases: int = -1
    """Leases this sampler can hold at once (-1: the older form: ``credits`` adds up)."""
    held: list[int] = []
    """Lease ids received and not yet answered (being generated or queued)."""
    submitted: list[int] = []
    """Lease ids answered lately (their groups may still be on their way): not lost."""
    sync: int = 0
    """This state's number, increasing per connection; the ``WorkGrant`` echoes it."""
    acked: int = 0
    """``sync`` of the last ``WorkGrant`` this sampler received (0: none yet)."""

    @property
    def states_work(self) -> bool:
        return self.max_leases >= 0

    @property
    def installed(self) -> PolicyVersion:
        return PolicyVersion(self.incarnation, self.installed_version)


class WorkGrant(Message, frozen=True):
    """PromptSource -> sampler on ``tasks``: the answer to a work state (``WorkRequest`` with
    ``max_leases``). Every lease sent before it on this connection has arrived before it.

    ``credits`` leases follow (unless the window is full); ``pending`` leases were counted
    as on their way when the state was judged (sent after the grant it acknowledged): a
    sampler that received fewer than ``pending`` leases between its state and this grant
    lost some, and says its state again at once (acknowledging this grant) so that they are
    re-issued. ``reissued``: leases judged lost by this state, re-issued to anyone."""

    server_id: str
    sync: int
    credits: int
    pending: int = 0
    reissued: int = 0


class TaskLease(Message, frozen=True):
    """One prompt to sample ``group_size`` times, leased until ``deadline_s`` from issue.

    ``attempt`` counts issues of the same task; ``lease_id`` is unique per issue. A result is
    accepted only for the lease that is open when it arrives.
    """

    lease_id: int
    task_id: str
    attempt: int
    prompt: str
    group_size: int
    ttl_s: float
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    min_version: int = 0
    """Generate with policy version >= this (else wait for weights): work made by an older
    policy would be too stale to train when it arrives."""
    token: bytes = b""
    """16 random bytes the sampler echoes in ``RolloutGroup.lease_token``: without CURVE a
    sampler's name is self-claimed, so this is what proves a group is the lease holder's.
    (The reference answer never travels: the trusted side scores from its own record.)"""
    episode_seed: int = 0
    """Multi-turn jobs: the seed every episode of this lease resets its environment with (the
    trusted side replays with the same)."""
    episode_meta: dict[str, Any] = {}
    """Multi-turn jobs: the prompt's metadata fields the environment reads on the sampler
    (``job.episode.lease_fields``); they reach the sampler, so never the answer."""


# -- rollouts: Sampler -> Rewarder -> Buffer ------------------------------------------


class RolloutGroup(Message, _Versioned, frozen=True):
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
    prompt_token_ids: np.ndarray  # int32 (P,)
    token_ids: np.ndarray  # int32 (sum_i T_i,)
    logprobs: np.ndarray  # float32 (sum_i T_i,)
    offsets: np.ndarray  # int32 (G + 1,)
    texts: list[str]
    finish_reasons: list[str]
    generate_s: float = 0.0
    lease_token: bytes = b""
    """``TaskLease.token``, echoed."""
    turn_offsets: np.ndarray | None = None
    """Multi-turn episodes only (``echo2.envs``; None: one model turn per completion): int32
    (K + 1,), the boundaries of the K turn segments in ``token_ids``, from 0 to
    ``len(token_ids)``, every ``offsets[i]`` among them. A segment is one model action or
    one environment observation."""
    turn_sources: np.ndarray | None = None
    """uint8 (K,): 1 for a model segment (sampled, trained), 0 for an environment segment
    (appended observation tokens: log-probs 0, never trained)."""
    turn_versions: np.ndarray | None = None
    """int32 (K,): the policy version (of ``incarnation``) that generated each model segment;
    -1 for environment segments. ``version`` is the oldest of them."""
    episode_returns: np.ndarray | None = None
    """float32 (G,): each episode's return as the sampler's environment computed it. Believed
    only for an environment that cannot be replayed, from a trusted sampler; otherwise the
    Rewarder's replay computes the reward."""

    @property
    def group_size(self) -> int:
        return len(self.offsets) - 1

    @property
    def multi_turn(self) -> bool:
        return self.turn_offsets is not None

    def loss_mask(self) -> np.ndarray:
        """uint8 (len(token_ids),): 1 for a token the learner trains on (sampled by the
        policy), 0 for an environment token. All ones for single-turn completions. Call only
        on an admitted group (segments checked: ``echo2.actors.admission``)."""
        if self.turn_offsets is None or self.turn_sources is None:
            return np.ones(len(self.token_ids), dtype=np.uint8)
        lengths: np.ndarray = np.diff(np.asarray(self.turn_offsets, dtype=np.int64))
        return np.repeat(self.turn_sources.astype(np.uint8), lengths)


class ScoredGroup(Message, frozen=True):
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

    @property
    def zero_reward_variance(self) -> bool:
        """The kept completions' rewards all equal each other (or fewer than two are kept):
        every group advantage is exactly 0 (``echo2.rl.grpo.group_advantages``), so the group
        would cost a learner step's compute and carry no gradient."""
        kept = self.rewards[self.keep.astype(bool)]  # (K,)
        return bool(kept.size < 2 or (kept == kept[0]).all())


class ExpireLease(Message, frozen=True):
    """PromptSource -> Buffer: the lease's deadline passed. The Buffer decides, once, whether
    the group was already stored (``LeaseClosed(outcome="stored")``) or the lease is now
    expired (``outcome="expired"``; later results for it are rejected as late), so a task is
    re-issued only when no result for it can still be trained."""

    lease_id: int
    task_id: str
    attempt: int


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The trusted side's record of one open lease: what admission checks a group against
    and what the reward is computed from (``answer`` and ``meta`` never reach a sampler)."""

    lease_id: int
    task_id: str
    attempt: int
    sampler_id: str
    """The routing id the lease was sent to."""
    token: bytes
    group_size: int
    max_new_tokens: int
    prompt: str
    answer: str
    meta: dict[str, Any] = {}
    """``Prompt.meta`` of the task (plain msgpack values)."""
    prompt_token_ids: np.ndarray  # int32 (P,): the trusted tokenization of ``prompt``
    episode_seed: int = 0
    """``TaskLease.episode_seed`` (multi-turn jobs): the replay resets with it."""


class AdmissionWindow(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The versions a group may be tagged with now, and the model's vocabulary.

    ``newest`` is the learner's next version (nothing newer can have been published);
    ``oldest`` is that minus S. ``vocab_size``: token ids lie in ``[0, vocab_size)``."""

    incarnation: int
    newest: int
    oldest: int
    vocab_size: int


class LeaseQuery(Message, frozen=True):
    """Rewarder -> PromptSource (``leases``): the records of these leases, if open."""

    request_id: int
    lease_ids: list[int]


class LeaseRecords(Message, frozen=True):
    """PromptSource -> Rewarder: the open leases among those asked for (closed or unknown
    ones are absent) and the current ``AdmissionWindow``."""

    request_id: int
    records: list[LeaseRecord]
    window: AdmissionWindow


class GroupRejected(Message, frozen=True):
    """Rewarder -> Buffer (``scored``): a rollout group failed admission and was not scored.

    ``holder`` is True when the group echoed its open lease's token: it is the lease
    holder's (``sampler_id`` is then the holder's routing id), so the Buffer closes the
    lease as ``rejected`` and it is re-issued at once. Otherwise nothing about the lease
    changes and ``sampler_id`` is only what the group claimed."""

    lease_id: int
    task_id: str
    attempt: int
    sampler_id: str
    version: int
    reason: RejectReason
    holder: bool = False
    detail: str = ""


class EpisodeFailed(Message, frozen=True):
    """Sampler -> Rewarder (``rollouts``): an episode of this lease failed in the sampler's
    environment (it raised, or a reset or step passed ``job.episode.turn_timeout_s``), so no
    group comes for it. With the lease's token, the Rewarder forwards it to the Buffer as a
    ``GroupRejected`` of the holder (``reason``): the lease is closed ``rejected`` and
    re-issued at once, counted by reason, never scored as 0, and not held against the
    sampler's quarantine (the environment failed, not the sampler)."""

    lease_id: int
    task_id: str
    attempt: int
    sampler_id: str
    lease_token: bytes
    reason: EnvironmentFailure
    detail: str = ""
    """What failed, for the log: ``raised:<ExceptionType>: message`` or the call that timed out."""


class LearnerProgress(Message, frozen=True):
    """Buffer -> PromptSource after each batch: cumulative counters that pace issuance.
    (Stored groups are not among them: the PromptSource counts those from ``LeaseClosed``,
    so that a stored group never leaves its in-flight window before it is trained.)"""

    next_version: int
    groups_trained: int
    groups_dropped_after_store: int
    delivered_by_sampler: dict[str, int] = {}
    """Rollouts each sampler has had stored, cumulative (the scheduler's mu_i)."""
    incarnation: int = 0
    """The learner's incarnation (admission rejects versions of a later one)."""
    buffer_incarnation: int = 0
    """The Buffer's own incarnation (one more per restart of its process or resume; 0
    without a journal): counters of a later one supersede an earlier one's."""


class LeaseClosed(Message, frozen=True):
    """Buffer -> PromptSource: the lease is done, with what happened to the group
    (``LeaseOutcome``); ``reason`` says why a group was ``dropped`` ("" otherwise)."""

    lease_id: int
    task_id: str
    attempt: int
    outcome: LeaseOutcome
    reason: str = ""


# -- batches: Learner <-> Buffer ------------------------------------------------------


class BatchRequest(Message, _Versioned, frozen=True):
    """The learner at ``version`` asks for ``num_groups`` admissible groups."""

    request_id: int
    incarnation: int
    version: int
    num_groups: int


class Batch(Message, frozen=True):
    """Admissible groups for a ``BatchRequest``, with the buffer's counters at reply time."""

    request_id: int
    groups: list[ScoredGroup]
    buffer: BufferStats | None = None


class LearnerCheckpointed(Message, _Versioned, frozen=True):
    """Learner -> Buffer: a checkpoint at ``version`` is on disk, and a resume starts from it
    or a newer one. Groups handed for earlier versions are durable in the model; later ones
    are kept, so a resumed learner trains them again instead of losing them. The learner
    sends the checkpoint before its newest, the one ``--resume`` falls back to if the
    newest is damaged (0 while it has only one)."""

    incarnation: int
    version: int


# -- weights: Learner -> WeightPublisher -> Samplers ----------------------------------


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor lives in the flat snapshot: ``data[offset:offset+nbytes]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class LoraAdapter(msgspec.Struct, frozen=True):
    """A version that is a LoRA adapter on the base model every member already serves
    (``echo2.models.adapters``): its tensors are ``<module>.lora_A.weight`` (rank x in)
    and ``<module>.lora_B.weight`` (out x rank) per adapted linear module, and the module's
    output becomes ``base(x) + alpha / rank * B(A(x))``."""

    rank: int
    alpha: float


class Snapshot(Message, _Versioned, frozen=True):
    """Learner -> WeightPublisher: an immutable copy of the policy, flat, with its layout.

    In one process this travels over inproc without a copy: ``data`` is referenced, and the
    learner never reuses the buffer.
    """

    incarnation: int
    version: int
    tensors: list[TensorSpec]
    data: np.ndarray  # uint8 (total_bytes,)
    created_at_s: float
    adapter: LoraAdapter | None = None
    """Set: ``tensors`` are LoRA adapter weights on the job's base model, not the policy's
    full state (``echo2.models.adapters``)."""
    train_s: float = 0.0
    """The learner's recent mean seconds per update (T_train; 0: not measured yet): the
    publisher holds it against T_bcast (``echo2.capacity.publication``)."""


class WeightDelta(msgspec.Struct, frozen=True):
    """How a delta-coded version travels (``echo2.weights.delta``): its chunks carry a
    payload that rebuilds the full state from base version (``base_incarnation``,
    ``base_version``), which the member must hold complete and verified. The manifest's
    own fields keep describing the full state, and the rebuilt state is verified against
    them before it is installed."""

    base_incarnation: int
    base_version: int
    total_bytes: int
    """Payload bytes (what is chunked, relayed and repaired)."""
    chunk_digests: list[bytes]
    """One per chunk of payload (``chunk_bytes``), in the manifest's ``digest_algorithm``."""
    digest: bytes
    """Over the concatenated payload chunk digests (signed with the manifest)."""
    changed_fraction: float = 0.0
    """Elements whose bit pattern differs from the base (telemetry)."""
    chunk_bytes: int = 0
    """Payload bytes per chunk (0: the manifest's ``chunk_bytes``); a small payload travels
    in smaller chunks than the state, so that its rebuild overlaps its arrival."""


class WeightManifest(Message, _Versioned, frozen=True):
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
    seal_key: bytes = b""
    """Under ``[security]``: the version's AES-256-CTR content key (``echo2.weights.seal``);
    ``chunk_digests`` are then over the ciphertext. Empty: chunks are plaintext."""
    seal_check: bytes = b""
    """Keyed BLAKE3 of ``digest`` under ``seal_key``: commits the manifest to its key."""
    delta: WeightDelta | None = None
    """Set: this version's chunks are a delta payload against a base (``WeightDelta``);
    None: its chunks are the state itself (a dense version)."""
    delta_base: bool = False
    """The publisher codes later versions against this one (delta versions are on): a
    member keeps the state as its delta base. False: it need not keep a copy."""
    adapter: LoraAdapter | None = None
    """Set: the state is a LoRA adapter on the base model (``LoraAdapter``), installed as
    one (``Engine.install_adapter``); None: the policy's full weights."""


class WeightChunk(Message, _Versioned, frozen=True):
    """Bytes ``[index * chunk_bytes, ...)`` of snapshot (incarnation, version)."""

    incarnation: int
    version: int
    index: int
    data: np.ndarray  # uint8 (<= chunk_bytes,)


class WeightsReceived(Message, _Versioned, frozen=True):
    """Sampler -> WeightPublisher on ``weights``, the moment a version is complete and
    verified (before it is installed): how long each member took to hold a version, after
    the members that fed it, is what the publisher places members in later plans by
    (``echo2.weights.plan.Placement``)."""

    sampler_id: str
    incarnation: int
    version: int


class WeightsInstalled(Message, _Versioned, frozen=True):
    """A sampler installed a version (telemetry; T_bcast is measured from these)."""

    sampler_id: str
    incarnation: int
    version: int
    install_s: float
    time_s: float
    received_s: float = 0.0
    """Seconds from the version's manifest reaching the sampler to every chunk held and
    verified: its transfer, chain and repair included (0: not measured)."""
    complete_time_s: float = 0.0
    """Unix time the version was complete and verified there, before it waited for the
    sampler's generation batch to end (0: not measured)."""


class WeightSubscribe(Message, frozen=True):
    """Sampler -> WeightPublisher on ``weights`` (DEALER -> ROUTER), repeated as a lease:
    "I am alive, send versions to me; my relay inbox (PULL) is at ``relay_address``"."""

    sampler_id: str
    relay_address: str
    incarnation: int = -1
    installed_version: int = -1
    shm_id: str = ""
    """Identity of the shared-memory directory this sampler can map (``weights.shm``);
    "" for none. A publisher with the same identity hands it versions as ``WeightShm``."""

    @property
    def installed(self) -> PolicyVersion:
        """The version this sampler has installed (``NO_VERSION``: none yet)."""
        return PolicyVersion(self.incarnation, self.installed_version)


class RelayChain(msgspec.Struct, frozen=True, array_like=True):
    """One chain of a relay plan: stripe ``stripe``'s chunks flow publisher -> members[0]
    -> members[1] -> ... (each forwards every verified chunk of the stripe it receives). A
    member may head several chains of one stripe (a relay tree: it forwards to the next
    member of each), and is sent only the chains through it (``weights.plan.member_view``)."""

    stripe: int
    members: list[str]


class RelayPlan(Message, _Versioned, frozen=True):
    """WeightPublisher -> each member, before the manifest of (incarnation, version).

    Chunk ``i`` belongs to stripe ``i % stripes``. A star is ``stripes = 1`` with one chain
    of one member per sampler; a relay is one chain of every sampler; striped relay is
    ``stripes`` chains of every sampler in rotated orders. ``addresses`` maps member ->
    relay inbox address. ``publisher`` is the publisher's name: under ``[security]``, the
    name its chunk streams prove (a member's inbox admits it and its predecessors).
    """

    incarnation: int
    version: int
    stripes: int
    chains: list[RelayChain]
    addresses: dict[str, str] = {}
    publisher: str = ""
    stream_secret: bytes = b""
    """Under ``[security]``: random per plan; a chunk stream's sender proves it knows it
    (HMAC over the inbox's challenge, ``echo2.weights.stream``). Empty: inboxes are open."""


class WeightShm(Message, _Versioned, frozen=True):
    """WeightPublisher -> a member sharing its host, before the manifest: the version's
    bytes are in the file ``path`` (shared memory); map it and verify it there instead of
    waiting for a stream. The member is in no relay chain for this version."""

    incarnation: int
    version: int
    path: str


class ChunkRequest(Message, _Versioned, frozen=True):
    """Repair: a sampler asks for chunks it lacks (missing or corrupt) of a version."""

    sampler_id: str
    incarnation: int
    version: int
    indices: list[int]
    dense: bool = False
    """The delta form of this version cannot be used here (base not held, or the rebuilt
    state failed verification): send the dense manifest, and repair from the dense form."""


AnyMessage = (
    Hello
    | Welcome
    | Probe
    | SayHello
    | RunEnded
    | RunEndedSeen
    | Goodbye
    | GoodbyeSeen
    | JoinRequest
    | JoinInfo
    | EndOfStreamMsg
    | Heartbeat
    | LearnerMetrics
    | MetricsRecord
    | WorkRequest
    | WorkGrant
    | TaskLease
    | ExpireLease
    | LeaseQuery
    | LeaseRecords
    | GroupRejected
    | EpisodeFailed
    | LearnerProgress
    | RolloutGroup
    | ScoredGroup
    | LeaseClosed
    | BatchRequest
    | Batch
    | LearnerCheckpointed
    | Snapshot
    | WeightManifest
    | WeightChunk
    | WeightsInstalled
    | WeightsReceived
    | WeightSubscribe
    | RelayPlan
    | ChunkRequest
    | WeightShm
)

MESSAGE_TYPES: tuple[type[Message], ...] = AnyMessage.__args__
