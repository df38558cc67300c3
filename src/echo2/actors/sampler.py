"""Sampler: asks for work, generates G completions per prompt, installs new weights.

Role: a rollout worker. It holds one installed policy version and tags every rollout with
it; a new version is installed only once complete and verified, and only between
generation batches, so a batch never mixes versions.

Input: ``tasks`` (DEALER, identity = actor name) — ``Welcome`` then ``TaskLease`` from the
PromptSource; ``weights`` (DEALER, identity = actor name) — ``RelayPlan``, ``WeightManifest``
and repaired ``WeightChunk``s from the WeightPublisher, and a relay inbox (PULL, bound at an
address announced to the publisher) for streamed chunks, which it forwards down its relay
chain (``echo2.weights.WeightReceiver``).
Output: ``RolloutGroup`` on ``rollouts`` (PUSH, to the Rewarders); ``WeightsInstalled`` to the
WeightPublisher (T_bcast) and on telemetry.

Backpressure: credit-based, stated not added (``echo2.actors.work_state``). It can hold
``credits`` leases; every ``WorkRequest`` states that number, the leases it holds and the
ones it answered lately, and the PromptSource grants the difference. It states its work
after each batch, each install and every ``restate_s`` while it holds fewer leases than
``credits``, so a request or a lease lost with a torn connection (a link outage) costs one
state, not the rest of the run. A slow Rewarder makes the ``rollouts`` send block, which
stops generation and with it new credit.

Versions: a lease names ``min_version``; older weights would produce rollouts too stale
to train, so the sampler waits for a newer install instead of generating. Every
``WorkRequest`` names the installed version, and each install is reported with one: the
PromptSource leases nothing to a sampler too old to be trained from.

Leases carry a random ``token`` that each ``RolloutGroup`` echoes (``lease_token``); the
reference answer never reaches a sampler.

A restarted PromptSource knows no names: it answers this sampler's next message with
``SayHello``; the sampler says Hello again and states its work, keeping the leases it
holds (the PromptSource's journal kept them open).

A PromptSource that answers none of its work states for ``unreachable_log_s`` (a dead
link, a stopped data process) is named in a log line every ``unreachable_log_s``.

Multi-turn jobs (``[job.episode]``, ``echo2.envs``): each lease is G episodes, played
here to their end (``echo2.envs.play``: the environment runs on this machine, so an
episode keeps its state, and the result travels as one ``RolloutGroup`` per lease with
per-turn segments). Newer weights of the same incarnation are installed between turns,
and each action records the version that sampled it. An episode whose environment raised
or timed out fails its lease: ``EpisodeFailed`` goes to the Rewarder instead of a group
(the lease is re-issued, never scored as 0).

Shutdown: on ``stopping`` it finishes nothing new. Leaving a run that goes on (its process
stopped alone: Ctrl-C, an elastic worker scaled down), it says ``Goodbye`` and waits up to
``goodbye_timeout_s`` for ``GoodbyeSeen``: the PromptSource re-issues its leases now, not at
their deadlines. At the end of the run (``RunEnded``) there is nothing to give back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import deque
from typing import Annotated, Any, ClassVar

import numpy as np
from msgspec import Meta

from echo2 import ledger
from echo2.actor import Actor, ActorConfig, Port, record_statistics, run_until_stopped, until_stopping
from echo2.actors.work_state import SamplerWork
from echo2.engines.base import Completion, Engine, EngineThread, SamplingParams, make_engine
from echo2.envs.base import EnvironmentSpec, load_job_environment
from echo2.envs.codec import load_episode_codec
from echo2.envs.episode import EpisodeCodec, EpisodeLimits
from echo2.envs.play import OTHER_EPISODE_FAILED, EpisodeRequest, episode_group, play_episodes
from echo2.errors import ModelMismatch, TransportError
from echo2.job import JobConfig, JobObjects
from echo2.messages import (
    INSTALLED_TOPIC,
    EpisodeFailed,
    Goodbye,
    GoodbyeSeen,
    Hello,
    ModelIdentity,
    PolicyVersion,
    RolloutGroup,
    RunEnded,
    RunEndedSeen,
    SamplerStats,
    SayHello,
    TaskLease,
    Welcome,
    WorkGrant,
)
from echo2.models.location import is_hf_spec
from echo2.registry import EngineKind
from echo2.tasks.base import Prompt
from echo2.tasks.calls import TimedCalls
from echo2.transport.peers import connection_routing_id
from echo2.weights import WeightReceiver
from echo2.weights.chunks import SnapshotAssembler
from echo2.weights.link import LinkSpec
from echo2.weights.plan import DataPlane

STATS_RECORD_S = 5.0
"""Seconds between two ``stats`` records (generation and weight-path counters) in the
sampler's metrics file; a last one as it stops."""


class SamplerConfig(ActorConfig, frozen=True):
    unreachable_log_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds between two log lines while the PromptSource answers neither our Hello nor our work states."""
    restate_s: Annotated[float, Meta(gt=0)] = 2.0
    """Seconds between two work states while this sampler holds fewer leases than
    ``credits`` (each repairs a request or lease lost with a torn connection)."""
    engine: EngineKind = "torch"
    """Engine kind: "torch" (built-in or Hugging Face model, pure torch), "hf" (same, HF
    only), "vllm" (extra echo2[vllm]) or "simulated" (no compute, for scale tests)."""
    engine_kwargs: dict[str, Any] = {}
    """Keyword arguments of the engine's constructor (``seed`` and ``model_dir`` default
    from the job)."""
    credits: Annotated[int, Meta(ge=1)] = 8
    """Leases this sampler holds at once (asked for in every work state)."""
    max_batch_groups: Annotated[int, Meta(ge=1)] = 8
    """Most leases generated together in one engine call (larger batches decode faster)."""
    batch_wait_s: Annotated[float, Meta(ge=0)] = 0.0
    """With fewer than ``max_batch_groups`` leases queued and more already granted but not
    yet arrived, wait up to this long for them before generating. Leases return one by one
    as groups are stored, so without a wait a sampler decodes many small batches; a small
    model pays most of its decode cost per engine call, not per sequence. 0: never wait."""
    price_per_hour: Annotated[float, Meta(ge=0)] = 0.0
    """What this worker costs, dollars per hour, for cost-aware activation."""
    capacity: Annotated[float, Meta(ge=0)] = 0.0
    """Rollouts per second this worker says it delivers: the activation scheduler's estimate
    of it until it is measured (0: not declared; the median of the measured ones)."""
    goodbye_timeout_s: Annotated[float, Meta(ge=0)] = 2.0
    """Most seconds spent, when leaving a run that goes on, waiting for the PromptSource to
    acknowledge ``Goodbye`` (its leases re-issued at once); past it they expire at their
    deadlines. 0: leave without saying Goodbye."""
    uplink_mbps: Annotated[float, Meta(ge=0)] = 0.0
    """Emulated uplink cap on the weight path (relay forwarding), Mbit/s; 0: uncapped."""
    downlink_mbps: Annotated[float, Meta(ge=0)] = 0.0
    """Emulated downlink cap on the weight path, Mbit/s; 0: uncapped."""
    latency_ms: Annotated[float, Meta(ge=0)] = 0.0
    """Emulated one-way latency, milliseconds, added to every weight chunk this sampler receives."""
    relay_host: str = ""
    """Address peers reach this sampler's relay inbox at over tcp (default: this host's
    address on the route to the publisher)."""
    shm_dir: str = ""
    """Shared-memory directory (e.g. "/dev/shm"): when the weight publisher shares it (same
    host, its ``shm_dir``), versions are mapped from it and verified in place. "": off."""
    weights_data_plane: DataPlane = "stream"
    """Relay inbox over tcp: "stream" (chunks land in place in the assembly buffer,
    ``echo2.weights.stream``) or "zmq" (a ZeroMQ PULL)."""
    gap_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    """Seconds a version may receive no byte before its missing chunks are repaired (the
    floor: at least 3 round trips of the path, ``echo2.weights.pacing``)."""
    weights_forward_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds the next member's chunk stream may take no byte before it is skipped for the
    version (at least 3 of the kernel's retransmission timeouts)."""
    weights_connect_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    """Seconds to open a chunk stream to the next member."""
    weights_repair_window_bytes: Annotated[int, Meta(gt=0)] = 4 << 20
    """Repair bytes this sampler may have requested and not yet received."""
    weights_max_streams: Annotated[int, Meta(ge=1, le=1024)] = 128
    """Parallel TCP streams, at most, to the next member of a relay chain (and dialed to the
    publisher from a host with ``inbound = false``); the number used adapts to the path."""
    manifest_verify_key: str = ""
    """Ed25519 public key (PEM) of the learner: manifests not signed by it are rejected."""
    environment_threads: Annotated[int, Meta(ge=1)] = 8
    """Environment calls run at once (multi-turn jobs, ``[job.episode]``), each in a worker
    thread; more wait their turn, and a call's ``turn_timeout_s`` runs from when it starts.
    Raise it for an environment that waits on I/O (a remote sandbox, a service)."""


class Sampler(Actor):
    kind: ClassVar[str] = "sampler"
    trusted: ClassVar[bool] = False
    completes_run: ClassVar[bool] = True
    """It returns only when the PromptSource announces the end of the run (``RunEnded``):
    its process has then nothing left to do, and a remote host's launcher stops."""
    Config = SamplerConfig
    host_local_fields: ClassVar[frozenset[str]] = frozenset(
        {"relay_host", "shm_dir", "uplink_mbps", "downlink_mbps", "latency_ms", "manifest_verify_key"}
    )
    """Config fields that describe the machine a declared sampler runs on (addresses, paths,
    emulated links), not the job: a sampler joining with ``python -m echo2.join`` does not
    take them from the declared one."""
    ports: ClassVar[dict[str, Port]] = {
        "tasks": Port("dealer", bind=False),
        "rollouts": Port("push", bind=False),
        "weights": Port("dealer", bind=False),
    }
    config: SamplerConfig

    @classmethod
    def torch_weight(cls, config: ActorConfig) -> float:
        assert isinstance(config, SamplerConfig)
        return 1.0 if config.engine in ("torch", "hf", "vllm") else 0.0

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        kwargs = dict(self.config.engine_kwargs)
        kind = self.config.engine
        if kind == "torch" and is_hf_spec(self.job.model):
            kind = "hf"  # the torch engine for Hugging Face models
        if kind in ("torch", "hf", "vllm"):
            kwargs.setdefault("seed", _seed_from_name(self.job.seed, self.name))
            if kind != "torch":  # the tiny model renders plain text only
                kwargs["prompt_format"] = self.job.prompt_format
            if self.job.model:
                kwargs.setdefault("model_dir", self.job.model)
        if kind == "vllm":
            # A LoRA run's rollouts in flight finish under their own adapter version.
            kwargs.setdefault("resident_adapters", self.job.staleness + 1)
        self._engine_thread = EngineThread(self.name)
        self.engine: Engine = await self._engine_thread.call(make_engine, kind, **kwargs)
        # One routing id per connection (never the bare name: echo2.transport.peers).
        self._tasks = ctx.open("tasks", identity=connection_routing_id(self.name))
        self._rollouts = ctx.open("rollouts")
        self._weights = ctx.open("weights", identity=connection_routing_id(self.name))
        inbox = ctx.addresses("weights")  # where the relay inbox listens, or whom to dial
        self._receiver = WeightReceiver(
            ctx.transport,
            self._weights,
            name=self.name,
            link=LinkSpec(self.config.uplink_mbps, self.config.downlink_mbps, self.config.latency_ms),
            relay_host=self.config.relay_host,
            gap_timeout_s=self.config.gap_timeout_s,
            send_timeout_s=self.config.weights_forward_timeout_s,
            connect_timeout_s=self.config.weights_connect_timeout_s,
            max_repair_bytes=self.config.weights_repair_window_bytes,
            data_plane=self.config.weights_data_plane,
            shm_dir=self.config.shm_dir or None,
            on_complete=self._on_complete,
            verify_manifest=_manifest_verifier(self.config.manifest_verify_key),
            sealed=ctx.sealed_weights,
            finish_within=self.job.staleness,
            max_streams=self.config.weights_max_streams,
            relay_bind=inbox.stream_bind,
            relay_announce=inbox.stream_announce,
            dial=inbox.stream_dial[0] if inbox.stream_dial else "",
        )
        self._receiver.open()
        self._episodes: _Episodes | None = None
        if self.job.multi_turn:
            model = str(self.config.engine_kwargs.get("model_dir") or self.job.model)
            self._episodes = await asyncio.to_thread(
                _Episodes.load, self.job, ctx.job_objects, model, self.config, self.name
            )
        self._leases: deque[TaskLease] = deque()
        self._have_work = asyncio.Event()
        self._lease_arrived = asyncio.Event()
        self._work = SamplerWork(self.name, self.config.credits, self.config.restate_s)
        self._answered_s = time.monotonic()  # last WorkGrant, lease or Welcome on ``tasks``
        self._wake = asyncio.Event()  # work arrived or a version is ready to install
        self._weights_ready = asyncio.Event()
        self._ready: SnapshotAssembler | None = None
        self._installed: PolicyVersion | None = None
        self._welcomed = False  # nothing but Hello goes on ``tasks`` before Welcome
        self._run_ended = asyncio.Event()
        self.counters = dict.fromkeys(
            ("groups_sent", "samples_generated", "tokens_generated", "installs", "episodes_played", "episodes_failed"),
            0,
        )
        self.generate_s = 0.0
        self.wait_weights_s = 0.0

    async def _handshake(self) -> None:
        """Hello/Welcome: the PromptSource checks our protocol version and our claim to our
        name before any work, and says which model to serve; we check that our engine
        serves it.

        Refused with a retry delay (our name is still held by a connection that is up,
        e.g. this sampler's previous process, not yet dropped), we say Hello again after
        it; refused without one, or told of another model, we fail (exit non-zero).

        Runs in ``run()``, not ``setup()``: setup must never wait for a peer, since peers
        in the same process are set up one after another.
        """
        while True:
            await self._tasks.send(self._hello())
            reply = await self._wait_welcome()
            if reply.accepted:
                break
            if reply.retry_after_s <= 0:
                raise TransportError(f"PromptSource {reply.server_id} refused this sampler: {reply.reason}")
            self.ctx.log.warning("refused (%s); saying Hello again in %g s", reply.reason, reply.retry_after_s)
            await asyncio.sleep(reply.retry_after_s)  # the server's back-off, not a synchronisation
        if reply.model is not None:
            check_model(reply.model, self.engine.model_identity())
        self._welcomed = True

    def _hello(self) -> Hello:
        return Hello(peer_id=self.name, role="sampler", pid=os.getpid(), host=socket.gethostname())

    async def _on_welcome_again(self, reply: Welcome) -> None:
        """The answer to a Hello sent on ``SayHello`` (the PromptSource restarted): state our
        work; the leases this sampler holds stay its own."""
        if reply.accepted:
            self.ctx.log.info(
                "welcomed again by %s (it restarted); holding %d leases", reply.server_id, len(self._work.held)
            )
            await self._state_work()
            return
        if reply.retry_after_s <= 0:
            raise TransportError(f"PromptSource {reply.server_id} refused this sampler: {reply.reason}")
        self.ctx.log.warning("refused (%s); saying Hello again in %g s", reply.reason, reply.retry_after_s)
        await asyncio.sleep(reply.retry_after_s)  # the server's back-off, not a synchronisation
        await self._tasks.send(self._hello())

    async def _wait_welcome(self) -> Welcome:
        """The PromptSource's answer to our Hello; until it comes, a line every
        ``unreachable_log_s`` says we wait for it, and where (a wrong or unreachable address
        otherwise looks like a sampler that does nothing)."""
        started = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(self.config.unreachable_log_s):
                    while not isinstance(reply := await self._tasks.recv(), Welcome):
                        pass
                    return reply
            except TimeoutError:
                where = ", ".join(self._tasks.endpoints) or "tasks"
                self.ctx.log.warning(
                    "no answer from the PromptSource at %s to Hello for %.1f s: is it running, and that address reachable from here?",
                    where,
                    time.monotonic() - started,
                )

    def statistics(self) -> SamplerStats:
        receiver = getattr(self, "_receiver", None)
        received = receiver.statistics() if receiver is not None else {}
        work: SamplerWork | None = getattr(self, "_work", None)
        return SamplerStats(
            **self.counters,
            manifests_rejected=int(received.get("manifests_rejected", 0)),
            corrupt_chunks=int(received.get("corrupt_chunks", 0)),
            weight_repair_requests=int(received.get("repair_requests", 0)),
            weight_chunks_forwarded=int(received.get("chunks_forwarded", 0)),
            weight_shm_versions=int(received.get("shm_versions", 0)),
            weight_missing_bytes=int(received.get("repair_missing_bytes", 0)),
            weight_repair_bytes_requested=int(received.get("repair_bytes_requested", 0)),
            weight_requested_bytes_received=int(received.get("requested_bytes_received", 0)),
            weight_stream_bytes=int(received.get("stream_bytes_received", 0)),
            weight_forward_failures=int(received.get("forward_failures", 0)),
            work_states=work.states_sent if work is not None else 0,
            work_restates_for_loss=work.restates_for_loss if work is not None else 0,
            weight_versions_finished=int(received.get("versions_finished", 0)),
            weight_versions_abandoned=int(received.get("versions_abandoned", 0)),
            installed_version=self._installed.version if self._installed is not None else -1,
            env_stuck_threads=self._episodes.calls.stuck if self._episodes is not None else 0,
            generate_s=self.generate_s,
            wait_weights_s=self.wait_weights_s,
            price_per_hour=self.config.price_per_hour,
            declared_rollouts_per_s=self.config.capacity,
        )

    async def aclose(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        thread = getattr(self, "_engine_thread", None)
        if thread is not None:
            thread.close()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.close()
        episodes = getattr(self, "_episodes", None)
        if episodes is not None:
            episodes.calls.close()

    # -- loops -----------------------------------------------------------------------

    async def run(self) -> None:
        # Welcomed first, alone: a refusal or a model mismatch fails the actor with its own
        # one-line error, and a sampler that is not welcomed subscribes to nothing.
        welcomed, _ = await until_stopping(self.ctx.stopping, self._handshake())
        if welcomed:
            # Until the process stops, or the PromptSource says the run is over (RunEnded):
            # then this actor returns, which completes the run for its process.
            loops = run_until_stopped(
                self._run_ended,
                self._receive_leases(),
                self._receive_weights(),
                self._generate(),
                self._restate(),
                record_statistics(self, STATS_RECORD_S),
            )
            await until_stopping(self.ctx.stopping, loops)
            if not self._run_ended.is_set() and self.config.goodbye_timeout_s > 0:
                await self._say_goodbye()

    async def _say_goodbye(self) -> None:
        """Leaving a run that goes on: hand the leases held back now (``Goodbye``)."""
        await self._tasks.send(Goodbye(sampler_id=self.name, reason="its process is stopping"))
        try:
            async with asyncio.timeout(self.config.goodbye_timeout_s):  # a gone PromptSource must not hold the drain
                while True:
                    message = await self._tasks.recv()
                    if isinstance(message, GoodbyeSeen):
                        self.ctx.log.info("left the run: %d lease(s) handed back", message.leases_returned)
                        return
                    if isinstance(message, RunEnded):  # the whole run is stopping: nothing to hand back
                        await self._tasks.send(RunEndedSeen(sampler_id=self.name))
                        return
        except TimeoutError:
            self.ctx.log.warning(
                "no answer to Goodbye within %g s: the leases held expire at their deadlines",
                self.config.goodbye_timeout_s,
            )

    async def _receive_leases(self) -> None:
        await self._state_work()
        while True:
            for message in await self._tasks.recv_many():
                if isinstance(message, WorkGrant | TaskLease | Welcome):
                    self._answered_s = time.monotonic()
                if isinstance(message, WorkGrant):
                    if self._work.granted(message):
                        self.ctx.log.info(
                            "leases sent to this sampler were lost on the way (%d expected); stating our work again",
                            message.pending,
                        )
                        await self._state_work()
                elif isinstance(message, RunEnded):
                    self.ctx.log.warning("the run is over (%s: %s); stopping", message.server_id, message.reason)
                    await self._tasks.send(RunEndedSeen(sampler_id=self.name))
                    self._run_ended.set()
                elif isinstance(message, SayHello):
                    self.ctx.log.warning(
                        "%s does not know this sampler (it restarted?); saying Hello", message.server_id
                    )
                    await self._tasks.send(self._hello())
                elif isinstance(message, Welcome):
                    await self._on_welcome_again(message)
                elif isinstance(message, TaskLease):
                    self._work.received(message.lease_id)
                    self._leases.append(message)
                    self._have_work.set()
                    self._lease_arrived.set()
                    self._wake.set()

    async def _state_work(self) -> None:
        """Tell the PromptSource what we can hold, hold and answered (``WorkRequest``)."""
        await self._tasks.send(self._work.state(self._installed))

    async def _restate(self) -> None:
        """While holding fewer leases than ``credits``: state our work every ``restate_s``
        (it repairs what a torn connection lost), and say so when nothing answers."""
        last_warned = time.monotonic()
        interval = min(self.config.restate_s, self.config.unreachable_log_s) / 2
        while True:
            await asyncio.sleep(interval)  # a timer: states are periodic
            now = time.monotonic()
            if not self._welcomed:
                continue
            if self._work.due(now):
                await self._state_work()
            silent_s = now - self._answered_s
            # Short of work, and our states unanswered: a full sampler needs no answer.
            waiting = self._work.sync > self._work.acked and len(self._work.held) < self._work.max_leases
            if (
                waiting
                and silent_s >= self.config.unreachable_log_s
                and now - last_warned >= self.config.unreachable_log_s
            ):
                last_warned = now
                where = ", ".join(self._tasks.endpoints) or "tasks"
                self.ctx.log.warning(
                    "no answer from the PromptSource at %s to our work states for %.1f s (holding %d of %d leases): is the link up?",
                    where,
                    silent_s,
                    len(self._work.held),
                    self._work.max_leases,
                )

    async def _receive_weights(self) -> None:
        await self._receiver.run()

    def _on_complete(self, assembler: SnapshotAssembler) -> None:
        """A version is complete and verified: install it between generation batches."""
        if self._installed is not None and assembler.key <= self._installed:
            return
        if self._ready is not None and assembler.key <= self._ready.key:
            return
        self._ready = assembler
        self._weights_ready.set()
        self._wake.set()

    async def _install_ready(self) -> None:
        ready, self._ready = self._ready, None
        self._weights_ready.clear()
        if ready is None:
            return
        started = time.perf_counter()
        installed = ready.key
        adapter = ready.manifest.adapter  # a LoRA run's versions are adapters on the base model
        if adapter is not None:
            await self._engine_thread.call(self.engine.install_adapter, ready.tensors(), adapter, installed.version)
        else:
            await self._engine_thread.call(self.engine.install_weights, ready.tensors(), installed.version)
        self._installed = installed
        install_s = time.perf_counter() - started
        self.counters["installs"] += 1
        report = await self._receiver.report_installed(installed, install_s)
        if self._welcomed:
            await self._state_work()  # the PromptSource may lease to us now
        await self.ctx.publish_telemetry(INSTALLED_TOPIC, report)

    async def _fill_batch(self) -> None:
        """Give leases already granted up to ``batch_wait_s`` to arrive (see the config)."""
        wait_s, full = self.config.batch_wait_s, self.config.max_batch_groups
        if wait_s <= 0 or len(self._leases) >= full or self._work.owed <= 0:
            return
        deadline = asyncio.get_running_loop().time() + wait_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while len(self._leases) < full and self._work.owed > 0:
                    self._lease_arrived.clear()
                    await self._lease_arrived.wait()

    def _take_batch(self) -> list[TaskLease]:
        batch: list[TaskLease] = []
        while self._leases and len(batch) < self.config.max_batch_groups:
            lease = self._leases[0]
            if batch and _params(lease) != _params(batch[0]):
                break
            batch.append(self._leases.popleft())
        if not self._leases:
            self._have_work.clear()
        return batch

    async def _generate(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Install between batches, and also while idle or parked, so that a sampler
            # given work later starts from current weights.
            await self._install_ready()
            if not self._have_work.is_set():
                continue
            await self._fill_batch()
            batch = self._take_batch()
            if self._leases:
                self._wake.set()  # more queued: come straight back after this batch
            if not batch:
                continue
            needed = max(lease.min_version for lease in batch)
            if self._installed is None or self._installed.version < needed:
                started = time.perf_counter()
                while self._installed is None or self._installed.version < needed:
                    await self._weights_ready.wait()
                    await self._install_ready()
                self.wait_weights_s += time.perf_counter() - started
            await self._generate_batch(batch)

    async def _generate_batch(self, batch: list[TaskLease]) -> None:
        if self._episodes is not None:
            await self._play_batch(batch, self._episodes)
            return
        assert self._installed is not None
        made_by = self._installed
        first = batch[0]
        params = SamplingParams(temperature=first.temperature, top_p=first.top_p, max_new_tokens=first.max_new_tokens)
        prompt_ids = [self.engine.encode_prompt(lease.prompt) for lease in batch]
        started = time.perf_counter()
        rows = await self._engine_thread.call(self.engine.generate, prompt_ids, first.group_size, params)
        elapsed = time.perf_counter() - started
        self.generate_s += elapsed
        for lease, ids, completions in zip(batch, prompt_ids, rows, strict=True):
            group = rollout_group(lease, self.name, made_by, ids, completions, elapsed)
            await self._rollouts.send(group)
            self.ctx.ledger(ledger.Submitted(task=lease.task_id, lease=lease.lease_id, version=made_by.version))
            self.counters["groups_sent"] += 1
            self.counters["samples_generated"] += len(completions)
            self.counters["tokens_generated"] += int(group.offsets[-1])
        await self._answered(batch)

    async def _answered(self, batch: list[TaskLease]) -> None:
        """The batch's leases are answered (groups or failures sent): state our work, and
        the PromptSource grants what we can hold and do not."""
        self._work.answered(lease.lease_id for lease in batch)
        await self._state_work()

    async def _play_batch(self, batch: list[TaskLease], episodes: _Episodes) -> None:
        """Play each lease's G episodes (``echo2.envs.play``), all leases' turns together;
        send a group per lease, or ``EpisodeFailed`` when its environment failed."""
        assert self._installed is not None
        made_by = self._installed
        first = batch[0]
        prompt_ids = {lease.lease_id: self.engine.encode_prompt(lease.prompt) for lease in batch}
        requests = [
            EpisodeRequest(
                group=lease.lease_id,
                prompt=Prompt(task_id=lease.task_id, text=lease.prompt, answer="", meta=dict(lease.episode_meta)),
                prompt_ids=prompt_ids[lease.lease_id],
                seed=lease.episode_seed,
            )
            for lease in batch
            for _ in range(lease.group_size)
        ]
        generate_s = 0.0

        async def generate(contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
            nonlocal generate_s
            started = time.perf_counter()
            rows = await self._engine_thread.call(self.engine.generate, contexts, 1, params)
            generate_s += time.perf_counter() - started
            return [row[0] for row in rows]

        async def between_turns() -> None:
            # Newer weights of the same incarnation only: one episode's versions are
            # comparable, and the group names one incarnation.
            ready = self._ready
            if ready is not None and ready.key.incarnation == made_by.incarnation:
                await self._install_ready()

        def version() -> int:
            assert self._installed is not None
            return self._installed.version

        played = await play_episodes(
            requests,
            factory=episodes.spec.factory,
            generate=generate,
            codec=episodes.codec,
            limits=episodes.limits,
            calls=episodes.calls,
            timeout_s=self.job.episode.turn_timeout_s,
            temperature=first.temperature,
            top_p=first.top_p,
            version=version,
            between_turns=between_turns,
        )
        self.generate_s += generate_s
        for p in played:
            if p.close_error:
                self.ctx.log.warning("an environment's close() failed (%s)", p.close_error)
        by_lease = {lease.lease_id: [p for p in played if p.request.group == lease.lease_id] for lease in batch}
        for lease in batch:
            results = by_lease[lease.lease_id]
            failures = [p.failure for p in results if p.failure is not None]
            if failures:
                failure = next((f for f in failures if f.detail != OTHER_EPISODE_FAILED), failures[0])
                self.counters["episodes_failed"] += 1
                self.ctx.log.warning(
                    "task %s: an episode failed (%s: %s)", lease.task_id, failure.reason, failure.detail
                )
                await self._rollouts.send(
                    EpisodeFailed(
                        lease_id=lease.lease_id,
                        task_id=lease.task_id,
                        attempt=lease.attempt,
                        sampler_id=self.name,
                        lease_token=lease.token,
                        reason=failure.reason,
                        detail=failure.detail[:200],
                    )
                )
                continue
            group = episode_group(
                lease,
                self.name,
                made_by.incarnation,
                prompt_ids[lease.lease_id],
                [p.episode for p in results],
                episodes.codec,
                generate_s,
            )
            await self._rollouts.send(group)
            self.ctx.ledger(ledger.Submitted(task=lease.task_id, lease=lease.lease_id, version=group.version))
            self.counters["groups_sent"] += 1
            self.counters["episodes_played"] += len(results)
            self.counters["samples_generated"] += len(results)
            self.counters["tokens_generated"] += int(group.loss_mask().sum())
        await self._answered(batch)


class _Episodes:
    """What a Sampler of a multi-turn job plays with (``echo2.envs``)."""

    def __init__(self, spec: EnvironmentSpec, codec: EpisodeCodec, limits: EpisodeLimits, calls: TimedCalls):
        self.spec, self.codec, self.limits, self.calls = spec, codec, limits, calls

    @classmethod
    def load(
        cls, job: JobConfig, objects: JobObjects | None, model: str, config: SamplerConfig, name: str
    ) -> _Episodes:
        spec = load_job_environment(job, objects)
        calls = TimedCalls(config.environment_threads, name=f"{name}-env")
        return cls(spec, load_episode_codec(model, job.prompt_format), EpisodeLimits.of_job(job), calls)


def check_model(expected: ModelIdentity, served: ModelIdentity | None) -> None:
    """Raise ``ModelMismatch`` (one line: what differs) unless the engine serves ``expected``.

    ``served`` None (an engine without a real model, the simulated one) is not checked.
    """
    if served is None:
        return
    differs = [
        f"{field} {getattr(served, field)!r} (the job's: {getattr(expected, field)!r})"
        for field in ("vocab_size", "tokenizer_digest", "architecture_digest")
        if getattr(served, field) != getattr(expected, field)
    ]
    if differs:
        raise ModelMismatch(
            f"this sampler's model {served.model_id!r} is not the job's {expected.model_id!r}: "
            + "; ".join(differs)
            + ". Generating would produce rollouts the learner cannot train; load the job's model"
        )


def _params(lease: TaskLease) -> tuple[int, float, float, int]:
    return (lease.group_size, lease.temperature, lease.top_p, lease.max_new_tokens)


def _seed_from_name(seed: int, name: str) -> int:
    return (seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(name))) % (2**31)


def rollout_group(
    lease: TaskLease,
    sampler_id: str,
    made_by: PolicyVersion,
    prompt_ids: list[int],
    completions: list[Completion],
    generate_s: float = 0.0,
) -> RolloutGroup:
    """The ``RolloutGroup`` of one lease's completions, as ragged arrays (what a Sampler sends)."""
    lengths = [len(c.token_ids) for c in completions]
    offsets = np.zeros(len(completions) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return RolloutGroup(
        lease_id=lease.lease_id,
        task_id=lease.task_id,
        attempt=lease.attempt,
        sampler_id=sampler_id,
        incarnation=made_by.incarnation,
        version=made_by.version,
        prompt=lease.prompt,
        prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        token_ids=np.concatenate([c.token_ids for c in completions]).astype(np.int32, copy=False),
        logprobs=np.concatenate([c.logprobs for c in completions]).astype(np.float32, copy=False),
        offsets=offsets,
        texts=[c.text for c in completions],
        finish_reasons=[c.finish_reason for c in completions],
        generate_s=generate_s,
        lease_token=lease.token,
    )


def _manifest_verifier(public_key_path: str):
    if not public_key_path:
        return None
    from echo2.weights.signing import ManifestVerifier

    return ManifestVerifier(public_key_path).verify
