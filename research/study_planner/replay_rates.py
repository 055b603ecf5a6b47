"""The progress rates of a replayed in-run fit (`replay_inrun`): the rates' standard errors
of the mean-loss fit, the per-client-offset rates from logged ``client_losses``, and small
helpers shared with the replay."""

from __future__ import annotations

import math

import numpy as np


def rate_errors(log_losses: list[float | None], of_round: list[int]) -> tuple[float, np.ndarray]:
    """(σ, SE(ρ_j)): the residual scatter of log L_r in `progress_rates`' least squares and the
    standard error of each setting's rate (nan where not estimable)."""
    counts = np.zeros(max(of_round) + 1)
    rows, target = [], []
    for r, value in enumerate(log_losses):
        if value is not None and math.isfinite(value):
            rows.append(np.concatenate([[1.0], -counts]))
            target.append(value)
        counts[of_round[r]] += 1
    se = np.full(counts.size, np.nan)
    m, t = np.asarray(rows), np.asarray(target)
    if m.ndim != 2 or len(rows) < 2:
        return math.nan, se
    seen = np.flatnonzero(np.any(m[:, 1:] != 0, axis=0))
    x = m[:, np.concatenate([[0], 1 + seen])]
    dof = x.shape[0] - x.shape[1]
    if dof <= 0:
        return math.nan, se
    sol, *_ = np.linalg.lstsq(x, t, rcond=None)
    sigma = float(np.sqrt(np.sum((x @ sol - t) ** 2) / dof))
    cov = sigma**2 * np.linalg.pinv(x.T @ x)
    se[seen] = np.sqrt(np.diag(cov)[1:])
    return sigma, se


def client_rates(
    client_losses: list[list | None], of_round: list[int], start: int
) -> tuple[np.ndarray, ...]:
    """`progress_rates_by_client` of the rounds from `start` (planner.fit_client_offsets)."""
    from fedlora.errors import ConfigError
    from fedlora.system.planner.fit import progress_rates_by_client

    logged = client_losses[: len(of_round)]
    if not any(x is not None for x in logged):
        raise ConfigError(
            "planner.fit_client_offsets = true needs each round's client_losses, which this "
            "run did not log (it ran without planner.fit_client_offsets)"
        )
    pairs = [[[int(c), math.log(x)] for c, x in (p or []) if x > 0] for p in logged]
    return progress_rates_by_client(pairs[start:], of_round[start:])


def pad(x: np.ndarray, value: float, size: int) -> np.ndarray:
    out = np.full(size, value)
    out[: min(size, x.size)] = x[:size]
    return out


def yz_of(a: np.ndarray, q: np.ndarray, k: np.ndarray, gamma: int) -> tuple[float, float]:
    a2 = a**2
    return float(np.sum(a2 / q)), float(np.sum(a2 / q * gamma**2 / k.astype(float) ** 2))
