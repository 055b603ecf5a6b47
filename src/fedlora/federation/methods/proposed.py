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

from fedlora.config.sections import MethodConfig
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import MethodContext
from fedlora.federation.methods.registry import register_method
from fedlora.federation.methods.sketched import Sketched
from fedlora.federation.methods.strategies import resolve_k, resolve_q


@register_method("proposed")
class Proposed(Sketched):
    """Algorithm 1 with the planned per-client (q*, k*) (see the module docstring).

    With in-run calibration (`fedlora.federation.replan`) q and k change between rounds;
    `replan_state` (plain data: the probes, every round's setting and loss, the fits and
    plans) is what the checkpoint carries for that."""

    name = "proposed"
    in_run = False  # set by make_method from the Plan: fedlora.federation.replan drives q, k
    replan_state: dict = {}  # replaced, never mutated in place, by fedlora.federation.replan

    def state_dict(self) -> dict:
        return {"replan": self.replan_state} if self.replan_state else {}

    def load_state_dict(self, state: dict) -> None:
        self.replan_state = state.get("replan") or {}

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
        return method


@dataclass(frozen=True)
class Plan:
    """Algorithm 2's plan for one `proposed` run: q_n and k_n per client, and the simulated
    time its calibration runs took (the run's clock starts there)."""

    q: tuple[float, ...]
    k: tuple[int, ...]
    calibration_s: float = 0.0
    in_run: bool = False  # q, k are round 1's; the run calibrates itself (federation.replan)


def plan_file(method: MethodConfig) -> str | None:
    """The plan JSON file that method.q and method.k both name, if they do and it exists."""
    q, k = method.q, method.k
    if isinstance(q, str) and q == k and q.endswith(".json") and Path(q).exists():
        return q
    return None
