"""`fedavg`: homogeneous LoRA of rank γ, all clients or m sampled uniformly per round.

Aggregation is FedAvg's normalised data-weighted mean over the participants,
X ← Σ_{n∈K} a_n X_n / Σ_{n∈K} a_n (with all clients this is exactly Σ a_n X_n).
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
from fedlora.system.sketch import check_k, truncation_scales


def uniform_subset(n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """m of n clients uniformly without replacement, sorted; m = 0 means all n."""
    if m == 0 or m >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=m, replace=False))


def truncated_rank_plan(
    round_index: int,
    a: np.ndarray,
    ranks: np.ndarray,
    gamma: int,
    clients_per_round: int,
    rng: np.random.Generator,
) -> RoundPlan:
    """m clients uniformly (all when m = 0), each on its first r_n rank components, unscaled.

    The plan of every uniformly sampled method: FedAvg (r_n = γ) and the heterogeneous-rank
    baselines. Each participant's weight is its data weight a_n.
    """
    chosen = uniform_subset(a.size, clients_per_round, rng)
    scales = truncation_scales(gamma, ranks[chosen])  # (m, γ)
    tasks = tuple(
        ClientTask(int(n), scales[i], int(ranks[n]), float(a[n])) for i, n in enumerate(chosen)
    )
    return RoundPlan(round_index, tasks)


def uniform_participation(n: int, m: int) -> np.ndarray:
    """Each of n clients' probability of being among m drawn uniformly (m = 0: all)."""
    return np.full(n, 1.0 if m == 0 or m >= n else m / n)


def weighted_mean(client_states: list[Adapter], weights: np.ndarray) -> Adapter:
    """Σ w_i X_i / Σ w_i, key by key (float64 accumulation, cast back)."""
    w = np.asarray(weights, dtype=float) / np.sum(weights)
    out = {}
    for name in client_states[0]:
        acc = sum(wi * states[name].astype(np.float64) for wi, states in zip(w, client_states))
        out[name] = acc.astype(client_states[0][name].dtype)
    return out


class RankTruncationMethod(Method):
    """Base of the uniformly sampled methods whose clients train their first r_n rank
    components: FedAvg (r_n = γ), HeteroLoRA, FlexLoRA, FedStackLoRA."""

    def __init__(
        self, *, a: np.ndarray, ranks: np.ndarray, gamma: int, clients_per_round: int = 0
    ) -> None:
        self.a = np.asarray(a, dtype=float)
        self.ranks = check_k(ranks, gamma, name="method.ranks")
        self.gamma = gamma
        self.clients_per_round = clients_per_round

    def plan_round(
        self, round_index: int, rng_sampling: np.random.Generator, rng_sketch: np.random.Generator
    ) -> RoundPlan:
        return truncated_rank_plan(
            round_index, self.a, self.ranks, self.gamma, self.clients_per_round, rng_sampling
        )

    def participation(self) -> np.ndarray:
        return uniform_participation(self.a.size, self.clients_per_round)


@register_method("fedavg")
class FedAvg(RankTruncationMethod):
    name = "fedavg"
    dp_sampling = "uniform"  # m of N uniformly (m = 0: all N); X + Σ w_n (X_n − X)
    normalised_weights = True  # a_n / Σ_K a_j
    delta_aggregate = True  # Σ p_n X_n = X + Σ p_n (X_n − X): every client starts from X

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FedAvg:
        return cls(a=ctx.a, gamma=ctx.gamma, clients_per_round=ctx.cfg.method.clients_per_round)

    def __init__(self, *, a: np.ndarray, gamma: int, clients_per_round: int = 0) -> None:
        ranks = np.full(len(a), gamma)
        super().__init__(a=a, ranks=ranks, gamma=gamma, clients_per_round=clients_per_round)

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        return Aggregation(weighted_mean(client_states, np.array([t.weight for t in plan.tasks])))
