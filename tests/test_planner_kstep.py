"""The greedy k-step (fedlora.system.planner.kstep): the vectorised and scalar passes equal a
literal client-by-client loop; P2 never increases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedlora.system import planner
from fedlora.system.planner import (
    Constants,
    PlanOptions,
    PlanProblem,
    greedy_k,
    p2_objective,
    q_lower_bounds,
    q_step,
)
from planner_cases import CONSTANTS, QUAD, random_k, random_problem


def greedy_reference(problem, constants, q, options):
    """Algorithm 2 lines 12–21, literally: one client at a time, full P2 each time."""
    n, gamma = problem.n, problem.gamma
    k = np.full(n, gamma)
    while True:
        updated = False
        for i in range(n):
            if k[i] <= 1:
                continue
            trial = k.copy()
            trial[i] -= 1
            lo = q_lower_bounds(problem, constants, trial, options.q_lower_bound)
            feasible = q[i] > lo[i] if options.q_lower_bound == "per_client" else np.all(q > lo)
            before = p2_objective(problem, constants, q, k, options)
            after = p2_objective(problem, constants, q, trial, options)
            if feasible and after < before:
                k = trial
                updated = True
        if not updated:
            return k


@pytest.mark.parametrize("vectorised", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("bound", ["per_client", "paper", "none"])
def test_greedy_passes_equal_the_literal_loop(seed, bound, vectorised, monkeypatch):
    if vectorised:  # force the O(N)-per-iteration fixed-point pass used for large N
        monkeypatch.setattr(planner.kstep, "_SCALAR_PASS_MAX_N", 0)
    p = random_problem(25, seed, gamma=8)
    o = dataclasses.replace(QUAD, q_lower_bound=bound, comp_cost=["quadratic", "affine"][seed % 2])
    q = q_step(p, p.constants, np.full(25, 8), o).q
    got = greedy_k(p, p.constants, q, o)
    np.testing.assert_array_equal(got, greedy_reference(p, p.constants, q, o))


def test_greedy_equals_the_literal_loop_when_it_needs_more_than_gamma_passes():
    # Prepare: N = 172 (the vectorised pass), γ = 16; 171 light clients shrink k one step per
    # pass while one heavy client (a = 0.4) starts late: the literal greedy needs 19 passes
    # (a loop capped at γ + 1 = 17 passes stopped with that client one step short)
    n = 172
    a = np.full(n, 0.6 / (n - 1))
    a[-1] = 0.4
    p = PlanProblem(
        gamma=16, f_tot=100.0, a=a, tau_full_s=np.full(n, 0.5), t_full=np.full(n, 50.0),
        constants=Constants(1.0, 1.0, 0.01, 0.1),
    )  # fmt: skip
    o = dataclasses.replace(QUAD, q_lower_bound="none")
    q = np.full(n, 0.5)
    # Execute
    got = greedy_k(p, p.constants, q, o)
    # Assert
    np.testing.assert_array_equal(got, greedy_reference(p, p.constants, q, o))
    assert got[-1] == 7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_k_never_increases_p2(seed):
    p = random_problem(40, seed)
    q = q_step(p, p.constants, random_k(40, 16, seed), QUAD).q
    k = greedy_k(p, p.constants, q, QUAD)
    start = p2_objective(p, p.constants, q, np.full(40, 16), QUAD)
    assert p2_objective(p, p.constants, q, k, QUAD) <= start
    assert np.all((k >= 1) & (k <= 16))
    assert np.all(q > q_lower_bounds(p, p.constants, k, "per_client"))


def test_greedy_keeps_k_when_sketching_does_not_pay():
    # affine compute with ρ = 1 and a tiny upload: shrinking k saves almost nothing
    p = PlanProblem(
        gamma=8, f_tot=1e9, a=[0.5, 0.5], tau_full_s=[1, 1], t_full=[1, 1], constants=CONSTANTS
    )
    o = PlanOptions(comm_cost="linear", comp_cost="affine", rho=1.0)
    np.testing.assert_array_equal(greedy_k(p, CONSTANTS, np.array([0.5, 0.5]), o), [8, 8])
