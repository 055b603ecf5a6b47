"""The q-step's curve (P3, docs/paper.md, rows 8–10): for fixed k, the exact minimiser of the
fixed-M problem for every M, and the M that minimises the surrogate along it.

For fixed k, P3 minimises f(q) = M · Σ_n A q_n / (N B q_n − e_n), M = Σ w_n q_n,
e_n = a_n² N² c_n, over lo_n < q_n <= u_n (u_n = 1, or a privacy budget's rate,
`options.q_max`: 1 below stands for u_n). Writing A q/(NBq − e) = A/(NB) + κ_n/(q − p_n) with
p_n = e_n/(NB) and κ_n = A e_n/(NB)², the fixed-M problem min Σ κ_n/(q_n − p_n) s.t.
Σ w_n q_n = M has the KKT solution q_n(λ) = clip(p_n + √(κ_n/(λ w_n)), lo_n, 1).
Along this curve df/dλ has the sign of ψ(λ) = λ·M(λ) − H(λ) (H = the sum of the terms), and ψ
is continuous, piecewise linear and strictly increasing in λ (each free client contributes
λ e_n w_n/(NB) − A/(NB), each clipped one λ w_n q_n − const). So f is unimodal in λ, hence in M,
and its minimiser is the unique root of ψ, found exactly by a sweep over the 2N breakpoints and
a closed form in the bracketing segment (no grid, no tolerance).

`q_lower_bound`: "per_client" (default) lo_n = a_n² N c_n / B = p_n, the bound the surrogate's
own denominators need; "paper" lo_n = a_n² N (C + D K²)/B with K² = max_n γ²/k_n² (Remark 2);
"none": no per-client bound — P3 is then not an upper bound of P2, so the q-step minimises P2
itself for fixed k (same KKT form with p_n = 0, κ_n = a_n² c_n; ψ = λM + V − B is increasing in
λ too), subject only to R > 0. Strict bounds: the per-client bound is never attained (the
objective diverges there); the paper bound is enforced as q_n >= lo_n·(1 + 1e-9).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlora.errors import ConfigError
from fedlora.system.planner.objective import q_lower_bounds, sketch_penalty, sketched_round_weights
from fedlora.system.planner.problem import Constants, PlanOptions, PlanProblem

STRICT_MARGIN = 1e-9  # relative margin that turns the paper's strict q_n > lo_n into q_n >= ...


class QCurve:
    """The KKT curve q(μ) = clip(p + g μ, L, 1), μ = 1/√λ, of the fixed-M problem
    min Σ κ_n/(q_n − p_n) s.t. Σ w_n q_n = M, and the objective along it."""

    def __init__(
        self,
        w: np.ndarray,
        p: np.ndarray,
        kappa: np.ndarray,
        lower: np.ndarray,
        surrogate: str,
        constants: Constants,
        upper: np.ndarray | None = None,
    ) -> None:
        self.w, self.p, self.kappa, self.lower = w, p, kappa, lower
        self.upper = np.ones_like(w) if upper is None else upper  # q_n <= u_n (1: none)
        self.surrogate = surrogate
        self.A, self.B = constants.A, constants.B
        self.h0 = constants.A / constants.B  # Σ_n A/(NB): the constant part of P3's sum
        self.g = np.sqrt(kappa / w)
        self.skw = np.sqrt(kappa * w)
        self.mu_lo = np.maximum((lower - p) / self.g, 0.0)
        self.mu_hi = (self.upper - p) / self.g
        self.m_min = float(np.dot(w, lower))
        self.m_max = float(np.dot(w, self.upper))
        self._sweep()

    # --- pieces of the objective
    def q(self, mu: float) -> np.ndarray:
        return np.clip(self.p + self.g * mu, self.lower, self.upper)

    def value(self, q: np.ndarray) -> float:
        """f(q): P3 = M·(Σ A/(NB) + V), or P2 = A·M/(B − V); V = Σ κ/(q − p)."""
        d = q - self.p
        if np.any(d <= 0):
            return math.inf
        m = float(np.dot(self.w, q))
        v = float(np.sum(self.kappa / d))
        if self.surrogate == "P3":
            return m * (self.h0 + v)
        return self.A * m / (self.B - v) if v < self.B else math.inf

    def values(self, mus: np.ndarray) -> np.ndarray:
        """`value` at q(μ) for every μ of `mus` (the grid search over M), in blocks of about
        10⁶ numbers so that memory stays bounded at large N."""
        mus = np.asarray(mus, dtype=float)
        step = max(1, 1_000_000 // self.w.size)
        return np.concatenate([self._values(mus[i : i + step]) for i in range(0, mus.size, step)])

    def _values(self, mus: np.ndarray) -> np.ndarray:
        q = np.clip(self.p + self.g * mus[:, None], self.lower, self.upper)
        d = q - self.p
        ok = np.all(d > 0, axis=1)
        d = np.where(d > 0, d, 1.0)
        m = q @ self.w
        v = np.sum(self.kappa / d, axis=1)
        if self.surrogate == "P3":
            out = m * (self.h0 + v)
        else:
            out = np.where(v < self.B, self.A * m / np.where(v < self.B, self.B - v, 1.0), np.inf)
        return np.where(ok, out, np.inf)

    def _psi(self, wc: Any, vc: Any, gs: Any, mu: Any) -> Any:
        """ψ with a segment's state (Wc, Vc, G): W = Wc + Gμ, V = Vc + G/μ, λ = 1/μ²."""
        if self.surrogate == "P3":
            return wc / mu**2 - self.h0 - vc
        return wc / mu**2 + 2.0 * gs / mu + vc - self.B

    def _sweep(self) -> None:
        """State (Wc, Vc, G) after each breakpoint, in increasing μ."""
        w, p, lo, kap, up = self.w, self.p, self.lower, self.kappa, self.upper
        at_lo = self.mu_lo > 0
        free = ~at_lo
        wc0 = float(np.dot(w[at_lo], lo[at_lo]) + np.dot(w[free], p[free]))
        vc0 = float(np.sum(kap[at_lo] / (lo[at_lo] - p[at_lo])))
        g0 = float(np.sum(self.skw[free]))
        idx_lo = np.flatnonzero(at_lo)
        mus = np.concatenate([self.mu_lo[idx_lo], self.mu_hi])
        d_wc = np.concatenate([w[idx_lo] * (p[idx_lo] - lo[idx_lo]), w * (up - p)])
        d_vc = np.concatenate([-kap[idx_lo] / (lo[idx_lo] - p[idx_lo]), kap / (up - p)])
        d_g = np.concatenate([self.skw[idx_lo], -self.skw])
        order = np.argsort(mus, kind="stable")
        self.ev_mu = mus[order]
        # state of segment i (i = 0..E): before event i; segment E is after the last event
        self.seg_wc = wc0 + np.concatenate([[0.0], np.cumsum(d_wc[order])])
        self.seg_vc = vc0 + np.concatenate([[0.0], np.cumsum(d_vc[order])])
        self.seg_g = g0 + np.concatenate([[0.0], np.cumsum(d_g[order])])

    def _segment_bounds(self, i: int) -> tuple[float, float]:
        lo = self.ev_mu[i - 1] if i > 0 else 0.0
        hi = self.ev_mu[i] if i < self.ev_mu.size else math.inf
        return float(lo), float(hi)

    def _exact_state(self, i: int) -> tuple[float, float, float]:
        """(Wc, Vc, G) of segment i summed afresh (no cancellation from the running sums)."""
        lo_b, hi_b = self._segment_bounds(i)
        mid = (lo_b + hi_b) / 2 if math.isfinite(hi_b) else max(2 * lo_b, 1.0)
        at_lo = self.mu_lo > mid
        at_hi = (self.mu_hi < mid) & ~at_lo
        free = ~(at_lo | at_hi)
        w, p, lo, kap, up = self.w, self.p, self.lower, self.kappa, self.upper
        wc = float(
            np.dot(w[at_lo], lo[at_lo]) + np.dot(w[at_hi], up[at_hi]) + np.dot(w[free], p[free])
        )
        vc = float(
            np.sum(kap[at_lo] / (lo[at_lo] - p[at_lo]))
            + np.sum(kap[at_hi] / (up[at_hi] - p[at_hi]))
        )
        return wc, vc, float(self.skw[free].sum())

    def optimum_mu(self) -> float:
        """The unique root of ψ (the minimiser of f along the curve)."""
        psi = self._psi(self.seg_wc[1:], self.seg_vc[1:], self.seg_g[1:], self.ev_mu)
        neg = np.flatnonzero(psi < 0)  # ψ is decreasing in μ
        i = int(neg[0]) if neg.size else self.ev_mu.size
        wc, vc, gs = self._exact_state(i)
        if self.surrogate == "P3":
            mu = math.sqrt(wc / (self.h0 + vc)) if self.h0 + vc > 0 else math.inf
        else:  # wc x² + 2 gs x + (vc − B) = 0 in x = 1/μ
            c0 = self.B - vc
            if wc > 0:
                x = (-gs + math.sqrt(gs * gs + wc * c0)) / wc if c0 > 0 else 0.0
            else:
                x = c0 / (2 * gs) if gs > 0 else 0.0
            mu = 1.0 / x if x > 0 else math.inf
        lo_b, hi_b = self._segment_bounds(i)
        mu = min(max(mu, lo_b), hi_b)
        if not math.isfinite(mu):  # all clients at q = 1 beyond the last breakpoint
            mu = float(self.ev_mu[-1]) if self.ev_mu.size else 1.0
        return mu

    def mu_for_m(self, m: np.ndarray | float) -> np.ndarray:
        """μ with Σ w q(μ) = M (W is increasing and piecewise linear in μ)."""
        m = np.atleast_1d(np.asarray(m, dtype=float))
        w_ev = self.seg_wc[1:] + self.seg_g[1:] * self.ev_mu  # W at each breakpoint
        w_ev = np.maximum.accumulate(w_ev)
        seg = np.searchsorted(w_ev, m, side="left")  # segment holding each M
        if m.size > 1:  # many M (the grid): the running sums are accurate enough
            gs = self.seg_g[seg]
            mu = np.where(gs > 0, (m - self.seg_wc[seg]) / np.where(gs > 0, gs, 1.0), 0.0)
            lo_b = np.where(seg > 0, self.ev_mu[np.maximum(seg - 1, 0)], 0.0)
            hi_b = np.where(
                seg < self.ev_mu.size, self.ev_mu[np.minimum(seg, self.ev_mu.size - 1)], np.inf
            )
            return np.minimum(np.maximum(mu, lo_b), hi_b)
        i = int(seg[0])
        wc, _, gs = self._exact_state(i)  # one M: sum the segment afresh
        lo_b, hi_b = self._segment_bounds(i)
        mu1 = (float(m[0]) - wc) / gs if gs > 0 else lo_b
        return np.array([min(max(mu1, lo_b), hi_b)])

    def kkt_multiplier(self, mu: float) -> float:
        return 1.0 / mu**2


def q_curve(
    problem: PlanProblem, constants: Constants, k: np.ndarray, options: PlanOptions
) -> QCurve:
    """Build the q-step curve for fixed k; refuse infeasible clients (lo_n >= 1)."""
    n, nb = problem.n, problem.n * constants.B
    c = sketch_penalty(k, problem.gamma, constants)
    w = sketched_round_weights(problem, k, options)
    a2 = problem.a**2
    upper = q_upper_bounds(problem, options)
    if options.q_lower_bound == "none":
        p = np.zeros(n)
        kappa = a2 * c
        lower = _weight_bound(problem, options, np.zeros(n))
        total = float(np.sum(kappa / upper))
        if total >= constants.B:
            raise ConfigError(
                f"infeasible: even q_n = {_bound_text(options)} for every client gives B − "
                f"Σ a_n² c_n / q_n = {constants.B - total:.4g} <= 0 at k = {_short(k)} (the "
                "target needs infinitely many rounds); reduce C, D or raise B"
            )
        _check_upper(options, lower, upper)
        return QCurve(w, p, kappa, lower, "P2", constants, upper)
    e = a2 * n * n * c
    p = e / nb  # = a_n² N c_n / B, the per-client bound
    kappa = constants.A * e / nb**2
    lower = p.copy()
    if options.q_lower_bound == "paper":
        lower = q_lower_bounds(problem, constants, k, "paper") * (1.0 + STRICT_MARGIN)
    lower = _weight_bound(problem, options, lower)
    bad = np.flatnonzero(lower >= 1.0)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"infeasible: client {i} needs q_{i} > {lower[i]:.6g} >= 1 (q_lower_bound = "
            f"{options.q_lower_bound}: a_n = {problem.a[i]:.4g}, k_n = {int(k[i])}, "
            f"N = {n}, max_weight = {options.max_weight:g}); raise B or max_weight or lower "
            "that client's weight a_n, or set planner.q_lower_bound = 'none' (the q-step then "
            "minimises P2 itself, needing only a finite round count)"
        )
    _check_upper(options, lower, upper)
    return QCurve(w, p, kappa, lower, "P3", constants, upper)


def q_upper_bounds(problem: PlanProblem, options: PlanOptions) -> np.ndarray:
    """u_n: q_n <= u_n (`options.q_max`, e.g. the privacy budget's rates); 1 without."""
    return np.asarray(options.q_max, dtype=float) if options.q_max else np.ones(problem.n)


def _bound_text(options: PlanOptions) -> str:
    return "q_max_n" if options.q_max else "1"


def _check_upper(options: PlanOptions, lower: np.ndarray, upper: np.ndarray) -> None:
    """ConfigError when a client's lower bound meets its upper bound u_n < 1."""
    bad = np.flatnonzero(lower >= upper)
    if bad.size:
        i = int(bad[0])
        raise ConfigError(
            f"infeasible: client {i} needs q_{i} > {lower[i]:.6g} but its privacy budget "
            f"(planner.max_epsilon) allows at most q_{i} = {upper[i]:.6g}; raise the budget or "
            "privacy.noise_multiplier"
        )


def _weight_bound(problem: PlanProblem, options: PlanOptions, lower: np.ndarray) -> np.ndarray:
    """lower raised to a_n/w_max where `options.max_weight` = w_max > 0: the unbiased weight
    a_n/q_n of a sampled client is at most w_max."""
    if options.max_weight > 0:
        return np.maximum(lower, problem.a / options.max_weight)
    return lower


def _short(k: np.ndarray) -> str:
    k = np.asarray(k)
    return str(int(k[0])) if np.all(k == k[0]) else np.array2string(k, threshold=8)
