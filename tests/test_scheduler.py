"""The activation scheduler, fed by hand (no sockets, no clock), and fed a real heartbeat."""

from __future__ import annotations

import asyncio
import itertools
import math

import msgspec
import pytest

from echo2.actor import Actor
from echo2.capacity.model import ActivationController, Worker
from echo2.capacity.scheduler import Scheduler
from echo2.errors import DecodeError
from echo2.messages import (
    HEARTBEAT_TOPIC,
    CustomStats,
    Heartbeat,
    LearnerStats,
    PublisherStats,
    RewarderStats,
    SamplerStats,
    Statistics,
)
from echo2.runtime import ProcessRuntime
from echo2.topology import DEFAULT_HOST, HostSpec, Placement, derive_addresses
from echo2.transport import Codec, Transport


def _sched(policy: str = "cost_aware", **kw) -> Scheduler:
    defaults = dict(
        rollouts_per_step=64,
        staleness=3,
        learner_price_per_hour=1.5,
        warmup_s=5.0,
        shortfall_window_s=2.0,
        surplus_window_s=10.0,
        heartbeat_timeout_s=3.0,
        mu_window_s=20.0,
    )
    defaults.update(kw)
    return Scheduler(policy=policy, **defaults)


class Pool:
    """Simulated samplers: each generates at `rate` rollouts per busy second, busy always."""

    def __init__(self, sched: Scheduler, spec: dict[str, tuple[float, float]]) -> None:
        self.sched = sched
        self.spec = dict(spec)  # name -> (rate, price)
        self.generated = dict.fromkeys(spec, 0.0)
        self.busy = dict.fromkeys(spec, 0.0)
        self.dead: set[str] = set()

    def beat(self, now: float, dt: float = 1.0, t_train_s: float = 1.0) -> None:
        stats: dict[str, Statistics] = {"learner": LearnerStats(train_s_mean=t_train_s, kappa=2)}
        for name, (rate, price) in self.spec.items():
            if name in self.dead:
                continue
            if self.sched.is_active(name):
                self.busy[name] += dt
                self.generated[name] += rate * dt
            stats[name] = SamplerStats(
                price_per_hour=price, generate_s=self.busy[name], samples_generated=int(self.generated[name])
            )
        self.sched.observe_heartbeat(now, stats)
        self.sched.observe_delivered({k: int(v) for k, v in self.generated.items()})


def run(pool: Pool, start: float, end: float):
    decisions = []
    now = start
    while now <= end:
        pool.beat(now)
        decisions.append(pool.sched.decide(now))
        now += 1.0
    return decisions


MIXED = {
    **{f"fast-{i}": (6.4, 0.69) for i in range(8)},  # rho 0.108
    **{f"cheap-{i}": (4.0, 0.34) for i in range(8)},  # rho 0.085
    **{f"slow-{i}": (2.0, 0.60) for i in range(8)},  # rho 0.30
}


def test_warmup_activates_all_then_greedy_picks_cheapest_rho_up_to_target() -> None:
    sched = _sched()
    pool = Pool(sched, MIXED)
    decisions = run(pool, 0.0, 12.0)
    assert len(decisions[1].active) == 24 and "warm-up" in decisions[1].reason
    final = decisions[-1]
    # mu_min = 2 * 64 / (2 * 1 - 0) = 64, target 70.4: 8 cheap (32/s), then fast ones
    # (6 give 70.4 up to rounding, so a 7th is taken)
    assert final.mu_min == pytest.approx(64.0)
    assert final.target_mu == pytest.approx(70.4)
    assert set(final.active) == {f"cheap-{i}" for i in range(8)} | {f"fast-{i}" for i in range(7)}
    assert final.active_mu >= final.target_mu
    assert not any(s.startswith("slow") for s in final.active)
    parked = [d for d in decisions if d.parked]
    assert len(parked) == 1 and "cold start" in parked[0].reason
    assert final.cost_per_hour == pytest.approx(8 * 0.34 + 7 * 0.69 + 1.5)
    assert final.predicted_cost_per_step == pytest.approx(final.cost_per_hour / 3600.0)
    record = final.record()
    assert record["n_active"] == 15 and record["policy"] == "cost_aware"


def test_random_policy_costs_more_than_cost_aware_on_the_mixed_pool() -> None:
    costs = {}
    for policy in ("cost_aware", "random"):
        sched = _sched(policy, seed=1)
        final = run(Pool(sched, MIXED), 0.0, 12.0)[-1]
        assert final.active_mu >= final.target_mu
        costs[policy] = final.active_cost_per_hour
    assert costs["cost_aware"] < costs["random"]


def test_all_policy_serves_everyone_even_unknown_peers() -> None:
    sched = _sched("all")
    assert sched.is_active("never-seen")
    pool = Pool(sched, {"a": (4.0, 1.0), "b": (4.0, 1.0)})
    final = run(pool, 0.0, 30.0)[-1]
    assert final.active == ("a", "b") and not final.parked


def test_dead_sampler_is_dropped_and_replaced_at_once() -> None:
    sched = _sched()
    pool = Pool(sched, MIXED)
    before = run(pool, 0.0, 12.0)[-1]
    victim = "cheap-0"
    assert {victim, "fast-0"} <= set(before.active)
    pool.dead |= {victim, "fast-0"}  # 76.8 - 10.4 < 70.4
    decisions = run(pool, 13.0, 17.0)
    dropped = next(d for d in decisions if victim in d.parked)
    assert "unavailable" in dropped.reason
    assert dropped.activated, "a replacement is activated in the same decision"
    assert dropped.active_mu >= dropped.target_mu
    assert victim not in decisions[-1].available


def test_late_joiner_is_folded_in_when_a_shortfall_needs_it() -> None:
    sched = _sched()
    pool = Pool(sched, {f"s-{i}": (4.0, 0.35) for i in range(18)})  # 72/s >= 70.4
    assert len(run(pool, 0.0, 12.0)[-1].active) == 18
    # the learner got faster: T_train 0.8 s -> mu_min = 128 / 1.6 = 80, target 88: add joiners
    pool.spec.update({f"new-{i}": (4.0, 0.30) for i in range(6)})
    pool.generated.update({f"new-{i}": 0.0 for i in range(6)})
    pool.busy.update({f"new-{i}": 0.0 for i in range(6)})
    now, decisions = 13.0, []
    while now < 20.0:
        pool.beat(now, t_train_s=0.8)
        decisions.append(sched.decide(now))
        now += 1.0
    assert any("waiting" in d.reason for d in decisions), "hysteresis: the shortfall must last"
    final = decisions[-1]
    assert final.active_mu >= final.target_mu == pytest.approx(88.0)
    assert {f"new-{i}" for i in range(2)} <= set(final.active)  # cheapest (rho) joiners first


def test_surplus_releases_one_expensive_sampler_per_window() -> None:
    sched = _sched(surplus_window_s=5.0)
    pool = Pool(sched, MIXED)
    run(pool, 0.0, 12.0)
    # the learner got slower: T_train 2 s -> mu_min = 128 / 4 = 32, target 35.2
    decisions = []
    now = 13.0
    while now < 40.0:
        pool.beat(now, t_train_s=2.0)
        decisions.append(sched.decide(now))
        now += 1.0
    releases = [d for d in decisions if d.parked]
    assert releases and all(len(d.parked) == 1 for d in releases)
    assert releases[0].parked[0].startswith("fast")  # highest rho among the active
    gaps = [b.now_s - a.now_s for a, b in itertools.pairwise(releases)]
    assert all(g >= 5.0 for g in gaps)
    assert decisions[-1].active_mu >= decisions[-1].target_mu


def test_t_bcast_is_the_publishers_measurement_and_first_install_a_diagnostic() -> None:
    sched = _sched()
    pool = Pool(sched, {"a": (4.0, 1.0), "b": (4.0, 1.0)})
    pool.beat(0.0)
    sched.observe_heartbeat(
        0.5, {"learner": LearnerStats(published_version=4, published_at_s=1000.0, train_s_mean=1.0)}
    )
    sched.observe_install("b", 4, 1000.9)
    sched.observe_install("a", 4, 1000.3)
    assert sched.t_first_install_s == pytest.approx(0.9)  # diagnostic: first report fixes it
    assert sched.t_bcast_s == 0.0  # no publisher figure yet
    sched.observe_heartbeat(1.0, {"weight_publisher": PublisherStats(published=3)})  # t_bcast_s -1: not measured
    assert sched.t_bcast_s == 0.0
    sched.observe_heartbeat(1.0, {"weight_publisher": PublisherStats(published=3, t_bcast_s=0.25)})
    assert sched.t_bcast_s == pytest.approx(0.25)


def test_records_it_has_no_use_for_are_ignored_whatever_their_values_are_named() -> None:
    """Dispatch is on the record's type: a custom actor's values named like a sampler's do
    not make it a sampler, and a learner-shaped custom record sets no T_train."""
    sched = _sched()
    sched.observe_heartbeat(
        0.0,
        {
            "mine": CustomStats(values={"price_per_hour": 1.0, "generate_s": 5.0, "samples_generated": 50.0}),
            "impostor": CustomStats(values={"train_s_mean": 9.0, "kappa": 7.0, "t_bcast_s": 3.0}),
            "rewarder": RewarderStats(groups_scored=3, item_errors={"timeout": 1}),
        },
    )
    assert sched.available(0.0) == [] and sched.mu_estimates() == {}
    assert sched.t_train_s is None and sched.kappa == 2 and sched.t_bcast_s == 0.0
    assert sched.decide(0.0).active == ()


def test_unreachable_mu_min_activates_everything() -> None:
    sched = _sched(t_bcast_s=5.0)  # kappa * T_train = 2 s <= T_bcast = 5 s
    pool = Pool(sched, {"a": (4.0, 1.0), "b": (4.0, 2.0)})
    final = run(pool, 0.0, 10.0)[-1]
    assert final.mu_min is not None and math.isinf(final.mu_min)
    assert final.active == ("a", "b")
    assert final.record()["mu_min"] is None


def test_parked_sampler_keeps_its_measurement() -> None:
    sched = _sched()
    pool = Pool(sched, MIXED)
    run(pool, 0.0, 40.0)
    mus = sched.mu_estimates()
    assert mus["slow-0"] == pytest.approx(2.0, rel=0.05)
    assert not sched.is_active("slow-0")


def test_bad_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="activation policy"):
        _sched("cheapest")


def test_random_controller_uses_same_hysteresis() -> None:
    import random

    ctl = ActivationController(shortfall_window_s=3.0, rng=random.Random(0))
    workers = [Worker(f"w{i}", 1.0, float(i)) for i in range(10)]
    first = ctl.update(0.0, workers, 4.0)
    assert len(first.active) == 4
    assert ctl.update(1.0, workers, 6.0).activated == ()  # shortfall not sustained yet
    assert len(ctl.update(4.5, workers, 6.0).active) == 6


# -------------------------------------------------------------- through a real heartbeat


class _Reporting(Actor):
    """Reports a fixed statistics record (or a legacy flat dict) and idles until stopped."""

    kind = "reporting"

    def __init__(self, name: str, stats: object) -> None:
        super().__init__(name)
        self._stats = stats

    def statistics(self):  # type: ignore[no-untyped-def]
        return self._stats

    async def run(self) -> None:
        await self.ctx.stopping.wait()


async def test_scheduler_reads_the_typed_records_of_a_decoded_heartbeat(transport: Transport) -> None:
    actors = [
        _Reporting("s0", SamplerStats(price_per_hour=0.5, generate_s=2.0, samples_generated=8)),
        _Reporting("learner", LearnerStats(train_s_mean=0.25, kappa=3)),
        _Reporting("legacy", {"price_per_hour": 1.0, "generate_s": 1.0}),  # an actor from before typed stats
        _Reporting("quiet", None),
    ]
    places = [Placement(a.name, "main", DEFAULT_HOST, a.ports) for a in actors]
    addresses = derive_addresses(places, {DEFAULT_HOST: HostSpec()}, "test").ports
    sub = transport.sub(name="test.telemetry", bind=["inproc://sched-telemetry"], subscribe=[HEARTBEAT_TOPIC])
    runtime = ProcessRuntime(
        actors, addresses, transport=transport, heartbeat_s=0.02, telemetry_connect=["inproc://sched-telemetry"]
    )
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(runtime.run())
            beat = await asyncio.wait_for(sub.recv(), 10)
            runtime.request_stop("test")
    finally:
        sub.close()
    assert isinstance(beat, Heartbeat)
    assert beat.actor_stats["legacy"] == CustomStats(values={"price_per_hour": 1.0, "generate_s": 1.0})
    assert "quiet" not in beat.actor_stats
    sched = _sched()
    sched.observe_heartbeat(0.0, beat.actor_stats)
    assert sched.available(0.0) == ["s0"]  # not "legacy": a CustomStats is never a sampler
    assert sched.t_train_s == 0.25 and sched.kappa == 3


def test_a_heartbeat_carrying_an_unknown_record_is_a_decode_error_not_a_crash() -> None:
    """A record type this version does not know (a newer peer's) fails the typed decode, so
    the endpoint counts and drops that heartbeat, as any malformed input."""
    codec = Codec()
    good = Heartbeat(
        process="p", actors=["x"], pid=1, host="h", seq=0, time_s=0.0, loop_lag_s=0.0,
        actor_stats={"x": SamplerStats()},
    )  # fmt: skip
    header = bytes(codec.encode(good)[0])
    body = msgspec.msgpack.decode(header[2:])
    body["actor_stats"]["x"] = {"type": "QuantumStats", "qubits": 3}
    with pytest.raises(DecodeError):
        codec.decode([header[:2] + msgspec.msgpack.encode(body)])
