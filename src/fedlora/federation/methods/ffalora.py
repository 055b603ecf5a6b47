"""`ffalora`: FFA-LoRA, LoRA with A frozen at its random init (Sun et al., ICLR 2024).

Every client starts from the same A: the seeded kaiming-uniform init of the global adapter
(PEFT's), which no one ever trains; B starts at 0. Each round m clients are sampled
uniformly (``method.clients_per_round``; 0 = all); each trains only B (rank γ) and uploads it;
the server averages

    B ← Σ_{n∈K} p_n B_n,   p_n = a_n / Σ_{m∈K} a_m,   A unchanged,

so the global product is exact: (Σ p_n B_n) A = Σ p_n B_n A = Σ p_n ΔW_n (FFA-LoRA's point:
no cross terms, unlike averaging B and A separately).

Payload per participant: B of every LoRA module, out·γ parameters, up and down. A costs no
bits: every client rebuilds it from the run's seed. (FFA-LoRA's scaling α is the run's
lora.alpha: the paper's larger α for a frozen A is a config choice, not a rule.)
"""

from __future__ import annotations

from fedlora.federation.methods.partial import PartialMethod
from fedlora.federation.methods.registry import register_method


@register_method("ffalora")
class FFALoRA(PartialMethod):
    name = "ffalora"
    dp_sampling = "uniform"  # m of N uniformly; B ← B + Σ w_n (B_n − B)
    normalised_weights = True  # a_n / Σ_K a_j
    trains = averages = uplink = downlink = "B"
    # B ← B + Σ p_n (B_n − B): a server optimizer keeps it exact (linear in B)
    delta_aggregate = True
