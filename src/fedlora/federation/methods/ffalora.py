"""`ffalora`: FFA-LoRA, LoRA with A frozen at its random init (Sun et al., ICLR 2024).

Every client starts from the same A: the seeded kaiming-uniform init of the global adapter
(PEFT's), which no one ever trains; B starts at 0. Each round m clients are sampled
uniformly (``method.clients_per_round``; 0 = all); each trains only B (rank γ) and uploads it;
the server averages

    B ← Σ_{n∈K} p_n B_n,   p_n = a_n / Σ_{m∈K} a_m,   A unchanged,

so the global product is exact: (Σ p_n B_n) A = Σ p_n B_n A = Σ p_n ΔW_n (FFA-LoRA's point:
no cross terms, unlike averaging B and A separately).

Payload per participant: B of every LoRA module, out·γ parameters, up and down. A costs no
bits: every client rebuilds it from the run's seed. (FFA-LoRA's scaling α is the run's
lora.alpha: the paper's larger α for a frozen A is a config choice, not a rule.)
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    LayerShapes,
    Method,
    MethodContext,
    Payload,
    RoundPlan,
)
from fedlora.federation.methods.partial import average_parts, factor_params, full_rank_plan
from fedlora.federation.methods.registry import register_method


@register_method("ffalora")
class FFALoRA(Method):
    name = "ffalora"
    delta_aggregate = (
        True  # B ← B + Σ p_n (B_n − B): a server optimizer keeps it exact (linear in B)
    )

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FFALoRA:
        return cls(a=ctx.a, gamma=ctx.gamma, clients_per_round=ctx.cfg.method.clients_per_round)

    def __init__(self, *, a: np.ndarray, gamma: int, clients_per_round: int = 0) -> None:
        self.a = np.asarray(a, dtype=float)
        self.gamma = gamma
        self.clients_per_round = clients_per_round

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        return full_rank_plan(
            round_index, self.a, self.gamma, self.clients_per_round, rng_sampling, "B"
        )

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        return Aggregation(average_parts(global_state, plan, client_states, "B"))

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        params = factor_params("B", shapes, self.gamma)
        return Payload(uplink_params=params, downlink_params=params)
