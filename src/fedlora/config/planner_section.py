"""The planner section of an experiment config: Algorithm 2's options (solver, search,
bounds), `proposed`'s calibration (separate runs or in-run probes, the fit) and re-planning,
and its privacy budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from fedlora.config.checks import check_choice, check_int, check_number
from fedlora.errors import ConfigError, bad_value


@dataclass(frozen=True)
class PlannerConfig:
    """Algorithm 2 options (docs/paper.md, rows 1–11)."""

    solver: str = "exact"  # exact | cvxpy
    estimation_matrix: str = "fixed"  # fixed | paper (keeps the 1/R1 typo in row 2)
    q_lower_bound: str = "per_client"  # per_client | paper | none
    m_search: str = "exact"  # exact | grid
    m_range: str = "feasible"  # feasible | paper
    grid_eps: float = 0.0  # grid step for m_search = grid; 0 = (range)/200
    max_iterations: int = 50
    calibration_loss: float = 0.0  # F_s for the `proposed` calibration runs; 0 = auto
    # `proposed`: at most this many rounds per calibration run (fedlora.federation.methods.proposed)
    calibration_rounds: int = 30
    # `proposed` with calibration_loss = 0: F_s = this fraction of the first round's loss
    calibration_loss_fraction: float = 0.5
    # `proposed` with training.time_budget_s: true = the budget counts the calibration's
    # simulated time (its clock starts there); false = the budget starts after it, so it
    # trains as long as the other methods (times to target still include the calibration)
    calibration_in_budget: bool = True
    # `proposed` plans q and k ("qk"), only q with k from method.k ("q", Figure 2), or only k
    # with q from method.q ("k", Figure 3)
    optimize: str = "qk"
    # `proposed` (separate calibration) when the SVD fit contradicts the model: "constrained" (A, C, D >= 0
    # with floors where not identified, `fedlora.system.planner.constrained_fit`), "refuse",
    # or "nonnegative" (least squares with A, C, D >= 0, no floors: it can plan q -> 0)
    calibration_fit: str = "constrained"
    # "in-run" = the run's first rounds are the probes and the plan follows from
    # them (proposed's round hooks); "separate" = the paper's four calibration runs
    calibration: str = "in-run"
    probe_rounds: int = 4  # in-run: rounds per probe setting (4 settings, palindromic order)
    # in-run: the probes' two sampling rates q, high then low (each probed at k = γ and ⌈γ/4⌉)
    probe_q: tuple[float, ...] = (0.3, 0.15)
    # in-run: when the fit after a probe cycle fails, run the probes again (another full
    # palindromic cycle) and refit, up to this many cycles in all; 1 = fall back at once
    probe_cycles: int = 1
    # a_n/q_n <= max_weight for every planned q (0 = no bound); 1 = no sampled client counts
    # more than the whole federation
    max_weight: float = 1.0
    # share φ of B the variance (sketch) term takes at the data's largest Y (Z): the floor of
    # C (D) when the data do not identify it
    fit_floor_share: float = 0.1
    # in-run: the progress rates from each participant's own training loss with a per-client
    # intercept (the round's participant mix taken out), not from the round's mean loss
    fit_client_offsets: bool = False
    replan_every: int = 0  # in-run: refit and re-plan every R rounds after the probes; 0 = off
    replan_margin: float = 0.05  # adopt a new plan only if its predicted time is this much lower
    # privacy budget: every client's ε(privacy.delta) at the planned rounds stays below this
    # (one number for all or one per client; 0 = no budget); needs a privacy mechanism that
    # accepts a budget (`accepts_budget`: central DP)
    max_epsilon: Union[float, tuple[float, ...]] = 0.0  # noqa: UP007

    def __post_init__(self) -> None:
        check_choice("planner.solver", self.solver, ("exact", "cvxpy"))
        check_choice("planner.estimation_matrix", self.estimation_matrix, ("fixed", "paper"))
        check_choice("planner.q_lower_bound", self.q_lower_bound, ("per_client", "paper", "none"))
        check_choice("planner.m_search", self.m_search, ("exact", "grid"))
        check_choice("planner.m_range", self.m_range, ("feasible", "paper"))
        check_number("planner.grid_eps", self.grid_eps, lo=0)
        check_int("planner.max_iterations", self.max_iterations, lo=1)
        check_number("planner.calibration_loss", self.calibration_loss, lo=0)
        check_int("planner.calibration_rounds", self.calibration_rounds, lo=2)
        check_number(
            "planner.calibration_loss_fraction",
            self.calibration_loss_fraction,
            lo=0,
            hi=1,
            lo_open=True,
            hi_open=True,
        )
        check_choice("planner.optimize", self.optimize, ("qk", "q", "k"))
        check_choice(
            "planner.calibration_fit",
            self.calibration_fit,
            ("constrained", "refuse", "nonnegative"),
        )
        check_choice("planner.calibration", self.calibration, ("in-run", "separate"))
        check_int("planner.probe_rounds", self.probe_rounds, lo=1)
        _check_probe_q(self.probe_q)
        check_number("planner.max_weight", self.max_weight, lo=0)
        check_number(
            "planner.fit_floor_share", self.fit_floor_share, lo=0, hi=1, lo_open=True, hi_open=True
        )
        check_int("planner.probe_cycles", self.probe_cycles, lo=1)
        if not isinstance(self.fit_client_offsets, bool):
            raise bad_value("planner.fit_client_offsets", self.fit_client_offsets, "true or false")
        check_int("planner.replan_every", self.replan_every, lo=0)
        check_number("planner.replan_margin", self.replan_margin, lo=0)
        if self.replan_every and self.calibration != "in-run":
            raise ConfigError(
                f"planner.replan_every = {self.replan_every} needs planner.calibration = "
                f"'in-run' (got {self.calibration!r}): the refit uses the run's own probe rounds"
            )
        _check_in_run_only(self)
        budgets = self.max_epsilon if isinstance(self.max_epsilon, tuple) else (self.max_epsilon,)
        for i, e in enumerate(budgets):
            name = "planner.max_epsilon" + (f"[{i}]" if isinstance(self.max_epsilon, tuple) else "")
            check_number(name, e, lo=0, lo_open=isinstance(self.max_epsilon, tuple))
        if not isinstance(self.calibration_in_budget, bool):
            raise bad_value(
                "planner.calibration_in_budget", self.calibration_in_budget, "true or false"
            )


def _check_in_run_only(p: PlannerConfig) -> None:
    """planner.probe_cycles > 1 and planner.fit_client_offsets = true are in-run options."""
    for name, value, off in (
        ("probe_cycles", p.probe_cycles, 1),
        ("fit_client_offsets", p.fit_client_offsets, False),
    ):
        if value != off and p.calibration != "in-run":
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(
                f"planner.{name} = {shown} needs planner.calibration = 'in-run' (got "
                f"{p.calibration!r}): it changes how the run's own probe rounds are fitted"
            )


def _check_probe_q(probe_q: object) -> None:
    """planner.probe_q: two rates in (0, 1], the first strictly above the second."""
    allowed = "two sampling rates in (0, 1], high then low (e.g. [0.3, 0.15])"
    if isinstance(probe_q, list):
        probe_q = tuple(probe_q)
    if (
        not isinstance(probe_q, tuple)
        or len(probe_q) != 2
        or any(isinstance(q, bool) or not isinstance(q, (int, float)) for q in probe_q)
        or not all(0 < q <= 1 for q in probe_q)
        or not probe_q[0] > probe_q[1]
    ):
        raise bad_value(
            "planner.probe_q", list(probe_q) if isinstance(probe_q, tuple) else probe_q, allowed
        )
