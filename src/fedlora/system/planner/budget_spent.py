"""The rate bounds of a privacy budget part of which is already spent (docs/privacy.md, "A
privacy budget in the planner").

A plan made during a run (`proposed`'s in-run calibration and re-plans) comes after rounds
that already cost every client some privacy: its probes, earlier plans. Client n has spent
the Rényi DP r_n(α) at each order α (`fedlora.system.privacy.columns_rdp`), and T more rounds
at rate q add T·ρ(q, α) (the Poisson-subsampled Gaussian's one-round RDP), so its ε(δ) after
them is the conversion of r_n + T·ρ(q) (`rdp_to_epsilon`), which grows with q. The bound
u_n(T) is the largest q that keeps it within budget_n:

- clients whose (budget, spent RDP) are equal share one bound: after probes at one rate for
  all (the in-run calibration) every client has the same history, so one root is found;
- up to `EXACT_GROUPS` distinct (budget, history) pairs: each root exactly (Brent on log q
  with dp-accounting's RDP at every trial rate, `max_poisson_rate(..., spent_rdp=)`);
- more (after a plan with a rate per client, N distinct histories): the largest rate of a
  fixed log-spaced grid of `GRID_POINTS` rates in [1e-6, 1] (ratio 1.035 between neighbours)
  that keeps the budget, the grid's RDP computed once per σ. Exact at the grid's rates, so
  the bound never spends more than the budget; it is at most 3.5% below the exact root.

Pure numpy and dp-accounting (through `fedlora.system.privacy`); no torch, no I/O.
"""

from __future__ import annotations

import functools

import numpy as np

from fedlora.system.privacy import max_poisson_rate, poisson_round_rdp, rdp_to_epsilon

EXACT_GROUPS = 16  # distinct (budget, history) pairs solved exactly; more: the grid
GRID_POINTS = 401  # log-spaced rates in [GRID_LOW, 1]
GRID_LOW = 1e-6  # the smallest rate considered (max_poisson_rate's q_min)


def spent_rate_bounds(
    budgets: np.ndarray, sigma: float, rounds: int, delta: float, spent: np.ndarray
) -> np.ndarray:
    """(N,) u_n: the largest q_n whose `rounds` rounds, composed after the RDP `spent[n]`
    (N, orders) the client has already spent, keep its ε(δ) within `budgets[n]`; 0 where not
    even the smallest rate does (the history alone may exceed the budget, or be inf)."""
    budgets = np.asarray(budgets, dtype=float)
    spent = np.asarray(spent, dtype=float)
    if spent.ndim != 2 or spent.shape[0] != budgets.size:
        raise ValueError(f"spent: one RDP row per client expected, got shape {spent.shape}")
    keys = np.column_stack([budgets, spent])
    groups, back = np.unique(keys, axis=0, return_inverse=True)
    back = back.reshape(-1)
    if len(groups) <= EXACT_GROUPS:
        bounds = [
            max_poisson_rate(g[0], sigma, rounds, delta, q_min=GRID_LOW, spent_rdp=g[1:])
            for g in groups
        ]
    else:
        rates, table = _grid(float(sigma))  # (G,), (G, orders)
        bounds = [_grid_bound(g[0], g[1:], rounds, delta, rates, table) for g in groups]
    return np.asarray(bounds, dtype=float)[back]


def _grid_bound(
    budget: float,
    spent: np.ndarray,
    rounds: int,
    delta: float,
    rates: np.ndarray,
    table: np.ndarray,
) -> float:
    """The largest grid rate whose ε after `spent` and `rounds` rounds keeps `budget` (ε grows
    with q: the first rate over it ends the search); 0 when none does."""
    eps = rdp_to_epsilon(spent[None, :] + max(rounds, 0) * table, delta)  # (G,)
    over = np.flatnonzero(~(eps <= budget))
    last = (over[0] if over.size else len(rates)) - 1
    return float(rates[last]) if last >= 0 else 0.0


@functools.lru_cache(maxsize=8)
def _grid(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The grid's rates (G,) and their one-round RDP (G, orders) at σ (read-only)."""
    rates = np.geomspace(GRID_LOW, 1.0, GRID_POINTS)
    table = np.stack([poisson_round_rdp(float(q), sigma) for q in rates])
    rates.setflags(write=False)
    table.setflags(write=False)
    return rates, table
