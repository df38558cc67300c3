"""A hostile sampler, for tests and benchmarks of admission (``echo2.actors.admission``).

``HostileSampler`` (kind ``"echo2.actors.hostile:HostileSampler"``) speaks the sampler's
protocol on ``tasks`` and ``rollouts`` and never generates: it claims to have installed
version ``claimed_version``, takes every lease it is given and answers each with a group
wrong in one way (in rotation: a well-formed group with wrong answers that the earlier
protocol's ``answer`` key calls right, a version no learner published, out-of-vocabulary
ids, NaN or positive log-probs, too few log-probs, offsets out of order, over-long
completions, another group size, another prompt, another attempt). Between leases, and
once it is quarantined and gets none, it sends groups that prove nothing about who sent
them: replays of groups already sent, duplicates, leases it never held, a held lease
with the wrong token. It stops after ``groups`` groups, or when the run stops.

Shutdown: returns on ``stopping``. Statistics: ``CustomStats`` (``sent``, ``leases``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Annotated, ClassVar

import msgspec
import numpy as np
from msgspec import Meta

from echo2.actor import Actor, ActorConfig, Port, run_until_stopped
from echo2.actors.admission import PromptCodec, trusted_prompt_codec
from echo2.messages import CustomStats, Hello, RolloutGroup, TaskLease, Welcome, WorkRequest


class HostileSamplerConfig(ActorConfig, frozen=True):
    groups: Annotated[int, Meta(ge=0)] = 10_000
    """Hostile groups to send in all."""
    credits: Annotated[int, Meta(ge=1)] = 8
    """Leases asked for up front (one more per lease answered)."""
    claimed_version: int = 1_000_000
    """The installed version it claims in every ``WorkRequest`` (a lie)."""


class _OldRolloutGroup(RolloutGroup, frozen=True, tag="RolloutGroup"):
    """The group of a sampler of the earlier protocol revision, which sent the answer back."""

    answer: str = ""


HOLDER_ATTACKS = (
    "forged_answer",
    "unpublished_version",
    "out_of_vocab",
    "nan_logprobs",
    "positive_logprobs",
    "short_logprobs",
    "bad_offsets",
    "too_long",
    "group_size",
    "prompt",
    "attempt",
)
ANONYMOUS_ATTACKS = ("replay", "duplicate", "unleased", "wrong_token")


class HostileSampler(Actor):
    kind: ClassVar[str] = "hostile_sampler"
    Config = HostileSamplerConfig
    ports: ClassVar[dict[str, Port]] = {"tasks": Port("dealer", bind=False), "rollouts": Port("push", bind=False)}
    config: HostileSamplerConfig

    async def setup(self, ctx) -> None:
        await super().setup(ctx)
        self._codec: PromptCodec = await asyncio.to_thread(trusted_prompt_codec, self.job)
        self._tasks = ctx.open("tasks", identity=self.name.encode())
        self._rollouts = ctx.open("rollouts")
        self._fresh: deque[TaskLease] = deque()
        self._held: deque[TaskLease] = deque(maxlen=64)
        self._sent_groups: deque[RolloutGroup] = deque(maxlen=64)
        self._lease_arrived = asyncio.Event()
        self.sent = self.leases = 0

    def statistics(self) -> CustomStats:
        return CustomStats(values={"sent": getattr(self, "sent", 0), "leases": getattr(self, "leases", 0)})

    async def run(self) -> None:
        await run_until_stopped(self.ctx.stopping, self._receive_leases(), self._attack())

    def _request(self, credits: int) -> WorkRequest:
        return WorkRequest(
            sampler_id=self.name, credits=credits, incarnation=0, installed_version=self.config.claimed_version
        )

    async def _receive_leases(self) -> None:
        await self._tasks.send(Hello(peer_id=self.name, role="sampler"))
        while not isinstance(await self._tasks.recv(), Welcome):
            pass
        await self._tasks.send(self._request(self.config.credits))
        while True:
            for message in await self._tasks.recv_many():
                if isinstance(message, TaskLease):
                    self.leases += 1
                    self._fresh.append(message)
                    self._held.append(message)
                    self._lease_arrived.set()

    async def _attack(self) -> None:
        holder_attacks = itertools.cycle(HOLDER_ATTACKS)
        anonymous_attacks = itertools.cycle(ANONYMOUS_ATTACKS)
        while self.sent < self.config.groups:
            if not self._held:  # nothing to forge from yet
                self._lease_arrived.clear()
                await self._lease_arrived.wait()
                continue
            if self._fresh:
                lease = self._fresh.popleft()
                groups = [self._holder_group(lease, next(holder_attacks))]
                await self._tasks.send(self._request(1))
            else:
                groups = self._anonymous_groups(next(anonymous_attacks))
            for group in groups:
                await self._rollouts.send(group)
                self._sent_groups.append(group)
                self.sent += 1
            await asyncio.sleep(0)  # a send that never blocks never yields: let the lease loop run
        self.ctx.log.info("%s: sent %d hostile groups", self.name, self.sent)
        self.ctx.record("hostile_done", sent=self.sent, leases=self.leases)

    def _group(self, lease: TaskLease, texts: list[str], version: int) -> RolloutGroup:
        """A well-formed group for ``lease`` (what an honest sampler would send) with ``texts``."""
        lengths = [len(t) + 1 for t in texts]  # the text and EOS
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return RolloutGroup(
            lease_id=lease.lease_id,
            task_id=lease.task_id,
            attempt=lease.attempt,
            sampler_id=self.name,
            incarnation=0,
            version=version,
            prompt=lease.prompt,
            prompt_token_ids=np.asarray(self._codec.encode(lease.prompt), np.int32),
            token_ids=np.full(int(offsets[-1]), 3, np.int32),  # the char tokenizer's "0"
            logprobs=np.full(int(offsets[-1]), -0.5, np.float32),
            offsets=offsets,
            texts=texts,
            finish_reasons=["eos"] * len(texts),
            lease_token=lease.token,
        )

    def _holder_group(self, lease: TaskLease, attack: str) -> RolloutGroup:
        g = lease.group_size
        group = self._group(lease, ["0"] * g, lease.min_version)
        n = len(group.token_ids)
        replace = msgspec.structs.replace
        match attack:
            case "forged_answer":
                fields = {f: getattr(group, f) for f in group.__struct_fields__}
                return _OldRolloutGroup(**fields, answer="0")
            case "unpublished_version":
                return replace(group, version=self.config.claimed_version)
            case "out_of_vocab":
                return replace(group, token_ids=np.full(n, 1 << 30, np.int32))
            case "nan_logprobs":
                return replace(group, logprobs=np.full(n, np.nan, np.float32))
            case "positive_logprobs":
                return replace(group, logprobs=np.full(n, 3.0, np.float32))
            case "short_logprobs":
                return replace(group, logprobs=group.logprobs[:-1].copy())
            case "bad_offsets":
                return replace(group, offsets=group.offsets[::-1].copy())
            case "too_long":
                return self._group(lease, ["0" * (lease.max_new_tokens + 3)] * g, lease.min_version)
            case "group_size":
                return self._group(lease, ["0"] * (g + 1), lease.min_version)
            case "prompt":
                return replace(group, prompt_token_ids=group.prompt_token_ids[::-1].copy())
            case _:
                return replace(group, attempt=lease.attempt + 1)

    def _anonymous_groups(self, attack: str) -> list[RolloutGroup]:
        replace = msgspec.structs.replace
        past = self._sent_groups[-1] if self._sent_groups else self._group(self._held[-1], ["0"], 0)
        match attack:
            case "replay":
                return [self._sent_groups[0] if self._sent_groups else past]
            case "duplicate":
                return [past, past]
            case "unleased":
                return [replace(past, lease_id=past.lease_id + 1_000_000, task_id=f"never-leased-{self.sent}")]
            case _:
                return [replace(past, lease_token=bytes(16))]
