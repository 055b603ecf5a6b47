"""What the methods that train or send only part of the adapter share (ffalora, fedsalora,
rolora, fedsb, fedexlora): a full-rank round plan whose tasks name the factors they train,
the weighted mean of chosen factors, and payloads counted per factor.

An adapter holds, per LoRA module, ``<module>.lora_A`` (γ, in), ``<module>.lora_B``
(out, γ) and, for Fed-SB, ``<module>.lora_R`` (γ, γ).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedlora.federation.methods.base import Adapter, ClientTask, LayerShapes, RoundPlan
from fedlora.federation.methods.factors import normalized_weights
from fedlora.federation.methods.fedavg import uniform_subset

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
