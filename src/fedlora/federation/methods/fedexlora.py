"""`fedexlora`: FedEx-LoRA, exact aggregation through a residual in the frozen weights
(Singhal, Ponkshe & Vepakomma, ACL 2025).

Each round m clients are sampled uniformly (``method.clients_per_round``; 0 = all) and train
both factors of the rank-γ adapter, as FedAvg. The server averages them (p_n = a_n /
Σ_{m∈K} a_m) and, because the product of the means is not the mean of the products, adds the
difference to every client's frozen base weights:

    B ← B̄ = Σ p_n B_n,   A ← Ā = Σ p_n A_n,
    W0 ← W0 + s · (Σ p_n B_n A_n − B̄ Ā)      (s = lora.scaling: α/γ, or α/√γ with rsLoRA),

so W0 + s·B̄Ā after the round equals W0 + Σ p_n s·B_n A_n: the global ΔW is exactly the
weighted mean of the clients' ΔW_n. The engine merges the residual once
(`Aggregation.base_delta`, as FedStackLoRA's); a resumed run merges the checkpoint's sum of
residuals and gets the same weights bit for bit (`SlotLora.add_to_base`).

Payload per participant and LoRA module: up γ(out + in) (B_n, A_n); down γ(out + in) for
(B̄, Ā) plus the residual, a dense out × in matrix (FedEx-LoRA sends it as is). Its rank is
at most (m + 1)γ, so for m(+1)γ(out + in) < out·in a factored broadcast would be cheaper;
fedlora counts what the paper sends.
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import Adapter, Aggregation, MethodContext, RoundPlan
from fedlora.federation.methods.factors import lora_modules, normalized_weights, stack_factors
from fedlora.federation.methods.partial import PartialMethod, average_parts
from fedlora.federation.methods.registry import register_method


@register_method("fedexlora")
class FedExLoRA(PartialMethod):
    name = "fedexlora"
    dp_refusal = (
        "its aggregate adds a dense residual of the clients' products to the base "
        "weights, which clipping the adapter updates does not bound"
    )
    trains = averages = uplink = "AB"
    downlink = "ABW"  # (B̄, Ā) and the dense residual
    delta_aggregate = False  # its residual is exact only for the plain means B̄, Ā

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FedExLoRA:
        return cls(
            a=ctx.a,
            gamma=ctx.gamma,
            scaling=ctx.cfg.lora.scaling,
            clients_per_round=ctx.cfg.method.clients_per_round,
        )

    def __init__(
        self, *, a: np.ndarray, gamma: int, scaling: float, clients_per_round: int = 0
    ) -> None:
        super().__init__(a=a, gamma=gamma, clients_per_round=clients_per_round)
        self.scaling = float(scaling)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        out = average_parts(global_state, plan, client_states, "AB")
        p = normalized_weights(plan)
        base_delta: dict[str, np.ndarray] = {}
        norms: dict[str, float] = {}
        for mod in lora_modules(global_state):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            b_stack, a_stack = stack_factors(plan, client_states, mod, p)  # float64
            b_bar = sum(w * s[kb].astype(np.float64) for w, s in zip(p, client_states))
            a_bar = sum(w * s[ka].astype(np.float64) for w, s in zip(p, client_states))
            residual = self.scaling * (b_stack @ a_stack - b_bar @ a_bar)  # (out, in)
            base_delta[mod] = residual.astype(global_state[kb].dtype)
            norms[mod] = float(np.linalg.norm(residual))
        return Aggregation(out, base_delta=base_delta, info={"residual_norm": norms})
