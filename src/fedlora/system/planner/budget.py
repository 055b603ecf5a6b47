"""A privacy budget in Algorithm 2: every client's ε(δ) after the planned rounds stays within
``max_epsilon`` (docs/privacy.md).

Client n, sampled independently with probability q_n in each of T rounds of a Gaussian
mechanism with noise multiplier σ, has ε_n = ε(q_n, σ, T, δ) (the Poisson-subsampled
Gaussian, `fedlora.system.privacy`), which grows with q_n and with T. For a given T the budget
is therefore an upper bound q_n <= u_n(T) (the largest rate within it), and the planned rounds
R(q, k) grow as the bounds shrink. `plan_within_budget` iterates to a fixed point:

    T_0 = ⌈R⌉ of the plan without budget (kept when its q already keeps every budget at T_0);
    T_{i+1} = ⌈R⌉ of the plan with q_n <= u_n(T_i)

where each bounded plan is also asked to need at most T_i rounds (`PlanOptions.max_rounds`:
the exact q-step raises q along its curve until R <= T_i, `rounds_mu`), until ⌈R⌉ <= T_i: that
plan needs at most the T_i rounds its bounds were set for, so every client's ε after its ⌈R⌉
rounds is within the budget (ε grows with T). A few larger T (×1.05 each) are then tried
while they lower P2 (the bounds tighten but the round cap loosens); the best consistent plan
is kept. T only grows; a ConfigError names planner.max_epsilon when no T gives a plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.planner.budget_spent import spent_rate_bounds
from fedlora.system.planner.objective import expected_rounds
from fedlora.system.planner.problem import PlanOptions, PlanProblem
from fedlora.system.privacy import (
    max_poisson_rate,
    poisson_epsilon,
    poisson_round_rdp,
    rdp_to_epsilon,
)

MAX_FIXED_POINT_STEPS = 40
PATIENCE = 3  # after the first consistent T, stop after this many steps without a lower P2
SCAN_FACTOR = 1.05  # the next T tried after a consistent one


def client_budgets(problem: PlanProblem, options: PlanOptions) -> np.ndarray:
    """(N,) budgets from `options.max_epsilon` (one for all, or one per client)."""
    budgets = options.max_epsilon
    if isinstance(budgets, tuple):
        if len(budgets) != problem.n:
            raise bad_value(
                "planner.max_epsilon", budgets, f"one number, or one per client ({problem.n})"
            )
        return np.asarray(budgets, dtype=float)
    return np.full(problem.n, float(budgets))


def rate_bounds(
    budgets: np.ndarray, options: PlanOptions, rounds: int, spent: np.ndarray | None = None
) -> np.ndarray:
    """u_n(T): the largest q_n whose `rounds` rounds keep ε_n(δ) within budget_n; with
    `spent` (N, orders: the RDP each client has already spent, `columns_rdp`), the rounds
    composed after it (`spent_rate_bounds`)."""
    if spent is not None:
        return spent_rate_bounds(budgets, options.noise_multiplier, rounds, options.delta, spent)
    cache: dict[float, float] = {}
    for b in budgets:
        if b not in cache:
            cache[b] = max_poisson_rate(b, options.noise_multiplier, rounds, options.delta)
    return np.array([cache[b] for b in budgets])


def epsilons(
    q: np.ndarray, options: PlanOptions, rounds: int, spent: np.ndarray | None = None
) -> list[float]:
    """Every client's ε(δ) after `rounds` rounds at its rate q_n (after `spent`, if given)."""
    if spent is None:
        return [
            poisson_epsilon(float(x), options.noise_multiplier, rounds, options.delta) for x in q
        ]
    rdp = np.stack([poisson_round_rdp(float(x), options.noise_multiplier) for x in q])
    return rdp_to_epsilon(spent + rounds * rdp, options.delta).tolist()


def rounds_mu(
    problem: PlanProblem, constants: Any, k: np.ndarray, curve: Any, max_rounds: float
) -> float:
    """The smallest μ of the q-step's curve whose q(μ) needs R(q, k) <= `max_rounds` (R falls
    as μ, hence every q_n, grows); 0 without a bound, the curve's last breakpoint when even
    every q_n at its upper bound needs more rounds."""
    if not max_rounds:
        return 0.0
    top = float(np.max(curve.mu_hi))
    if expected_rounds(problem, constants, curve.q(top), k) > max_rounds:
        return top
    lo, hi = 0.0, top
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_rounds(problem, constants, curve.q(mid), k) <= max_rounds:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * top:
            break
    return hi


def over_rounds(
    problem: PlanProblem, constants: Any, q: np.ndarray, k: np.ndarray, options: PlanOptions
) -> bool:
    """True when `options.max_rounds` is set and (q, k) needs more rounds than it allows."""
    if not options.max_rounds:
        return False
    return expected_rounds(problem, constants, q, k) > options.max_rounds * (1 + 1e-9)


def _rounds(result: Any) -> int:
    r = float(result.expected_rounds)
    if not math.isfinite(r):
        raise ConfigError("planner.max_epsilon: the bounded plan needs infinitely many rounds")
    return max(1, math.ceil(r - 1e-9))


def _check_budget_noise(problem: PlanProblem, options: PlanOptions) -> None:
    """A budget needs noise (σ > 0) and δ < 1/N."""
    if options.noise_multiplier <= 0:
        raise bad_value(
            "privacy.noise_multiplier", options.noise_multiplier, "> 0 with planner.max_epsilon"
        )
    if options.delta * problem.n >= 1:
        raise bad_value(
            "options.delta",
            options.delta,
            f"must be < 1/N = {1 / problem.n:.3g} with a budget: a δ of 1/N or more allows "
            "publishing one client's whole data (and makes every ε about 0)",
        )


def plan_within_budget(
    problem: PlanProblem,
    options: PlanOptions,
    solve: Callable[[PlanOptions], Any],
    spent_rdp: np.ndarray | None = None,
) -> Any:
    """The plan of `solve(options)` (a `PlanResult`) with every client's ε within
    `options.max_epsilon` at its planned rounds (the module docstring); `options.max_epsilon
    = 0`: `solve(options)` itself. `spent_rdp` (N, orders): the RDP each client has already
    spent in the run (`fedlora.system.privacy.columns_rdp`): the planned rounds are composed
    after it, so the plan keeps what is left of the budget (`budget_spent`). The result's
    `privacy` holds each client's bound, ε (the spent part included) and budget, the rounds T
    and the steps taken (and ``spent_epsilon``, each client's ε before the plan)."""
    if not options.max_epsilon:
        return solve(options)
    _check_budget_noise(problem, options)
    budgets = client_budgets(problem, options)
    free = dataclasses.replace(options, max_epsilon=0.0, q_max=(), max_rounds=0.0)
    result = solve(free)
    rounds = _rounds(result)
    bounds = rate_bounds(budgets, options, rounds, spent_rdp)
    best: tuple[Any, int, np.ndarray] | None = None
    if np.all(result.q <= bounds * (1 + 1e-12)):  # the plan without budget keeps it
        best = (result, rounds, bounds)
    steps = misses = 0
    while best is None or misses < PATIENCE:
        if steps == MAX_FIXED_POINT_STEPS:
            if best is not None:
                break
            raise ConfigError(
                f"planner.max_epsilon = {options.max_epsilon}: no plan keeps every budget "
                f"within {steps} steps (the rounds grew to {rounds})"
            )
        steps += 1
        if np.any(bounds <= 0):
            if best is not None:
                break
            i = int(np.argmin(bounds))
            raise ConfigError(
                f"planner.max_epsilon = {options.max_epsilon}: client {i} cannot keep ε <= "
                f"{budgets[i]:g} over {rounds} rounds at any rate"
                + (" after the ε it has already spent" if spent_rdp is not None else "")
                + f" (privacy.noise_multiplier = {options.noise_multiplier:g}); raise the "
                "budget or the noise"
            )
        bounded = dataclasses.replace(
            free, q_max=tuple(float(u) for u in bounds), max_rounds=float(rounds)
        )
        try:
            res = solve(bounded)
        except ConfigError:  # the bounds leave no feasible q at these rounds
            res = None
        needed = _rounds(res) if res is not None else math.ceil(rounds * 1.1)
        if res is not None and needed <= rounds:  # consistent: a candidate
            improved = best is None or res.objective < best[0].objective
            best = (res, rounds, bounds) if improved else best
            misses = 0 if improved else misses + 1
            rounds = max(rounds + 1, math.ceil(rounds * SCAN_FACTOR))  # a few more rounds
        else:
            misses += best is not None
            rounds = max(rounds + 1, needed)
        bounds = rate_bounds(budgets, options, rounds, spent_rdp)
    result, rounds, bounds = best
    final = _rounds(result)
    return dataclasses.replace(
        result,
        privacy={
            "max_epsilon": budgets.tolist(),
            "noise_multiplier": options.noise_multiplier,
            "delta": options.delta,
            "rounds": final,
            "bound_rounds": rounds,
            "q_max": bounds.tolist(),
            "epsilon": epsilons(result.q, options, final, spent_rdp),
            "fixed_point_steps": steps,
            **_spent_field(spent_rdp, options),
        },
    )


def _spent_field(spent_rdp: np.ndarray | None, options: PlanOptions) -> dict[str, Any]:
    """``spent_epsilon``: each client's ε(δ) before the plan (none without `spent_rdp`)."""
    if spent_rdp is None:
        return {}
    eps = rdp_to_epsilon(spent_rdp, options.delta)
    return {"spent_epsilon": [float(x) if math.isfinite(x) else None for x in eps]}
