"""`fedsb`: Fed-SB, federated LoRA-SB: train an r × r matrix between frozen factors
(Singhal, Ponkshe, Vartak, Varshney & Vepakomma, 2025).

Every LoRA module computes ΔW = s · B R A (s = the forward factor lora.scaling) with B
(out, γ) and A (γ, in) frozen and the same on every client, and only R (γ, γ) trained. Each
round m clients are sampled uniformly (``method.clients_per_round``; 0 = all), each trains
R_n from the global R, and the server averages

    R ← Σ_{n∈K} p_n R_n,   p_n = a_n / Σ_{m∈K} a_m,

which is exact: B (Σ p_n R_n) A = Σ p_n B R_n A = Σ p_n ΔW_n / s.

Initialisation (`initial_state`): LoRA-SB sets B and A from the truncated SVD of an
approximate first full fine-tuning step (a gradient pass over the data). fedlora's methods
never touch the model, so here B has orthonormal columns and A orthonormal rows drawn from
the run's seed (so every client rebuilds them, at no cost in bits) and R = 0 (ΔW = 0 at the
start, like LoRA's B = 0): the r × r exactness and the payload are Fed-SB's; the subspace R
trains in is random rather than the gradient's (a stated deviation).

Payload per participant: R of every LoRA module, γ² parameters, up and down: independent of
the layer sizes and of the number of clients.
"""

from __future__ import annotations

import numpy as np

from fedlora.federation.methods.base import Adapter, MethodContext
from fedlora.federation.methods.factors import lora_modules
from fedlora.federation.methods.partial import PartialMethod
from fedlora.federation.methods.registry import register_method

INIT_STREAM = 0x5B5B  # keeps the frozen factors' draws apart from the engine's streams


def orthonormal(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, cols) matrix with orthonormal columns (rows ≥ cols) or rows (rows < cols)."""
    tall = rows >= cols
    q, _ = np.linalg.qr(rng.normal(size=(rows, cols) if tall else (cols, rows)))
    return q if tall else q.T


@register_method("fedsb")
class FedSB(PartialMethod):
    name = "fedsb"
    dp_sampling = "uniform"  # m of N uniformly; R ← R + Σ w_n (R_n − R)
    normalised_weights = True  # a_n / Σ_K a_j
    trains = averages = uplink = downlink = "R"
    delta_aggregate = True  # R ← R + Σ p_n (R_n − R); B R A is linear in R: exact for any step

    @classmethod
    def from_config(cls, ctx: MethodContext) -> FedSB:
        return cls(
            a=ctx.a,
            gamma=ctx.gamma,
            clients_per_round=ctx.cfg.method.clients_per_round,
            seed=ctx.cfg.training.seed,
        )

    def __init__(
        self, *, a: np.ndarray, gamma: int, clients_per_round: int = 0, seed: int = 0
    ) -> None:
        super().__init__(a=a, gamma=gamma, clients_per_round=clients_per_round)
        self.seed = seed

    def initial_state(self, global_state: Adapter) -> Adapter:
        """B (out, γ) orthonormal columns, A (γ, in) orthonormal rows, R = 0 (γ, γ)."""
        rng = np.random.default_rng([self.seed, INIT_STREAM])
        out = dict(global_state)
        for mod in sorted(lora_modules(global_state)):
            ka, kb = f"{mod}.lora_A", f"{mod}.lora_B"
            (n_out, g), n_in = global_state[kb].shape, global_state[ka].shape[1]
            out[kb] = orthonormal(n_out, g, rng).astype(global_state[kb].dtype)
            out[ka] = orthonormal(g, n_in, rng).astype(global_state[ka].dtype)
            out[f"{mod}.lora_R"] = np.zeros((g, g), dtype=global_state[ka].dtype)
        return out
