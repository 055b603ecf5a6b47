"""The data of Algorithm 2 (paper §V): the constants A–D, a calibration run, the planning
problem and the options, each checked when it is built.

`Constants(A, B, C, D)`
    The constants of Theorem 1 as used in P2: R(q, k) = A / (B − Σ a_n²/q_n · c_n) with
    c_n = C + D·γ²/k_n². All four are > 0; an estimate is normalised to B = 1 (P2 and P3
    are unchanged by a common scale, docs/paper.md, row 3).
`Observation(q, k, rounds)`
    One calibration run: per-client q and k vectors and the rounds R it needed to reach the
    calibration loss F_s.
`PlanProblem(gamma, f_tot, a, tau_full_s, t_full, constants=None, calibration=())`
    γ, the total band f_tot, and per client: the aggregation weight a_n (Σ a_n = 1), the local
    computation time per round at k = γ (`tau_full_s`, seconds) and the upload time of the full
    adapter with one unit of band (`t_full`, so t_full/f_tot is seconds). Exactly one of
    `constants` or `calibration` (>= 4 observations).
`PlanOptions(...)`
    The variants of docs/paper.md, rows 1–11 (see the field comments); `PlanOptions.from_config`
    builds them from `PlannerConfig` and `NetworkConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.privacy import SIGMA_RANGE

A_SUM_TOLERANCE = 1e-6  # |Σ a_n − 1| allowed without normalisation
GAMMA_MAX = 4096  # the largest global rank γ a problem may name (LoRA ranks are far below)

SOLVERS = ("exact", "cvxpy")
ESTIMATION_MATRICES = ("fixed", "paper")
Q_LOWER_BOUNDS = ("per_client", "paper", "none")
M_SEARCHES = ("exact", "grid")
M_RANGES = ("feasible", "paper")
COMM_COSTS = ("quadratic", "linear", "exact")
COMP_COSTS = ("quadratic", "linear", "affine")
CALIBRATION_FITS = ("constrained", "refuse")


def positive_number(name: str, value: Any, what: str = "must be a finite number > 0") -> float:
    """`value` as a float; a ConfigError naming `name` unless it is a finite number > 0."""
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
                self, name, positive_number(f"constants.{name}", getattr(self, name), "must be > 0")
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
        object.__setattr__(self, "f_tot", positive_number("f_tot", self.f_tot))
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
            rounds = positive_number(f"{where}.rounds", o.rounds)
            obs = obs[:i] + (Observation(q, kf.astype(np.int64), rounds),) + obs[i + 1 :]
        object.__setattr__(self, "calibration", obs)

    @property
    def n(self) -> int:
        return int(self.a.size)

    def full_rank(self) -> np.ndarray:
        """k_n = γ for every client (no sketching; Algorithm 2's start)."""
        return np.full(self.n, self.gamma, dtype=np.int64)

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
    """Variants of Algorithm 2 (docs/paper.md, rows 1–11). Defaults match `PlannerConfig` and
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
    max_weight: float = 0.0  # w_max: q_n >= a_n/w_max (a_n/q_n <= w_max); 0 = none (runs: 1)
    polish: bool = True  # each iterate's k also scored with the exact P2 minimiser over q
    calibration_fit: str = "constrained"  # constrained (A, C, D >= 0, floors) | refuse (SVD only)
    fit_floor_share: float = 0.1  # φ of the floors of C and D where not identified (`fit`)
    # a privacy budget (`budget.plan_within_budget`): every client's ε(delta) at the planned
    # rounds <= max_epsilon (one for all, or one per client; 0 = none) at noise multiplier σ
    max_epsilon: float | tuple[float, ...] = 0.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    q_max: tuple[float, ...] = ()  # q_n <= q_max_n (the budget's rates; () = 1 for all)
    max_rounds: float = 0.0  # the exact q-step keeps R(q, k) <= max_rounds (0 = no bound)

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
        mw = self.max_weight
        if (
            isinstance(mw, bool)
            or not isinstance(mw, (int, float))
            or not (math.isfinite(mw) and mw >= 0)
        ):
            raise bad_value(
                "options.max_weight", mw, "a finite number >= 0 (w_max of a_n/q_n; 0 = no bound)"
            )
        if self.calibration_fit not in CALIBRATION_FITS:
            raise bad_value(
                "options.calibration_fit",
                self.calibration_fit,
                f"allowed: {', '.join(CALIBRATION_FITS)}",
            )
        fs = self.fit_floor_share
        if isinstance(fs, bool) or not isinstance(fs, (int, float)) or not (0.0 < fs < 1.0):
            raise bad_value("options.fit_floor_share", fs, "a number in (0, 1)")
        _check_budget_options(self)
        if not isinstance(self.polish, bool):
            raise bad_value("options.polish", self.polish, "true or false")
        if not isinstance(self.normalize_a, bool):
            raise bad_value("options.normalize_a", self.normalize_a, "true or false")

    @classmethod
    def from_config(cls, planner: Any, network: Any, privacy: Any = None) -> PlanOptions:
        """From a `PlannerConfig`, a `NetworkConfig` and a `PrivacyConfig` (its σ and δ for
        planner.max_epsilon) (the engine's `proposed` method)."""
        budget = {}
        if privacy is not None:
            budget = {"noise_multiplier": privacy.noise_multiplier, "delta": privacy.delta}
        return cls(
            max_epsilon=planner.max_epsilon,
            **budget,
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
            max_weight=planner.max_weight,
            fit_floor_share=planner.fit_floor_share,
        )


def _check_budget_options(options: PlanOptions) -> None:
    """max_epsilon (a number >= 0 or one > 0 per client), σ >= 0, δ in (0, 1), q_max in (0, 1]."""
    for name in ("max_epsilon", "q_max"):
        value = getattr(options, name)
        if isinstance(value, list):
            object.__setattr__(options, name, tuple(value))
    budgets = options.max_epsilon
    items = budgets if isinstance(budgets, tuple) else (budgets,)
    for e in items:
        ok = isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e)
        if not ok or e < 0 or (isinstance(budgets, tuple) and e <= 0):
            raise bad_value("options.max_epsilon", budgets, "a number >= 0 or one > 0 per client")
    sigma, delta = options.noise_multiplier, options.delta
    lo, hi = SIGMA_RANGE
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, (int, float))
        or not (sigma == 0 or lo <= sigma <= hi)
    ):
        raise bad_value(
            "options.noise_multiplier", sigma, f"0 or a number in [{lo:g}, {hi:g}] (finite)"
        )
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise bad_value("options.delta", delta, "a number in (0, 1)")
    if any(not (isinstance(u, (int, float)) and 0 < u <= 1) for u in options.q_max):
        raise bad_value("options.q_max", options.q_max, "one number in (0, 1] per client")
