"""`rolora`: RoLoRA, alternating optimisation of the two LoRA factors (Chen et al., 2025).

Rounds alternate: in round r = 0, 2, 4, … (0-based) every participant trains only B with A
frozen; in round r = 1, 3, 5, … only A with B frozen (B first: with B = 0 at the init, A
would get no gradient). m clients are sampled uniformly per round (``method.clients_per_round``;
0 = all), and the server averages the factor that moved, p_n = a_n / Σ_{m∈K} a_m:

    B-round:  B ← Σ p_n B_n        A-round:  A ← Σ p_n A_n

The other factor is the same on every client, so the product is exact in every round:
(Σ p_n B_n) A = Σ p_n B_n A (and likewise for A).

Payload per participant: up, the factor it trained (out·γ or γ·in per LoRA module); down,
both factors, γ(out + in): a client sampled now may have missed the rounds that moved the
frozen factor (clients keep nothing between rounds, as for fedavg). With every client in
every round, a client would need only the factor moved in the previous round: RoLoRA's "half
the communication" counts that case.
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    LayerShapes,
    Payload,
    RoundPlan,
)
from fedlora.federation.methods.partial import (
    PartialMethod,
    average_parts,
    factor_params,
    full_rank_plan,
)
from fedlora.federation.methods.registry import register_method


def rolora_factor(round_index: int) -> str:
    """The factor RoLoRA trains in 0-based round `round_index`: B in even rounds, A in odd."""
    return "B" if round_index % 2 == 0 else "A"


@register_method("rolora")
class RoLoRA(PartialMethod):
    """`PartialMethod` (its construction and sampling) with the trained, averaged and sent
    factor alternating by round (`rolora_factor`)."""

    name = "rolora"
    dp_sampling = "uniform"  # m of N uniformly; the moving factor + Σ w_n (X_n − X)
    normalised_weights = True  # a_n / Σ_K a_j
    delta_aggregate = True  # the moving factor ← it + Σ p_n (X_n − X); exact for any step

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        factor = rolora_factor(round_index)
        return full_rank_plan(
            round_index, self.a, self.gamma, self.clients_per_round, rng_sampling, factor
        )

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        factor = rolora_factor(plan.round)
        return Aggregation(
            average_parts(global_state, plan, client_states, factor), info={"factor": factor}
        )

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        return Payload(
            uplink_params=factor_params(rolora_factor(plan.round), shapes, self.gamma),
            downlink_params=factor_params("AB", shapes, self.gamma),
        )
