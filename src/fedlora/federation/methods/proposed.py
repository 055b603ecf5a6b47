"""`proposed`: Algorithm 1 with the per-client (q*, k*) of Algorithm 2's plan.

The plan comes as a value (`Plan`): `fedlora.federation.calibration.prepare_proposed` runs the
calibration, fits the constants, plans and writes plan.json for the user, then hands the
`Plan` to the engine (`run_in_process(plan=...)`), which gives it to `make_method`. Without a
`Plan`, method.q and method.k must both name one plan JSON file (`plan_file`), e.g. the
output of `fedlora plan` or a previous run's plan.json; that is how the Flower runtime runs
`proposed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.config.sections import MethodConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import MethodContext, RoundContext
from fedlora.federation.methods.proposed_replan import (
    InRunPlanner,
    check_probe_budget,
    rank_message,
)
from fedlora.federation.methods.registry import register_method
from fedlora.federation.methods.sketched import Sketched
from fedlora.federation.methods.strategies import resolve_k, resolve_q


@register_method("proposed")
class Proposed(Sketched):
    """Algorithm 1 with the planned per-client (q*, k*) (see the module docstring).

    With in-run calibration its round hooks drive an `InRunPlanner`
    (`fedlora.federation.methods.proposed_replan`): q and k change between rounds, and the
    planner's state (plain data: the probes, every round's setting and loss, the fits and
    plans) is what the checkpoint carries for that."""

    name = "proposed"
    dp_sampling = "independent"  # Sketched with the planned q*: Poisson sampling
    in_run = False  # set from the Plan: the InRunPlanner drives q and k

    def __init__(self, *, a: np.ndarray, q: np.ndarray, k: np.ndarray, gamma: int) -> None:
        super().__init__(a=a, q=q, k=k, gamma=gamma)
        self.replanner = InRunPlanner()

    @classmethod
    def check_run(cls, cfg: ExperimentConfig) -> None:
        """Algorithm 2's calibration (every run without a plan file) needs lora.rank >= 2;
        with a privacy budget, the in-run probes alone must fit in it (`check_probe_budget`)."""
        if not plan_file(cfg.method) and cfg.lora.rank < 2:
            raise ConfigError(rank_message(cfg.lora.rank))
        if not plan_file(cfg.method) and cfg.planner.calibration == "in-run":
            check_probe_budget(cfg, cls)

    @classmethod
    def check_flower(cls, cfg: ExperimentConfig) -> None:
        """On Flower it needs a plan file: Algorithm 2's calibration runs are engine runs."""
        m = cfg.method
        if not plan_file(m):
            raise ConfigError(
                f"method.name = 'proposed' with method.q = {m.q!r}, method.k = {m.k!r}: on "
                "Flower it needs a plan: set method.q and method.k to one plan JSON file "
                "(`fedlora plan -o`, or the plan.json of a `fedlora run` with method proposed)"
            )

    def before_round(self, ctx: RoundContext, round_index: int) -> None:
        if self.in_run:
            self.set_sampling(*self.replanner.before_round(ctx, round_index))

    def after_round(self, ctx: RoundContext, round_index: int, line: dict[str, Any]) -> None:
        if self.in_run:
            self.replanner.after_round(ctx, round_index, line)

    def state_dict(self) -> dict:
        state = self.replanner.state
        return {"replan": state} if state else {}

    def load_state_dict(self, state: dict) -> None:
        self.replanner.state = state.get("replan") or {}

    @classmethod
    def from_config(cls, ctx: MethodContext) -> Proposed:
        m, plan = ctx.cfg.method, ctx.plan
        q_spec, k_spec = (list(plan.q), list(plan.k)) if plan is not None else (m.q, m.k)
        if plan is None and not plan_file(m):
            raise ConfigError(
                f"method.name = 'proposed' with method.q = {m.q!r}, method.k = {m.k!r} needs "
                "Algorithm 2's plan: run it with `fedlora run` / `fedlora compare`, or set "
                "method.q and method.k to one plan JSON file"
            )
        q = resolve_q(q_spec, a=ctx.a, q_fixed=m.q_fixed)
        k = resolve_k(k_spec, n=ctx.a.size, gamma=ctx.gamma, rng=ctx.rng)
        method = cls(a=ctx.a, q=q, k=k, gamma=ctx.gamma)
        method.in_run = plan is not None and plan.in_run
        method.logs_client_losses = method.in_run and ctx.cfg.planner.fit_client_offsets
        return method


@dataclass(frozen=True)
class Plan:
    """Algorithm 2's plan for one `proposed` run: q_n and k_n per client, and the simulated
    time its calibration runs took (the run's clock starts there)."""

    q: tuple[float, ...]
    k: tuple[int, ...]
    calibration_s: float = 0.0
    in_run: bool = False  # q, k are round 1's; the run calibrates itself (InRunPlanner)


def plan_file(method: MethodConfig) -> str | None:
    """The plan JSON file that method.q and method.k both name, if they do and it exists."""
    q, k = method.q, method.k
    if isinstance(q, str) and q == k and q.endswith(".json") and Path(q).exists():
        return q
    return None
