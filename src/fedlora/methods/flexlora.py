"""`flexlora`: aggregate the full products, redistribute by truncated SVD (Bai et al. 2024).

Participant n (m sampled uniformly, ``method.clients_per_round``; 0 = all) with rank budget
r_n (``method.ranks``) trains the first r_n components of the global adapter. The server forms
each module's weighted product

    W = Σ_{n∈K} p_n B_n diag(s_n) A_n   (out, in),   p_n = a_n / Σ_{K} a_n,

(s_n: 1 on the client's r_n components) and keeps as the next global adapter its rank-γ
truncated SVD W ≈ U Σ Vᵀ, stored in singular-value order as B = U√Σ (out, γ), A = √Σ Vᵀ
(γ, in). Because of that order, client n's rank-r_n truncated SVD of W (the best rank-r_n
approximation, Eckart–Young) is exactly the first r_n components, i.e. the truncation scale
vector. If W has rank below γ the trailing components are zero. The SVD is computed from the
stacked factors (QR of both, SVD of a Σr × Σr core), never from the (out, in) matrix.
The forward factor scaling = alpha/γ is common to all clients and to W, so it cancels.

Payload per participant and LoRA module: r_n(out + in) down and up.
"""

from __future__ import annotations

import numpy as np

from fedlora.methods.base import Adapter, Aggregation, RoundPlan
from fedlora.methods.fedavg import RankTruncationMethod
from fedlora.methods.heterolora import lora_modules


def truncated_svd_factors(
    b_stack: np.ndarray, a_stack: np.ndarray, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """B (out, rank), A (rank, in) with B A = the best rank-`rank` approximation of b_stack @ a_stack.

    Singular values in decreasing order; B = U√Σ, A = √ΣVᵀ; zero-padded when rank(W) < rank.
    """
    qb, rb = np.linalg.qr(b_stack)  # (out, p), (p, R)
    qa, ra = np.linalg.qr(a_stack.T)  # (in, p'), (p', R)
    u_c, sv, vt_c = np.linalg.svd(rb @ ra.T)  # core (p, p')
    k = min(rank, sv.size)
    root = np.sqrt(sv[:k])
    b = np.zeros((b_stack.shape[0], rank))
    a = np.zeros((rank, a_stack.shape[1]))
    b[:, :k] = (qb @ u_c[:, :k]) * root[None, :]
    a[:k] = root[:, None] * (vt_c[:k] @ qa.T)
    return b, a


class FlexLoRA(RankTruncationMethod):
    name = "flexlora"

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        p = np.array([t.weight for t in plan.tasks], dtype=float)
        p = p / p.sum()
        out: Adapter = {}
        singular: dict[str, list[float]] = {}
        for mod in lora_modules(global_state):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            active = [np.asarray(t.scale) != 0 for t in plan.tasks]
            b_stack = np.concatenate(  # (out, Σ r_n): p_n B_n diag(s_n) on the active columns
                [
                    p[i] * s[kb][:, m].astype(np.float64) * np.asarray(t.scale)[m]
                    for i, (t, s, m) in enumerate(zip(plan.tasks, client_states, active))
                ],
                axis=1,
            )
            a_stack = np.concatenate(  # (Σ r_n, in)
                [s[ka][m].astype(np.float64) for s, m in zip(client_states, active)], axis=0
            )
            b, a = truncated_svd_factors(b_stack, a_stack, self.gamma)
            out[kb] = b.astype(global_state[kb].dtype)
            out[ka] = a.astype(global_state[ka].dtype)
            singular[mod] = (np.linalg.norm(b, axis=0) ** 2).tolist()  # ‖U√σ‖² = σ
        for name in global_state:
            out.setdefault(name, global_state[name])
        return Aggregation(out, info={"singular_values": singular})
