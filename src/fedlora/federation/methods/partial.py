"""What the methods that train or send only part of the adapter share (ffalora, fedsalora,
rolora, fedsb, fedexlora): a full-rank round plan whose tasks name the factors they train,
the weighted mean of chosen factors, and payloads counted per factor.

`PartialMethod` is their base: m clients sampled uniformly each round on the whole rank-γ
adapter; a subclass says in class attributes what a participant trains (`trains`), what the
server averages (`averages`) and what a participant receives and sends (`downlink`,
`uplink`), and keeps only what differs (Fed-SB's init, FedSA-LoRA's local B, FedEx-LoRA's
residual).

An adapter holds, per LoRA module, ``<module>.lora_A`` (γ, in), ``<module>.lora_B``
(out, γ) and, for Fed-SB, ``<module>.lora_R`` (γ, γ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
from fedlora.federation.methods.factors import normalized_weights
from fedlora.federation.methods.fedavg import uniform_participation, uniform_subset

# parameters of one factor of one module: (out, in, γ) -> count
FACTOR_PARAMS: dict[str, Callable[[int, int, int], int]] = {
    "A": lambda out, inp, g: g * inp,
    "B": lambda out, inp, g: out * g,
    "R": lambda out, inp, g: g * g,
    "W": lambda out, inp, g: out * inp,  # a dense (out, in) matrix (FedEx-LoRA's residual)
}


def factor_params(factors: str, shapes: LayerShapes, gamma: int) -> int:
    """Parameters of `factors` (letters of ``ABRW``) summed over every LoRA module."""
    return sum(FACTOR_PARAMS[f](o, i, gamma) for f in factors for o, i in shapes.values())


def full_rank_plan(
    round_index: int,
    a: np.ndarray,
    gamma: int,
    clients_per_round: int,
    rng: np.random.Generator,
    trains: str,
) -> RoundPlan:
    """m clients uniformly (all when m = 0) on the whole rank-γ adapter (scale 1), training
    the factors `trains`; each participant's weight is its data weight a_n."""
    chosen = uniform_subset(a.size, clients_per_round, rng)
    ones = np.ones(gamma)
    tasks = tuple(ClientTask(int(n), ones, gamma, float(a[n]), trains) for n in chosen)
    return RoundPlan(round_index, tasks)


def average_parts(
    global_state: Adapter, plan: RoundPlan, client_states: Sequence[Adapter], parts: str
) -> Adapter:
    """The global adapter with every tensor of the factors `parts` (``"B"`` -> every
    ``*.lora_B``) replaced by the participants' mean Σ p_n X_n (p_n = a_n / Σ_K a_n, float64,
    cast back); every other tensor keeps its global value (the clients' copies are not read)."""
    p = normalized_weights(plan)
    out = dict(global_state)
    suffixes = tuple(f".lora_{f}" for f in parts)
    for name, x in global_state.items():
        if name.endswith(suffixes):
            acc = sum(w * s[name].astype(np.float64) for w, s in zip(p, client_states))
            out[name] = np.asarray(acc).astype(x.dtype)
    return out


class PartialMethod(Method):
    """m clients uniformly (``method.clients_per_round``; 0 = all) on the rank-γ adapter, each
    training the factors `trains`; the server replaces the factors `averages` by the
    participants' mean Σ p_n X_n (p_n = a_n / Σ_K a_m; `average_parts`). Payload per
    participant: the factors `uplink` up, `downlink` down (letters of ``ABRW``)."""

    trains = "AB"
    averages = "AB"
    uplink = "AB"
    downlink = "AB"
    delta_aggregate = True  # X ← X + Σ p_n (X_n − X) on the averaged factors

    @classmethod
    def from_config(cls, ctx: MethodContext) -> PartialMethod:
        return cls(a=ctx.a, gamma=ctx.gamma, clients_per_round=ctx.cfg.method.clients_per_round)

    def __init__(self, *, a: np.ndarray, gamma: int, clients_per_round: int = 0) -> None:
        self.a = np.asarray(a, dtype=float)
        self.gamma = gamma
        self.clients_per_round = clients_per_round

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        return full_rank_plan(
            round_index, self.a, self.gamma, self.clients_per_round, rng_sampling, self.trains
        )

    def participation(self) -> np.ndarray:
        return uniform_participation(self.a.size, self.clients_per_round)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        return Aggregation(average_parts(global_state, plan, client_states, self.averages))

    def payload(self, task: ClientTask, shapes: LayerShapes, plan: RoundPlan) -> Payload:
        return Payload(
            uplink_params=factor_params(self.uplink, shapes, self.gamma),
            downlink_params=factor_params(self.downlink, shapes, self.gamma),
        )
