"""The q-step (fedlora.system.planner.qcurve, .qstep): one client by hand (q* = 2·p), the KKT
conditions, unimodality in M, agreement of the exact and cvxpy solvers, the M range and grid,
infeasible clients named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedlora.errors import ConfigError
from fedlora.system.planner import (
    Constants,
    PlanProblem,
    p2_objective,
    plan,
    problem_from_dict,
    q_curve,
    q_lower_bounds,
    q_step,
    sketched_round_weights,
)
from planner_cases import CONSTANTS, QUAD, one_client, random_k, random_problem, raw_problem


@pytest.mark.parametrize("bound", ["per_client", "none"])
def test_q_step_one_client_by_hand(bound):
    # P3 (per_client): f = w q (A/B + κ/(q − p)), p = κ = a²N²c/(NB)·… = 0.011 → q* = p + √(κp) = 2p.
    # P2 (none): f = A w q/(B − b/q), b = 0.011 → q* = 2b/B. Both 0.022.
    res = q_step(one_client(), CONSTANTS, [4], dataclasses.replace(QUAD, q_lower_bound=bound))
    assert res.q[0] == pytest.approx(0.022, rel=1e-12)
    assert res.surrogate == ("P3" if bound == "per_client" else "P2")


def kkt_check(problem, k, options, res, rtol=1e-9):
    curve = q_curve(problem, problem.constants, np.asarray(k), options)
    q, lam = res.q, res.multiplier
    marginal = curve.kappa / (q - curve.p) ** 2 / curve.w  # −∂V/∂q_n / w_n
    at_hi = q >= 1 - 1e-12
    at_lo = q <= curve.lower * (1 + 1e-12)
    free = ~(at_hi | at_lo)
    assert free.any()
    np.testing.assert_allclose(marginal[free], lam, rtol=rtol)
    assert np.all(marginal[at_hi] >= lam * (1 - rtol))
    assert np.all(marginal[at_lo] <= lam * (1 + rtol))
    assert np.all(q > curve.p) and np.all(q <= 1)
    big_w = float(np.dot(curve.w, q))
    v = float(np.sum(curve.kappa / (q - curve.p)))
    if res.surrogate == "P3":  # outer condition ψ(λ) = 0: λ·M = A/B + V
        assert lam * big_w == pytest.approx(problem.constants.A / problem.constants.B + v, rel=rtol)
    else:  # λ·M = B − V
        assert lam * big_w == pytest.approx(problem.constants.B - v, rel=rtol)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bound", ["per_client", "paper", "none"])
def test_exact_q_step_satisfies_kkt(seed, bound):
    p = random_problem(30, seed)
    k = random_k(30, 16, seed)
    o = dataclasses.replace(QUAD, q_lower_bound=bound)
    kkt_check(p, k, o, q_step(p, p.constants, k, o))


def test_exact_q_step_with_clients_at_q_equal_1_satisfies_kkt():
    # cheap clients (tiny w) and large constants push some q to 1
    rng = np.random.default_rng(5)
    n = 12
    p = PlanProblem(
        gamma=8,
        f_tot=100.0,
        a=rng.dirichlet(np.ones(n)),
        tau_full_s=np.r_[np.full(4, 1e-4), rng.uniform(1, 3, n - 4)],
        t_full=np.r_[np.full(4, 1e-3), rng.uniform(10, 100, n - 4)],
        constants=Constants(1.0, 1.0, 0.5, 0.05),
    )
    res = q_step(p, p.constants, np.full(n, 8), QUAD)
    assert np.sum(res.q >= 1 - 1e-12) >= 1
    kkt_check(p, np.full(n, 8), QUAD, res)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_p3_is_unimodal_in_m_on_random_instances(seed):
    # the exact solver relies on ψ being increasing in λ; check f(M) along a fine grid of M
    p = random_problem(20, seed)
    k = random_k(20, 16, seed)
    curve = q_curve(p, p.constants, k, QUAD)
    m = curve.m_min + (curve.m_max - curve.m_min) * np.geomspace(1e-6, 1, 400)
    f = np.array([curve.value(curve.q(mu)) for mu in curve.mu_for_m(m)])
    d = np.sign(np.diff(f))
    d = d[d != 0]
    assert np.sum(d[1:] != d[:-1]) <= 1  # at most one change of direction (down, then up)
    assert f.min() >= q_step(p, p.constants, k, QUAD).objective * (1 - 1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bound", ["per_client", "paper", "none"])
def test_exact_and_cvxpy_agree_on_the_objective(seed, bound):
    n = [8, 15, 20][seed]
    p = random_problem(n, seed)
    k = random_k(n, 16, seed)
    o = dataclasses.replace(QUAD, q_lower_bound=bound)
    exact = q_step(p, p.constants, k, o)
    ref = q_step(p, p.constants, k, dataclasses.replace(o, solver="cvxpy"))
    assert ref.objective == pytest.approx(exact.objective, rel=1e-6)
    assert ref.objective >= exact.objective * (1 - 1e-9)  # the exact answer is the minimum


def test_grid_search_is_never_better_than_exact_and_converges_to_it():
    p = random_problem(20, 3)
    k = random_k(20, 16, 3)
    exact = q_step(p, p.constants, k, QUAD)
    coarse = q_step(p, p.constants, k, dataclasses.replace(QUAD, m_search="grid"))
    step = (exact.m - q_curve(p, p.constants, k, QUAD).m_min) / 50
    fine = q_step(p, p.constants, k, dataclasses.replace(QUAD, m_search="grid", grid_eps=step))
    assert coarse.objective >= exact.objective * (1 - 1e-12)
    assert fine.objective >= exact.objective * (1 - 1e-12)
    assert fine.objective <= coarse.objective
    assert fine.objective == pytest.approx(exact.objective, rel=1e-2)


def test_cvxpy_grid_matches_exact_grid():
    p = random_problem(10, 4)
    k = random_k(10, 16, 4)
    o = dataclasses.replace(QUAD, m_search="grid", grid_eps=0.05)
    exact = q_step(p, p.constants, k, o)
    ref = q_step(p, p.constants, k, dataclasses.replace(o, solver="cvxpy"))
    assert ref.objective == pytest.approx(exact.objective, rel=1e-6)


def test_m_range_paper_clamps_m_into_the_papers_range():
    p = random_problem(20, 0)
    k = random_k(20, 16, 0)
    w = sketched_round_weights(p, k, QUAD)
    m_min = 20 * (k.min() / k.max()) ** 2 * w.min()
    free = q_step(p, p.constants, k, QUAD)
    assert free.m < m_min  # this instance's optimum lies below the paper's M_min (PAPER_NOTES #8)
    res = q_step(p, p.constants, k, dataclasses.replace(QUAD, m_range="paper"))
    assert res.m == pytest.approx(m_min, rel=1e-9)
    assert res.objective > free.objective


def test_none_bound_gives_p2_no_worse_than_per_client_for_the_same_k():
    p = random_problem(20, 1)
    k = random_k(20, 16, 1)
    q_pc = q_step(p, p.constants, k, QUAD).q
    q_none = q_step(p, p.constants, k, dataclasses.replace(QUAD, q_lower_bound="none")).q
    assert p2_objective(p, p.constants, q_none, k, QUAD) <= p2_objective(
        p, p.constants, q_pc, k, QUAD
    ) * (1 + 1e-12)


def test_paper_bound_is_strict_with_a_tiny_margin():
    p = random_problem(20, 2)
    k = random_k(20, 16, 2)
    o = dataclasses.replace(QUAD, q_lower_bound="paper")
    q = q_step(p, p.constants, k, o).q
    lo = q_lower_bounds(p, p.constants, k, "paper")
    assert np.all(q > lo)
    assert np.all(q >= lo * (1 + 1e-9) * (1 - 1e-15))


def test_infeasible_client_is_named():
    # client 1 holds almost all data: a²N(C + D)/B = 0.9801·2·1.2 = 2.35 > 1, and even q = 1
    # leaves B − Σ a²(C + D) = 1 − 0.9802·1.2 < 0
    raw = raw_problem(constants={"A": 1, "B": 1, "C": 1.0, "D": 0.2})
    raw["clients"][0]["a"], raw["clients"][1]["a"] = 0.01, 0.99
    p, o = problem_from_dict(raw)
    with pytest.raises(
        ConfigError, match=r"infeasible: client 1 needs q_1 > 2.35.*q_lower_bound = 'none'"
    ):
        plan(p, o)
    with pytest.raises(ConfigError, match=r"infeasible: even q_n = 1"):
        plan(p, dataclasses.replace(o, q_lower_bound="none"))
