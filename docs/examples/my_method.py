"""An example method (docs/methods.md, "Writing a method"): every round, FedAvg over the
method.clients_per_round clients that hold the most data."""

from __future__ import annotations

import numpy as np

from fedlora.config import ExperimentConfig
from fedlora.errors import bad_value
from fedlora.federation.methods.base import (
    Aggregation,
    ClientTask,
    Method,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.registry import register_method
from fedlora.system.sketch import unbiased_aggregate


@register_method("largest_first")
class LargestFirst(Method):
    delta_aggregate = True  # X + Σ p_n (X_n − X): a server optimizer may step on it

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:  # called whatever method.name is
        m = cfg.method
        if m.name == "largest_first" and m.clients_per_round < 1:
            raise bad_value("method.clients_per_round", m.clients_per_round, ">= 1 here")

    @classmethod
    def from_config(cls, ctx: MethodContext) -> LargestFirst:
        return cls(ctx.a, ctx.gamma, ctx.cfg.method.clients_per_round)

    def __init__(self, a: np.ndarray, gamma: int, m: int) -> None:
        self.a, self.gamma = np.asarray(a, dtype=float), gamma
        self.chosen = np.sort(np.argsort(-self.a, kind="stable")[:m])  # the m largest

    def plan_round(self, round_index, rng_sampling, rng_sketch) -> RoundPlan:
        p = self.a[self.chosen] / self.a[self.chosen].sum()  # data shares among them
        full = np.ones(self.gamma)  # every rank component, unscaled
        tasks = (ClientTask(int(n), full, self.gamma, float(w)) for n, w in zip(self.chosen, p))
        return RoundPlan(round_index, tuple(tasks))

    def aggregate(self, global_state, plan, client_states) -> Aggregation:
        weights = [t.weight for t in plan.tasks]  # X ← X + Σ p_n (X_n − X)
        return Aggregation(unbiased_aggregate(global_state, client_states, weights))
