"""`heterolora`: heterogeneous-rank LoRA with truncation and zero padding (HetLoRA, Cho et al. 2024).

The global adapter has rank γ. Participant n (m sampled uniformly per round,
``method.clients_per_round``; 0 = all) has rank budget r_n ≤ γ (``method.ranks``):

- download: the global adapter truncated to its first r_n components (B[:, :r_n], A[:r_n]);
- local training of those r_n components (rank truncation scale vector: 1 on the first r_n,
  0 elsewhere, no rescaling);
- upload: the r_n trained components; the server zero-pads them back to rank γ
  (B̃_n = [B_n, 0], Ã_n = [A_n; 0]) and averages the padded *modules*:

      B ← Σ_{n∈K} p_n B̃_n,   A ← Σ_{n∈K} p_n Ã_n,   Σ_{n∈K} p_n = 1.

  Component j ≥ r_n receives a zero from client n, so high-rank components are shrunk by the
  low-rank clients' share (the dilution later papers criticise). That is the method.

Weights p_n (`weighting`): ``"sparsity"`` (HetLoRA's sparsity-weighted aggregation, the
default): per LoRA module, p_n ∝ ‖B̃_n Ã_n‖_F, the Frobenius norm of the client's padded
product, normalised over the participants (all norms zero: falls back to data weights);
``"data"``: p_n = a_n / Σ_{K} a_n. HetLoRA's optional local rank self-pruning is not
implemented. Payload: r_n(out + in) parameters per module, up and down.
"""

from __future__ import annotations

import numpy as np

from fedlora.errors import bad_value
from fedlora.methods.base import Adapter, Aggregation, RoundPlan
from fedlora.methods.fedavg import RankTruncationMethod, weighted_mean

WEIGHTINGS = ("sparsity", "data")


def lora_modules(state: Adapter) -> list[str]:
    """Module names that have both ``<module>.lora_A`` and ``<module>.lora_B``."""
    return [k[: -len(".lora_A")] for k in state if k.endswith(".lora_A") and k[:-1] + "B" in state]


def product_fro_norm(b: np.ndarray, a: np.ndarray) -> float:
    """‖B A‖_F without forming the (out, in) product: ‖BA‖² = Σ (BᵀB) ⊙ (AAᵀ)."""
    b, a = b.astype(np.float64), a.astype(np.float64)
    return float(np.sqrt(max(np.sum((b.T @ b) * (a @ a.T)), 0.0)))


class HeteroLoRA(RankTruncationMethod):
    name = "heterolora"

    def __init__(
        self,
        *,
        a: np.ndarray,
        ranks: np.ndarray,
        gamma: int,
        clients_per_round: int = 0,
        weighting: str = "sparsity",
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise bad_value("heterolora weighting", weighting, f"one of {', '.join(WEIGHTINGS)}")
        super().__init__(a=a, ranks=ranks, gamma=gamma, clients_per_round=clients_per_round)
        self.weighting = weighting

    def aggregate(
        self, global_state: Adapter, plan: RoundPlan, client_states: list[Adapter]
    ) -> Aggregation:
        if not client_states:
            return Aggregation(dict(global_state))
        data_w = np.array([t.weight for t in plan.tasks], dtype=float)
        data_w = data_w / data_w.sum()
        masks = [(np.asarray(t.scale) != 0).astype(np.float64) for t in plan.tasks]  # (γ,) each
        out: Adapter = {}
        info: dict = {"weights": {}}
        for mod in lora_modules(global_state):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            padded_a = [m[:, None] * s[ka] for m, s in zip(masks, client_states)]  # (γ, in)
            padded_b = [s[kb] * m[None, :] for m, s in zip(masks, client_states)]  # (out, γ)
            p = data_w
            if self.weighting == "sparsity":
                norms = np.array([product_fro_norm(b, a) for b, a in zip(padded_b, padded_a)])
                if norms.sum() > 0:
                    p = norms / norms.sum()
            info["weights"][mod] = p.tolist()
            dtype_a, dtype_b = global_state[ka].dtype, global_state[kb].dtype
            out[ka] = sum(w * x for w, x in zip(p, padded_a)).astype(dtype_a)
            out[kb] = sum(w * x for w, x in zip(p, padded_b)).astype(dtype_b)
        rest = [k for k in global_state if k not in out]
        if rest:  # anything that is not a LoRA pair: the data-weighted mean
            out.update(weighted_mean([{k: s[k] for k in rest} for s in client_states], data_w))
        return Aggregation(out, info=info)
