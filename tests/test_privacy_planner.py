"""planner.max_epsilon: the plan keeps every client's ε(δ) within its budget at the planned
rounds, and on a small instance it is no worse than a brute-force search over a grid of q and
every k (each grid point's ε from dp-accounting itself); `fedlora plan` shows the bounds."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.system.planner import PlanOptions, plan
from fedlora.system.planner.objective import expected_rounds, p2_objective
from planner_cases import TWO_CLIENTS

dpa = pytest.importorskip("dp_accounting")

SIGMA, DELTA = 1.0, 1e-5
PROBLEM = TWO_CLIENTS  # tests/planner_cases.py


def _one_round_rdp(q: float) -> tuple[np.ndarray, np.ndarray]:
    """dp-accounting's RDP of one Poisson-subsampled Gaussian round (T rounds: T times it)."""
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(SIGMA)), 1)
    return acc._orders, acc._rdp.copy()


def _library_epsilon(q: float, rounds: int) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(SIGMA)), rounds)
    return acc.get_epsilon(DELTA)


def _brute_force(budget: float, options: PlanOptions) -> float:
    """min P2 over a log grid of (q_1, q_2) and every (k_1, k_2) whose ε at ⌈R⌉ rounds keeps
    the budget for both clients."""
    grid = np.geomspace(0.02, 1.0, 40)
    rdp = {q: _one_round_rdp(q) for q in grid}
    best = math.inf
    for q1, q2 in itertools.product(grid, grid):
        q = np.array([q1, q2])
        for k in itertools.product((1, 2), repeat=2):
            rounds = expected_rounds(PROBLEM, PROBLEM.constants, q, np.array(k))
            if not math.isfinite(rounds):
                continue
            t = math.ceil(rounds - 1e-9)
            eps = [dpa.rdp.compute_epsilon(rdp[x][0], t * rdp[x][1], DELTA)[0] for x in q]
            if max(eps) <= budget:
                best = min(best, p2_objective(PROBLEM, PROBLEM.constants, q, np.array(k), options))
    return best


def test_the_budgeted_plan_keeps_every_budget_and_beats_a_brute_force_grid():
    free_options = PlanOptions(q_lower_bound="none")
    free = plan(PROBLEM, free_options)
    # the plan without budget spends more than 8 on client 0 over its rounds
    assert _library_epsilon(float(free.q[0]), math.ceil(free.expected_rounds)) > 8.0
    options = PlanOptions(
        q_lower_bound="none", max_epsilon=8.0, noise_multiplier=SIGMA, delta=DELTA
    )
    result = plan(PROBLEM, options)
    rounds = math.ceil(result.expected_rounds - 1e-9)
    eps = [_library_epsilon(float(q), rounds) for q in result.q]
    assert max(eps) <= 8.0
    assert result.privacy["epsilon"] == pytest.approx(eps)
    assert result.privacy["rounds"] == rounds
    assert np.all(result.q <= np.array(result.privacy["q_max"]) * (1 + 1e-12))
    assert free.objective < result.objective <= _brute_force(8.0, free_options) * (1 + 1e-9)


def test_a_budget_no_rate_can_keep_names_planner_max_epsilon():
    options = PlanOptions(max_epsilon=0.05, noise_multiplier=SIGMA, delta=DELTA)
    with pytest.raises(ConfigError, match="max_epsilon"):
        plan(PROBLEM, options)


def test_fedlora_plan_shows_each_clients_bound_and_epsilon(tmp_path, capsys):
    problem = {
        "gamma": 2,
        "f_tot": 1.0,
        "clients": [
            {"a": 0.6, "tau_full_s": 1.0, "t_full": 0.5},
            {"a": 0.4, "tau_full_s": 0.3, "t_full": 1.5},
        ],
        "constants": {"A": 30.0, "B": 1.0, "C": 0.1, "D": 0.02},
        "options": {"q_lower_bound": "none", "max_epsilon": [8.0, 20.0]},
    }
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(problem))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--noise-multiplier", "1.0", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())["privacy"]
    assert saved["max_epsilon"] == [8.0, 20.0] and len(saved["q_max"]) == 2
    assert "client 0: q = " in text and "<= 8" in text and "client 1: q = " in text
    assert max(saved["epsilon"][0], 0) <= 8.0 and saved["epsilon"][1] <= 20.0
