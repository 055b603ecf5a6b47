"""`sketched`: the paper's Algorithm 1 — independent sampling, per-client sketches, Eq. (6).

Each round client n joins with probability q_n (Bernoulli, independent), trains a fresh
uniformly random k_n-of-γ sketch scaled by γ/k_n, and the server applies the unbiased rule
X ← X − Σ_{n∈K} (a_n/q_n)(X − X_n^H) (docs/paper.md, row 7). A round may have no participant.

q and k are checked once, where `from_config` resolves ``method.q`` / ``method.k``
(`strategies.resolve_q` / `resolve_k`); the method and the round kernels of
`fedlora.system.sketch` trust them (docs/architecture.md, "A parameter's walk").
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    Method,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.registry import register_method
from fedlora.federation.methods.strategies import resolve_k, resolve_q
from fedlora.system.sketch import (
    draw_participants,
    draw_sketch_scales,
    unbiased_aggregate,
    unbiased_weights,
)


@register_method("sketched")
class Sketched(Method):
    name = "sketched"
    dp_sampling = "independent"  # client n joins with its own q_n (Poisson sampling)
    delta_aggregate = True  # X + Σ (a_n/q_n)(X_n − X)

    @classmethod
    def from_config(cls, ctx: MethodContext) -> Sketched:
        m = ctx.cfg.method  # the boundary: the config's fields become checked vectors here
        q = resolve_q(m.q, a=ctx.a, q_fixed=m.q_fixed)
        k = resolve_k(m.k, n=ctx.a.size, gamma=ctx.gamma, rng=ctx.rng)
        return cls(a=ctx.a, q=q, k=k, gamma=ctx.gamma)

    def __init__(self, *, a: np.ndarray, q: np.ndarray, k: np.ndarray, gamma: int) -> None:
        """`q`, `k`: (N,) checked vectors (`resolve_q` / `resolve_k`, or `check_q` /
        `check_k` of `fedlora.system.sketch`); asserted, not re-checked."""
        self.a = np.asarray(a, dtype=float)
        self.gamma = gamma
        self.set_sampling(q, k)

    def set_sampling(self, q: np.ndarray, k: np.ndarray) -> None:
        """The (N,) q and k the next rounds use: at construction, and between rounds when
        `proposed`'s in-run planner puts a probe's or a new plan's setting in force (values
        from the planner, already checked: asserted here)."""
        self.q = np.asarray(q, dtype=float)
        self.k = np.asarray(k, dtype=np.int64)
        assert self.q.shape == self.k.shape == self.a.shape, "one q_n, k_n per client"
        assert np.all((self.q > 0) & (self.q <= 1)), f"unchecked q: {self.q}"
        assert np.all((self.k >= 1) & (self.k <= self.gamma)), f"unchecked k: {self.k}"

    def participation(self) -> np.ndarray:
        return self.q.copy()

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        participants = draw_participants(self.q, rng_sampling)
        if participants.size == 0:
            return RoundPlan(round_index, ())
        scales = draw_sketch_scales(self.gamma, self.k[participants], rng_sketch)  # (K, γ)
        weights = unbiased_weights(self.a, self.q, participants)
        tasks = tuple(
            ClientTask(int(n), scales[i], int(self.k[n]), float(weights[i]))
            for i, n in enumerate(participants)
        )
        return RoundPlan(round_index, tasks)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        weights = [t.weight for t in plan.tasks]
        return Aggregation(unbiased_aggregate(global_state, client_states, weights))
