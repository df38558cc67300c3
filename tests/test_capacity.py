"""Capacity model and cost-aware activation: paper numbers, hand cases, properties."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.capacity.model import (
    ActivationController,
    Worker,
    bubble_ratio,
    cost_per_step,
    greedy_activation,
    mu_min,
    mu_target,
    overlap_holds,
    predicted_bubble_ratio,
    random_activation,
    staleness_bound,
)

FAST = settings(max_examples=150, deadline=None, database=None)

# ----------------------------------------------------------------------------- capacity model


def test_mu_min_paper_case() -> None:
    # kappa=2, R=2048 (128 prompts x 16), T_train=1631.2 s, T_bcast=1437 s (relay, 9 workers)
    m = mu_min(kappa=2, R=2048, T_train_s=1631.2, T_bcast_s=1437.0)
    assert m == pytest.approx(2.24, abs=0.01)
    assert mu_target(m) == pytest.approx(1.1 * m)
    assert overlap_holds(kappa=2, T_train_s=1631.2, T_bcast_s=1437.0, R=2048, mu_pool=m * 1.0001)
    assert not overlap_holds(kappa=2, T_train_s=1631.2, T_bcast_s=1437.0, R=2048, mu_pool=m * 0.999)


def test_mu_min_infeasible_when_broadcast_outlasts_training() -> None:
    with pytest.raises(ValueError, match="no finite capacity"):
        mu_min(kappa=1, R=2048, T_train_s=1631.2, T_bcast_s=1831.0)
    with pytest.raises(ValueError, match="no finite capacity"):
        mu_min(kappa=2, R=10, T_train_s=5.0, T_bcast_s=10.0)  # equality is not enough


def test_mu_target_rejects_gamma_below_one() -> None:
    with pytest.raises(ValueError, match="gamma"):
        mu_target(2.0, gamma=0.9)


def test_staleness_bound_hand_cases() -> None:
    # (T_bcast + R/mu) / T_train = (5 + 20/4) / 10 = 1 -> ceil 1 -> 3 + 1 - 1 = 3
    assert staleness_bound(kappa=3, T_train_s=10.0, T_bcast_s=5.0, R=20, mu_pool=4.0) == 3
    # (6 + 5) / 10 = 1.1 -> ceil 2 -> 4
    assert staleness_bound(kappa=3, T_train_s=10.0, T_bcast_s=6.0, R=20, mu_pool=4.0) == 4
    # paper case at mu = 2.5/s: (1437 + 819.2) / 1631.2 = 1.38 -> 2 + 2 - 1 = 3 = S
    assert staleness_bound(kappa=2, T_train_s=1631.2, T_bcast_s=1437.0, R=2048, mu_pool=2.5) == 3
    with pytest.raises(ValueError, match="mu_pool"):
        staleness_bound(kappa=2, T_train_s=1.0, T_bcast_s=0.0, R=1, mu_pool=0.0)


def test_bubble_model_hand_values() -> None:
    # kappa=1, R=10, T_train=10, T_bcast=5: mu=1 -> shortfall 5 + 10 - 10 = 5 -> 5/15
    b = predicted_bubble_ratio(R=10, T_train_s=10.0, T_bcast_s=5.0, kappa=1, mu_pool=1.0)
    assert b == pytest.approx(1 / 3)
    assert predicted_bubble_ratio(R=10, T_train_s=10.0, T_bcast_s=5.0, kappa=1, mu_pool=2.0) == 0.0
    assert predicted_bubble_ratio(R=10, T_train_s=10.0, T_bcast_s=5.0, kappa=1, mu_pool=0.0) == 1.0


model_args = st.fixed_dictionaries(
    {
        "kappa": st.integers(1, 12),
        "R": st.integers(1, 4096),
        "T_train_s": st.floats(0.1, 5000.0),
        "T_bcast_s": st.floats(0.0, 5000.0),
    }
)


@FAST
@given(args=model_args, mu_hi=st.floats(1e-3, 1e3), shrink=st.floats(0.01, 0.9))
def test_bubble_zero_iff_overlap_and_monotone_in_pool(args: dict, mu_hi: float, shrink: float) -> None:
    mu_lo = mu_hi * shrink
    b_hi = predicted_bubble_ratio(mu_pool=mu_hi, **args)
    b_lo = predicted_bubble_ratio(mu_pool=mu_lo, **args)
    for mu, b in ((mu_hi, b_hi), (mu_lo, b_lo)):
        assert 0.0 <= b < 1.0
        assert (b == 0.0) == overlap_holds(mu_pool=mu, **args)
    assert b_lo >= b_hi
    if b_hi > 0:
        assert b_lo > b_hi  # strictly rising once below the knee


def test_measured_bubble_ratio() -> None:
    assert bubble_ratio(0.0, 0.0) == 0.0
    assert bubble_ratio(idle_s=1.0, train_s=3.0) == 0.25
    with pytest.raises(ValueError):
        bubble_ratio(-1.0, 1.0)


def test_cost_per_step() -> None:
    # 4 workers x $0.35/h + learner 4 x $3.06/h for 900 s
    assert cost_per_step(1.40, 12.24, step_s=900.0) == pytest.approx((1.40 + 12.24) / 4)


# ----------------------------------------------------------------------------- greedy activation

POOL = [
    Worker("rtx5090", mu=1.0, price_per_hour=0.35),  # rho 0.35
    Worker("rtx4090", mu=0.6, price_per_hour=0.25),  # rho 0.417
    Worker("a10", mu=0.5, price_per_hour=0.60),  # rho 1.2
    Worker("l4", mu=0.8, price_per_hour=0.40),  # rho 0.5
]


def test_greedy_picks_by_rho() -> None:
    act = greedy_activation(POOL, target_mu=1.5)
    assert act.active_ids == ("rtx5090", "rtx4090")
    assert act.total_mu == pytest.approx(1.6)
    assert act.cost_per_hour == pytest.approx(0.60)
    assert act.met
    act = greedy_activation(POOL, target_mu=2.0)
    assert act.active_ids == ("rtx5090", "rtx4090", "l4")
    assert greedy_activation(POOL, target_mu=0.0).active_ids == ()


def test_greedy_skips_unavailable_and_breaks_ties_by_id() -> None:
    pool = [Worker("b", 1.0, 0.5), Worker("a", 1.0, 0.5), Worker("c", 5.0, 0.1, available=False)]
    assert greedy_activation(pool, target_mu=1.0).active_ids == ("a",)


def test_infeasible_pool_activates_all_and_reports_unmet() -> None:
    act = greedy_activation(POOL, target_mu=10.0)
    assert set(act.active_ids) == {w.worker_id for w in POOL}
    assert act.total_mu == pytest.approx(2.9)
    assert not act.met


def test_duplicate_ids_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        greedy_activation([Worker("a", 1.0, 1.0), Worker("a", 2.0, 1.0)], 1.0)


def test_worker_rho_and_validation() -> None:
    assert Worker("w", mu=2.0, price_per_hour=0.5).rho == 0.25
    assert Worker("w", mu=0.0, price_per_hour=0.5).rho == math.inf
    with pytest.raises(ValueError):
        Worker("w", mu=-1.0, price_per_hour=0.5)


pools = st.lists(st.tuples(st.floats(0.05, 5.0), st.floats(0.05, 3.0), st.booleans()), min_size=1, max_size=8).map(
    lambda rows: [Worker(f"w{i}", mu, price, avail) for i, (mu, price, avail) in enumerate(rows)]
)


def _optimal_cost(workers: list[Worker], target_mu: float) -> float:
    usable = [w for w in workers if w.available]
    best = math.inf
    for k in range(len(usable) + 1):
        for subset in itertools.combinations(usable, k):
            if sum(w.mu for w in subset) >= target_mu:
                best = min(best, sum(w.price_per_hour for w in subset))
    return best


@FAST
@given(workers=pools, target_mu=st.floats(0.0, 20.0), seed=st.integers(0, 2**16))
def test_greedy_cost_properties(workers: list[Worker], target_mu: float, seed: int) -> None:
    greedy = greedy_activation(workers, target_mu)
    usable = [w for w in workers if w.available]
    feasible = sum(w.mu for w in usable) >= target_mu
    assert greedy.met == feasible
    assert greedy.cost_per_hour <= sum(w.price_per_hour for w in usable) + 1e-9
    if not feasible:
        assert len(greedy.active_ids) == len(usable)
        return
    assert greedy.total_mu >= target_mu
    # LP-relaxation bound: greedy-by-rho <= OPT + the price of one worker; OPT <= random.
    opt = _optimal_cost(workers, target_mu)
    max_price = max((w.price_per_hour for w in usable), default=0.0)
    assert greedy.cost_per_hour <= opt + max_price + 1e-9
    rand = random_activation(workers, target_mu, random.Random(seed))
    assert rand.met and opt <= rand.cost_per_hour + 1e-9
    assert greedy.cost_per_hour <= rand.cost_per_hour + max_price + 1e-9


def test_greedy_beats_random_on_average_for_heterogeneous_pool() -> None:
    cheap = [Worker(f"cheap{i}", mu=1.0, price_per_hour=0.35) for i in range(6)]
    pool = cheap + [Worker(f"dear{i}", mu=0.5, price_per_hour=0.60) for i in range(6)]
    greedy = greedy_activation(pool, target_mu=4.0)
    rng = random.Random(0)
    mean_random = sum(random_activation(pool, 4.0, rng).cost_per_hour for _ in range(200)) / 200
    assert greedy.cost_per_hour == pytest.approx(4 * 0.35)
    assert mean_random > 1.15 * greedy.cost_per_hour


# ----------------------------------------------------------------------------- controller


def W(worker_id: str, mu: float, price: float, available: bool = True) -> Worker:
    return Worker(worker_id, mu=mu, price_per_hour=price, available=available)


def _controller() -> ActivationController:
    return ActivationController(shortfall_window_s=30.0, surplus_window_s=60.0, surplus_margin=0.1)


def test_cold_start_plans_greedily_at_once() -> None:
    ctl = _controller()
    d = ctl.update(0.0, [W("a", 1.0, 0.3), W("b", 1.0, 0.5), W("c", 1.0, 0.9)], target_mu=1.8)
    assert d.activated == ("a", "b") and d.active == ("a", "b") and d.parked == ()
    assert "cold start" in d.reason


def test_short_dip_does_not_activate_sustained_one_does() -> None:
    ctl = _controller()
    ok = [W("a", 1.0, 0.3), W("b", 1.0, 0.5), W("c", 1.0, 0.9)]
    dip = [W("a", 0.8, 0.3), W("b", 1.0, 0.5), W("c", 1.0, 0.9)]
    ctl.update(0.0, ok, 1.9)
    d = ctl.update(10.0, dip, 1.9)
    assert d.activated == () and "shortfall 0.0 s" in d.reason
    d = ctl.update(35.0, dip, 1.9)  # 25 s < 30 s window
    assert d.activated == ()
    ctl.update(36.0, ok, 1.9)  # recovered: window restarts
    ctl.update(50.0, dip, 1.9)
    d = ctl.update(79.0, dip, 1.9)  # 29 s
    assert d.activated == ()
    d = ctl.update(80.0, dip, 1.9)  # 30 s: sustained
    assert d.activated == ("c",) and d.active == ("a", "b", "c")
    assert d.reason.startswith("shortfall 30.0 s: pool 1.8/s vs target 1.9/s")


def test_surplus_releases_most_expensive_only_after_window() -> None:
    ctl = _controller()
    ws = [W("a", 1.0, 0.3), W("b", 1.0, 0.5), W("c", 1.0, 0.9)]
    assert ctl.update(0.0, ws, 2.5).active == ("a", "b", "c")
    # target drops to 1.5: without "c" the pool gives 2.0 >= 1.5 * 1.1 -> surplus
    assert ctl.update(100.0, ws, 1.5).parked == ()
    assert ctl.update(159.0, ws, 1.5).parked == ()
    d = ctl.update(160.0, ws, 1.5)
    assert d.parked == ("c",) and d.active == ("a", "b")
    # without "b" only 1.0 < 1.65: no further release, however long
    assert ctl.update(1000.0, ws, 1.5).parked == ()
    assert ctl.update(2000.0, ws, 1.5).active == ("a", "b")


def test_margin_prevents_release_when_rest_is_barely_enough() -> None:
    ctl = _controller()
    ws = [W("a", 1.0, 0.3), W("b", 1.0, 0.5)]
    ctl.update(0.0, ws, 2.0)
    assert ctl.update(0.0, ws, 0.95).active == ("a", "b")  # 1.0 < 0.95 * 1.1
    assert ctl.update(500.0, ws, 0.95).active == ("a", "b")


def test_unavailable_worker_dropped_at_once_and_replaced() -> None:
    ctl = _controller()
    ws = [W("a", 1.0, 0.3), W("b", 1.0, 0.5), W("c", 1.0, 0.9), W("d", 1.0, 1.2)]
    ctl.update(0.0, ws, 1.5)
    d = ctl.update(1.0, [W("a", 1.0, 0.3, available=False), *ws[1:]], 1.5)
    assert d.parked == ("a",) and d.activated == ("c",) and d.active == ("b", "c")
    assert "dropped unavailable" in d.reason
    # a worker that vanishes from the report is treated the same way
    d = ctl.update(2.0, [ws[0], ws[2], ws[3]], 1.5)
    assert d.parked == ("b",) and d.activated == ("a",) and d.active == ("c", "a")


def test_new_workers_join_parked() -> None:
    ctl = _controller()
    ctl.update(0.0, [W("a", 2.0, 0.3)], 1.5)
    d = ctl.update(1.0, [W("a", 2.0, 0.3), W("new", 5.0, 0.01)], 1.5)
    assert d.active == ("a",) and d.activated == () and "steady" in d.reason


def test_time_must_not_go_backwards() -> None:
    ctl = _controller()
    ctl.update(10.0, [W("a", 1.0, 0.3)], 1.0)
    with pytest.raises(ValueError, match="backwards"):
        ctl.update(9.0, [W("a", 1.0, 0.3)], 1.0)
