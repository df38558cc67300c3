"""ECHO-2's overlap-based capacity model and cost-aware worker activation (pure python).

Symbols (paper): kappa = learner updates per published snapshot; R = rollouts consumed per
update; T_train = seconds per update; T_bcast = seconds from publication until a fraction
1/gamma of the active workers has installed the snapshot; mu_i = worker i's delivered
rollouts/s (completed, scored, in the buffer); c_i = its price per hour; rho_i = c_i / mu_i.

  overlap:      kappa * T_train >= T_bcast + kappa * R / mu_pool,   mu_pool = sum(mu_i)
  minimum:      mu_min = kappa * R / (kappa * T_train - T_bcast)    (needs kappa*T_train > T_bcast)
  target:       mu_target = gamma * mu_min,  gamma = 1.1
  staleness:    S_worst = kappa + ceil((T_bcast + R / mu_pool) / T_train) - 1
  activation:   min sum(c_i) s.t. sum(mu_i) >= mu_target; greedy by rho (paper)
  broadcast:    kappa * T_train >= T_bcast (the overlap condition without generation);
                when it fails, ``broadcast_remedy`` says which kappa (S) or payload restores
                it, and the publisher publishes less often (``echo2.capacity.publication``)

Our choices where the paper is silent:
- Bubble model (`predicted_bubble_ratio`). One publication cycle: the learner trains for
  kappa * T_train s; the pool needs T_bcast s to install the snapshot and kappa * R / mu_pool
  s to produce the cycle's kappa * R rollouts from it. The cycle therefore lasts
  max(kappa*T_train, T_bcast + kappa*R/mu_pool), and the learner idles for
  shortfall = max(0, T_bcast + kappa*R/mu_pool - kappa*T_train):
      bubble = shortfall / (shortfall + kappa * T_train).
  It is exactly 0 iff the overlap condition holds (both are computed from the same
  expression), rises strictly as mu_pool drops below mu_min and tends to 1 as mu_pool -> 0.
  It is pessimistic: the buffer's staleness window can hide part of a shortfall.
- Greedy ties on rho break by worker_id (deterministic). Workers with mu <= 0 or
  unavailable are never activated (they cost money and deliver nothing). If the pool
  cannot meet the target, every usable worker is activated and `met` is False.
  Greedy is within one worker's price of the optimum (cost <= OPT + max c_i, by the LP
  relaxation); it is not always optimal.
- `ActivationController` (closed loop, hysteresis): see its docstring. It never swaps
  workers to re-optimise the whole set; it only adds the cheapest parked workers or releases
  the least cost-efficient active one, which bounds churn. Default windows (30 s shortfall,
  300 s surplus, 10% surplus margin) are ours: adding is cheap to undo, releasing is not.
- Functions take times in seconds and capacities in rollouts/s; argument orders follow the
  project brief, so call them with keywords.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# --------------------------------------------------------------------------- capacity model


def _cycle_shortfall_s(kappa: int, R: float, T_train_s: float, T_bcast_s: float, mu_pool: float) -> float:
    """Seconds per publication cycle by which data arrival lags training (<= 0: overlap)."""
    return (T_bcast_s + kappa * R / mu_pool) - kappa * T_train_s


def _check_model_args(kappa: int, R: float, T_train_s: float, T_bcast_s: float) -> None:
    if kappa < 1:
        raise ValueError(f"kappa (updates per publication) must be >= 1, got {kappa}")
    if R <= 0:
        raise ValueError(f"R (rollouts per update) must be > 0, got {R}")
    if T_train_s <= 0:
        raise ValueError(f"T_train_s must be > 0, got {T_train_s}")
    if T_bcast_s < 0:
        raise ValueError(f"T_bcast_s must be >= 0, got {T_bcast_s}")


def mu_min(kappa: int, R: float, T_train_s: float, T_bcast_s: float) -> float:
    """Smallest pool capacity (rollouts/s) for which the overlap condition holds."""
    _check_model_args(kappa, R, T_train_s, T_bcast_s)
    slack_s = kappa * T_train_s - T_bcast_s
    if slack_s <= 0:
        raise ValueError(
            f"no finite capacity suffices: kappa*T_train = {kappa}*{T_train_s} s <= T_bcast = {T_bcast_s} s; "
            "raise kappa (staleness budget) or make the broadcast faster"
        )
    return kappa * R / slack_s


def t_bcast_for_bytes(bytes_per_version: float, link_mbps: float) -> float:
    """T_bcast of a pipelined relay moving ``bytes_per_version`` over links of ``link_mbps``
    Mbit/s: bytes / Bw (the chain's fill, a few chunks, is left out). The bytes are what a
    version puts on the wire: its delta payload when delta coding is on."""
    if not (link_mbps > 0 and bytes_per_version >= 0):
        raise ValueError(f"need link_mbps > 0 and bytes_per_version >= 0, got {link_mbps}, {bytes_per_version}")
    return bytes_per_version * 8 / (link_mbps * 1e6)


@dataclass(frozen=True)
class BroadcastRemedy:
    """What would hide a measured T_bcast behind training again (the overlap condition's
    broadcast term, kappa * T_train >= T_bcast)."""

    kappa: int
    """Updates per publication that would do it."""
    staleness: int
    """The budget S that gives that kappa by default (the learner's kappa = max(1, S - 1))."""
    bytes_per_version: int
    """Bytes per version that would broadcast within kappa * T_train at the measured rate
    (T_bcast scales with the bytes a version puts on the wire, ``t_bcast_for_bytes``)."""


def broadcast_remedy(kappa: int, T_train_s: float, T_bcast_s: float, bytes_per_version: int) -> BroadcastRemedy | None:
    """None when kappa * T_train >= T_bcast (broadcast hides behind training); else the
    smallest kappa (and S) and the largest payload that would restore it, each alone."""
    if kappa < 1 or T_train_s <= 0 or T_bcast_s < 0 or bytes_per_version < 0:
        raise ValueError(
            f"need kappa >= 1, T_train_s > 0, T_bcast_s >= 0, bytes >= 0; got {kappa}, {T_train_s}, {T_bcast_s}, {bytes_per_version}"
        )
    if kappa * T_train_s >= T_bcast_s:
        return None
    needed = max(kappa + 1, math.ceil(T_bcast_s / T_train_s))
    return BroadcastRemedy(
        kappa=needed,
        staleness=needed + 1,
        bytes_per_version=int(bytes_per_version * kappa * T_train_s / T_bcast_s),
    )


def mu_target(mu_min: float, gamma: float = 1.1) -> float:
    """Provisioning target (rollouts/s): mu_min with headroom gamma >= 1 (paper: 1.1)."""
    if gamma < 1.0:
        raise ValueError(f"gamma must be >= 1 (headroom over mu_min), got {gamma}")
    return gamma * mu_min


def overlap_holds(kappa: int, T_train_s: float, T_bcast_s: float, R: float, mu_pool: float) -> bool:
    """True if generation + broadcast of a cycle fits inside its kappa training updates."""
    _check_model_args(kappa, R, T_train_s, T_bcast_s)
    if mu_pool <= 0:
        return False
    return _cycle_shortfall_s(kappa, R, T_train_s, T_bcast_s, mu_pool) <= 0


def staleness_bound(kappa: int, T_train_s: float, T_bcast_s: float, R: float, mu_pool: float) -> int:
    """Worst-case staleness (learner updates) of a consumed batch under steady state."""
    _check_model_args(kappa, R, T_train_s, T_bcast_s)
    if mu_pool <= 0:
        raise ValueError(f"mu_pool must be > 0 rollouts/s for a finite staleness bound, got {mu_pool}")
    return kappa + math.ceil((T_bcast_s + R / mu_pool) / T_train_s) - 1


def predicted_bubble_ratio(R: float, T_train_s: float, T_bcast_s: float, kappa: int, mu_pool: float) -> float:
    """Model learner idle fraction in [0, 1]: 0 iff the overlap condition holds (module doc)."""
    _check_model_args(kappa, R, T_train_s, T_bcast_s)
    if mu_pool < 0:
        raise ValueError(f"mu_pool must be >= 0 rollouts/s, got {mu_pool}")
    if mu_pool == 0:
        return 1.0  # no data ever arrives
    shortfall_s = max(0.0, _cycle_shortfall_s(kappa, R, T_train_s, T_bcast_s, mu_pool))
    return shortfall_s / (shortfall_s + kappa * T_train_s)


def bubble_ratio(idle_s: float, train_s: float) -> float:
    """Measured learner bubble ratio idle / (idle + train); 0 before anything happened."""
    if idle_s < 0 or train_s < 0:
        raise ValueError(f"times must be >= 0, got idle_s={idle_s}, train_s={train_s}")
    total_s = idle_s + train_s
    return 0.0 if total_s == 0 else idle_s / total_s


def cost_per_step(active_cost_per_hour: float, learner_cost_per_hour: float, step_s: float) -> float:
    """Dollars per learner step: (active workers + learner) $/h times the step's duration."""
    if step_s < 0:
        raise ValueError(f"step_s must be >= 0, got {step_s}")
    return (active_cost_per_hour + learner_cost_per_hour) * step_s / 3600.0


# --------------------------------------------------------------------------- activation


@dataclass(frozen=True)
class Worker:
    """A rollout worker as the scheduler sees it (measured, not promised, throughput)."""

    worker_id: str
    mu: float  # delivered rollouts/s
    price_per_hour: float  # dollars/h while active
    available: bool = True  # heartbeats fresh

    def __post_init__(self) -> None:
        if self.mu < 0 or self.price_per_hour < 0:
            raise ValueError(f"worker {self.worker_id!r}: mu and price_per_hour must be >= 0")

    @property
    def rho(self) -> float:
        """Dollars-per-hour per rollout/s (lower is more cost-efficient); inf if mu == 0."""
        return math.inf if self.mu == 0 else self.price_per_hour / self.mu

    @property
    def usable(self) -> bool:
        return self.available and self.mu > 0


@dataclass(frozen=True)
class Activation:
    """An active set, in activation order, with its capacity and price."""

    active_ids: tuple[str, ...]
    total_mu: float  # rollouts/s
    cost_per_hour: float  # dollars/h of the active workers
    met: bool  # total_mu >= target_mu


def _rho_key(w: Worker) -> tuple[float, str]:
    return (w.rho, w.worker_id)


def _unique(workers: Iterable[Worker]) -> list[Worker]:
    out = list(workers)
    ids = [w.worker_id for w in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate worker_id in {sorted(ids)}")
    return out


def _fill(order: Sequence[Worker], target_mu: float) -> Activation:
    """Activate workers in `order` until their summed mu reaches target_mu (or all are used)."""
    chosen: list[Worker] = []
    total_mu = 0.0
    for w in order:
        if total_mu >= target_mu:
            break
        chosen.append(w)
        total_mu += w.mu
    return Activation(
        active_ids=tuple(w.worker_id for w in chosen),
        total_mu=total_mu,
        cost_per_hour=sum(w.price_per_hour for w in chosen),
        met=total_mu >= target_mu,
    )


def greedy_activation(workers: Iterable[Worker], target_mu: float) -> Activation:
    """Paper's rule: cheapest rho first until sum(mu) >= target_mu (rollouts/s)."""
    usable = [w for w in _unique(workers) if w.usable]
    return _fill(sorted(usable, key=_rho_key), target_mu)


def random_activation(workers: Iterable[Worker], target_mu: float, rng: random.Random) -> Activation:
    """Ablation baseline: usable workers in random order until sum(mu) >= target_mu."""
    usable = sorted((w for w in _unique(workers) if w.usable), key=lambda w: w.worker_id)
    rng.shuffle(usable)
    return _fill(usable, target_mu)


@dataclass(frozen=True)
class Decision:
    """Outcome of one controller update; the caller tells workers to start/stop."""

    activated: tuple[str, ...]  # newly activated by this update
    parked: tuple[str, ...]  # newly parked: released on surplus, or dropped as unavailable
    active: tuple[str, ...]  # the active set after this update
    active_mu: float  # rollouts/s of the active set (latest measurements)
    target_mu: float  # rollouts/s
    reason: str


class ActivationController:
    """Closed-loop activation with hysteresis; pure: time comes in as `now_s`.

    Each `update(now_s, workers, target_mu)` takes the latest measured mu and availability of
    every known worker (workers missing from the list count as unavailable; new ones join
    as parked; a parked worker's mu should be its last measurement or a prior estimate).
    - An active worker that is unavailable is dropped at once and the set is refilled at
      once with the cheapest parked workers: a lost worker is a fact, not noise.
    - Cold start (empty active set): plan greedily at once.
    - Shortfall (active mu < target): add the cheapest (rho) parked workers until the target
      is met, but only once the shortfall has lasted `shortfall_window_s`.
    - Surplus: release the least cost-efficient (highest rho) active worker if the rest still
      give >= target * (1 + surplus_margin), once that has lasted `surplus_window_s`; one
      release per window, so the set shrinks gradually.
    Any interruption of a condition restarts its window.
    With ``rng`` the same loop picks workers in random order instead of by rho (the paper's
    random-activation ablation: same hysteresis, same target, no cost awareness).
    """

    def __init__(
        self,
        shortfall_window_s: float = 30.0,
        surplus_window_s: float = 300.0,
        surplus_margin: float = 0.1,
        rng: random.Random | None = None,
    ) -> None:
        if shortfall_window_s < 0 or surplus_window_s < 0 or surplus_margin < 0:
            raise ValueError("windows and surplus_margin must be >= 0")
        self._rng = rng  # None: cost-aware (rho order); a Random: random-order ablation
        self.shortfall_window_s = shortfall_window_s
        self.surplus_window_s = surplus_window_s
        self.surplus_margin = surplus_margin
        self._active: list[str] = []
        self._shortfall_since_s: float | None = None
        self._surplus_since_s: float | None = None
        self._last_now_s = -math.inf

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(self._active)

    def update(self, now_s: float, workers: Iterable[Worker], target_mu: float) -> Decision:
        if now_s < self._last_now_s:
            raise ValueError(f"now_s went backwards: {now_s} < {self._last_now_s}")
        self._last_now_s = now_s
        known = {w.worker_id: w for w in _unique(workers)}
        dropped = [i for i in self._active if i not in known or not known[i].usable]
        self._active = [i for i in self._active if i not in dropped]
        mu = sum(known[i].mu for i in self._active)
        fmt = f"pool {mu:.3g}/s vs target {target_mu:.3g}/s"

        if dropped or (not self._active and target_mu > 0):
            added = self._add_cheapest(known, target_mu)
            self._shortfall_since_s = self._surplus_since_s = None
            why = f"dropped unavailable {dropped}" if dropped else "cold start"
            return self._decision(known, added, dropped, target_mu, f"{why}: {fmt}, added {added}")

        if mu < target_mu:
            self._surplus_since_s = None
            if self._shortfall_since_s is None:
                self._shortfall_since_s = now_s
            held_s = now_s - self._shortfall_since_s
            if held_s < self.shortfall_window_s:
                return self._decision(known, [], [], target_mu, f"shortfall {held_s:.1f} s (waiting): {fmt}")
            added = self._add_cheapest(known, target_mu)
            self._shortfall_since_s = None
            reason = f"shortfall {held_s:.1f} s: {fmt}, added {added}"
            return self._decision(known, added, [], target_mu, reason)

        self._shortfall_since_s = None
        worst = self._release_candidate(known)
        if worst is None or mu - known[worst].mu < target_mu * (1.0 + self.surplus_margin):
            self._surplus_since_s = None
            return self._decision(known, [], [], target_mu, f"steady: {fmt}")
        if self._surplus_since_s is None:
            self._surplus_since_s = now_s
        held_s = now_s - self._surplus_since_s
        if held_s < self.surplus_window_s:
            return self._decision(known, [], [], target_mu, f"surplus {held_s:.1f} s (waiting): {fmt}")
        self._active.remove(worst)
        self._surplus_since_s = None
        reason = f"surplus {held_s:.1f} s: {fmt}, released {worst!r}"
        return self._decision(known, [], [worst], target_mu, reason)

    def _release_candidate(self, known: dict[str, Worker]) -> str | None:
        """The active worker a surplus releases: highest rho, or a random one (ablation)."""
        if self._rng is not None:
            return self._rng.choice(sorted(self._active)) if self._active else None
        return max(self._active, key=lambda i: _rho_key(known[i]), default=None)

    def _add_cheapest(self, known: dict[str, Worker], target_mu: float) -> list[str]:
        """Append parked usable workers, cheapest rho first (random order with an rng),
        until target_mu is reached."""
        mu = sum(known[i].mu for i in self._active)
        parked = sorted((w for i, w in known.items() if w.usable and i not in self._active), key=_rho_key)
        if self._rng is not None:
            parked.sort(key=lambda w: w.worker_id)
            self._rng.shuffle(parked)
        added = list(_fill(parked, target_mu - mu).active_ids)
        self._active.extend(added)
        return added

    def _decision(
        self, known: dict[str, Worker], added: list[str], parked: list[str], target_mu: float, reason: str
    ) -> Decision:
        return Decision(
            activated=tuple(added),
            parked=tuple(parked),
            active=tuple(self._active),
            active_mu=sum(known[i].mu for i in self._active),
            target_mu=target_mu,
            reason=reason,
        )
