"""Shared instances of the planner tests (tests/test_planner_*.py): random problems, a
one-client problem, the PROBLEM.json structure of docs/planner.md."""

from __future__ import annotations

import numpy as np

from fedlora.system.planner import Constants, PlanOptions, PlanProblem

CONSTANTS = Constants(1.0, 1.0, 0.01, 0.001)
QUAD = PlanOptions(comm_cost="quadratic", comp_cost="quadratic")


def random_problem(n: int, seed: int, gamma: int = 16, constants: Constants = CONSTANTS):
    rng = np.random.default_rng(seed)
    return PlanProblem(
        gamma=gamma,
        f_tot=100.0,
        a=rng.dirichlet(np.ones(n)),
        tau_full_s=rng.uniform(0.5, 3.0, n),
        t_full=rng.uniform(10.0, 100.0, n),
        constants=constants,
    )


def random_k(n: int, gamma: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 100).integers(max(1, gamma // 2), gamma + 1, n)


def one_client(**kw) -> PlanProblem:
    return PlanProblem(
        gamma=4, f_tot=10.0, a=[1.0], tau_full_s=[1.0], t_full=[10.0], constants=CONSTANTS, **kw
    )


def raw_problem(**changes):
    raw = {
        "gamma": 16,
        "f_tot": 100.0,
        "clients": [
            {"a": 0.5, "tau_full_s": 1.3, "t_full": 40.0},
            {"a": 0.5, "tau_full_s": 0.7, "t_full": 80.0},
        ],
        "constants": {"A": 1.0, "B": 1.0, "C": 0.01, "D": 0.001},
        "options": {"comm_cost": "quadratic", "comp_cost": "quadratic"},
    }
    raw.update(changes)
    return raw
