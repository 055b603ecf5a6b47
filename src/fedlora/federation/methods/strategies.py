"""Per-client sampling probabilities q and sketch sizes k from a strategy, a file or a list.

q strategies (paper §VI-A): `full` (1), `fixed` (q_fixed, 0.2 by default), `uniform` (1/N),
`weighted` (a_n). k strategies (§VI-B): `full` (γ), `normal` (a normal around γ/2 with
σ = γ/4, truncated to [1, γ] and rounded), `uniform` (integers uniform on [1, γ]).
A file is JSON (a list, or an object with key "q"/"k") or CSV (a column named "q"/"k").
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.sketch import check_k, check_q


def _read_vector(path: str, column: str) -> list[float]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"method.{column} = {path!r}: cannot read: {e.strerror or e}") from None
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
            ) from None
        if isinstance(data, dict):
            if column not in data:
                raise ConfigError(f"{path}: no key {column!r} (keys: {', '.join(data)})")
            data = data[column]
        if not isinstance(data, list):
            raise ConfigError(f"{path}: expected a list of numbers for {column}")
        return data
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or column not in rows[0]:
        raise ConfigError(f"{path}: expected a CSV with a column named {column!r}")
    try:
        return [float(r[column]) for r in rows]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: column {column!r} has a non-number: {e}") from None


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
        spec = _read_vector(spec, "q")
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
        spec = _read_vector(spec, "k")
    k = check_k(np.asarray(spec), gamma, name="method.k")
    if k.size != n:
        raise bad_value("method.k", list(spec), f"one value per client (N = {n}), got {k.size}")
    return k
