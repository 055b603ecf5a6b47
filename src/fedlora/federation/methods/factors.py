"""The LoRA factor algebra that the rank-heterogeneous methods share (fedstacklora, flexlora,
heterolora): which modules an adapter holds, the participants' normalised weights, the
stacked factors of a round, and ‖B A‖_F without forming the (out, in) product.

An adapter holds, per LoRA module, ``<module>.lora_A`` of shape (γ, in) and
``<module>.lora_B`` of shape (out, γ); a participant's `ClientTask.scale` (γ,) is non-zero on
the r_n components it trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedlora.federation.methods.base import Adapter, RoundPlan


def lora_modules(state: Adapter) -> list[str]:
    """Module names that have both ``<module>.lora_A`` and ``<module>.lora_B``."""
    return [k[: -len(".lora_A")] for k in state if k.endswith(".lora_A") and k[:-1] + "B" in state]


def normalized_weights(plan: RoundPlan) -> np.ndarray:
    """p_n = w_n / Σ_{m∈K} w_m over the round's participants (their data weights), shape (m,)."""
    p = np.array([t.weight for t in plan.tasks], dtype=float)
    return p / p.sum()


def stack_factors(
    plan: RoundPlan, client_states: Sequence[Adapter], module: str, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The stacked factors of `module` over the participants, in float64:

        B_stack (out, Σ r_n) = [p_1 B_1[:, J_1] diag(s_1[J_1]), …, p_m B_m[:, J_m] diag(s_m[J_m])]
        A_stack (Σ r_n, in)  = [A_1[J_1]; …; A_m[J_m]]

    with J_n the components participant n trained (s_n ≠ 0), p_n = `weights[n]`, so that
    B_stack A_stack = Σ_n p_n B_n diag(s_n) A_n.
    """
    ka, kb = f"{module}.lora_A", f"{module}.lora_B"
    active = [np.asarray(t.scale) != 0 for t in plan.tasks]
    b_stack = np.concatenate(
        [
            weights[i] * s[kb][:, m].astype(np.float64) * np.asarray(t.scale)[m]
            for i, (t, s, m) in enumerate(zip(plan.tasks, client_states, active))
        ],
        axis=1,
    )
    a_stack = np.concatenate(
        [s[ka][m].astype(np.float64) for s, m in zip(client_states, active)], axis=0
    )
    return b_stack, a_stack


def product_sq_norm(b: np.ndarray, a: np.ndarray) -> float:
    """‖B A‖_F² from the Gram matrices: Σ (BᵀB) ⊙ (AAᵀ) (no (out, in) product)."""
    return float(max(np.sum((b.T @ b) * (a @ a.T)), 0.0))


def product_fro_norm(b: np.ndarray, a: np.ndarray) -> float:
    """‖B A‖_F in float64, without forming the (out, in) product."""
    return float(np.sqrt(product_sq_norm(b.astype(np.float64), a.astype(np.float64))))
