"""The wireless network model (paper §IV, Eq. 10–18): cost models, exact per-round bandwidth
allocation and round-time bounds, for the clients' profiles of `fedlora.system.client_profiles`
(the profile names stay importable from here).

Units: τ (`tau_s`) is seconds of local computation per round. t (`t`) is the upload time of a
client's payload with one unit of bandwidth, i.e. ``payload_bits / spectral_efficiency`` in
bit/(bit/s/Hz) = s·Hz, so that with f_n Hz the upload takes t_n / f_n seconds.

Pure numpy; no torch, no I/O (a profiles file is read by `fedlora.files.load_profiles`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedlora.errors import ConfigError, bad_value

# the client-profile names lived here once; still importable from here
from fedlora.system.client_profiles import (
    PROFILE_COLUMNS,
    ClientProfiles,
    check_times,
    ergodic_spectral_efficiency,
    fading_time_factor,
    generate_profiles,
    planning_time_factor,
    profiles_from_rows,
    profiles_to_rows,
    rayleigh_gains,
    spectral_efficiency,
)

__all__ = [
    "COST_MODELS",
    "comm_factor",
    "comp_factor",
    "allocate_bandwidth",
    "round_time",
    "expected_max_tau",
    "round_time_bound",
    "round_time_upper_bound",
    # defined in fedlora.system.client_profiles (docs/network.md names them here)
    "PROFILE_COLUMNS",
    "ClientProfiles",
    "ergodic_spectral_efficiency",
    "fading_time_factor",
    "generate_profiles",
    "planning_time_factor",
    "profiles_from_rows",
    "profiles_to_rows",
    "rayleigh_gains",
    "spectral_efficiency",
]

COST_MODELS = ("quadratic", "linear", "affine")


# ----------------------------------------------------------------------------- cost models


def comm_factor(k: np.ndarray | Sequence[int] | int, gamma: int, model: str) -> np.ndarray:
    """Upload size of a k-of-γ sketch relative to the full adapter (docs/paper.md, row 4).

    `quadratic`: k²/γ² (paper §V-B). `linear` (and `exact`): k/γ — a sketch sends k columns
    of B (m×γ) and k rows of A (γ×n), k(m+n) of γ(m+n) parameters.
    """
    ratio = np.asarray(k, dtype=float) / gamma
    if model == "quadratic":
        return ratio**2
    if model in ("linear", "exact"):
        return ratio
    raise bad_value("comm_cost", model, "quadratic, linear or exact")


def comp_factor(
    k: np.ndarray | Sequence[int] | int, gamma: int, model: str, rho: float = 0.0
) -> np.ndarray:
    """Local compute time of a k-of-γ sketch relative to k = γ (docs/paper.md, row 5).

    `quadratic`: k²/γ² (paper). `linear`: k/γ. `affine`: ρ + (1−ρ)k/γ, where ρ is the share
    of a step (the frozen base model's forward and backward) that does not shrink with k.
    Edge case: affine with ρ = 1 is constant 1; with ρ = 0 it equals linear.
    """
    ratio = np.asarray(k, dtype=float) / gamma
    if model == "quadratic":
        return ratio**2
    if model == "linear":
        return ratio
    if model == "affine":
        if not 0.0 <= rho <= 1.0:
            raise bad_value("rho", rho, "must be in [0, 1]")
        return rho + (1.0 - rho) * ratio
    raise bad_value("comp_cost", model, "quadratic, linear or affine")


# ----------------------------------------------------------------------------- allocation


def allocate_bandwidth(
    tau_s: Sequence[float] | np.ndarray, t: Sequence[float] | np.ndarray, f_tot: float
) -> tuple[float, np.ndarray]:
    """Exact per-round allocation (docs/paper.md, row 15): the round time T and each client's band.

    Finds T > max τ_n (over clients with t_n > 0) with Σ t_n / (T − τ_n) = f_tot, so that every
    sampled client finishes at T; f_n = t_n / (T − τ_n). The left side is strictly decreasing
    and convex in T, so Newton's method from a left bracket converges monotonically.

    Edge cases: no client → (0.0, []). One client → T = τ + t/f_tot. Clients with t_n = 0 need
    no band (f_n = 0); if one of them computes longer than the others' T, the round lasts its
    τ and the others need less than f_tot in total.
    """
    tau = np.asarray(tau_s, dtype=float).ravel()
    t = np.asarray(t, dtype=float).ravel()
    if tau.shape != t.shape:
        raise ConfigError(
            f"tau_s and t must have one entry per client: got {tau.size} and {t.size}"
        )
    check_times("tau_s", tau)
    check_times("t", t)
    if not (math.isfinite(f_tot) and f_tot > 0):
        raise bad_value("f_tot", f_tot, "the total bandwidth must be finite and > 0")
    f = np.zeros_like(t)
    if tau.size == 0:
        return 0.0, f
    sends = t > 0
    if not sends.any():
        return float(tau.max()), f
    ts, taus = t[sends], tau[sends]
    tau_max = taus.max()
    # Work with u = T − τ_max > 0; offsets d_n = τ_max − τ_n >= 0: g(u) = Σ t_n/(u + d_n) − f_tot.
    d = tau_max - taus
    u_lo = ts[np.argmax(taus)] / f_tot  # one term alone reaches f_tot here: g(u_lo) >= 0
    u_hi = ts.sum() / f_tot  # every term <= t_n/u: g(u_hi) <= 0
    u = u_lo
    for _ in range(200):
        terms = ts / (u + d)
        g = terms.sum() - f_tot
        if g <= 0:
            break
        dg = -(terms / (u + d)).sum()
        u_next = min(u - g / dg, u_hi)
        if u_next <= u * (1 + 1e-15):
            break
        u = u_next
    round_time = tau_max + u
    f[sends] = ts / (u + d)
    other = tau[~sends]
    if other.size and other.max() > round_time:
        round_time = float(other.max())
        f[sends] = ts / (round_time - taus)
    return float(round_time), f


def round_time(
    tau_full_s: np.ndarray,
    t_full: np.ndarray,
    k: np.ndarray | Sequence[int],
    gamma: int,
    *,
    comm_cost: str,
    comp_cost: str,
    rho: float,
    f_tot_hz: float,
    uplink_bits: np.ndarray | None = None,
    full_bits: float | None = None,
    efficiency: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[float, np.ndarray]:
    """The round time T (s) of the participants and each one's band (Hz): the ONE round-time
    formula (docs/paper.md, rows 4–6 and 15), used by the engine and by report's re-clocking.

    τ_n = tau_full_s · comp_factor(k_n). t_n = t_full · uplink_bits / full_bits for
    comm_cost = exact when the payload bits are given, else t_full · comm_factor(k_n).
    `efficiency` = (nominal, faded) spectral efficiencies: t_n scales by nominal / faded
    (Rayleigh fading). The downlink broadcast is not included (the caller adds it).
    """
    tau = tau_full_s * comp_factor(k, gamma, comp_cost, rho)
    if comm_cost == "exact" and uplink_bits is not None and full_bits is not None:
        t = t_full * uplink_bits / full_bits
    else:
        t = t_full * comm_factor(k, gamma, comm_cost)
    if efficiency is not None:
        t = t * efficiency[0] / efficiency[1]
    return allocate_bandwidth(tau, t, f_tot_hz)


# ----------------------------------------------------------------------------- bounds


def expected_max_tau(q: Sequence[float] | np.ndarray, tau_s: Sequence[float] | np.ndarray) -> float:
    """Eq. (16), docs/paper.md row 14: E[max_{n∈K} τ_n] under independent sampling, max ∅ = 0.

    Clients sorted by τ ascending; client n is the slowest participant with probability
    q_n Π_{i>n} (1 − q_i).
    """
    q = np.asarray(q, dtype=float)
    tau = np.asarray(tau_s, dtype=float)
    order = np.argsort(tau, kind="stable")
    q, tau = q[order], tau[order]
    # none_after[n] = Π_{i>n} (1 − q_i)
    none_after = np.append(np.cumprod((1.0 - q)[::-1])[::-1][1:], 1.0)
    return float(np.sum(q * none_after * tau))


def round_time_bound(
    q: Sequence[float] | np.ndarray,
    tau_s: Sequence[float] | np.ndarray,
    t: Sequence[float] | np.ndarray,
    f_tot: float,
) -> float:
    """Theorem 2 (Eq. 15): E[T] <= Σ q_n t_n / f_tot + E[max τ_n]."""
    q = np.asarray(q, dtype=float)
    return float(np.dot(q, np.asarray(t, dtype=float)) / f_tot + expected_max_tau(q, tau_s))


def round_time_upper_bound(
    q: Sequence[float] | np.ndarray,
    tau_s: Sequence[float] | np.ndarray,
    t: Sequence[float] | np.ndarray,
    f_tot: float,
) -> float:
    """Eq. (18): E[T] <= Σ q_n (t_n / f_tot + τ_n), the bound the optimizer uses."""
    q = np.asarray(q, dtype=float)
    return float(np.dot(q, np.asarray(t, dtype=float) / f_tot + np.asarray(tau_s, dtype=float)))
