"""`fedsalora`: FedSA-LoRA, share A and keep B on the client (Guo et al., ICLR 2025).

FedSA-LoRA's finding: the A matrices learn what the clients share, the B matrices what is
specific to each. Each round m clients are sampled uniformly (``method.clients_per_round``;
0 = all); client n trains both factors, starting from the global A and ITS OWN B_n (the one
it kept after the last round it took part in; at first the init, B = 0), uploads only A_n
and keeps B_n. The server averages

    A ← Σ_{n∈K} p_n A_n,   p_n = a_n / Σ_{m∈K} a_m,

and never sees a B (`is_local`: the trainer strips every ``lora_B`` from the upload and keeps
it in the client's memory, `fedlora.federation.clientmemory`). Client n's model is the
personalised (A, B_n).

Evaluation: FedSA-LoRA evaluates each client's personalised model on its own test data;
fedlora evaluates one global adapter on the task's test set. That adapter is (A, B̄) with
B̄ = Σ_n a_n B_n over every client's kept B (a client that never trained: its init 0). B̄ is
formed in the simulation for evaluation and export only: it is sent on no link and the clock
does not count it.

Payload per participant: A of every LoRA module, γ·in parameters, up and down.
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


@register_method("fedsalora")
class FedSALoRA(Method):
    name = "fedsalora"
    delta_aggregate = True  # A ← A + Σ p_n (A_n − A)

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FedSALoRA:
        return cls(a=ctx.a, gamma=ctx.gamma, clients_per_round=ctx.cfg.method.clients_per_round)

    def __init__(self, *, a: np.ndarray, gamma: int, clients_per_round: int = 0) -> None:
        self.a = np.asarray(a, dtype=float)
        self.gamma = gamma
        self.clients_per_round = clients_per_round

    def is_local(self, name: str) -> bool:
        return name.endswith(".lora_B")

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        return full_rank_plan(
            round_index, self.a, self.gamma, self.clients_per_round, rng_sampling, "AB"
        )

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        return Aggregation(average_parts(global_state, plan, client_states, "A"))

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        params = factor_params("A", shapes, self.gamma)
        return Payload(uplink_params=params, downlink_params=params)
