"""The k-step of Algorithm 2 (lines 12–21, docs/paper.md, row 11): greedy on the true P2 with q
fixed. Start from k_n = γ, pass over the clients in order and decrement k_n when that strictly
lowers P2 and keeps q feasible; repeat until a pass changes nothing. A pass is computed
exactly without a Python loop over clients (see `greedy_k`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedlora.system.network import comm_factor, comp_factor
from fedlora.system.planner.objective import q_lower_bounds, sketch_penalty
from fedlora.system.planner.problem import Constants, PlanOptions, PlanProblem


def k_floor(problem: PlanProblem, constants: Constants, q: np.ndarray, mode: str) -> np.ndarray:
    """Smallest k each client may take with q fixed: q_n > lo_n(k) (lo_n grows as k falls).

    per_client: per client; paper: one floor for all (K² = γ²/min k² moves every bound);
    none: 1 (only R > 0, which the greedy test itself keeps)."""
    n, gamma = problem.n, problem.gamma
    if mode == "none":
        return np.ones(n, dtype=np.int64)
    floor = np.full(n, gamma, dtype=np.int64)
    for kk in range(gamma, 0, -1):
        ok = q > q_lower_bounds(problem, constants, np.full(n, kk), mode)
        if mode == "paper":
            if not ok.all():
                break
            floor[:] = kk
        else:
            floor = np.where(ok, kk, floor)
    return floor


_SCALAR_PASS_MAX_N = 100  # below this a plain loop over clients beats the vectorised pass


def _pass_vectorised(
    cand: np.ndarray, d_w: np.ndarray, d_v: np.ndarray, big_w: float, den: float
) -> np.ndarray:
    """The same pass as the least fixed point of "accept i if the test passes after the moves
    accepted before i" (see `greedy_k`); each iteration is O(N)."""
    accepted = np.zeros(cand.size, dtype=bool)
    while True:
        pre_w = big_w + np.concatenate([[0.0], np.cumsum(np.where(accepted, d_w, 0.0))[:-1]])
        pre_d = den - np.concatenate([[0.0], np.cumsum(np.where(accepted, d_v, 0.0))[:-1]])
        ok = cand & (pre_d - d_v > 0) & (d_w * pre_d + pre_w * d_v < 0)
        ok |= accepted
        if np.array_equal(ok, accepted):
            return accepted
        accepted = ok


def greedy_k(
    problem: PlanProblem,
    constants: Constants,
    q: Sequence[float] | np.ndarray,
    options: PlanOptions,
    k_start: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """Greedy k-step of Algorithm 2 (lines 12–21) on the true P2 with q fixed.

    Passes over clients 0..N−1 and decrements k_n (> 1, staying feasible for q) when that
    strictly lowers P2 = A·W/(B − V), W = Σ q w(k), V = Σ a²/q·c(k); repeats until a pass
    changes nothing. The test is ΔW·(B − V) + W·ΔV < 0 for the current (W, V). A pass is
    computed exactly without a loop over clients: every accepted move lowers P2, so a move
    accepted given some set of earlier moves stays accepted when more earlier moves are added;
    iterating "accept i if the test passes after the accepted moves before i" from the empty
    set grows to the sequential pass's set (its least fixed point).
    """
    q = np.asarray(q, dtype=float)
    gamma = problem.gamma
    k = problem.full_rank() if k_start is None else np.array(k_start, dtype=np.int64)
    floor = np.maximum(k_floor(problem, constants, q, options.q_lower_bound), 1)
    # per-client tables over k = 1..γ: q_n·w_n(k) and a_n²/q_n·c_n(k), shape (N, γ)
    levels = np.arange(1, gamma + 1)
    comm = comm_factor(levels, gamma, options.comm_cost) / problem.f_tot
    comp = comp_factor(levels, gamma, options.comp_cost, options.rho)
    w_tab = q[:, None] * (problem.t_full[:, None] * comm + problem.tau_full_s[:, None] * comp)
    v_tab = (problem.a**2 / q)[:, None] * sketch_penalty(levels, gamma, constants)[None, :]
    rows = np.arange(problem.n)
    if problem.n <= _SCALAR_PASS_MAX_N:
        return _greedy_scalar(w_tab, v_tab, k, floor, constants.B)
    while True:  # until a pass changes nothing (a client may start moving late: no γ cap)
        cand = k > floor
        if not cand.any():
            break
        j, j1 = k - 1, np.where(cand, k - 2, k - 1)  # table columns of k and k − 1
        big_w = float(w_tab[rows, j].sum())
        den = constants.B - float(v_tab[rows, j].sum())
        d_w = w_tab[rows, j1] - w_tab[rows, j]
        d_v = v_tab[rows, j1] - v_tab[rows, j]
        accepted = _pass_vectorised(cand, d_w, d_v, big_w, den)
        if not accepted.any():
            break
        k = np.where(accepted, k - 1, k)
    return k


def _greedy_scalar(
    w_tab: np.ndarray, v_tab: np.ndarray, k: np.ndarray, floor: np.ndarray, b: float
) -> np.ndarray:
    """`greedy_k` for small N: the literal client-by-client passes on the tables."""
    wt, vt, kk, fl = w_tab.tolist(), v_tab.tolist(), k.tolist(), floor.tolist()
    n = len(kk)
    while True:
        big_w = math.fsum(wt[i][kk[i] - 1] for i in range(n))
        den = b - math.fsum(vt[i][kk[i] - 1] for i in range(n))
        changed = False
        for i in range(n):
            ki = kk[i]
            if ki <= fl[i]:
                continue
            dw = wt[i][ki - 2] - wt[i][ki - 1]
            dv = vt[i][ki - 2] - vt[i][ki - 1]
            if den - dv > 0 and dw * den + big_w * dv < 0:
                kk[i] = ki - 1
                big_w += dw
                den -= dv
                changed = True
        if not changed:
            return np.asarray(kk, dtype=np.int64)
