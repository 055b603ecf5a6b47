"""`fedstacklora`: stacking heterogeneous LoRA adapters into the base (FLoRA, Wang et al. 2024).

Each round participant n (m sampled uniformly, ``method.clients_per_round``; 0 = all) trains a
FRESH adapter of its own rank r_n (``method.ranks``): B = 0, A ~ U(−1/√in, 1/√in) (PEFT's
kaiming-uniform(a=√5) init), drawn from a generator derived from (seed, round), so every
client can rebuild it and a resumed run draws the same. The server stacks the uploads,

    B_stack = [p_1 B_1, …, p_m B_m] (out, Σ r_n),   A_stack = [A_1; …; A_m] (Σ r_n, in),

with p_n = a_n / Σ_{K} a_n, and every participant downloads the stacked adapter and merges
it into its frozen base weights: W ← W + scaling · B_stack A_stack = W + Σ p_n scaling B_n A_n.
Here the engine does the merge once (`Aggregation.base_delta`); scaling = lora.alpha /
lora.rank is the factor of the forward pass ΔW = scaling · B diag(s) A, and s_n (1 on the
first r_n components) selects the client's r_n components. The next round starts again from
a fresh adapter.

Payload per participant and LoRA module: up r_n(out + in); down the stacked adapter of the
round, Σ_{j∈K} r_j (out + in), which grows with the number of participants.
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    LayerShapes,
    MethodContext,
    Payload,
    RoundPlan,
    sketch_payload_params,
)
from fedlora.federation.methods.factors import lora_modules, normalized_weights, stack_factors
from fedlora.federation.methods.fedavg import RankTruncationMethod
from fedlora.federation.methods.registry import register_method

INIT_STREAM = 0x5743  # keeps the fresh-init draws apart from the engine's streams


def fresh_adapter(template: Adapter, seed: int, round_index: int) -> Adapter:
    """B = 0 and A ~ U(−1/√in, 1/√in) (kaiming-uniform, a = √5) with the shapes of `template`.

    Deterministic in (seed, round_index): the adapter every client starts round r+1 from.
    """
    rng = np.random.default_rng([seed, INIT_STREAM, round_index])
    out: Adapter = {}
    for name in sorted(template):
        x = template[name]
        if name.endswith(".lora_A"):
            bound = 1.0 / np.sqrt(x.shape[1])  # x: (γ, in)
            out[name] = rng.uniform(-bound, bound, size=x.shape).astype(x.dtype)
        else:
            out[name] = np.zeros_like(x)
    return out


@register_method("fedstacklora")
class FedStackLoRA(RankTruncationMethod):
    name = "fedstacklora"
    dp_refusal = (
        "its aggregate stacks the clients' factors side by side and merges them "
        "into the base weights, not a sum of updates"
    )
    flower_refusal = "its merged base update is not sent to the nodes; use `fedlora run`"

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FedStackLoRA:
        cfg = ctx.cfg
        return cls(
            a=ctx.a,
            ranks=ctx.ranks(),
            gamma=ctx.gamma,
            scaling=cfg.lora.scaling,  # α/γ (α/√γ with lora.rslora): the slots' factor
            seed=cfg.training.seed,
            clients_per_round=cfg.method.clients_per_round,
        )

    def __init__(
        self,
        *,
        a: np.ndarray,
        ranks: np.ndarray,
        gamma: int,
        scaling: float,
        seed: int = 0,
        clients_per_round: int = 0,
    ) -> None:
        super().__init__(a=a, ranks=ranks, gamma=gamma, clients_per_round=clients_per_round)
        self.scaling = float(scaling)
        self.seed = seed

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        p = normalized_weights(plan)
        base_delta: dict[str, np.ndarray] = {}
        for mod in lora_modules(global_state):
            # the stack: B_stack (out, Σr) = [p_n B_n[:, :r_n]], A_stack (Σr, in) = [A_n[:r_n]]
            b_stack, a_stack = stack_factors(plan, client_states, mod, p)
            dtype = global_state[f"{mod}.lora_B"].dtype
            base_delta[mod] = (self.scaling * b_stack @ a_stack).astype(dtype)
        fresh = fresh_adapter(global_state, self.seed, plan.round + 1)
        info = {"stacked_rank": int(sum(t.rank_used for t in plan.tasks))}
        return Aggregation(fresh, base_delta=base_delta, info=info)

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        stacked = sum(t.rank_used for t in plan.tasks)
        return Payload(
            uplink_params=sketch_payload_params(task.rank_used, shapes),
            downlink_params=sketch_payload_params(stacked, shapes),
        )
