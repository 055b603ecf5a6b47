"""The objective P2 of Algorithm 2 and its pieces (docs/paper.md, rows 4–6, 9 and 12).

Sketched times are the cost model applied once: t_n = t_full·comm_factor(k_n),
τ_n = τ_full·comp_factor(k_n), and w_n = t_n/f_tot + τ_n is client n's share of the round-time
bound E[T] <= Σ q_n w_n (Eq. 18). P2 = R(q, k) · Σ q_n w_n with k_n ∈ {1..γ} and
R(q, k) = A / (B − Σ a_n²/q_n · c_n), c_n = C + D·γ²/k_n² (Theorem 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedlora.errors import bad_value
from fedlora.system.network import comm_factor, comp_factor
from fedlora.system.planner.problem import Q_LOWER_BOUNDS, Constants, PlanOptions, PlanProblem


def sketched_round_weights(problem: PlanProblem, k: np.ndarray, options: PlanOptions) -> np.ndarray:
    """w_n = t_n/f_tot + τ_n with the cost model applied once (docs/paper.md, rows 4–6)."""
    t = problem.t_full * comm_factor(k, problem.gamma, options.comm_cost)
    tau = problem.tau_full_s * comp_factor(k, problem.gamma, options.comp_cost, options.rho)
    return t / problem.f_tot + tau


def sketch_penalty(k: np.ndarray, gamma: int, constants: Constants) -> np.ndarray:
    """c_n = C + D γ²/k_n² (Theorem 1)."""
    return constants.C + constants.D * (gamma / np.asarray(k, dtype=float)) ** 2


def q_lower_bounds(
    problem: PlanProblem, constants: Constants, k: np.ndarray, mode: str
) -> np.ndarray:
    """lo_n of P2 (docs/paper.md, row 9): per_client a_n²N c_n/B, paper a_n²N(C+DK²)/B, none 0."""
    a2n = problem.a**2 * problem.n / constants.B
    if mode == "per_client":
        return a2n * sketch_penalty(k, problem.gamma, constants)
    if mode == "paper":
        k_min = np.full(1, np.min(k))
        return a2n * sketch_penalty(k_min, problem.gamma, constants)[0]
    if mode == "none":
        return np.zeros(problem.n)
    raise bad_value("options.q_lower_bound", mode, f"allowed: {', '.join(Q_LOWER_BOUNDS)}")


def expected_rounds(
    problem: PlanProblem, constants: Constants, q: np.ndarray, k: np.ndarray
) -> float:
    """R(q, k) = A / (B − Σ a_n²/q_n · c_n) (Theorem 1); inf when the denominator is <= 0."""
    v = float(np.sum(problem.a**2 / q * sketch_penalty(k, problem.gamma, constants)))
    den = constants.B - v
    return constants.A / den if den > 0 else math.inf


def p2_objective(
    problem: PlanProblem,
    constants: Constants,
    q: np.ndarray,
    k: np.ndarray,
    options: PlanOptions,
) -> float:
    """P2 = R(q, k) · Σ q_n w_n(k); inf if R <= 0 (the target is not reachable)."""
    q = np.asarray(q, dtype=float)
    w = sketched_round_weights(problem, k, options)
    return expected_rounds(problem, constants, q, k) * float(np.dot(q, w))


def plan_degeneracy(
    problem: PlanProblem,
    constants: Constants,
    q: Sequence[float] | np.ndarray,
    k: Sequence[int] | np.ndarray,
    options: PlanOptions,
    rtol: float = 1e-6,
) -> dict[str, Any]:
    """Whether a plan is degenerate: every k_n = 1, or every q_n at one of its bounds
    (the lower bound lo_n of `options.q_lower_bound`, or 1). Such a plan is the optimiser
    pressed against its box rather than a trade-off, and says more about the constants
    than about the clients. Also counts k_n = γ and each bound."""
    q = np.asarray(q, dtype=float)
    k = np.asarray(k, dtype=np.int64)
    lo = q_lower_bounds(problem, constants, k, options.q_lower_bound)
    at_lower = (lo > 0) & (q <= lo * (1 + rtol) + 1e-12)
    at_one = q >= 1 - rtol
    reasons = []
    if np.all(k == 1):
        reasons.append("every k_n = 1")
    if np.all(at_lower | at_one):
        reasons.append("every q_n at a bound (lower bound or 1)")
    return {
        "degenerate": bool(reasons),
        "reasons": reasons,
        "k_at_1": int(np.sum(k == 1)),
        "k_at_gamma": int(np.sum(k == problem.gamma)),
        "q_at_lower_bound": int(np.sum(at_lower)),
        "q_at_1": int(np.sum(at_one)),
        "n": int(q.size),
    }
