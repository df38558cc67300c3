"""The activation scheduler the PromptSource runs: measurements in, an active set out.

Pure: no sockets and no clock reads. The PromptSource feeds it what it hears (heartbeats,
the Buffer's per-sampler delivery counts, ``WeightsInstalled``) with the time ``now_s`` it
heard them, and calls ``decide(now_s)`` periodically; the answer is the set of samplers
that may receive leases. Everything else is parked: a parked sampler gets no new leases
(its credits are kept, not served) and keeps installing weights, so it can be activated
again at once.

Measured figures (``echo2.capacity.model`` has the formulas):

* ``T_train``: the Learner's ``train_s_mean`` (its ``LearnerStats``), unless declared.
* ``kappa``: the Learner's ``kappa`` (its ``LearnerStats``), else ``max(1, S - 1)``.
* ``T_bcast``: the WeightPublisher's own measurement, ``PublisherStats.t_bcast_s``
  (publication until ``ceil(active / gamma)`` of the samplers active at publication
  installed it, reported on the reliable ``weights`` channel), unless declared; 0 until
  measured. Publication to first install (the Learner's ``published_at_s`` and
  ``published_version`` against the samplers' ``WeightsInstalled``, earliest per version,
  EMA) is recorded as a diagnostic (``t_first_install_s``), not used. Why not the paper's
  "until 1/gamma of the workers installed it" from the install times heard here: a
  sampler installs only when it starts its next batch (between batches, and only once it
  has a lease), so install times also measure batch lengths and idle waits for work, not
  the broadcast; with S > kappa the samplers meanwhile keep generating on the older,
  still admissible, version (measured: that quantile put the knee about twice too high,
  and an idle pool's delays exceeded kappa * T_train, making mu_min unreachable).
* ``mu_i``: delivered rollouts per second *of generation*: the sampler's generation rate
  over the last ``mu_window_s`` (``samples_generated`` / ``generate_s`` of its
  ``SamplerStats``) times the fraction of its rollouts the Buffer stored (``delivered_by_sampler``).
  Deviation from the paper's "moving average of delivered rollouts/s": in an
  over-provisioned pool the raw delivery rate measures the learner's demand split among
  the workers, not what each could deliver, so it cannot tell the scheduler whom to park.
  A parked sampler keeps its last measurement; one never measured gets the rollouts/s it
  declares (``SamplerStats.declared_rollouts_per_s``, ``python -m echo2.join --capacity``),
  else the median of the measured ones (or ``prior_mu``).
* availability: a sampler whose heartbeat is older than ``heartbeat_timeout_s`` is gone
  (dropped from the active set at once; its leases expire at the source), and so is one
  that said ``Goodbye`` (``observe_left``: at once, not a heartbeat timeout later; it is
  known again once it says ``Hello``); a new one joins parked and is folded in by the
  next decision.

Heartbeats carry one typed record per actor (``Heartbeat.actor_stats``); the scheduler
dispatches on the record's type and ignores the records it has no use for, including
``CustomStats`` of actors of one's own, whatever their values are named.

Policies: ``"all"`` (every available sampler: what echo2 did before), ``"cost_aware"``
(``ActivationController``: greedy by rho with hysteresis), ``"random"`` (same controller,
random order: the paper's ablation). The first ``warmup_s`` after the first sampler is
seen every sampler is active, so that each one gets measured before any is parked.
"""

from __future__ import annotations

import math
import random
import statistics as stats_mod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from echo2.capacity.model import ActivationController, Worker, cost_per_step, mu_min, mu_target, staleness_bound
from echo2.messages import LearnerStats, PublisherStats, SamplerStats, Statistics

ActivationPolicy = Literal["all", "cost_aware", "random"]
POLICIES: tuple[ActivationPolicy, ...] = get_args(ActivationPolicy)
YIELD_LAG_S = 5.0


@dataclass
class _SamplerState:
    sampler_id: str
    price_per_hour: float = 0.0
    last_seen_s: float = -math.inf
    samples_generated: float = 0.0
    delivered: int = 0
    # (now_s, samples_generated, generate_s) heartbeat samples inside the mu window
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)
    mu: float | None = None  # latest measurement (kept while parked)
    declared_mu: float = 0.0  # rollouts/s it says it delivers, until measured


@dataclass(frozen=True)
class SchedulerDecision:
    """One decision: what changed, why, and the figures it was based on."""

    now_s: float
    policy: str
    reason: str
    active: tuple[str, ...]
    activated: tuple[str, ...]
    parked: tuple[str, ...]
    available: tuple[str, ...]
    mu_by_sampler: dict[str, float]
    active_mu: float  # rollouts/s of the active set
    mu_min: float | None  # rollouts/s; None until T_train is known (inf: unreachable)
    target_mu: float | None
    t_train_s: float | None
    t_bcast_s: float
    t_first_install_s: float | None
    kappa: int
    staleness_bound: int | None
    active_cost_per_hour: float  # dollars/h of the active samplers
    cost_per_hour: float  # active samplers + learner, dollars/h
    predicted_cost_per_step: float | None  # dollars, at T_train per step

    @property
    def changed(self) -> bool:
        return bool(self.activated or self.parked)

    def record(self) -> dict[str, object]:
        """Flat values for ``ctx.record("activation", ...)``."""
        return {
            "policy": self.policy,
            "reason": self.reason,
            "active": list(self.active),
            "activated": list(self.activated),
            "parked": list(self.parked),
            "n_active": len(self.active),
            "n_available": len(self.available),
            "active_mu": round(self.active_mu, 4),
            "mu_by_sampler": {k: round(v, 4) for k, v in sorted(self.mu_by_sampler.items())},
            "mu_min": _round(self.mu_min),
            "target_mu": _round(self.target_mu),
            "t_train_s": _round(self.t_train_s),
            "t_bcast_s": round(self.t_bcast_s, 4),
            "t_first_install_s": _round(self.t_first_install_s),
            "kappa": self.kappa,
            "staleness_bound": self.staleness_bound,
            "active_cost_per_hour": round(self.active_cost_per_hour, 4),
            "cost_per_hour": round(self.cost_per_hour, 4),
            "predicted_cost_per_step": _round(self.predicted_cost_per_step, 6),
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    if value is None or math.isinf(value):
        return None
    return round(value, digits)


class Scheduler:
    """Activation scheduler (module docstring). Times are seconds on the caller's clock."""

    def __init__(
        self,
        *,
        policy: str = "all",
        rollouts_per_step: int,
        staleness: int,
        learner_price_per_hour: float = 0.0,
        gamma: float = 1.1,
        heartbeat_timeout_s: float = 3.0,
        warmup_s: float = 10.0,
        mu_window_s: float = 20.0,
        shortfall_window_s: float = 5.0,
        surplus_window_s: float = 30.0,
        surplus_margin: float = 0.1,
        t_train_s: float = 0.0,
        t_bcast_s: float = -1.0,
        prior_mu: float = 0.0,
        seed: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"activation policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.R = rollouts_per_step
        self.staleness = staleness
        self.learner_price_per_hour = learner_price_per_hour
        self.gamma = gamma
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.warmup_s = warmup_s
        self.mu_window_s = mu_window_s
        self.declared_t_train_s = t_train_s if t_train_s > 0 else None
        self.declared_t_bcast_s = t_bcast_s if t_bcast_s >= 0 else None
        self.prior_mu = prior_mu
        self.controller = ActivationController(
            shortfall_window_s=shortfall_window_s,
            surplus_window_s=surplus_window_s,
            surplus_margin=surplus_margin,
            rng=random.Random(seed) if policy == "random" else None,
        )
        self._samplers: dict[str, _SamplerState] = {}
        self._left: set[str] = set()  # said Goodbye: heartbeats still in flight are ignored
        self._first_seen_s: float | None = None
        self._active: tuple[str, ...] = ()
        self._t_train_s: float | None = None
        self._kappa: int | None = None
        self._publisher_t_bcast_s: float | None = None
        self._published_at: dict[int, float] = {}  # version -> unix seconds
        self._installs: dict[int, dict[str, float]] = {}  # version -> sampler -> unix seconds
        self._t_bcast_ema: float | None = None
        self._bcast_done: set[int] = set()

    # -- measurements ------------------------------------------------------------------

    def observe_heartbeat(self, now_s: float, actor_stats: Mapping[str, Statistics]) -> None:
        """One process's ``Heartbeat.actor_stats`` (actor name -> statistics record)."""
        for actor, stats in actor_stats.items():
            match stats:
                case SamplerStats():
                    self._observe_sampler(now_s, actor, stats)
                case LearnerStats():
                    self._observe_learner(stats)
                case PublisherStats(t_bcast_s=t_bcast_s) if t_bcast_s > 0:
                    self._publisher_t_bcast_s = t_bcast_s
                case _:
                    pass  # the other actors' records carry nothing the scheduler uses

    def _observe_learner(self, stats: LearnerStats) -> None:
        if stats.train_s_mean > 0:
            self._t_train_s = stats.train_s_mean
        if stats.kappa >= 1:
            self._kappa = stats.kappa
        if stats.published_version >= 0 and stats.published_at_s > 0:
            self._published_at[stats.published_version] = stats.published_at_s

    def observe_left(self, sampler_id: str) -> None:
        """``sampler_id`` said ``Goodbye``: unavailable now, and forgotten."""
        self._samplers.pop(sampler_id, None)
        self._left.add(sampler_id)

    def observe_hello(self, sampler_id: str) -> None:
        """``sampler_id`` was welcomed: its heartbeats count again (after a ``Goodbye``)."""
        self._left.discard(sampler_id)

    def _observe_sampler(self, now_s: float, sampler_id: str, stats: SamplerStats) -> None:
        if sampler_id in self._left:
            return
        state = self._samplers.get(sampler_id)
        if state is None:
            state = self._samplers[sampler_id] = _SamplerState(sampler_id)
            if self._first_seen_s is None:
                self._first_seen_s = now_s
        state.last_seen_s = max(state.last_seen_s, now_s)
        state.price_per_hour = max(0.0, stats.price_per_hour)
        state.declared_mu = stats.declared_rollouts_per_s if stats.declared_rollouts_per_s > 0 else 0.0
        generated, busy = float(stats.samples_generated), stats.generate_s
        state.samples_generated = generated
        state.samples.append((now_s, generated, busy))
        while len(state.samples) > 2 and state.samples[0][0] < now_s - self.mu_window_s:
            state.samples.popleft()
        first, last = state.samples[0], state.samples[-1]
        d_generated, d_busy = last[1] - first[1], last[2] - first[2]
        if d_generated > 0 and d_busy > 0:
            state.mu = d_generated / d_busy * self._yield(state, now_s)

    def _yield(self, state: _SamplerState, now_s: float) -> float:
        """Fraction of a sampler's rollouts the Buffer stored. Rollouts take a while to reach
        the Buffer, so delivered counts are compared with what was generated
        ``YIELD_LAG_S`` earlier (clipped to 1); 1 until there is such a sample."""
        old = [g for t, g, _ in state.samples if t <= now_s - YIELD_LAG_S and g > 0]
        if not old or state.delivered <= 0:
            return 1.0
        return min(1.0, state.delivered / old[-1])

    def observe_delivered(self, delivered_by_sampler: dict[str, int]) -> None:
        """Cumulative rollouts each sampler has had stored in the Buffer."""
        for sampler_id, n in delivered_by_sampler.items():
            state = self._samplers.get(sampler_id)
            if state is not None:
                state.delivered = max(state.delivered, int(n))

    def observe_install(self, sampler_id: str, version: int, time_s: float) -> None:
        """A ``WeightsInstalled``: ``sampler_id`` installed ``version`` at unix ``time_s``."""
        self._installs.setdefault(version, {})[sampler_id] = time_s
        self._update_t_bcast(version)
        for old in [v for v in self._installs if v < version - 16]:
            self._installs.pop(old, None)
            self._published_at.pop(old, None)

    def _update_t_bcast(self, version: int) -> None:
        at = self._published_at.get(version)
        if at is None or version in self._bcast_done:
            return
        active = [s for s in self._active if s in self._samplers] or list(self._samplers)
        delays = [t - at for s, t in self._installs[version].items() if s in active]
        if not delays:
            return
        self._bcast_done.add(version)
        delay = max(0.0, min(delays))
        self._t_bcast_ema = delay if self._t_bcast_ema is None else 0.7 * self._t_bcast_ema + 0.3 * delay

    # -- derived figures -----------------------------------------------------------------

    @property
    def t_train_s(self) -> float | None:
        return self.declared_t_train_s if self.declared_t_train_s is not None else self._t_train_s

    @property
    def t_bcast_s(self) -> float:
        if self.declared_t_bcast_s is not None:
            return self.declared_t_bcast_s
        if self._publisher_t_bcast_s is not None:
            return self._publisher_t_bcast_s
        return 0.0

    @property
    def t_first_install_s(self) -> float | None:
        """Diagnostic only: publication to first install (EMA), see the module docstring."""
        return self._t_bcast_ema

    @property
    def kappa(self) -> int:
        return self._kappa or max(1, self.staleness - 1)

    @property
    def active(self) -> tuple[str, ...]:
        return self._active

    def is_active(self, sampler_id: str) -> bool:
        return self.policy == "all" or sampler_id in self._active

    def available(self, now_s: float) -> list[str]:
        return sorted(
            s.sampler_id for s in self._samplers.values() if now_s - s.last_seen_s <= self.heartbeat_timeout_s
        )

    def mu_estimates(self) -> dict[str, float]:
        """Rollouts/s per known sampler: measured, else declared, else the median measured,
        else prior_mu."""
        measured = [s.mu for s in self._samplers.values() if s.mu is not None and s.mu > 0]
        fallback = stats_mod.median(measured) if measured else self.prior_mu
        return {
            i: (s.mu if s.mu is not None and s.mu > 0 else s.declared_mu or fallback) for i, s in self._samplers.items()
        }

    def _targets(self, pool_mu: float) -> tuple[float | None, float | None, int | None]:
        t_train = self.t_train_s
        if t_train is None:
            return None, None, None
        try:
            minimum = mu_min(self.kappa, self.R, t_train, self.t_bcast_s)
        except ValueError:
            return math.inf, math.inf, None
        bound = staleness_bound(self.kappa, t_train, self.t_bcast_s, self.R, pool_mu) if pool_mu > 0 else None
        return minimum, mu_target(minimum, self.gamma), bound

    # -- the decision --------------------------------------------------------------------

    def decide(self, now_s: float) -> SchedulerDecision:
        available = self.available(now_s)
        mus = self.mu_estimates()
        before = set(self._active)
        warming = self._first_seen_s is None or now_s - self._first_seen_s < self.warmup_s
        minimum, target, _ = self._targets(sum(mus[i] for i in available))
        if self.policy == "all" or warming or target is None or not any(mus[i] > 0 for i in available):
            self._active = tuple(available)
            if self.policy == "all":
                why = "policy all: every available sampler"
            elif target is None:
                why = "T_train not measured yet: every available sampler"
            elif warming:
                why = f"warm-up ({self.warmup_s:.0f} s): every available sampler, measuring"
            else:
                why = "no sampler measured yet: every available sampler"
            reason = why
        else:
            workers = [Worker(i, mus[i], self._samplers[i].price_per_hour, i in available) for i in mus]
            capped = target if math.isfinite(target) else sum(mus[i] for i in available) * 2 + 1.0
            decision = self.controller.update(now_s, workers, capped)
            self._active = decision.active
            reason = decision.reason if math.isfinite(target) else f"mu_min unreachable: {decision.reason}"
        after = set(self._active)
        active_mu = sum(mus.get(i, 0.0) for i in self._active)
        _, _, bound = self._targets(active_mu)
        active_cost = sum(self._samplers[i].price_per_hour for i in self._active)
        t_train = self.t_train_s
        return SchedulerDecision(
            now_s=now_s,
            policy=self.policy,
            reason=reason,
            active=tuple(sorted(self._active)),
            activated=tuple(sorted(after - before)),
            parked=tuple(sorted(before - after)),
            available=tuple(available),
            mu_by_sampler=mus,
            active_mu=active_mu,
            mu_min=minimum,
            target_mu=target,
            t_train_s=t_train,
            t_bcast_s=self.t_bcast_s,
            t_first_install_s=self.t_first_install_s,
            kappa=self.kappa,
            staleness_bound=bound,
            active_cost_per_hour=active_cost,
            cost_per_hour=active_cost + self.learner_price_per_hour,
            predicted_cost_per_step=(
                cost_per_step(active_cost, self.learner_price_per_hour, t_train) if t_train else None
            ),
        )
