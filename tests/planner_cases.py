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


# two clients whose budgets bind (tests/test_privacy_planner.py, tests/test_budget_spent.py)
TWO_CLIENTS = PlanProblem(
    gamma=2,
    f_tot=1.0,
    a=np.array([0.6, 0.4]),
    tau_full_s=np.array([1.0, 0.3]),
    t_full=np.array([0.5, 1.5]),
    constants=Constants(30.0, 1.0, 0.1, 0.02),
)


def model_free_proposed(tmp_path, *overrides: str, q0: float = 0.3, spent=None):
    """A `proposed` method in-run and what its round hooks see of a run (`RoundContext`),
    without a model: 10 clients, a = 0.1 each, probe_rounds 2, first q = `q0`, k = 8 of
    γ = 8; `spent` (or none): the run's spent-RDP callback. Returns (method, ctx)."""
    from types import SimpleNamespace

    from fedlora.config import load_config
    from fedlora.federation.methods.base import RoundContext
    from fedlora.federation.methods.proposed import Proposed

    cfg = load_config(None, ["method.name=proposed", "data.n_clients=10", "lora.rank=8",
                             "planner.probe_rounds=2", *overrides])  # fmt: skip
    rng = np.random.default_rng(0)
    a = np.full(10, 0.1)
    method = Proposed(a=a, q=np.full(10, q0), k=np.full(10, 8), gamma=8)
    method.in_run = True
    profiles = SimpleNamespace(tau_full_s=rng.uniform(0.5, 3, 10), t_full=rng.uniform(1e6, 1e7, 10),
                               snr_db=np.full(10, np.nan))  # fmt: skip
    return method, RoundContext(cfg, a, profiles, tmp_path, lambda msg: None, spent)


def drive_theorem1(method, ctx, rounds: int, constants_at, before_hooks=None) -> list[dict]:
    """Rounds whose loss follows Theorem 1's model for the q, k in force (no noise): the
    log-loss falls by (1 − C·Σa²/q − D·Σa²/q·γ²/k²)/A a round, (A, C, D) = constants_at(r).
    `before_hooks(q)`: called with the round's q before `after_round` sees the round (as the
    engine accounts a round's privacy before the planner runs)."""
    import math

    level, lines = math.log(2.0), []
    for r in range(rounds):
        method.before_round(ctx, r)
        q, k = method.q, method.k
        if before_hooks is not None:
            before_hooks(q)
        A, C, D = constants_at(r)
        y = float(np.sum(0.01 / q))
        z = float(np.sum(0.01 / q * 64 / k.astype(float) ** 2))
        line = {"round": r + 1, "train_loss": math.exp(level)}
        method.after_round(ctx, r, line)
        lines.append(line)
        level -= (1.0 - C * y - D * z) / A
    return lines
