"""Algorithm 2 of the paper (§V): estimate A–D from calibration runs, then choose each
client's sampling probability q_n and sketch size k_n to minimise the wall-clock bound P2.

Pure numpy/scipy (cvxpy only for the reference q-step solver); no torch, no I/O except
`load_problem`.

Data types
----------
`Constants(A, B, C, D)`
    The constants of Theorem 1 as used in P2: R(q, k) = A / (B − Σ a_n²/q_n · c_n) with
    c_n = C + D·γ²/k_n². All four are > 0; an estimate is normalised to B = 1 (P2 and P3
    are unchanged by a common scale, PAPER_NOTES #3).
`Observation(q, k, rounds)`
    One calibration run: per-client q and k vectors and the rounds R it needed to reach the
    calibration loss F_s.
`PlanProblem(gamma, f_tot, a, tau_full_s, t_full, constants=None, calibration=())`
    γ, the total band f_tot, and per client: the aggregation weight a_n (Σ a_n = 1), the local
    computation time per round at k = γ (`tau_full_s`, seconds) and the upload time of the full
    adapter with one unit of band (`t_full`, so t_full/f_tot is seconds). Exactly one of
    `constants` or `calibration` (>= 4 observations).
`PlanOptions(...)`
    The variants of PAPER_NOTES #1–#11 (see the field comments); `PlanOptions.from_config`
    builds them from `PlannerConfig` and `NetworkConfig`.
`QStepResult(q, m, objective, multiplier, surrogate)`
    One q-step for fixed k: the argmin q, M = Σ w_n q_n, the value of the surrogate that was
    minimised ("P3", or "P2" when `q_lower_bound = "none"`) and its KKT multiplier λ.
`PlanResult(q, k, objective, expected_round_time_s, expected_rounds, constants, ...)`
    The best (q, k) seen by the alternation, its P2 value = expected_rounds ·
    expected_round_time_s, and how the alternation ended. `to_dict()` gives the `fedlora plan`
    output.

Model (PAPER_NOTES #4–#6, #9, #12)
------------------------------------
Sketched times are the cost model applied once: t_n = t_full·comm_factor(k_n),
τ_n = τ_full·comp_factor(k_n), and w_n = t_n/f_tot + τ_n is client n's share of the round-time
bound E[T] <= Σ q_n w_n (Eq. 18). P2 = R(q, k) · Σ q_n w_n with k_n ∈ {1..γ}.

q-step (P3, PAPER_NOTES #8, #10)
------------------------------------
For fixed k, P3 minimises f(q) = M · Σ_n A q_n / (N B q_n − e_n), M = Σ w_n q_n,
e_n = a_n² N² c_n, over lo_n < q_n <= 1. Writing A q/(NBq − e) = A/(NB) + κ_n/(q − p_n) with
p_n = e_n/(NB) and κ_n = A e_n/(NB)², the fixed-M problem min Σ κ_n/(q_n − p_n) s.t.
Σ w_n q_n = M has the KKT solution q_n(λ) = clip(p_n + √(κ_n/(λ w_n)), lo_n, 1) (PAPER_NOTES #10).
Along this curve df/dλ has the sign of ψ(λ) = λ·M(λ) − H(λ) (H = the sum of the terms), and ψ
is continuous, piecewise linear and strictly increasing in λ (each free client contributes
λ e_n w_n/(NB) − A/(NB), each clipped one λ w_n q_n − const). So f is unimodal in λ, hence in M,
and its minimiser is the unique root of ψ, found exactly by a sweep over the 2N breakpoints and
a closed form in the bracketing segment (no grid, no tolerance). `m_search = "grid"` instead
evaluates the exact fixed-M solution on the paper's grid of step ε.

`q_lower_bound`: "per_client" (default) lo_n = a_n² N c_n / B = p_n, the bound the surrogate's
own denominators need; "paper" lo_n = a_n² N (C + D K²)/B with K² = max_n γ²/k_n² (Remark 2);
"none": no per-client bound — P3 is then not an upper bound of P2, so the q-step minimises P2
itself for fixed k (same KKT form with p_n = 0, κ_n = a_n² c_n; ψ = λM + V − B is increasing in
λ too), subject only to R > 0. Strict bounds: the per-client bound is never attained (the
objective diverges there); the paper bound is enforced as q_n >= lo_n·(1 + 1e-9).

k-step and alternation (Algorithm 2 lines 12–21, PAPER_NOTES #11)
------------------------------------------------------------------
Greedy on the true P2 with q fixed: start from k_n = γ, pass over the clients in order and
decrement k_n when that strictly lowers P2 and keeps q feasible; repeat until a pass changes
nothing. A pass is computed exactly without a Python loop over clients (see `greedy_k`).
The alternation q-step → k-step stops on a fixed point or a cycle of k and returns the best
(q, k) it has seen.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.network import comm_factor, comp_factor

STRICT_MARGIN = 1e-9  # relative margin that turns the paper's strict q_n > lo_n into q_n >= ...
A_SUM_TOLERANCE = 1e-6  # |Σ a_n − 1| allowed without normalisation
GAMMA_MAX = 4096  # the largest global rank γ a problem may name (LoRA ranks are far below)

SOLVERS = ("exact", "cvxpy")
ESTIMATION_MATRICES = ("fixed", "paper")
Q_LOWER_BOUNDS = ("per_client", "paper", "none")
M_SEARCHES = ("exact", "grid")
M_RANGES = ("feasible", "paper")
COMM_COSTS = ("quadratic", "linear", "exact")
COMP_COSTS = ("quadratic", "linear", "affine")


# ----------------------------------------------------------------------------- data types


def _positive(name: str, value: Any, what: str = "must be a finite number > 0") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise bad_value(name, value, what)
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise bad_value(name, value, what)
    return v


@dataclass(frozen=True)
class Constants:
    """A, B, C, D of Theorem 1 / P2; all > 0."""

    A: float
    B: float
    C: float
    D: float

    def __post_init__(self) -> None:
        for name in ("A", "B", "C", "D"):
            object.__setattr__(
                self, name, _positive(f"constants.{name}", getattr(self, name), "must be > 0")
            )

    def to_dict(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C": self.C, "D": self.D}


@dataclass(frozen=True)
class Observation:
    """One calibration run: q and k per client and the rounds it took to reach F_s."""

    q: np.ndarray
    k: np.ndarray
    rounds: float


@dataclass(frozen=True)
class PlanProblem:
    """Clients, band and either known constants or calibration observations (see module doc)."""

    gamma: int
    f_tot: float
    a: np.ndarray
    tau_full_s: np.ndarray
    t_full: np.ndarray
    constants: Constants | None = None
    calibration: tuple[Observation, ...] = ()

    def __post_init__(self) -> None:
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
            raise bad_value("gamma", g, "an integer >= 1 (the global LoRA rank γ)")
        if g > GAMMA_MAX:  # the k-step is O(N·γ): an absurd γ would run for ever
            raise bad_value("gamma", g, f"at most {GAMMA_MAX} (the global LoRA rank γ)")
        object.__setattr__(self, "gamma", int(g))
        object.__setattr__(self, "f_tot", _positive("f_tot", self.f_tot))
        arrays = {}
        for name in ("a", "tau_full_s", "t_full"):
            x = np.asarray(getattr(self, name), dtype=float).ravel()
            arrays[name] = x
        n = arrays["a"].size
        if n == 0:
            raise bad_value("clients", [], "at least one client")
        for name, x in arrays.items():
            if x.size != n:
                raise ConfigError(f"{name} has {x.size} entries, expected one per client ({n})")
            bad = np.flatnonzero(~np.isfinite(x) | (x <= 0))
            if bad.size:
                i = int(bad[0])
                raise bad_value(f"clients[{i}].{name}", float(x[i]), "must be finite and > 0")
            object.__setattr__(self, name, x)
        total = float(arrays["a"].sum())
        if abs(total - 1.0) > A_SUM_TOLERANCE:
            raise ConfigError(
                f"clients[*].a sum to {total:.9g}, not 1 (tolerance {A_SUM_TOLERANCE:g}): "
                "fix the weights, or ask for normalisation with options.normalize_a = true "
                "(fedlora plan --normalize-a)"
            )
        if (self.constants is None) == (not self.calibration):
            raise ConfigError(
                "a problem needs exactly one of constants (A, B, C, D) or calibration "
                f"(>= 4 observations); got constants={'yes' if self.constants else 'no'}, "
                f"calibration={len(self.calibration)} observations"
            )
        obs = tuple(self.calibration)
        for i, o in enumerate(obs):
            q = np.asarray(o.q, dtype=float).ravel()
            k = np.asarray(o.k).ravel()
            where = f"calibration[{i}]"
            if q.size != n or k.size != n:
                raise ConfigError(
                    f"{where}: q has {q.size} and k has {k.size} entries, expected {n} (one per "
                    "client)"
                )
            bad = np.flatnonzero(~np.isfinite(q) | (q <= 0) | (q > 1))
            if bad.size:
                j = int(bad[0])
                raise bad_value(f"{where}.q[{j}]", float(q[j]), "must be in (0, 1]")
            kf = np.asarray(k, dtype=float)
            bad = np.flatnonzero(~np.isfinite(kf) | (kf != np.round(kf)) | (kf < 1) | (kf > g))
            if bad.size:
                j = int(bad[0])
                raise bad_value(f"{where}.k[{j}]", k[j].item(), f"an integer in 1..gamma = {g}")
            rounds = _positive(f"{where}.rounds", o.rounds)
            obs = obs[:i] + (Observation(q, kf.astype(np.int64), rounds),) + obs[i + 1 :]
        object.__setattr__(self, "calibration", obs)

    @property
    def n(self) -> int:
        return int(self.a.size)

    @staticmethod
    def normalized_weights(a: Sequence[float] | np.ndarray) -> np.ndarray:
        """a / Σ a (for `normalize_a`); rejects non-positive weights first."""
        x = np.asarray(a, dtype=float).ravel()
        bad = np.flatnonzero(~np.isfinite(x) | (x <= 0))
        if bad.size:
            i = int(bad[0])
            raise bad_value(f"clients[{i}].a", float(x[i]), "must be finite and > 0")
        return x / x.sum()


@dataclass(frozen=True)
class PlanOptions:
    """Variants of Algorithm 2 (PAPER_NOTES #1–#11). Defaults match `PlannerConfig` and
    `NetworkConfig`."""

    solver: str = "exact"  # exact | cvxpy (reference q-step)
    estimation_matrix: str = "fixed"  # fixed | paper (row 2 uses 1/R1)
    q_lower_bound: str = "per_client"  # per_client | paper (worst-case K²) | none
    m_search: str = "exact"  # exact (root of ψ) | grid (step grid_eps)
    m_range: str = "feasible"  # feasible (Σ w lo, Σ w] | paper [M_min, M_max]
    grid_eps: float = 0.0  # grid step for m_search = grid; 0 = range/200
    max_iterations: int = 50  # q-steps of the alternation
    comm_cost: str = "exact"  # quadratic (paper) | linear | exact (= linear here)
    comp_cost: str = "affine"  # quadratic (paper) | linear | affine
    rho: float = 0.9  # affine compute: share of a step that does not shrink with k
    normalize_a: bool = False  # rescale a to sum to 1 instead of refusing

    def __post_init__(self) -> None:
        for name, choices in (
            ("solver", SOLVERS),
            ("estimation_matrix", ESTIMATION_MATRICES),
            ("q_lower_bound", Q_LOWER_BOUNDS),
            ("m_search", M_SEARCHES),
            ("m_range", M_RANGES),
            ("comm_cost", COMM_COSTS),
            ("comp_cost", COMP_COSTS),
        ):
            if getattr(self, name) not in choices:
                raise bad_value(
                    f"options.{name}", getattr(self, name), f"allowed: {', '.join(choices)}"
                )
        eps = self.grid_eps
        if (
            isinstance(eps, bool)
            or not isinstance(eps, (int, float))
            or not (math.isfinite(eps) and eps >= 0)
        ):
            raise bad_value("options.grid_eps", eps, "a finite number >= 0 (0 = range/200)")
        it = self.max_iterations
        if isinstance(it, bool) or not isinstance(it, int) or it < 1:
            raise bad_value("options.max_iterations", it, "an integer >= 1")
        r = self.rho
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 <= r <= 1.0):
            raise bad_value("options.rho", r, "a number in [0, 1]")
        if not isinstance(self.normalize_a, bool):
            raise bad_value("options.normalize_a", self.normalize_a, "true or false")

    @classmethod
    def from_config(cls, planner: Any, network: Any) -> PlanOptions:
        """From a `PlannerConfig` and a `NetworkConfig` (the engine's `proposed` method)."""
        return cls(
            solver=planner.solver,
            estimation_matrix=planner.estimation_matrix,
            q_lower_bound=planner.q_lower_bound,
            m_search=planner.m_search,
            m_range=planner.m_range,
            grid_eps=planner.grid_eps,
            max_iterations=planner.max_iterations,
            comm_cost=network.comm_cost,
            comp_cost=network.comp_cost,
            rho=network.rho,
        )


@dataclass(frozen=True)
class QStepResult:
    """The q-step's answer for fixed k (see module doc)."""

    q: np.ndarray
    m: float  # M = Σ w_n q_n
    objective: float  # value of the minimised surrogate (P3, or P2 for q_lower_bound = none)
    multiplier: float  # λ of the fixed-M KKT conditions (nan for cvxpy)
    surrogate: str  # "P3" | "P2"


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
        }


# ----------------------------------------------------------------------------- model pieces


def sketched_round_weights(problem: PlanProblem, k: np.ndarray, options: PlanOptions) -> np.ndarray:
    """w_n = t_n/f_tot + τ_n with the cost model applied once (PAPER_NOTES #4–#6)."""
    t = problem.t_full * comm_factor(k, problem.gamma, options.comm_cost)
    tau = problem.tau_full_s * comp_factor(k, problem.gamma, options.comp_cost, options.rho)
    return t / problem.f_tot + tau


def sketch_penalty(k: np.ndarray, gamma: int, constants: Constants) -> np.ndarray:
    """c_n = C + D γ²/k_n² (Theorem 1)."""
    return constants.C + constants.D * (gamma / np.asarray(k, dtype=float)) ** 2


def q_lower_bounds(
    problem: PlanProblem, constants: Constants, k: np.ndarray, mode: str
) -> np.ndarray:
    """lo_n of P2 (PAPER_NOTES #9): per_client a_n²N c_n/B, paper a_n²N(C+DK²)/B, none 0."""
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


# ----------------------------------------------------------------------------- constants


def _observation_matrix(
    observations: Sequence[Observation], gamma: int, a: np.ndarray, estimation_matrix: str
) -> np.ndarray:
    rows = []
    a2 = np.asarray(a, dtype=float) ** 2
    for i, o in enumerate(observations):
        q = np.asarray(o.q, dtype=float)
        k = np.asarray(o.k, dtype=float)
        y = float(np.sum(a2 / q))
        z = float(np.sum(a2 / q * gamma**2 / k**2))  # γ²/k², PAPER_NOTES #2
        r = observations[0].rounds if (estimation_matrix == "paper" and i == 1) else o.rounds
        rows.append([1.0 / r, -1.0, y, z])
    return np.asarray(rows)


def _null_vector(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, s, vt = np.linalg.svd(m)
    if s.size < 4:
        s = np.concatenate([s, np.zeros(4 - s.size)])
    return vt[-1], s


def estimate_constants(
    observations: Sequence[Observation],
    gamma: int,
    a: Sequence[float] | np.ndarray,
    estimation_matrix: str = "fixed",
) -> Constants:
    """A–D from >= 4 calibration runs (Eq. 21, PAPER_NOTES #1–#3).

    Row i is [1/R_i, −1, Y_i, Z_i] with Y = Σ a²/q, Z = Σ a²/q·γ²/k²; x = [A, B, C, D] is the
    right singular vector of the smallest singular value (least squares in ‖Mx‖ with ‖x‖ = 1
    when there are more than four runs), rescaled to B = 1. Refuses sets that cannot identify D
    and estimates with a non-positive constant, naming the suspect run.
    """
    if estimation_matrix not in ESTIMATION_MATRICES:
        raise bad_value(
            "options.estimation_matrix",
            estimation_matrix,
            f"allowed: {', '.join(ESTIMATION_MATRICES)}",
        )
    obs = list(observations)
    if len(obs) < 4:
        raise bad_value(
            "calibration", f"{len(obs)} observations", "at least 4 runs (4 unknowns A, B, C, D)"
        )
    a = np.asarray(a, dtype=float)
    ks = np.concatenate([np.asarray(o.k, dtype=float).ravel() for o in obs])
    if np.all(ks == ks[0]):
        raise ConfigError(
            f"calibration: every run uses k = {int(ks[0])} for every client, so Z = Y·γ²/k² in "
            "every run and D cannot be told apart from C; use runs with at least two different "
            "sketch sizes k"
        )
    m = _observation_matrix(obs, gamma, a, estimation_matrix)
    ratio = m[:, 3] / m[:, 2]
    if np.ptp(ratio) <= 1e-12 * np.max(np.abs(ratio)):
        raise ConfigError(
            f"calibration: Z/Y = {ratio[0]:.6g} in every run (the same mix of sketch sizes), so D "
            "cannot be told apart from C; vary k between runs"
        )
    x, s = _null_vector(m)
    if s[-2] <= 1e-10 * s[0]:
        raise ConfigError(
            "calibration: the runs do not identify A, B, C, D (the observation matrix "
            f"[1/R, -1, Y, Z] has rank < 3, singular values {np.array2string(s, precision=3)}); "
            "vary q and k between runs"
        )
    if abs(x[1]) <= 1e-12 * np.max(np.abs(x)):
        raise ConfigError(
            f"calibration: the fit gives B = 0 (x = {np.array2string(x, precision=4)}); the rounds "
            "do not follow R = A/(B − C·Y − D·Z); check the runs"
        )
    x = x / x[1]
    names = ("A", "B", "C", "D")
    bad = [f"{names[j]} = {x[j]:.4g}" for j in (0, 2, 3) if not x[j] > 0]
    if not bad:
        return Constants(*(float(v) for v in x))
    # which run is suspect: leave each out and see whether the rest give positive constants
    suspects = []
    for i in range(len(obs)):
        rest = np.delete(m, i, axis=0)
        xi, si = _null_vector(rest)
        if abs(xi[1]) <= 1e-12 * np.max(np.abs(xi)):
            continue
        xi = xi / xi[1]
        if np.all(xi[[0, 2, 3]] > 0):
            suspects.append(i)
    if suspects:
        described = "; ".join(
            f"observation {i} (rounds = {obs[i].rounds:g}, mean q = {np.mean(obs[i].q):.3g}, "
            f"mean k = {np.mean(obs[i].k):.3g})"
            for i in suspects
        )
        hint = f"suspect: {described} — without it the fit has A, C, D > 0"
    else:
        hint = "no single observation explains it: check the rounds of every run"
    raise ConfigError(
        f"calibration: the estimate contradicts the model (A, B, C, D must be > 0): "
        f"{', '.join(bad)} with B = 1; {hint}"
    )


def calibration_fit(
    observations: Sequence[Observation],
    gamma: int,
    a: Sequence[float] | np.ndarray,
    constants: Constants,
) -> list[dict[str, float]]:
    """How well A–D explain each calibration run (Eq. 21 and Theorem 1).

    Per observation: Y = Σ a²/q, Z = Σ a²/q·γ²/k², the observed R, the predicted
    R̂ = A/(B − C·Y − D·Z) (inf when the denominator is <= 0), R̂/R − 1, and the residual of
    its row of the linear system, (A/R − B + C·Y + D·Z)/B (0 for an exact fit; what the SVD or
    non-negative fit minimises).
    """
    a2 = np.asarray(a, dtype=float) ** 2
    out = []
    for o in observations:
        q = np.asarray(o.q, dtype=float)
        k = np.asarray(o.k, dtype=float)
        y = float(np.sum(a2 / q))
        z = float(np.sum(a2 / q * gamma**2 / k**2))
        den = constants.B - constants.C * y - constants.D * z
        predicted = constants.A / den if den > 0 else math.inf
        observed = float(o.rounds)
        out.append(
            {
                "Y": y,
                "Z": z,
                "observed_rounds": observed,
                "predicted_rounds": predicted,
                "relative_error": predicted / observed - 1.0,
                "row_residual": (constants.A / observed - den) / constants.B,
            }
        )
    return out


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
    than about the clients (issue 14). Also counts k_n = γ and each bound."""
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


# ----------------------------------------------------------------------------- q-step


class _QCurve:
    """The KKT curve q(μ) = clip(p + g μ, L, 1), μ = 1/√λ, of the fixed-M problem
    min Σ κ_n/(q_n − p_n) s.t. Σ w_n q_n = M, and the objective along it."""

    def __init__(
        self,
        w: np.ndarray,
        p: np.ndarray,
        kappa: np.ndarray,
        lower: np.ndarray,
        surrogate: str,
        constants: Constants,
    ) -> None:
        self.w, self.p, self.kappa, self.lower = w, p, kappa, lower
        self.surrogate = surrogate
        self.A, self.B = constants.A, constants.B
        self.h0 = constants.A / constants.B  # Σ_n A/(NB): the constant part of P3's sum
        self.g = np.sqrt(kappa / w)
        self.skw = np.sqrt(kappa * w)
        self.mu_lo = np.maximum((lower - p) / self.g, 0.0)
        self.mu_hi = (1.0 - p) / self.g
        self.m_min = float(np.dot(w, lower))
        self.m_max = float(w.sum())
        self._sweep()

    # --- pieces of the objective
    def q(self, mu: float) -> np.ndarray:
        return np.clip(self.p + self.g * mu, self.lower, 1.0)

    def value(self, q: np.ndarray) -> float:
        """f(q): P3 = M·(Σ A/(NB) + V), or P2 = A·M/(B − V); V = Σ κ/(q − p)."""
        d = q - self.p
        if np.any(d <= 0):
            return math.inf
        m = float(np.dot(self.w, q))
        v = float(np.sum(self.kappa / d))
        if self.surrogate == "P3":
            return m * (self.h0 + v)
        return self.A * m / (self.B - v) if v < self.B else math.inf

    def _psi(self, wc: Any, vc: Any, gs: Any, mu: Any) -> Any:
        """ψ with a segment's state (Wc, Vc, G): W = Wc + Gμ, V = Vc + G/μ, λ = 1/μ²."""
        if self.surrogate == "P3":
            return wc / mu**2 - self.h0 - vc
        return wc / mu**2 + 2.0 * gs / mu + vc - self.B

    def _sweep(self) -> None:
        """State (Wc, Vc, G) after each breakpoint, in increasing μ."""
        w, p, lo, kap = self.w, self.p, self.lower, self.kappa
        at_lo = self.mu_lo > 0
        free = ~at_lo
        wc0 = float(np.dot(w[at_lo], lo[at_lo]) + np.dot(w[free], p[free]))
        vc0 = float(np.sum(kap[at_lo] / (lo[at_lo] - p[at_lo])))
        g0 = float(np.sum(self.skw[free]))
        idx_lo = np.flatnonzero(at_lo)
        mus = np.concatenate([self.mu_lo[idx_lo], self.mu_hi])
        d_wc = np.concatenate([w[idx_lo] * (p[idx_lo] - lo[idx_lo]), w * (1.0 - p)])
        d_vc = np.concatenate([-kap[idx_lo] / (lo[idx_lo] - p[idx_lo]), kap / (1.0 - p)])
        d_g = np.concatenate([self.skw[idx_lo], -self.skw])
        order = np.argsort(mus, kind="stable")
        self.ev_mu = mus[order]
        # state of segment i (i = 0..E): before event i; segment E is after the last event
        self.seg_wc = wc0 + np.concatenate([[0.0], np.cumsum(d_wc[order])])
        self.seg_vc = vc0 + np.concatenate([[0.0], np.cumsum(d_vc[order])])
        self.seg_g = g0 + np.concatenate([[0.0], np.cumsum(d_g[order])])

    def _segment_bounds(self, i: int) -> tuple[float, float]:
        lo = self.ev_mu[i - 1] if i > 0 else 0.0
        hi = self.ev_mu[i] if i < self.ev_mu.size else math.inf
        return float(lo), float(hi)

    def _exact_state(self, i: int) -> tuple[float, float, float]:
        """(Wc, Vc, G) of segment i summed afresh (no cancellation from the running sums)."""
        lo_b, hi_b = self._segment_bounds(i)
        mid = (lo_b + hi_b) / 2 if math.isfinite(hi_b) else max(2 * lo_b, 1.0)
        at_lo = self.mu_lo > mid
        at_hi = (self.mu_hi < mid) & ~at_lo
        free = ~(at_lo | at_hi)
        w, p, lo, kap = self.w, self.p, self.lower, self.kappa
        wc = float(np.dot(w[at_lo], lo[at_lo]) + w[at_hi].sum() + np.dot(w[free], p[free]))
        vc = float(
            np.sum(kap[at_lo] / (lo[at_lo] - p[at_lo])) + np.sum(kap[at_hi] / (1 - p[at_hi]))
        )
        return wc, vc, float(self.skw[free].sum())

    def optimum_mu(self) -> float:
        """The unique root of ψ (the minimiser of f along the curve)."""
        psi = self._psi(self.seg_wc[1:], self.seg_vc[1:], self.seg_g[1:], self.ev_mu)
        neg = np.flatnonzero(psi < 0)  # ψ is decreasing in μ
        i = int(neg[0]) if neg.size else self.ev_mu.size
        wc, vc, gs = self._exact_state(i)
        if self.surrogate == "P3":
            mu = math.sqrt(wc / (self.h0 + vc)) if self.h0 + vc > 0 else math.inf
        else:  # wc x² + 2 gs x + (vc − B) = 0 in x = 1/μ
            c0 = self.B - vc
            if wc > 0:
                x = (-gs + math.sqrt(gs * gs + wc * c0)) / wc if c0 > 0 else 0.0
            else:
                x = c0 / (2 * gs) if gs > 0 else 0.0
            mu = 1.0 / x if x > 0 else math.inf
        lo_b, hi_b = self._segment_bounds(i)
        mu = min(max(mu, lo_b), hi_b)
        if not math.isfinite(mu):  # all clients at q = 1 beyond the last breakpoint
            mu = float(self.ev_mu[-1]) if self.ev_mu.size else 1.0
        return mu

    def mu_for_m(self, m: np.ndarray | float) -> np.ndarray:
        """μ with Σ w q(μ) = M (W is increasing and piecewise linear in μ)."""
        m = np.atleast_1d(np.asarray(m, dtype=float))
        w_ev = self.seg_wc[1:] + self.seg_g[1:] * self.ev_mu  # W at each breakpoint
        w_ev = np.maximum.accumulate(w_ev)
        seg = np.searchsorted(w_ev, m, side="left")  # segment holding each M
        if m.size > 1:  # many M (the grid): the running sums are accurate enough
            gs = self.seg_g[seg]
            mu = np.where(gs > 0, (m - self.seg_wc[seg]) / np.where(gs > 0, gs, 1.0), 0.0)
            lo_b = np.where(seg > 0, self.ev_mu[np.maximum(seg - 1, 0)], 0.0)
            hi_b = np.where(
                seg < self.ev_mu.size, self.ev_mu[np.minimum(seg, self.ev_mu.size - 1)], np.inf
            )
            return np.minimum(np.maximum(mu, lo_b), hi_b)
        i = int(seg[0])
        wc, _, gs = self._exact_state(i)  # one M: sum the segment afresh
        lo_b, hi_b = self._segment_bounds(i)
        mu1 = (float(m[0]) - wc) / gs if gs > 0 else lo_b
        return np.array([min(max(mu1, lo_b), hi_b)])

    def kkt_multiplier(self, mu: float) -> float:
        return 1.0 / mu**2


def _curve(
    problem: PlanProblem, constants: Constants, k: np.ndarray, options: PlanOptions
) -> _QCurve:
    """Build the q-step curve for fixed k; refuse infeasible clients (lo_n >= 1)."""
    n, nb = problem.n, problem.n * constants.B
    c = sketch_penalty(k, problem.gamma, constants)
    w = sketched_round_weights(problem, k, options)
    a2 = problem.a**2
    if options.q_lower_bound == "none":
        p = np.zeros(n)
        kappa = a2 * c
        lower = np.zeros(n)
        total = float(kappa.sum())
        if total >= constants.B:
            raise ConfigError(
                f"infeasible: even q_n = 1 for every client gives B − Σ a_n² c_n = "
                f"{constants.B - total:.4g} <= 0 at k = {_short(k)} (the target needs infinitely "
                "many rounds); reduce C, D or raise B"
            )
        return _QCurve(w, p, kappa, lower, "P2", constants)
    e = a2 * n * n * c
    p = e / nb  # = a_n² N c_n / B, the per-client bound
    kappa = constants.A * e / nb**2
    lower = p.copy()
    if options.q_lower_bound == "paper":
        lower = q_lower_bounds(problem, constants, k, "paper") * (1.0 + STRICT_MARGIN)
    bad = np.flatnonzero(lower >= 1.0)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"infeasible: client {i} needs q_{i} > {lower[i]:.6g} >= 1 (q_lower_bound = "
            f"{options.q_lower_bound}: a_n = {problem.a[i]:.4g}, k_n = {int(k[i])}, "
            f"N = {n}); raise B or lower that client's weight a_n"
        )
    return _QCurve(w, p, kappa, lower, "P3", constants)


def _short(k: np.ndarray) -> str:
    k = np.asarray(k)
    return str(int(k[0])) if np.all(k == k[0]) else np.array2string(k, threshold=8)


def _m_range(
    problem: PlanProblem, k: np.ndarray, curve: _QCurve, options: PlanOptions
) -> tuple[float, float]:
    """[M_a, M_b] searched: the feasible (Σ w lo, Σ w], or the paper's
    [N·(min k/max k)²·min w, N·max w] (§V-D, with the sketched w of PAPER_NOTES #6) intersected
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
    curve = _curve(problem, constants, k, options)
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
    else:
        grid = _grid(m_lo, m_hi, options.grid_eps, open_low)
        mus = curve.mu_for_m(grid)
        values = np.array([curve.value(curve.q(x)) for x in mus])
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
    curve: _QCurve, m_lo: float, m_hi: float, open_low: bool, options: PlanOptions
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
    constraints = [coef @ y == m_par, y <= (1.0 - curve.p) / curve.g]
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
        qv = np.clip(curve.p + curve.g * np.asarray(y.value, dtype=float), curve.lower, 1.0)
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


# ----------------------------------------------------------------------------- k-step


def _k_floor(problem: PlanProblem, constants: Constants, q: np.ndarray, mode: str) -> np.ndarray:
    """Smallest k each client may take with q fixed: q_n > lo_n(k) (lo_n grows as k falls).

    per_client: per client; paper: one floor for all (K² = γ²/min k² moves every bound);
    none: 1 (only R > 0, which the greedy test itself keeps)."""
    n, gamma = problem.n, problem.gamma
    if mode == "none":
        return np.ones(n, dtype=np.int64)
    floor = np.full(n, gamma, dtype=np.int64)
    for kk in range(gamma, 0, -1):
        ok = q > q_lower_bounds(problem, constants, np.full(n, kk), mode)
        if mode == "paper":
            if not ok.all():
                break
            floor[:] = kk
        else:
            floor = np.where(ok, kk, floor)
    return floor


_SCALAR_PASS_MAX_N = 100  # below this a plain loop over clients beats the vectorised pass


def _pass_vectorised(
    cand: np.ndarray, d_w: np.ndarray, d_v: np.ndarray, big_w: float, den: float
) -> np.ndarray:
    """The same pass as the least fixed point of "accept i if the test passes after the moves
    accepted before i" (see `greedy_k`); each iteration is O(N)."""
    accepted = np.zeros(cand.size, dtype=bool)
    while True:
        pre_w = big_w + np.concatenate([[0.0], np.cumsum(np.where(accepted, d_w, 0.0))[:-1]])
        pre_d = den - np.concatenate([[0.0], np.cumsum(np.where(accepted, d_v, 0.0))[:-1]])
        ok = cand & (pre_d - d_v > 0) & (d_w * pre_d + pre_w * d_v < 0)
        ok |= accepted
        if np.array_equal(ok, accepted):
            return accepted
        accepted = ok


def greedy_k(
    problem: PlanProblem,
    constants: Constants,
    q: Sequence[float] | np.ndarray,
    options: PlanOptions,
    k_start: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Greedy k-step of Algorithm 2 (lines 12–21) on the true P2 with q fixed.

    Passes over clients 0..N−1 and decrements k_n (> 1, staying feasible for q) when that
    strictly lowers P2 = A·W/(B − V), W = Σ q w(k), V = Σ a²/q·c(k); repeats until a pass
    changes nothing. The test is ΔW·(B − V) + W·ΔV < 0 for the current (W, V). A pass is
    computed exactly without a loop over clients: every accepted move lowers P2, so a move
    accepted given some set of earlier moves stays accepted when more earlier moves are added;
    iterating "accept i if the test passes after the accepted moves before i" from the empty
    set grows to the sequential pass's set (its least fixed point).
    """
    q = np.asarray(q, dtype=float)
    gamma = problem.gamma
    k = (
        np.full(problem.n, gamma, dtype=np.int64)
        if k_start is None
        else np.array(k_start, dtype=np.int64)
    )
    floor = np.maximum(_k_floor(problem, constants, q, options.q_lower_bound), 1)
    # per-client tables over k = 1..γ: q_n·w_n(k) and a_n²/q_n·c_n(k), shape (N, γ)
    levels = np.arange(1, gamma + 1)
    comm = comm_factor(levels, gamma, options.comm_cost) / problem.f_tot
    comp = comp_factor(levels, gamma, options.comp_cost, options.rho)
    w_tab = q[:, None] * (problem.t_full[:, None] * comm + problem.tau_full_s[:, None] * comp)
    v_tab = (problem.a**2 / q)[:, None] * sketch_penalty(levels, gamma, constants)[None, :]
    rows = np.arange(problem.n)
    if problem.n <= _SCALAR_PASS_MAX_N:
        return _greedy_scalar(w_tab, v_tab, k, floor, constants.B)
    while True:  # until a pass changes nothing (a client may start moving late: no γ cap)
        cand = k > floor
        if not cand.any():
            break
        j, j1 = k - 1, np.where(cand, k - 2, k - 1)  # table columns of k and k − 1
        big_w = float(w_tab[rows, j].sum())
        den = constants.B - float(v_tab[rows, j].sum())
        d_w = w_tab[rows, j1] - w_tab[rows, j]
        d_v = v_tab[rows, j1] - v_tab[rows, j]
        accepted = _pass_vectorised(cand, d_w, d_v, big_w, den)
        if not accepted.any():
            break
        k = np.where(accepted, k - 1, k)
    return k


def _greedy_scalar(
    w_tab: np.ndarray, v_tab: np.ndarray, k: np.ndarray, floor: np.ndarray, b: float
) -> np.ndarray:
    """`greedy_k` for small N: the literal client-by-client passes on the tables."""
    wt, vt, kk, fl = w_tab.tolist(), v_tab.tolist(), k.tolist(), floor.tolist()
    n = len(kk)
    while True:
        big_w = math.fsum(wt[i][kk[i] - 1] for i in range(n))
        den = b - math.fsum(vt[i][kk[i] - 1] for i in range(n))
        changed = False
        for i in range(n):
            ki = kk[i]
            if ki <= fl[i]:
                continue
            dw = wt[i][ki - 2] - wt[i][ki - 1]
            dv = vt[i][ki - 2] - vt[i][ki - 1]
            if den - dv > 0 and dw * den + big_w * dv < 0:
                kk[i] = ki - 1
                big_w += dw
                den -= dv
                changed = True
        if not changed:
            return np.asarray(kk, dtype=np.int64)


# ----------------------------------------------------------------------------- alternation


def alternate(
    problem: PlanProblem,
    constants: Constants,
    options: PlanOptions,
    k0: Sequence[int] | np.ndarray | None = None,
) -> PlanResult:
    """Alternate q-step and greedy k-step from k0 (default k = γ); stop on a fixed point or a
    cycle of k (or max_iterations q-steps) and return the best (q, k) by P2 (PAPER_NOTES #11)."""
    k = (
        np.full(problem.n, problem.gamma, dtype=np.int64)
        if k0 is None
        else np.asarray(k0, dtype=np.int64)
    )
    seen = {k.tobytes()}
    history: list[float] = []
    best: tuple[float, np.ndarray, np.ndarray, float] | None = None
    stop = "max_iterations"
    iterations = 0
    while iterations < options.max_iterations:
        iterations += 1
        step = q_step(problem, constants, k, options)
        k_new = greedy_k(problem, constants, step.q, options)
        for kk in (k, k_new):  # the iterates (q, k) and (q, k_new)
            value = p2_objective(problem, constants, step.q, kk, options)
            history.append(value)
            if best is None or value < best[0]:
                best = (value, step.q, kk, step.m)
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
    `capability` budgets, `fedlora.methods.ranks`); τ_n = 0 gets γ."""
    tau, gamma = problem.tau_full_s, problem.gamma
    k = np.full(problem.n, gamma, dtype=np.int64)
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
    """The alternation from several k⁰, keeping the best plan by P2 (PAPER_NOTES #11).

    The alternation is a descent on P2 that ends in a fixed point or a cycle, and different
    k⁰ can end in different ones. Default starts, in order: ``gamma`` (k = γ, Algorithm 2's
    start), ``capability`` (`capability_start`), then ``previous_best``: the alternation again
    from the best k found by those two (skipped when it equals a start already tried). The
    result is the best iterate over all of them (ties: the earliest start), with `start`
    naming the start it came from and `starts` the P2 each start reached. `iterations`
    counts all q-steps.
    """
    if starts is None:
        starts = {
            "gamma": np.full(problem.n, problem.gamma, dtype=np.int64),
            "capability": capability_start(problem),
        }
        restart = True
    else:
        restart = False
    best: PlanResult | None = None
    reached: dict[str, float] = {}
    iterations = 0
    tried: set[bytes] = set()
    queue = list(starts.items())
    while queue:
        name, k0 = queue.pop(0)
        k0 = np.asarray(k0, dtype=np.int64)
        if k0.tobytes() in tried:
            continue
        tried.add(k0.tobytes())
        res = alternate(problem, constants, options, k0=k0)
        iterations += res.iterations
        reached[name] = res.objective
        if best is None or res.objective < best.objective:
            best = dataclasses.replace(res, start=name)
        if not queue and restart:
            restart = False
            queue.append(("previous_best", best.k))
    if best is None:
        raise bad_value("starts", starts, "at least one k⁰")
    return dataclasses.replace(best, iterations=iterations, starts=reached)


def plan(problem: PlanProblem, options: PlanOptions | None = None) -> PlanResult:
    """Algorithm 2: estimate A–D if the problem gives calibration runs, then alternate from
    several starts and keep the best plan (`multi_start`)."""
    options = options or PlanOptions()
    constants = problem.constants
    if constants is None:
        constants = estimate_constants(
            problem.calibration, problem.gamma, problem.a, options.estimation_matrix
        )
    return multi_start(problem, constants, options)


# ----------------------------------------------------------------------------- PROBLEM.json

_TOP_KEYS = ("gamma", "f_tot", "clients", "constants", "calibration", "options")
_CLIENT_KEYS = ("a", "tau_full_s", "t_full")
_OPTION_KEYS = tuple(f.name for f in dataclasses.fields(PlanOptions))


def _unknown(where: str, key: str, valid: Sequence[str]) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def problem_from_dict(
    raw: Any, *, source: str = "problem", overrides: dict[str, Any] | None = None
) -> tuple[PlanProblem, PlanOptions]:
    """Build (PlanProblem, PlanOptions) from the PROBLEM.json structure (docs/planner.md).
    `overrides` replace option fields (e.g. the CLI's --solver)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    for key in raw:
        if key not in _TOP_KEYS:
            raise _unknown(source, key, _TOP_KEYS)
    opts_raw = raw.get("options", {})
    if not isinstance(opts_raw, dict):
        raise bad_value("options", opts_raw, "a JSON object")
    for key in opts_raw:
        if key not in _OPTION_KEYS:
            raise _unknown(f"{source}: options", key, _OPTION_KEYS)
    options = PlanOptions(**{**opts_raw, **(overrides or {})})
    for key in ("gamma", "f_tot", "clients"):
        if key not in raw:
            raise ConfigError(f"{source}: missing key {key!r}")
    clients = raw["clients"]
    if not isinstance(clients, list):
        raise bad_value("clients", clients, "a list of objects with a, tau_full_s, t_full")
    if not clients:
        raise bad_value("clients", clients, "at least one client")
    cols: dict[str, list[float]] = {c: [] for c in _CLIENT_KEYS}
    for i, row in enumerate(clients):
        if not isinstance(row, dict):
            raise bad_value(f"clients[{i}]", row, "an object with a, tau_full_s, t_full")
        for key in row:
            if key not in _CLIENT_KEYS:
                raise _unknown(f"{source}: clients[{i}]", key, _CLIENT_KEYS)
        for c in _CLIENT_KEYS:
            if c not in row:
                raise ConfigError(f"{source}: clients[{i}] has no {c!r}")
            cols[c].append(_positive(f"clients[{i}].{c}", row[c], "must be finite and > 0"))
    a = np.asarray(cols["a"])
    if options.normalize_a:
        a = PlanProblem.normalized_weights(a)
    constants = None
    if "constants" in raw and raw["constants"] is not None:
        cr = raw["constants"]
        if not isinstance(cr, dict):
            raise bad_value("constants", cr, "an object with A, B, C, D")
        for key in cr:
            if key not in ("A", "B", "C", "D"):
                raise _unknown(f"{source}: constants", key, ("A", "B", "C", "D"))
        missing = [x for x in "ABCD" if x not in cr]
        if missing:
            raise ConfigError(f"{source}: constants lacks {', '.join(missing)}")
        constants = Constants(cr["A"], cr["B"], cr["C"], cr["D"])
    calibration: list[Observation] = []
    if not isinstance(raw.get("calibration") or [], list):
        raise bad_value("calibration", raw["calibration"], "a list of calibration runs")
    for i, ob in enumerate(raw.get("calibration") or []):
        if not isinstance(ob, dict) or set(ob) != {"q", "k", "rounds"}:
            raise bad_value(
                f"calibration[{i}]", ob, 'an object {"q": [...], "k": [...], "rounds": R}'
            )
        for name in ("q", "k"):
            if not isinstance(ob[name], list) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in ob[name]
            ):
                raise bad_value(f"calibration[{i}].{name}", ob[name], "a list of numbers")
        if any(not isinstance(v, int) for v in ob["k"]):
            raise bad_value(f"calibration[{i}].k", ob["k"], "a list of integers")
        calibration.append(
            Observation(np.asarray(ob["q"], dtype=float), np.asarray(ob["k"]), ob["rounds"])
        )
    gamma = raw["gamma"]
    if isinstance(gamma, float) and gamma.is_integer():
        raise bad_value("gamma", gamma, "an integer (write it without a decimal point)")
    problem = PlanProblem(
        gamma=gamma,
        f_tot=raw["f_tot"],
        a=a,
        tau_full_s=np.asarray(cols["tau_full_s"]),
        t_full=np.asarray(cols["t_full"]),
        constants=constants,
        calibration=tuple(calibration),
    )
    return problem, options


def load_problem(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[PlanProblem, PlanOptions]:
    """Read a PROBLEM.json (schema in docs/planner.md)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{p}: invalid JSON at line {e.lineno} column {e.colno} (char {e.pos}): {e.msg}"
        ) from None
    return problem_from_dict(raw, source=str(p), overrides=overrides)
