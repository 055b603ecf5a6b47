"""Per-client sampling probabilities q and sketch sizes k from a strategy, a file or a list.

q strategies (paper §VI-A): `full` (1), `fixed` (q_fixed, 0.2 by default), `uniform` (1/N),
`weighted` (a_n). k strategies (§VI-B): `full` (γ), `normal` (a normal around γ/2 with
σ = γ/4, truncated to [1, γ] and rounded), `uniform` (integers uniform on [1, γ]).
A file is JSON (a list, or an object with key "q"/"k") or CSV (a column named "q"/"k").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedlora.errors import bad_value
from fedlora.files import read_vector
from fedlora.system.sketch import check_k, check_q


def resolve_q(spec: str | Sequence[float], *, a: np.ndarray, q_fixed: float = 0.2) -> np.ndarray:
    """The (N,) sampling probabilities for a strategy name, a file path, or explicit values."""
    n = len(a)
    if isinstance(spec, str):
        if spec == "full":
            return np.ones(n)
        if spec == "fixed":
            return np.full(n, float(q_fixed))
        if spec == "uniform":
            return np.full(n, 1.0 / n)
        if spec == "weighted":
            return check_q(np.asarray(a, dtype=float), name="method.q (weighted: a_n)")
        spec = read_vector(spec, "q")
    q = check_q(np.asarray(spec, dtype=float), name="method.q")
    if q.size != n:
        raise bad_value("method.q", list(spec), f"one value per client (N = {n}), got {q.size}")
    return q


def resolve_k(
    spec: str | Sequence[int], *, n: int, gamma: int, rng: np.random.Generator
) -> np.ndarray:
    """The (N,) sketch sizes (or ranks) for a strategy name, a file path, or explicit values."""
    if isinstance(spec, str):
        if spec == "full":
            return np.full(n, gamma, dtype=np.int64)
        if spec == "uniform":
            return rng.integers(1, gamma + 1, size=n)
        if spec == "normal":
            draws = np.empty(n)
            filled = 0
            while filled < n:  # rejection sampling: the truncated normal on [1, γ]
                x = rng.normal(gamma / 2, gamma / 4, size=2 * n)
                x = x[(x >= 1) & (x <= gamma)]
                take = min(n - filled, x.size)
                draws[filled : filled + take] = x[:take]
                filled += take
            return np.clip(np.rint(draws), 1, gamma).astype(np.int64)
        spec = read_vector(spec, "k")
    k = check_k(np.asarray(spec), gamma, name="method.k")
    if k.size != n:
        raise bad_value("method.k", list(spec), f"one value per client (N = {n}), got {k.size}")
    return k
