"""Algorithm 2's plan from the calibration runs' observations: the clients' profiles read
back from clients.csv, the constants A–D fitted (SVD, or non-negative least squares as the
fallback), then (q*, k*) planned with `fedlora.system.planner` (both, q only with k from
`method.k`, or k only with q from `method.q`). Used by `fedlora.federation.calibration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.proposed_plan import plan_for, planning_t_full
from fedlora.federation.runfiles import ClientRow


def client_arrays(rows: Sequence[ClientRow]) -> dict[str, np.ndarray]:
    """a_n, τ_n^γ, t_n^γ and the mean SNR (NaN for given profiles: no fading-aware plan)
    of a run's clients.csv rows (`fedlora.federation.runfiles.read_clients`)."""
    return {
        "a": np.array([r.a for r in rows]),
        "tau_full_s": np.array([r.tau_full_s for r in rows]),
        "t_full": np.array([r.t_full for r in rows]),
        "snr_db": np.array([r.snr_db for r in rows]),
    }


def nonnegative_constants(observations: Sequence[Any], gamma: int, a: np.ndarray) -> Any:
    """A, C, D >= 0 with B = 1 by non-negative least squares on A/R_i + C·Y_i + D·Z_i = 1
    (Eq. 21's rows divided through by B; Y = Σ a²/q, Z = Σ a²/q·γ²/k², docs/paper.md, row 2).

    The fallback of ``planner.calibration_fit = "nonnegative"`` when the unconstrained fit
    contradicts the model. A constant the fit puts at 0 is raised to 1e-9 of the largest
    (the planner needs all four > 0): a zero D says that, in the calibration, smaller
    sketches did not need more rounds.
    """
    from scipy.optimize import nnls

    from fedlora.system.planner.problem import Constants

    a2 = np.asarray(a, dtype=float) ** 2
    rows = []
    for o in observations:
        y = float(np.sum(a2 / o.q))
        z = float(np.sum(a2 / o.q * gamma**2 / np.asarray(o.k, dtype=float) ** 2))
        rows.append([1.0 / o.rounds, y, z])
    x, _ = nnls(np.asarray(rows), np.ones(len(rows)))
    if not x[0] > 0:
        raise ConfigError(
            "calibration: even with A, C, D >= 0 the fit gives A = 0 (the rounds R_i carry "
            "no information); raise planner.calibration_rounds or set planner.calibration_loss"
        )
    x = np.maximum(x, 1e-9 * x.max())
    return Constants(A=float(x[0]), B=1.0, C=float(x[1]), D=float(x[2]))


def plan_from_calibration(
    cfg: ExperimentConfig, clients: dict[str, np.ndarray], records: list[dict]
) -> dict:
    """plan.json's fields beside the calibration: fit, degeneracy, q, k, constants, ..."""
    from fedlora.system.planner.estimate import calibration_fit, estimate_constants
    from fedlora.system.planner.fit import constrained_fit
    from fedlora.system.planner.objective import (
        expected_rounds,
        p2_objective,
        plan_degeneracy,
        sketched_round_weights,
    )
    from fedlora.system.planner.problem import Observation, PlanOptions, PlanProblem

    n, gamma = cfg.data.n_clients, cfg.lora.rank
    a = clients["a"] / clients["a"].sum()
    observations = [
        Observation(np.full(n, r["q"]), np.full(n, r["k"]), float(r["rounds"])) for r in records
    ]
    options = PlanOptions.from_config(cfg.planner, cfg.network, cfg.privacy)
    problem = PlanProblem(
        gamma=gamma,
        f_tot=cfg.network.f_tot_hz,
        a=a,
        tau_full_s=clients["tau_full_s"],
        t_full=planning_t_full(cfg, clients),
        calibration=tuple(observations),
    )
    floors: dict[str, str] = {}
    try:
        constants = estimate_constants(observations, gamma, a, options.estimation_matrix)
        fit = "svd"
    except ConfigError as e:
        if cfg.planner.calibration_fit == "refuse":
            raise
        if cfg.planner.calibration_fit == "nonnegative":
            constants = nonnegative_constants(observations, gamma, a)
            fit = f"nonnegative (the SVD fit was refused: {e})"
        else:  # constrained: A, C, D >= 0 and floors where the runs do not identify C or D
            yz = np.array(
                [
                    [np.sum(a**2 / o.q), np.sum(a**2 / o.q * gamma**2 / o.k.astype(float) ** 2)]
                    for o in observations
                ]
            )
            result = constrained_fit(
                [1.0 / o.rounds for o in observations],
                yz[:, 0],
                yz[:, 1],
                floor_share=cfg.planner.fit_floor_share,
            )
            constants, floors = result.constants, result.floors
            fit = f"constrained (the SVD fit was refused: {e})"
    q, k, extra = plan_for(cfg, problem, constants, options, a)
    weights = sketched_round_weights(problem, np.asarray(k), options)
    degeneracy = plan_degeneracy(problem, constants, q, k, options)
    return {
        "fit": calibration_fit(observations, gamma, a, constants),
        "degeneracy": degeneracy,
        "q": [float(x) for x in q],
        "k": [int(x) for x in k],
        "optimize": cfg.planner.optimize,
        "constants": constants.to_dict(),
        "constants_fit": fit,
        "floors": floors,
        "objective": float(p2_objective(problem, constants, q, k, options)),
        "expected_rounds": float(expected_rounds(problem, constants, q, k)),
        "expected_round_time_s": float(np.dot(q, weights)),
        **extra,
    }
