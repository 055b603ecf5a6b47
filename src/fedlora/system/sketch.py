"""Sketching, independent client sampling and unbiased aggregation (paper §II, Eq. 3–6).

Pure numpy; every random draw takes an explicit `numpy.random.Generator`.

Validation happens once, at the boundary: `check_q` / `check_k` (called where a config's
q and k become vectors, `fedlora.federation.methods.strategies`). The round kernels
(`draw_participants`, `unbiased_weights`, `draw_sketch_scales`, `truncation_scales`) trust
checked vectors and only assert what a bug could break. `sample_participants`,
`aggregation_weights`, `sketch_scale_vectors`, `sketch_masks`, `truncation_scale_vectors`
and `sketch_indices` are the same kernels behind the checks, for callers holding unchecked
values (a script, a benchmark).

A sketch of size k out of rank γ is a uniformly random index set Γ ⊆ {0..γ-1}, |Γ| = k,
with scale γ/k, so that S = (γ/k) Σ_{j∈Γ} e_j e_jᵀ has E[S] = I (each index is included
with probability k/γ).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fedlora.errors import ConfigError, bad_value

__all__ = [
    "check_q",
    "check_k",
    "sketch_indices",
    "sketch_masks",
    "sketch_scale_vectors",
    "truncation_scale_vectors",
    "sample_participants",
    "aggregation_weights",
    "draw_participants",
    "unbiased_weights",
    "draw_sketch_scales",
    "truncation_scales",
    "unbiased_aggregate",
    "algorithm1_literal_aggregate",
]


def check_q(q: Sequence[float] | np.ndarray, name: str = "q") -> np.ndarray:
    """Validate sampling probabilities: every q_n in (0, 1], finite. Never clamps."""
    q = np.asarray(q, dtype=float)
    if q.ndim != 1 or q.size == 0:
        raise bad_value(name, q.tolist(), "a non-empty 1-D vector")
    bad = np.flatnonzero(~(np.isfinite(q) & (q > 0) & (q <= 1)))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"{name}[{i}]", float(q[i]), "each q_n must lie in (0, 1]")
    return q


def check_k(k: Sequence[int] | np.ndarray, gamma: int, name: str = "k") -> np.ndarray:
    """Validate sketch sizes: integers in 1..γ (k_n = 0 is not allowed: docs/paper.md, row 12)."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise bad_value("gamma", gamma, "the LoRA rank γ must be an integer >= 1")
    arr = np.asarray(k)
    if arr.ndim != 1 or arr.size == 0:
        raise bad_value(name, arr.tolist(), "a non-empty 1-D vector")
    if not np.issubdtype(arr.dtype, np.integer):
        as_float = arr.astype(float)
        if not np.all(np.isfinite(as_float)) or not np.all(as_float == np.round(as_float)):
            raise bad_value(name, arr.tolist(), "integers in 1..γ")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 1) | (arr > gamma))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"{name}[{i}]", int(arr[i]), f"each k_n must be in 1..γ = 1..{gamma}")
    return arr


def sketch_indices(gamma: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Eq. (3): a uniformly random k-subset of {0..γ-1}, sorted. Scale is γ/k.

    Edge cases: k = γ gives every index (the full adapter); k = 1 a single index.
    """
    check_k([k], gamma)
    return np.sort(rng.choice(gamma, size=int(k), replace=False))


def sketch_masks(gamma: int, k: Sequence[int] | np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """0/1 masks for many clients at once: (C, γ) with exactly k_c ones in row c (checked k)."""
    return _masks(gamma, check_k(k, gamma), rng)


def _masks(gamma: int, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Vectorised: one uniform key per (client, index); the k_c smallest keys of a row form a
    uniformly random k_c-subset (all orderings of i.i.d. keys are equally likely)."""
    keys = rng.random((k.size, gamma))  # (C, γ)
    ranks = np.argsort(np.argsort(keys, axis=1), axis=1)  # (C, γ): rank of each key in its row
    return (ranks < k[:, None]).astype(np.float64)


def sketch_scale_vectors(
    gamma: int, k: Sequence[int] | np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """`draw_sketch_scales` for an unchecked k (`check_k` first)."""
    return draw_sketch_scales(gamma, check_k(k, gamma), rng)


def draw_sketch_scales(gamma: int, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The diagonals of S_n (C, γ): γ/k_n on the sketched indices, 0 elsewhere. E = ones.

    Trusts `k`: a checked (C,) integer vector in 1..γ (`check_k`)."""
    assert k.ndim == 1 and k.dtype.kind in "iu", f"k must be a checked integer vector: {k!r}"
    assert k.size == 0 or (k.min() >= 1 and k.max() <= gamma), f"k outside 1..γ: {k}"
    return _masks(gamma, k, rng) * (gamma / k)[:, None]


def truncation_scale_vectors(gamma: int, ranks: Sequence[int] | np.ndarray) -> np.ndarray:
    """`truncation_scales` for unchecked ranks (`check_k` first, name "rank")."""
    return truncation_scales(gamma, check_k(ranks, gamma, name="rank"))


def truncation_scales(gamma: int, ranks: np.ndarray) -> np.ndarray:
    """Rank truncation (HeteroLoRA-style) as a scale vector (C, γ): 1 on the first r_n, unscaled.

    Trusts `ranks`: a checked (C,) integer vector in 1..γ (`check_k`)."""
    assert ranks.ndim == 1 and ranks.dtype.kind in "iu", f"ranks unchecked: {ranks!r}"
    assert ranks.size == 0 or (ranks.min() >= 1 and ranks.max() <= gamma), f"ranks: {ranks}"
    return (np.arange(gamma)[None, :] < ranks[:, None]).astype(np.float64)


def sample_participants(q: Sequence[float] | np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`draw_participants` for an unchecked q (`check_q` first)."""
    return draw_participants(check_q(q), rng)


def draw_participants(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Independent Bernoulli participation 𝕀_n ~ Bernoulli(q_n): sorted participant indices.

    Trusts `q`: a checked (N,) float vector in (0, 1] (`check_q`). The result can be empty
    (docs/paper.md, row 13): the caller records a round with no update.
    """
    assert q.ndim == 1 and q.dtype.kind == "f", f"q must be a checked float vector: {q!r}"
    return np.flatnonzero(rng.random(q.size) < q)


def aggregation_weights(
    a: Sequence[float] | np.ndarray, q: Sequence[float] | np.ndarray, participants: np.ndarray
) -> np.ndarray:
    """`unbiased_weights` for unchecked a, q (`check_q`, and one a_n per q_n)."""
    a = np.asarray(a, dtype=float)
    q = check_q(q)
    if a.shape != q.shape:
        raise ConfigError(f"a and q must have one entry per client: got {a.size} and {q.size}")
    return unbiased_weights(a, q, np.asarray(participants, dtype=np.int64))


def unbiased_weights(a: np.ndarray, q: np.ndarray, participants: np.ndarray) -> np.ndarray:
    """a_n / q_n for each participant (the unbiased weights of Eq. 6).

    Trusts its inputs: (N,) float a and checked q (`check_q`), integer participant indices."""
    assert a.shape == q.shape, f"one a_n per q_n: {a.shape} vs {q.shape}"
    return a[participants] / q[participants]


def unbiased_aggregate(
    global_params: Mapping[str, np.ndarray],
    client_params: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | np.ndarray,
) -> dict[str, np.ndarray]:
    """Eq. (6), unbiased (docs/paper.md, row 7): X ← X − Σ_{n∈K} (a_n/q_n)(X − X_n^H).

    `weights` are a_n/q_n of the participants, in the order of `client_params`. With no
    participant the global parameters are returned unchanged (copied). Taking expectation
    over 𝕀_n ~ Bernoulli(q_n) gives E[X⁺] = X − Σ_n a_n (X − X_n) = Σ_n a_n X_n when Σ a_n = 1.
    """
    weights = np.asarray(weights, dtype=float)
    if len(client_params) != weights.size:
        raise ConfigError(
            f"one weight per participant: got {weights.size} weights for {len(client_params)} clients"
        )
    out = {}
    for name, x in global_params.items():
        x = np.asarray(x)
        delta = np.zeros_like(x, dtype=np.result_type(x.dtype, np.float64))
        for i, (w, client) in enumerate(zip(weights, client_params)):
            if name not in client:
                raise ConfigError(f"client update {i} has no parameter {name!r}")
            xn = np.asarray(client[name])
            if xn.shape != x.shape:  # never broadcast: (3, 1) against (3,) would grow X
                raise ConfigError(
                    f"client update {i}: {name} has shape {xn.shape}, the global one {x.shape}"
                )
            delta += w * (x - xn)
        out[name] = (x - delta).astype(x.dtype, copy=False)
    return out


def algorithm1_literal_aggregate(
    global_params: Mapping[str, np.ndarray],
    client_params: Sequence[Mapping[str, np.ndarray]],
    a: np.ndarray,
    q: np.ndarray,
    participants: np.ndarray,
    lr: float,
) -> dict[str, np.ndarray]:
    """Algorithm 1, lines 13 and 16–17, taken literally, to show its bias (docs/paper.md, row 7).

    Clients send ΔX/q_n with ΔX = X − X_n^H (already containing η); the server applies
    X ← X − η Σ a_n 𝕀_n (1/q_n) · (ΔX/q_n): one η and one 1/q too many.
    """
    a = np.asarray(a, dtype=float)
    q = np.asarray(q, dtype=float)
    out = {}
    for name, x in global_params.items():
        x = np.asarray(x, dtype=float)
        total = np.zeros_like(x)
        for n, client in zip(participants, client_params):
            sent = (x - np.asarray(client[name], dtype=float)) / q[n]
            total += a[n] / q[n] * sent
        out[name] = x - lr * total
    return out
