"""Per-client rank budgets r_n ≤ γ, shared by every heterogeneous-rank baseline.

One config field, ``method.ranks``, gives the budgets of FSLoRA (its sketch sizes k_n),
HeteroLoRA, FedStackLoRA and FlexLoRA, so that the methods are compared on the same devices:

- ``capability`` (default): from each device's local compute time at full rank τ_n (the
  `tau_full_s` of its profile): r_n = ⌈γ · τ_min / τ_n⌉. The fastest device gets γ, a device
  twice as slow ⌈γ/2⌉, and every device at least 1. A device with τ_n = 0 gets γ; the
  reference τ_min is the smallest positive τ.
- ``full`` / ``normal`` / ``uniform``: the k strategies of `strategies.resolve_k`.
- ``fslora_uniform`` / ``fslora_normal`` / ``fslora_heavy_tail_low``: the distributions of
  the FSLoRA authors' ``generate_ranks`` (src/main.py:22-45 of
  wenzhifang/Federated-Sketching-LoRA-Implementation at ac24177; every baseline of theirs
  shares it) on [a, b] = ``method.rank_range`` (default [1, γ]); see `reference_ranks`.
- a ``.json`` / ``.csv`` file (key or column ``k``) or an explicit list, one entry per client.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedlora.config.sections import RANK_STRATEGIES, REFERENCE_RANK_STRATEGIES
from fedlora.errors import ConfigError, bad_value
from fedlora.federation.methods.strategies import resolve_k


def capability_ranks(tau_full_s: Sequence[float] | np.ndarray, gamma: int) -> np.ndarray:
    """r_n = ⌈γ · τ_min / τ_n⌉ in 1..γ: rank proportional to device speed 1/τ_n."""
    tau = np.asarray(tau_full_s, dtype=float)
    if tau.ndim != 1 or tau.size == 0:
        raise bad_value("tau_full_s", tau.tolist(), "a non-empty 1-D vector of seconds")
    bad = np.flatnonzero(~np.isfinite(tau) | (tau < 0))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"tau_full_s[{i}]", float(tau[i]), "finite and >= 0 seconds")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise bad_value("lora.rank", gamma, "an integer >= 1")
    ranks = np.full(tau.size, int(gamma), dtype=np.int64)
    positive = tau > 0
    if positive.any():
        tau_min = tau[positive].min()
        # ratio in (0, 1]; a tiny epsilon keeps exact multiples (γ·τ_min/τ = 8.000000001) at 8
        ratio = tau_min / tau[positive]
        ranks[positive] = np.clip(np.ceil(gamma * ratio - 1e-9), 1, gamma).astype(np.int64)
    return ranks


def reference_ranks(n: int, lo: int, hi: int, dist: str, rng: np.random.Generator) -> np.ndarray:
    """N rank budgets in [lo, hi] drawn as the FSLoRA authors' ``generate_ranks`` does:

    - ``uniform``: continuous uniform on [lo, hi];
    - ``normal``: normal with mean (lo + hi)/2 and σ = (hi − lo)/6 (99.7% inside), clipped;
    - ``heavy_tail_low``: 1/x with x lognormal (μ = ln((lo + hi)/4), σ = 1), rescaled by
      min–max onto [lo, hi]: most clients near lo, a few up to hi (the smallest draw is lo,
      the largest hi). One client (or equal draws) gets lo (the authors' formula divides 0/0).

    then rounded half to even (numpy's round). The authors seed numpy's global generator with
    42 inside the function; here `rng` is the run's ``strategy`` stream (reproducible by
    training.seed), so the budgets follow the same distribution but not the same draws.
    """
    if dist == "uniform":
        x = rng.uniform(lo, hi, n)
    elif dist == "normal":
        x = rng.normal((lo + hi) / 2, (hi - lo) / 6, n)
    elif dist == "heavy_tail_low":
        x = 1.0 / rng.lognormal(np.log((lo + hi) / 4), 1.0, n)
        span = x.max() - x.min()
        x = lo + (x - x.min()) / span * (hi - lo) if span > 0 else np.full(n, float(lo))
    else:
        raise bad_value(
            "method.ranks", f"fslora_{dist}", "fslora_uniform, _normal, _heavy_tail_low"
        )
    return np.round(np.clip(x, lo, hi)).astype(np.int64)


def resolve_ranks(
    spec: str | Sequence[int],
    *,
    n: int,
    gamma: int,
    rng: np.random.Generator,
    tau_full_s: np.ndarray | None = None,
    rank_range: Sequence[int] = (),
) -> np.ndarray:
    """The (N,) rank budgets for ``method.ranks``; `tau_full_s` is needed for ``capability``,
    `rank_range` ([a, b], default [1, γ]) by the ``fslora_*`` strategies."""
    if isinstance(spec, str) and spec in REFERENCE_RANK_STRATEGIES:
        lo, hi = rank_range if len(rank_range) == 2 else (1, gamma)
        if not 1 <= lo <= hi <= gamma:
            raise bad_value(
                "method.rank_range", list(rank_range), f"[a, b] with 1 <= a <= b <= {gamma}"
            )
        return reference_ranks(n, int(lo), int(hi), spec.removeprefix("fslora_"), rng)
    if isinstance(spec, str) and spec == "capability":
        if tau_full_s is None:
            raise bad_value(
                "method.ranks", spec, "capability needs the client profiles (tau_full_s)"
            )
        tau = np.asarray(tau_full_s, dtype=float)
        if tau.size != n:
            raise bad_value(
                "method.ranks", spec, f"profiles have {tau.size} clients, data.n_clients = {n}"
            )
        return capability_ranks(tau, gamma)
    if (
        isinstance(spec, str)
        and not spec.endswith((".json", ".csv"))
        and spec not in RANK_STRATEGIES
    ):
        raise bad_value(
            "method.ranks", spec, f"a strategy ({', '.join(RANK_STRATEGIES)}), a file, or a list"
        )
    try:
        return resolve_k(spec, n=n, gamma=gamma, rng=rng)
    except ConfigError as e:  # resolve_k's messages name method.k
        raise ConfigError(str(e).replace("method.k", "method.ranks")) from None
