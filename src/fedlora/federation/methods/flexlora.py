"""`flexlora`: aggregate the full products, redistribute by truncated SVD (Bai et al. 2024).

Participant n (m sampled uniformly, ``method.clients_per_round``; 0 = all) with rank budget
r_n (``method.ranks``) trains the first r_n components of the global adapter. The server forms
each module's full-size weighted product

    W_g = Σ_{n∈K} p_n B_n diag(s_n) A_n   (out, in),   p_n = a_n / Σ_{K} a_n,

(s_n: 1 on the client's r_n components) and, as FlexLoRA's reference, splits its SVD
W_g = U Σ Vᵀ as B = U Σ (out, γ), A = Vᵀ (γ, in), in singular-value order. Client n's
download, FlexLoRA's per-client truncation of the full W_g to rank r_n (Eckart–Young), is then
exactly the first r_n components: B = U_r Σ_r, A = V_rᵀ. A's rows are orthonormal, also for
components with σ_j = 0 (when rank(W_g) < γ, e.g. participants whose ranks sum to less than
γ): V is completed to an orthonormal basis (seeded, like any SVD's choice of null vectors), so
B_j = 0 but A_j ≠ 0 and every component gets a gradient again in the next round.

The global adapter has rank γ, so when Σ_K r_n > γ the evaluated (and exported) global model
is W_g's best rank-γ approximation; the clients, whose r_n ≤ γ, get the same truncation as
from the full W_g. `info["truncation_loss"]` records ‖W_g − W_γ‖_F / ‖W_g‖_F per module.

The SVD is computed from the stacked factors (QR of both, SVD of a Σr × Σr core), never from
the (out, in) matrix. The forward factor scaling = alpha/γ is common to all clients and to W,
so it cancels. Payload per participant and LoRA module: r_n(out + in) down and up.
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import Adapter, Aggregation, MethodContext, RoundPlan
from fedlora.federation.methods.factors import (
    lora_modules,
    normalized_weights,
    product_sq_norm,
    stack_factors,
)
from fedlora.federation.methods.fedavg import RankTruncationMethod
from fedlora.federation.methods.registry import register_method

NULL_STREAM = 0xF1E7  # keeps the null-space draws apart from the engine's streams


def truncated_svd_factors(
    b_stack: np.ndarray,
    a_stack: np.ndarray,
    rank: int,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """B (out, rank) = U_r Σ_r, A (rank, in) = V_rᵀ of W = b_stack @ a_stack (FlexLoRA's split).

    B A is the best rank-`rank` approximation of W. A has orthonormal rows: beyond rank(W) (and
    beyond the stacks' row space) V is completed with orthonormal vectors drawn from `rng`
    (default seed 0), whose B columns are 0. Rows beyond `in` (rank > in) stay 0.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    qb, rb = np.linalg.qr(b_stack)  # (out, p), (p, R)
    qa, ra = np.linalg.qr(a_stack.T)  # (in, p'), (p', R)
    u_c, sv, vt_c = np.linalg.svd(rb @ ra.T)  # core (p, p'): u (p, p), vt (p', p')
    v = qa @ vt_c.T  # (in, p'): right singular vectors, then a basis of the rest of span(qa)
    n_in = a_stack.shape[1]
    if v.shape[1] < min(rank, n_in):  # complete V outside span(qa), orthonormally
        extra = rng.normal(size=(n_in, min(rank, n_in) - v.shape[1]))
        extra -= qa @ (qa.T @ extra)
        v = np.concatenate([v, np.linalg.qr(extra)[0]], axis=1)
    k = min(rank, sv.size)
    m = min(rank, v.shape[1])
    b = np.zeros((b_stack.shape[0], rank))
    a = np.zeros((rank, n_in))
    b[:, :k] = (qb @ u_c[:, :k]) * sv[:k][None, :]
    a[:m] = v[:, :m].T
    return b, a


@register_method("flexlora")
class FlexLoRA(RankTruncationMethod):
    name = "flexlora"
    dp_refusal = (
        "its aggregate is a truncated SVD of the clients' products, not a sum of "
        "their adapter updates"
    )

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FlexLoRA:
        m = ctx.cfg.method
        return cls(
            a=ctx.a,
            ranks=ctx.ranks(),
            gamma=ctx.gamma,
            clients_per_round=m.clients_per_round,
            seed=ctx.cfg.training.seed,
        )

    def __init__(
        self,
        *,
        a: np.ndarray,
        ranks: np.ndarray,
        gamma: int,
        clients_per_round: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(a=a, ranks=ranks, gamma=gamma, clients_per_round=clients_per_round)
        self.seed = seed

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        p = normalized_weights(plan)
        rng = np.random.default_rng([self.seed, NULL_STREAM, plan.round])
        out: Adapter = {}
        singular: dict[str, list[float]] = {}
        lost: dict[str, float] = {}
        for mod in lora_modules(global_state):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            # (out, Σ r_n): p_n B_n diag(s_n) on the active columns; (Σ r_n, in)
            b_stack, a_stack = stack_factors(plan, client_states, mod, p)
            b, a = truncated_svd_factors(b_stack, a_stack, self.gamma, rng)
            out[kb] = b.astype(global_state[kb].dtype)
            out[ka] = a.astype(global_state[ka].dtype)
            sv = np.linalg.norm(b, axis=0)  # ‖U_j σ_j‖ = σ_j
            singular[mod] = sv.tolist()
            total = product_sq_norm(b_stack, a_stack)  # ‖W_g‖²
            lost[mod] = float(np.sqrt(max(total - np.sum(sv**2), 0.0) / total)) if total else 0.0
        for name in global_state:
            out.setdefault(name, global_state[name])
        return Aggregation(out, info={"singular_values": singular, "truncation_loss": lost})
