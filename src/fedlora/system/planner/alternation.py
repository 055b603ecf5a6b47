"""Algorithm 2's alternation (docs/paper.md, row 11): q-step → k-step until k reaches a fixed point
or a cycle, keeping the best (q, k) seen, from several starting k⁰; and `plan`, the whole
algorithm (estimate A–D from calibration runs if needed, then the alternation, within a
privacy budget if one is given: `budget.plan_within_budget`).

`PlanResult(q, k, objective, expected_round_time_s, expected_rounds, constants, ...)`
    The best (q, k) seen by the alternation, its P2 value = expected_rounds ·
    expected_round_time_s, and how the alternation ended. `to_dict()` gives the `fedlora plan`
    output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.planner.budget import over_rounds, plan_within_budget
from fedlora.system.planner.estimate import estimate_constants
from fedlora.system.planner.fit import constrained_fit
from fedlora.system.planner.kstep import greedy_k, k_floor
from fedlora.system.planner.objective import expected_rounds, p2_objective, sketched_round_weights
from fedlora.system.planner.problem import Constants, PlanOptions, PlanProblem
from fedlora.system.planner.qcurve import q_upper_bounds
from fedlora.system.planner.qstep import QStepResult, p2_q_step, q_step


@dataclass(frozen=True)
class PlanResult:
    """The best iterate of the alternation (see module doc)."""

    q: np.ndarray
    k: np.ndarray
    objective: float  # P2 = expected_rounds · expected_round_time_s
    expected_round_time_s: float  # Σ q_n w_n (Eq. 18)
    expected_rounds: float  # R(q, k) = A / (B − Σ a_n² c_n / q_n)
    constants: Constants
    iterations: int  # q-steps run
    solver: str
    stop_reason: str  # fixed_point | cycle | max_iterations
    history: tuple[float, ...] = field(default=())  # P2 of every iterate, in order
    m: float = math.nan  # M of the chosen q-step
    start: str = "gamma"  # the k⁰ whose alternation gave this plan (`multi_start`)
    starts: dict[str, float] = field(default_factory=dict)  # P2 reached from each start
    constants_fit: str = ""  # how A–D were obtained by `plan` ("" = given)
    floors: dict[str, str] = field(default_factory=dict)  # constants floored by the fit, why
    privacy: dict[str, Any] = field(default_factory=dict)  # planner.max_epsilon (`budget`)

    def to_dict(self) -> dict[str, Any]:
        return {
            "q": [float(x) for x in self.q],
            "k": [int(x) for x in self.k],
            "objective": float(self.objective),
            "expected_round_time_s": float(self.expected_round_time_s),
            "expected_rounds": float(self.expected_rounds),
            "constants": self.constants.to_dict(),
            "iterations": int(self.iterations),
            "solver": self.solver,
            "stop_reason": self.stop_reason,
            "history": [float(x) for x in self.history],
            "start": self.start,
            "starts": {name: float(v) for name, v in self.starts.items()},
            **({"constants_fit": self.constants_fit} if self.constants_fit else {}),
            **({"floors": dict(self.floors)} if self.floors else {}),
            **({"privacy": dict(self.privacy)} if self.privacy else {}),
        }


def alternate(
    problem: PlanProblem,
    constants: Constants,
    options: PlanOptions,
    k0: Sequence[int] | np.ndarray | None = None,
) -> PlanResult:
    """Alternate q-step and greedy k-step from k0 (default k = γ); stop on a fixed point or a
    cycle of k (or max_iterations q-steps) and return the best (q, k) seen by P2, not the last."""
    k = problem.full_rank() if k0 is None else np.asarray(k0, dtype=np.int64)
    seen = {k.tobytes()}
    history: list[float] = []
    best: tuple[float, np.ndarray, np.ndarray, float] | None = None
    stop = "max_iterations"
    iterations = 0
    polish_cache: dict[bytes, QStepResult | None] = {}
    while iterations < options.max_iterations:
        iterations += 1
        step = q_step(problem, constants, k, options)
        k_new = greedy_k(problem, constants, step.q, options)
        for kk in (k, k_new):  # the iterates (q, k) and (q, k_new)
            value, q_it, m_it = (
                p2_objective(problem, constants, step.q, kk, options),
                step.q,
                step.m,
            )
            polished = _polish(problem, constants, kk, options, polish_cache)
            if polished is not None and polished.objective < value:  # a candidate, not the path
                value, q_it, m_it = polished.objective, polished.q, polished.m
            if over_rounds(problem, constants, q_it, kk, options):  # options.max_rounds
                value = math.inf
            history.append(value)
            if best is None or value < best[0]:
                best = (value, q_it, kk, m_it)
        if np.array_equal(k_new, k):
            stop = "fixed_point"
            break
        key = k_new.tobytes()
        if key in seen:
            stop = "cycle"
            break
        seen.add(key)
        k = k_new
    assert best is not None
    value, q, k_best, m = best
    rounds = expected_rounds(problem, constants, q, k_best)
    round_time_s = float(np.dot(q, sketched_round_weights(problem, k_best, options)))
    return PlanResult(
        q=q,
        k=k_best,
        objective=value,
        expected_round_time_s=round_time_s,
        expected_rounds=rounds,
        constants=constants,
        iterations=iterations,
        solver=options.solver,
        stop_reason=stop,
        history=tuple(history),
        m=m,
    )


def _polish(
    problem: PlanProblem,
    constants: Constants,
    k: np.ndarray,
    options: PlanOptions,
    cache: dict[bytes, QStepResult | None],
) -> QStepResult | None:
    """`options.polish`: the exact P2 minimiser over q for k (`p2_q_step`), cached by k."""
    if not options.polish:
        return None
    key = np.asarray(k, dtype=np.int64).tobytes()
    if key not in cache:
        cache[key] = p2_q_step(problem, constants, k, options)
    return cache[key]


UNIFORM_LEVELS = 64  # the uniform start tries every κ up to this γ, then a geometric grid


def uniform_start(problem: PlanProblem, constants: Constants, options: PlanOptions) -> np.ndarray:
    """k⁰ = κ for every client, with κ in 1..γ the level whose exact P2 q-step is lowest
    (γ q-steps). The coordinate descent cannot raise q and lower k together; this start
    lets it begin where both are already traded (from k = γ the exact q is small,
    and small q blocks every k decrement)."""
    best, best_k = math.inf, problem.full_rank()
    levels = range(problem.gamma, 0, -1)
    if problem.gamma > UNIFORM_LEVELS:  # a large γ: UNIFORM_LEVELS levels, geometric
        levels = np.unique(np.geomspace(1, problem.gamma, UNIFORM_LEVELS).round().astype(int))
    for level in levels:
        k = np.full(problem.n, level, dtype=np.int64)
        step = p2_q_step(problem, constants, k, options)
        if step is not None and step.objective < best:
            best, best_k = step.objective, k
    return best_k


def grid_path_start(problem: PlanProblem, constants: Constants, options: PlanOptions) -> np.ndarray:
    """The best k of the paper's own path (Algorithm 2 from k = γ with the grid search over M
    of step range/200, exact fixed-M q): the exact planner starts there too, so with the P2
    polish it is never worse than the grid path (tested on random instances)."""
    grid = dataclasses.replace(options, solver="exact", m_search="grid", polish=False)
    try:
        return alternate(problem, constants, grid).k
    except ConfigError:  # no feasible grid point: the start is simply not offered
        return problem.full_rank()


def check_plan(result: PlanResult) -> None:
    """Refuse a degenerate plan (a q_n of 0 or a non-finite objective): inputs so extreme
    that the bound P2 is not finite in floating point."""
    bad_q = np.flatnonzero(~np.isfinite(result.q) | (result.q <= 0))
    if bad_q.size or not math.isfinite(result.objective):
        what = (
            f"q[{int(bad_q[0])}] = {float(result.q[bad_q[0]]):.6g}"
            if bad_q.size
            else f"the objective P2 = {result.objective}"
        )
        raise ConfigError(
            f"no usable plan: {what} (the inputs span too many orders of magnitude for the "
            "bound P2 to be finite); check the clients' tau_full_s, t_full, a and the "
            "constants or calibration runs"
        )


def capability_start(problem: PlanProblem) -> np.ndarray:
    """k⁰_n = ⌈γ · τ_min / τ_n⌉ in 1..γ: rank proportional to device speed (the baselines'
    `capability` budgets, `fedlora.federation.methods.ranks`); τ_n = 0 gets γ."""
    tau, gamma = problem.tau_full_s, problem.gamma
    k = problem.full_rank()
    pos = tau > 0
    if pos.any():
        k[pos] = np.clip(np.ceil(gamma * tau[pos].min() / tau[pos] - 1e-9), 1, gamma)
    return k


def multi_start(
    problem: PlanProblem,
    constants: Constants,
    options: PlanOptions,
    starts: dict[str, Sequence[int] | np.ndarray] | None = None,
) -> PlanResult:
    """The alternation from several k⁰, keeping the best plan by P2 (docs/paper.md, row 11).

    The alternation is a descent on P2 that ends in a fixed point or a cycle, and different
    k⁰ can end in different ones. Default starts, in order: ``gamma`` (k = γ, Algorithm 2's
    start), ``capability`` (`capability_start`), then ``previous_best``: the alternation again
    from the best k found by those two (skipped when it equals a start already tried). The
    result is the best iterate over all of them (ties: the earliest start), with `start`
    naming the start it came from and `starts` the P2 each start reached. `iterations`
    counts all q-steps.

    Each k⁰ is first lifted to the smallest ranks that leave the q-step feasible
    (`k_floor` at q = 1: lo_n(k) < 1): the capability rank of a slow client that holds much
    of the data (a_n large) can otherwise put its lower bound lo_n = a_n² N c_n / B above 1,
    and the q-step would refuse a plan that k = γ shows exists. A feasible start is unchanged.
    """
    if starts is None:
        starts = {
            "gamma": problem.full_rank(),
            "capability": capability_start(problem),
            "uniform": uniform_start(problem, constants, options),
        }
        if options.solver == "exact" and options.polish:
            starts["grid_path"] = grid_path_start(problem, constants, options)
        restart = True
    else:
        restart = False
    lift = k_floor(problem, constants, q_upper_bounds(problem, options), options.q_lower_bound)
    best: PlanResult | None = None
    reached: dict[str, float] = {}
    iterations = 0
    tried: set[bytes] = set()
    failure: ConfigError | None = None
    queue = list(starts.items())
    while queue:
        name, k0 = queue.pop(0)
        k0 = np.maximum(np.asarray(k0, dtype=np.int64), lift)
        if k0.tobytes() in tried:
            continue
        tried.add(k0.tobytes())
        try:
            res = alternate(problem, constants, options, k0=k0)
        except ConfigError as e:  # upper bounds (q_max) can leave a start with no feasible q
            if not options.q_max:
                raise
            failure, res = e, None
        if res is not None:
            iterations += res.iterations
            reached[name] = res.objective
            if best is None or res.objective < best.objective:
                best = dataclasses.replace(res, start=name)
        if not queue and restart and best is not None:
            restart = False
            queue.append(("previous_best", best.k))
    if best is None:
        if failure is not None:
            raise failure
        raise bad_value("starts", starts, "at least one k⁰")
    return dataclasses.replace(best, iterations=iterations, starts=reached)


def plan(problem: PlanProblem, options: PlanOptions | None = None) -> PlanResult:
    """Algorithm 2: estimate A–D if the problem gives calibration runs (the SVD of Eq. 21; when
    it contradicts the model and `options.calibration_fit = "constrained"`, the constrained
    fit with its floors, `fit.constrained_fit`), then alternate from several starts and keep
    the best plan (`multi_start`)."""
    options = options or PlanOptions()
    constants = problem.constants
    how, floors = "", {}
    if constants is None:
        try:
            constants = estimate_constants(
                problem.calibration, problem.gamma, problem.a, options.estimation_matrix
            )
            how = "svd"
        except ConfigError as e:
            if options.calibration_fit != "constrained":
                raise
            obs = problem.calibration
            a2, g2 = problem.a**2, problem.gamma**2
            y = [float(np.sum(a2 / o.q)) for o in obs]
            z = [float(np.sum(a2 / o.q * g2 / o.k.astype(float) ** 2)) for o in obs]
            fit = constrained_fit(
                [1.0 / o.rounds for o in obs], y, z, floor_share=options.fit_floor_share
            )
            constants, floors = fit.constants, fit.floors
            how = f"constrained (the SVD fit was refused: {e})"
    result = plan_within_budget(problem, options, lambda o: multi_start(problem, constants, o))
    return dataclasses.replace(result, constants_fit=how, floors=floors)
