"""A privacy budget part of which is spent: the rate bounds of the rounds still to come
(`budget_spent`), the ledger's RDP, and the planner keeping what is left. Every ε checked
here is dp-accounting's own `RdpAccountant` composing the whole history (the spent rounds and
the planned ones), not fedlora's composition."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from fedlora.system.planner import PlanOptions, plan
from fedlora.system.planner.budget import plan_within_budget
from fedlora.system.planner.budget_spent import EXACT_GROUPS, spent_rate_bounds
from fedlora.system.privacy import columns_rdp, max_poisson_rate, poisson_round_rdp
from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting
from planner_cases import TWO_CLIENTS, drive_theorem1, model_free_proposed

dpa = pytest.importorskip("dp_accounting")

SIGMA, DELTA = 1.2, 1e-5
SETTING = RoundSetting("central", SIGMA, 1.0, "poisson")


def _library_epsilon(history: list[tuple[float, int]], sigma: float = SIGMA) -> float:
    """ε(δ) of (rate, rounds) events composed by dp-accounting itself: each distinct round's
    RDP from its own `RdpAccountant` (cached: the tests compose the same probe rounds with
    many planned rates), summed with the rounds' counts as the accountant composes them, and
    converted by its `compute_epsilon`."""
    total = np.zeros(len(_orders()))
    for q, rounds in history:
        if rounds:
            total = total + rounds * _library_round_rdp(float(q), sigma)
    return dpa.rdp.compute_epsilon(_orders(), total, DELTA)[0]


@functools.cache
def _library_round_rdp(q: float, sigma: float) -> np.ndarray:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 1)
    return np.array(acc._rdp)


def _orders():
    return dpa.rdp.RdpAccountant()._orders


def _spent(history: list[tuple[float, int]]) -> np.ndarray:
    """(orders,) the RDP of `history`, from a ledger of one client."""
    ledger = PrivacyLedger(1)
    for q, rounds in history:
        for _ in range(rounds):
            ledger.record(SETTING, "poisson", [q])
    return ledger.rdp()[0]


def test_the_ledgers_rdp_converts_to_dp_accountings_epsilon_per_client():
    ledger = PrivacyLedger(3)
    ledger.record(SETTING, "poisson", [0.3, 0.1, 0.3])
    ledger.record(SETTING, "poisson", [0.3, 0.1, 0.3], mask=[True, True, False])
    ledger.record(SETTING, "poisson", [0.05, 0.2, 0.3], mask=[True, True, False])
    rdp = ledger.rdp()
    assert rdp.shape == (3, len(dpa.rdp.RdpAccountant().orders))
    expected = [
        _library_epsilon([(0.3, 2), (0.05, 1)]),
        _library_epsilon([(0.1, 2), (0.2, 1)]),
        _library_epsilon([(0.3, 1)]),
    ]
    orders = dpa.rdp.RdpAccountant().orders
    got = [dpa.rdp.compute_epsilon(orders, row, DELTA)[0] for row in rdp]
    assert got == pytest.approx(expected, rel=1e-9)
    assert ledger.epsilons(DELTA) == pytest.approx(expected, rel=1e-9)


def test_a_round_without_noise_leaves_no_budget():
    ledger = PrivacyLedger(2)
    ledger.record(SETTING, "poisson", [0.1, 0.1])
    ledger.record_unprotected(1)
    assert np.all(np.isinf(columns_rdp(ledger.columns, 2)))
    bounds = spent_rate_bounds(np.array([8.0, 8.0]), SIGMA, 10, DELTA, ledger.rdp())
    assert bounds.tolist() == [0.0, 0.0]


def test_nothing_spent_gives_the_bound_of_a_fresh_budget_exactly():
    fresh = max_poisson_rate(4.0, SIGMA, 30, DELTA)
    zero = np.zeros((1, len(poisson_round_rdp(0.1, SIGMA))))
    assert spent_rate_bounds(np.array([4.0]), SIGMA, 30, DELTA, zero)[0] == fresh


@pytest.mark.parametrize("spent_history", [[(0.3, 4), (0.15, 4)], [(0.02, 16)], [(0.5, 1)]])
def test_the_bound_keeps_the_budget_with_the_spent_rounds_and_no_more(spent_history):
    budget, rounds = 6.0, 40
    spent = _spent(spent_history)
    u = spent_rate_bounds(np.array([budget]), SIGMA, rounds, DELTA, spent[None, :])[0]
    assert 0 < u < max_poisson_rate(budget, SIGMA, rounds, DELTA)  # the spent part costs rate
    assert _library_epsilon(spent_history + [(u, rounds)]) <= budget
    assert _library_epsilon(spent_history + [(u * 1.001, rounds)]) > budget  # Brent to 1e-4


def test_a_history_over_the_budget_leaves_rate_zero():
    spent = _spent([(1.0, 20)])  # ε far above 2
    assert _library_epsilon([(1.0, 20)]) > 2.0
    assert spent_rate_bounds(np.array([2.0]), SIGMA, 5, DELTA, spent[None, :])[0] == 0.0


def test_many_distinct_histories_use_the_grid_below_the_exact_bound(monkeypatch):
    from fedlora.system.planner import budget_spent

    monkeypatch.setattr(budget_spent, "GRID_POINTS", 121)  # ratio 1.122 between rates (fast)
    budget_spent._grid.cache_clear()
    n = EXACT_GROUPS + 4
    rates = np.linspace(0.01, 0.2, n)  # every client its own history: the grid path
    ledger = PrivacyLedger(n)
    for _ in range(5):
        ledger.record(SETTING, "poisson", rates)
    budgets, rounds = np.full(n, 5.0), 25
    grid = spent_rate_bounds(budgets, SIGMA, rounds, DELTA, ledger.rdp())
    for i in (0, n - 1):
        exact = spent_rate_bounds(budgets[i : i + 1], SIGMA, rounds, DELTA, ledger.rdp()[i : i + 1])
        assert exact[0] / 1.123 <= grid[i] <= exact[0]
        assert _library_epsilon([(float(rates[i]), 5), (float(grid[i]), rounds)]) <= 5.0
    assert np.all(np.diff(grid) <= 0)  # more spent, less left
    budget_spent._grid.cache_clear()


PROBLEM = TWO_CLIENTS


def test_a_plan_after_spent_rounds_keeps_what_is_left_of_the_budget():
    options = PlanOptions(q_lower_bound="none", max_epsilon=8.0, noise_multiplier=1.0, delta=DELTA)
    fresh = plan(PROBLEM, options)
    history = [(0.1, 2), (0.05, 2)]  # probe rounds, every client alike
    spent_eps = _library_epsilon(history, sigma=1.0)
    assert 0.5 < spent_eps < 8.0
    ledger = PrivacyLedger(2)
    for q, rounds in history:
        for _ in range(rounds):
            ledger.record(RoundSetting("central", 1.0, 1.0, "poisson"), "poisson", [q, q])
    from fedlora.system.planner.alternation import multi_start

    result = plan_within_budget(
        PROBLEM, options, lambda o: multi_start(PROBLEM, PROBLEM.constants, o), ledger.rdp()
    )
    rounds = result.privacy["rounds"]
    assert rounds == math.ceil(result.expected_rounds - 1e-9)
    eps = [_library_epsilon(history + [(float(q), rounds)], sigma=1.0) for q in result.q]
    assert max(eps) <= 8.0
    assert result.privacy["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert result.privacy["spent_epsilon"] == pytest.approx([spent_eps] * 2, rel=1e-9)
    # the plan ignoring the spent part would take a client past the budget
    fresh_eps = [
        _library_epsilon(history + [(float(q), fresh.privacy["rounds"])], sigma=1.0)
        for q in fresh.q
    ]
    assert max(fresh_eps) > 8.0
    assert result.objective > fresh.objective  # less budget, a slower plan


def _in_run(tmp_path, ledger: PrivacyLedger | None):
    """`proposed`'s in-run planner on 10 clients without a model (tests/planner_cases.py),
    under a budget of ε = 7 at σ = 1; `ledger` (or none) is what the run has spent."""
    return model_free_proposed(
        tmp_path,
        "planner.probe_q=[0.1, 0.05]", "privacy.mode=central", "privacy.noise_multiplier=1.0",
        "privacy.clip_norm=1.0", "privacy.delta=1e-5", "planner.max_epsilon=7",
        q0=0.1,
        spent=None if ledger is None else ledger.rdp,
    )  # fmt: skip


def _drive(method, ctx, ledger: PrivacyLedger, rounds: int) -> list[dict]:
    """Rounds whose loss follows Theorem 1's model (A, C, D = 40, 0.3, 0.002), each
    accounted in `ledger` at the round's rates before the planner sees it (as the engine)."""
    setting = RoundSetting("central", 1.0, 1.0, "poisson")
    return drive_theorem1(
        method, ctx, rounds, lambda r: (40.0, 0.3, 0.002),
        before_hooks=lambda q: ledger.record(setting, "poisson", q),
    )  # fmt: skip


def test_the_in_run_plan_keeps_what_the_probes_left_of_the_budget(tmp_path):
    (tmp_path / "spent").mkdir()
    (tmp_path / "fresh").mkdir()
    ledger = PrivacyLedger(10)
    method, ctx = _in_run(tmp_path / "spent", ledger)
    entry = _drive(method, ctx, ledger, 8)[7]["planner"]  # the fit after the 8 probe rounds
    privacy = entry["plan"]["privacy"]
    probes = [(0.1, 2), (0.05, 2), (0.1, 2), (0.05, 2)]  # both k at each rate
    spent_eps = _library_epsilon(probes, sigma=1.0)
    assert privacy["spent_epsilon"] == pytest.approx([spent_eps] * 10, rel=1e-9)
    rounds = privacy["rounds"]
    eps = [_library_epsilon(probes + [(q, rounds)], sigma=1.0) for q in entry["plan"]["q"]]
    assert max(eps) <= 7.0 and privacy["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert max(entry["plan"]["q"]) == pytest.approx(max(privacy["q_max"]))  # the budget binds
    # the same planner told nothing was spent plans as if the whole budget were left: with
    # the probes its plan takes a client past the budget (the run would stop early)
    method2, ctx2 = _in_run(tmp_path / "fresh", None)
    fresh = _drive(method2, ctx2, PrivacyLedger(10), 8)[7]["planner"]["plan"]
    assert "spent_epsilon" not in fresh["privacy"]
    assert max(fresh["privacy"]["epsilon"]) <= 7.0  # its own count, without the probes
    assert max(fresh["q"]) > max(entry["plan"]["q"])
    rounds = fresh["privacy"]["rounds"]
    assert max(_library_epsilon(probes + [(q, rounds)], sigma=1.0) for q in fresh["q"]) > 7.0
