"""The q-step of Algorithm 2: for fixed k, the q that minimises P3 (P2 itself when
`q_lower_bound = "none"`), by a search over M = Σ w_n q_n along the KKT curve (`qcurve`).

`m_search = "exact"` takes the curve's root of ψ, clamped to the searched range of M;
`m_search = "grid"` evaluates the exact fixed-M solution on the paper's grid of step ε.
`solver = "cvxpy"` is the reference: CVX for each fixed M, as in the paper, with the same
outer search over M.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.planner.budget import rounds_mu
from fedlora.system.planner.objective import q_lower_bounds, sketch_penalty, sketched_round_weights
from fedlora.system.planner.problem import Constants, PlanOptions, PlanProblem
from fedlora.system.planner.qcurve import STRICT_MARGIN, QCurve, q_curve, q_upper_bounds


@dataclass(frozen=True)
class QStepResult:
    """The q-step's answer for fixed k (see module doc)."""

    q: np.ndarray
    m: float  # M = Σ w_n q_n
    objective: float  # value of the minimised surrogate (P3, or P2 for q_lower_bound = none)
    multiplier: float  # λ of the fixed-M KKT conditions (nan for cvxpy)
    surrogate: str  # "P3" | "P2"


def _m_range(
    problem: PlanProblem, k: np.ndarray, curve: QCurve, options: PlanOptions
) -> tuple[float, float]:
    """[M_a, M_b] searched: the feasible (Σ w lo, Σ w], or the paper's
    [N·(min k/max k)²·min w, N·max w] (§V-D, with the sketched w: docs/paper.md, row 6) intersected
    with it. The paper's range always meets the feasible one (its M_min <= N·min w <= Σ w)."""
    lo, hi = curve.m_min, curve.m_max
    if options.m_range == "paper":
        w = curve.w
        p_lo = problem.n * (np.min(k) / np.max(k)) ** 2 * float(np.min(w))
        p_hi = problem.n * float(np.max(w))
        lo, hi = max(lo, p_lo), min(hi, p_hi)
    return lo, hi


def _grid(lo: float, hi: float, eps: float, open_low: bool) -> np.ndarray:
    step = eps if eps > 0 else (hi - lo) / 200.0
    if step <= 0:
        return np.array([hi])
    count = int(math.floor((hi - lo) / step + 1e-9))
    if count > 1_000_000:
        raise bad_value("options.grid_eps", eps, f"too fine for the range [{lo:.6g}, {hi:.6g}]")
    pts = lo + step * np.arange(0 if not open_low else 1, count + 1)
    pts = pts[pts <= hi]
    if pts.size == 0 or pts[-1] < hi:
        pts = np.append(pts, hi)
    return pts


def q_step(
    problem: PlanProblem, constants: Constants, k: Sequence[int] | np.ndarray, options: PlanOptions
) -> QStepResult:
    """Minimise P3 over q for fixed k (P2 itself when q_lower_bound = none); exact or cvxpy."""
    k = np.asarray(k, dtype=np.int64)
    curve = q_curve(problem, constants, k, options)
    m_lo, m_hi = _m_range(problem, k, curve, options)
    # the per-client bound (and R > 0 for "none") is never attained: M = Σ w lo is excluded
    open_low = options.q_lower_bound != "paper" and m_lo <= curve.m_min
    if options.solver == "cvxpy":
        return _q_step_cvxpy(curve, m_lo, m_hi, open_low, options)
    if options.m_search == "exact":
        mu = curve.optimum_mu()
        m = float(np.dot(curve.w, curve.q(mu)))
        if m < m_lo or m > m_hi:  # unimodal: the constrained optimum is the nearer end
            mu = float(curve.mu_for_m(min(max(m, m_lo), m_hi))[0])
        mu = max(mu, rounds_mu(problem, constants, k, curve, options.max_rounds))
    else:
        grid = _grid(m_lo, m_hi, options.grid_eps, open_low)
        mus = curve.mu_for_m(grid)
        values = curve.values(mus)
        if not np.isfinite(values).any():
            raise ConfigError(
                "m_search = grid: no grid point of M is feasible; use a finer grid_eps"
            )
        mu = float(mus[int(np.argmin(values))])
    q = curve.q(mu)
    return QStepResult(
        q=q,
        m=float(np.dot(curve.w, q)),
        objective=curve.value(q),
        multiplier=curve.kkt_multiplier(mu),
        surrogate=curve.surrogate,
    )


def _q_step_cvxpy(
    curve: QCurve, m_lo: float, m_hi: float, open_low: bool, options: PlanOptions
) -> QStepResult:
    """Reference q-step: CVX for each fixed M (the paper's approach), outer search over M by
    bounded Brent (m_search = exact; f is unimodal in M) or the grid."""
    try:
        import cvxpy as cp
    except ImportError:  # pragma: no cover - cvxpy is in the test extra
        raise ConfigError(
            "options.solver = 'cvxpy' needs the cvxpy package: pip install 'fedlora[plan]'"
        ) from None
    from scipy.optimize import minimize_scalar

    # Diagonal preconditioning q = p + g·y (g_n = √(κ_n/w_n)): the raw problem spans many orders
    # of magnitude (q_n − p_n from 1e-9 to 1) and Clarabel stops at ~1e-3 relative accuracy on
    # it; in y every coefficient is √(κ_n w_n). cvxpy still solves the generic convex problem.
    scale = float(curve.skw.sum())
    coef = curve.skw / scale
    y = cp.Variable(curve.w.size)
    m_par = cp.Parameter()
    constraints = [coef @ y == m_par, y <= (curve.upper - curve.p) / curve.g]
    if np.any(curve.lower > curve.p):
        constraints.append(y >= (curve.lower - curve.p) / curve.g)
    problem = cp.Problem(cp.Minimize(coef @ cp.inv_pos(y)), constraints)
    base = float(np.dot(curve.w, curve.p))
    solved: dict[float, np.ndarray] = {}

    def solve(m: float) -> float:
        m_par.value = (m - base) / scale
        try:
            with warnings.catch_warnings():  # "may be inaccurate": judged by f(q) below
                warnings.simplefilter("ignore")
                problem.solve(solver=cp.CLARABEL)
        except cp.SolverError:
            return math.inf
        if y.value is None or problem.status not in ("optimal", "optimal_inaccurate"):
            return math.inf
        qv = np.clip(curve.p + curve.g * np.asarray(y.value, dtype=float), curve.lower, curve.upper)
        solved[m] = qv
        return curve.value(qv)

    span = m_hi - m_lo
    if options.m_search == "exact":
        # Brent on t = log(M − M_lo): f is unimodal in M, hence in t; the optimum often sits
        # within 1e-3 of the range above M_lo, where a linear-scale search would crawl.
        t_lo = math.log(span * 1e-12) if open_low else math.log(span * 1e-15)
        with warnings.catch_warnings():  # inf at infeasible M is expected
            warnings.simplefilter("ignore", RuntimeWarning)
            res = minimize_scalar(
                lambda t: solve(m_lo + math.exp(t)),
                bounds=(t_lo, math.log(span)),
                method="bounded",
                options={"xatol": 1e-10},
            )
        candidates = [m_lo + math.exp(float(res.x)), m_hi]
    else:
        candidates = [float(x) for x in _grid(m_lo, m_hi, options.grid_eps, open_low)]
    values = [curve.value(solved[m]) if m in solved else solve(m) for m in candidates]
    if not np.isfinite(values).any():
        raise ConfigError("solver = cvxpy: no value of M gave a solution")
    best = candidates[int(np.argmin(values))]
    qv = solved[best]
    return QStepResult(
        q=qv,
        m=float(np.dot(curve.w, qv)),
        objective=curve.value(qv),
        multiplier=math.nan,
        surrogate=curve.surrogate,
    )


def p2_q_step(
    problem: PlanProblem, constants: Constants, k: Sequence[int] | np.ndarray, options: PlanOptions
) -> QStepResult | None:
    """The exact minimiser of P2 itself over q for fixed k, inside the same bounds as the
    q-step (lo_n of `options.q_lower_bound`, made strict by STRICT_MARGIN, and a_n/w_max of
    `options.max_weight`); None when no q is feasible.

    P2 = A·M/(B − V), V = Σ κ_n/q_n with κ_n = a_n² c_n, M = Σ w_n q_n: the KKT curve of
    `QCurve` with p = 0 (its "P2" surrogate), clipped to the bounds. P3 >= P2 is only an upper
    bound, so the P3 q-step can leave P2 on the table; the alternation (`alternate`) keeps the
    better of the two by P2 (the grid path's worse-on-P3 q once beat the exact one)."""
    k = np.asarray(k, dtype=np.int64)
    a2 = problem.a**2
    kappa = a2 * sketch_penalty(k, problem.gamma, constants)
    lower = q_lower_bounds(problem, constants, k, options.q_lower_bound) * (1.0 + STRICT_MARGIN)
    if options.max_weight > 0:
        lower = np.maximum(lower, problem.a / options.max_weight)
    upper = q_upper_bounds(problem, options)
    if np.any(lower >= upper) or float(np.sum(kappa / upper)) >= constants.B:
        return None
    w = sketched_round_weights(problem, k, options)
    curve = QCurve(w, np.zeros(problem.n), kappa, lower, "P2", constants, upper)
    q = curve.q(
        max(curve.optimum_mu(), rounds_mu(problem, constants, k, curve, options.max_rounds))
    )
    value = curve.value(q)
    if not math.isfinite(value):
        return None
    return QStepResult(
        q=q, m=float(np.dot(w, q)), objective=value, multiplier=math.nan, surrogate="P2"
    )
