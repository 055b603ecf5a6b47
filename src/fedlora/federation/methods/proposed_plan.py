"""Algorithm 2's plan from fitted constants, shared by `proposed`'s in-run calibration
(`proposed_replan`) and the separate calibration (`fedlora.federation.calibration_plan`):
`plan_for` runs the optimisation ``planner.optimize`` names (within ``planner.max_epsilon``
when it is set), `planning_t_full` the full-rank times the planner plans with (fading's
expected factor included)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig


def plan_for(
    cfg: ExperimentConfig,
    problem: Any,
    constants: Any,
    options: Any,
    a: np.ndarray,
    spent_rdp: np.ndarray | None = None,
):
    """(q, k, details) of `planner.optimize`: both (multi-start), q only with k from method.k, or k
    only with q from method.q (Figures 2 and 3). Shared with the separate calibration.

    With planner.max_epsilon (`options.max_epsilon`) and optimize = "qk", the plan keeps every
    client's ε within its budget at the planned rounds (`plan_within_budget`), composed after
    `spent_rdp` (N, orders: what the run has spent so far, the in-run probes included); its
    bounds and ε are in ``details["privacy"]``. With optimize = "q" or "k" the budget does not
    shape the plan; the run's budget stop keeps it."""
    from fedlora.system.planner.alternation import multi_start
    from fedlora.system.planner.budget import plan_within_budget
    from fedlora.system.planner.kstep import greedy_k
    from fedlora.system.planner.qstep import q_step

    n, gamma = problem.n, problem.gamma
    if cfg.planner.optimize == "qk":
        result = plan_within_budget(
            problem, options, lambda o: multi_start(problem, constants, o), spent_rdp
        )
        details = {
            "iterations": result.iterations,
            "stop_reason": result.stop_reason,
            "start": result.start,
            "starts": result.starts,
        }
        if result.privacy:
            details["privacy"] = result.privacy
        return result.q, result.k, details
    from fedlora.federation.methods.strategies import resolve_k, resolve_q
    from fedlora.system.seeding import derive_rng

    if cfg.planner.optimize == "q":
        k = resolve_k(cfg.method.k, n=n, gamma=gamma, rng=derive_rng(cfg.training.seed, "strategy"))
        return q_step(problem, constants, k, options).q, np.asarray(k), {}
    q = resolve_q(cfg.method.q, a=a, q_fixed=cfg.method.q_fixed)  # given: max_weight not applied
    return np.asarray(q), greedy_k(problem, constants, q, options), {}


def planning_t_full(cfg: ExperimentConfig, clients: dict[str, np.ndarray]) -> np.ndarray:
    """t_full for the planner: with Rayleigh fading, the mean-SNR time times the expected
    factor of fading (`fedlora.system.client_profiles.planning_time_factor`; the ergodic rate
    when there is no outage floor, the exact mean with one); unchanged without fading or
    channel data."""
    snr = clients.get("snr_db")
    if cfg.network.fading != "rayleigh" or snr is None or not np.all(np.isfinite(snr)):
        return clients["t_full"]
    from fedlora.system.client_profiles import planning_time_factor

    return clients["t_full"] * planning_time_factor(snr, cfg.network.fading_floor)
