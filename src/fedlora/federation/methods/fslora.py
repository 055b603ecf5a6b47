"""`fslora`: Federated Sketching LoRA (Fang et al. 2025).

The server keeps a global adapter of rank γ. Each round it samples m of the N clients
uniformly without replacement (``method.clients_per_round``; 0 = all); participant n trains a
fresh uniformly random k_n-of-γ sketch of it, scaled by γ/k_n (Eq. 3; k_n = the client's rank
budget, ``method.ranks``, with ``[method.fslora] k = "ranks"``), and uploads the k_n columns of B and rows of A it changed. The
server averages the updates over the m participants:

    X ← X + (1/m) Σ_{n∈K} (X_n − X)

Every participant counts in the 1/m, also for the components it did not touch (their update
is 0). Dividing each component by the number of clients that touched it instead would not be
FSLoRA's rule: it re-weights components by how often they were drawn and biases the mean.
FSLoRA weighs clients equally (its objective is the plain mean of the client losses), so the
data weights a_n are not used. The authors' code feeds this average update to a server AdamW
(``method.server_optimizer = "adam"``; configs/fslora_reference.toml).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlora.config.checks import check_choice
from fedlora.federation.methods.base import (
    Adapter,
    Aggregation,
    ClientTask,
    Method,
    MethodContext,
    RoundPlan,
)
from fedlora.federation.methods.fedavg import uniform_participation, uniform_subset
from fedlora.federation.methods.registry import register_method
from fedlora.system.sketch import check_k, draw_sketch_scales, unbiased_aggregate

FSLORA_K = ("reference", "ranks")  # method.fslora.k


@dataclass(frozen=True)
class FSLoRAOptions:
    """FSLoRA's own options, the table ``[method.fslora]``."""

    # the sketch sizes k_n: "reference" (k_n uniform on [4, γ], our reading of the authors'
    # earlier code) or "ranks" (the shared budgets of method.ranks); formerly method.fslora_k
    k: str = "reference"

    def __post_init__(self) -> None:
        check_choice("method.fslora.k", self.k, FSLORA_K)


@register_method("fslora")
class FSLoRA(Method):
    name = "fslora"
    dp_sampling = "uniform"  # m of N uniformly; X + (1/m) Σ (X_n − X)
    delta_aggregate = True  # X + (1/m) Σ (X_n − X)
    options = FSLoRAOptions

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FSLoRA:
        m, gamma = ctx.cfg.method, ctx.gamma
        ranks = ctx.ranks()
        # "reference": k_n uniform on [4, γ] (γ < 4: γ), our reading of the authors'
        # code at 1bc7362; their current code: k = "ranks" with method.ranks = "fslora_*"
        # (docs/methods.md, "FSLoRA as its authors run it")
        if ctx.options.k == "reference":
            ranks = ctx.rng.integers(min(4, gamma), gamma + 1, size=ctx.a.size)
        return cls(k=ranks, gamma=gamma, clients_per_round=m.clients_per_round)

    def __init__(self, *, k: np.ndarray, gamma: int, clients_per_round: int = 0) -> None:
        self.k = check_k(k, gamma, name="method.ranks")
        self.gamma = gamma
        self.clients_per_round = clients_per_round

    def participation(self) -> np.ndarray:
        return uniform_participation(self.k.size, self.clients_per_round)

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        chosen = uniform_subset(self.k.size, self.clients_per_round, rng_sampling)
        scales = draw_sketch_scales(self.gamma, self.k[chosen], rng_sketch)  # (m, γ)
        weight = 1.0 / chosen.size
        tasks = tuple(
            ClientTask(int(n), scales[i], int(self.k[n]), weight) for i, n in enumerate(chosen)
        )
        return RoundPlan(round_index, tasks)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        # X − Σ (1/m)(X − X_n) = X + (1/m) Σ (X_n − X); the default payload() counts the
        # k_n(out + in) parameters of the sketched components, up and down.
        return Aggregation(
            unbiased_aggregate(global_state, client_states, [t.weight for t in plan.tasks])
        )
