"""An accounting written from the papers, independent of dp-accounting, for the privacy tests
to check fedlora's ε against: the Rényi DP of the Gaussian and of the Poisson-subsampled
Gaussian (Mironov, Talwar & Zhang 2019), bounds on sampling without replacement (Wang, Balle
& Kasiviswanathan 2019, Theorem 9; a lower bound from one pair of neighbouring outputs), and
the conversion to (ε, δ) that docs/privacy.md says fedlora uses (Canonne, Kamath & Steinke
2020, Proposition 12) over the orders it names.

RDP of order α of a mechanism with noise multiplier s (noise s·Δ for sensitivity Δ), in units
of the sensitivity:

    Gaussian                   α / (2 s²)
    Poisson-subsampled, rate q log A_α / (α − 1),  A_α = E_{z~N(0,s²)} [(1 − q + q e^{(2z−1)/(2s²)})^α]
                               (integer α: Σ_k C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/(2s²)})

Only numpy, scipy's quadrature and the standard library.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import integrate, optimize

# the orders docs/privacy.md names (dp-accounting's defaults): 1.1 .. 10.9, 11 .. 63, 128 .. 1024
ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _logsumexp(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def gaussian_rdp(s: float, alpha: float) -> float:
    return alpha / (2 * s * s)


def poisson_rdp(q: float, s: float, alpha: float) -> float:
    """RDP of order α of the Poisson-subsampled Gaussian (rate q, multiplier s)."""
    if q == 1:
        return gaussian_rdp(s, alpha)
    if float(alpha).is_integer():
        a = int(alpha)
        terms = [
            _log_comb(a, k) + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * s * s)
            for k in range(a + 1)
        ]
        return _logsumexp(terms) / (a - 1)
    return _log_mixture_moment(q, s, alpha) / (alpha - 1)


def _log_mixture_moment(q: float, s: float, alpha: float) -> float:
    """log E_{z~N(0,s²)}[(1 − q + q e^{(2z−1)/(2s²)})^α] by quadrature around its peak."""

    def log_f(z: float) -> float:
        ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * s * s))
        return -z * z / (2 * s * s) - math.log(s * math.sqrt(2 * math.pi)) + alpha * ratio

    peak = optimize.minimize_scalar(
        lambda z: -log_f(z), bounds=(-50 * s, 50 * s + 50), method="bounded"
    )
    z0, top = float(peak.x), float(log_f(peak.x))
    width = 40 * s
    value, _ = integrate.quad(
        lambda z: math.exp(log_f(z) - top), z0 - width, z0 + width, points=[z0], limit=400, epsabs=0
    )
    return top + math.log(value)


def wor_upper_rdp(gamma: float, s: float, alpha: int) -> float:
    """Wang, Balle & Kasiviswanathan 2019, Theorem 9, for the Gaussian (ε(∞) = ∞): an upper
    bound on the RDP of order α (an integer >= 2) of sampling m of N without replacement
    (γ = m/N) under replace-one, multiplier s."""
    eps = [0.0, 0.0] + [gaussian_rdp(s, j) for j in range(2, alpha + 1)]
    terms = [0.0]  # log 1
    two = 2 * math.log(gamma) + _log_comb(alpha, 2)
    terms.append(two + min(math.log(4) + math.log(math.expm1(eps[2])), eps[2] + math.log(2)))
    for j in range(3, alpha + 1):
        terms.append(j * math.log(gamma) + _log_comb(alpha, j) + (j - 1) * eps[j] + math.log(2))
    return _logsumexp(terms) / (alpha - 1)


def shift_pair_rdp(gamma: float, s: float, alpha: float) -> float:
    """A lower bound on the RDP of order α of m-of-N sampling under replace-one: the outputs
    of one pair of neighbours, the client's update +C or −C (others' 0), sampled with
    probability γ, noise s·C... in units of C: D_α((1−γ)N(0) + γN(1) || (1−γ)N(0) + γN(−1))."""

    def log_mix(z: float, mean: float) -> float:
        return float(
            np.logaddexp(
                math.log1p(-gamma) - z * z / (2 * s * s),
                math.log(gamma) - (z - mean) ** 2 / (2 * s * s),
            )
        )

    def log_f(z: float) -> float:
        return alpha * log_mix(z, 1.0) + (1 - alpha) * log_mix(z, -1.0)

    peak = optimize.minimize_scalar(
        lambda z: -log_f(z), bounds=(-50 * s, 50 * s + 50), method="bounded"
    )
    z0, top = float(peak.x), float(log_f(peak.x))
    value, _ = integrate.quad(
        lambda z: math.exp(log_f(z) - top), z0 - 40 * s, z0 + 40 * s, points=[z0], limit=400
    )
    return (top + math.log(value / (s * math.sqrt(2 * math.pi)))) / (alpha - 1)


def epsilon_from_rdp(rdp: dict[float, float], delta: float) -> float:
    """(ε, δ) from RDP at every order (Canonne, Kamath & Steinke 2020, Proposition 12):
    min over α of rdp(α) + log((α − 1)/α) − (log δ + log α)/(α − 1)."""
    return max(
        0.0,
        min(
            r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
            for a, r in rdp.items()
        ),
    )


def poisson_epsilon_reference(q: float, s: float, rounds: int, delta: float) -> float:
    """ε(δ) of `rounds` rounds of the Poisson-subsampled Gaussian, at the ORDERS."""
    return epsilon_from_rdp({a: rounds * poisson_rdp(q, s, a) for a in ORDERS}, delta)


def gaussian_epsilon_reference(s: float, rounds: int, delta: float) -> float:
    return epsilon_from_rdp({a: rounds * gaussian_rdp(s, a) for a in ORDERS}, delta)


@functools.lru_cache(maxsize=64)
def poisson_rdp_orders(q: float, s: float) -> tuple[float, ...]:
    """One round's RDP at every one of the ORDERS (cached: rounds scale it)."""
    return tuple(poisson_rdp(q, s, a) for a in ORDERS)


def poisson_bounds(q: float, s: float, rounds: int, delta: float) -> tuple[float, float]:
    """The reference ε(δ) at every order (exact) and at the integer orders only: an accountant
    that computes the fractional orders conservatively lies between the two."""
    rdp = {a: rounds * r for a, r in zip(ORDERS, poisson_rdp_orders(q, s))}
    integer = {a: r for a, r in rdp.items() if float(a).is_integer()}
    return epsilon_from_rdp(rdp, delta), epsilon_from_rdp(integer, delta)


def wor_upper_epsilon(gamma: float, s: float, rounds: int, delta: float) -> float:
    """ε(δ) of `rounds` rounds of m-of-N sampling by Theorem 9 (integer orders up to 256)."""
    orders = [int(a) for a in ORDERS if float(a).is_integer() and a <= 256]
    return epsilon_from_rdp({a: rounds * wor_upper_rdp(gamma, s, a) for a in orders}, delta)
