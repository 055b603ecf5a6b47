"""The wireless network model (paper §IV, Eq. 10–18): client profiles, cost models,
exact per-round bandwidth allocation and round-time bounds.

Units: τ (`tau_s`) is seconds of local computation per round. t (`t`) is the upload time of a
client's payload with one unit of bandwidth, i.e. ``payload_bits / spectral_efficiency`` in
bit/(bit/s/Hz) = s·Hz, so that with f_n Hz the upload takes t_n / f_n seconds.

Pure numpy; no torch, no I/O (a profiles file is read by `fedlora.files.load_profiles`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedlora.errors import ConfigError, bad_value

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


def _check_times(name: str, x: np.ndarray) -> None:
    bad = np.flatnonzero(~np.isfinite(x) | (x < 0))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"{name}[{i}]", float(x[i]), "times must be finite and >= 0")


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
    _check_times("tau_s", tau)
    _check_times("t", t)
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


# ----------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class ClientProfiles:
    """Per-client system profile. `tau_full_s`: local compute per round at k = γ;
    `t_full`: upload time of the full adapter with one unit of bandwidth (s·Hz).
    The channel fields are NaN when the profiles were given rather than generated."""

    tau_full_s: np.ndarray
    t_full: np.ndarray
    distance_m: np.ndarray
    path_loss_db: np.ndarray
    snr_db: np.ndarray  # mean SNR over the reference band f_tot
    spectral_efficiency: np.ndarray  # bit/s/Hz at the mean SNR

    def __post_init__(self) -> None:
        n = self.tau_full_s.size
        for name in ("t_full", "distance_m", "path_loss_db", "snr_db", "spectral_efficiency"):
            if getattr(self, name).size != n:
                raise ConfigError(
                    f"profiles: {name} has {getattr(self, name).size} entries, expected {n}"
                )
        _check_times("tau_full_s", self.tau_full_s)
        _check_times("t_full", self.t_full)

    @property
    def n(self) -> int:
        return int(self.tau_full_s.size)

    @property
    def has_channel(self) -> bool:
        return bool(np.all(np.isfinite(self.spectral_efficiency)))


def spectral_efficiency(snr_db: np.ndarray, fading_gain: np.ndarray | None = None) -> np.ndarray:
    """Shannon spectral efficiency log2(1 + SNR·|h|²) in bit/s/Hz."""
    snr = 10.0 ** (np.asarray(snr_db, dtype=float) / 10.0)
    if fading_gain is not None:
        snr = snr * fading_gain
    return np.log2(1.0 + snr)


def rayleigh_gains(n: int, rng: np.random.Generator) -> np.ndarray:
    """Rayleigh block fading: |h|² ~ Exp(1), one draw per client per round."""
    return rng.exponential(1.0, size=n)


def _check_snr(snr_db: np.ndarray | Sequence[float]) -> np.ndarray:
    snr_db = np.asarray(snr_db, dtype=float)
    bad = np.flatnonzero(~np.isfinite(snr_db))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"snr_db[{i}]", float(snr_db[i]), "a finite number of dB")
    return snr_db


def ergodic_spectral_efficiency(snr_db: np.ndarray | Sequence[float]) -> np.ndarray:
    """E[log2(1 + SNR·h)] in bit/s/Hz under Rayleigh fading, h = |h|² ~ Exp(1).

    Closed form e^{1/s} E1(1/s) / ln 2 (s the mean SNR, E1 the exponential integral); below
    the mean-SNR rate log2(1 + s) (Jensen). It is the long-run mean *rate*; the mean upload
    *time* is another matter (`fading_time_factor`).
    """
    from scipy.special import exp1

    x = 1.0 / 10.0 ** (_check_snr(snr_db) / 10.0)
    big = x > 500.0  # e^x overflows: asymptotic e^x E1(x) = (1/x)(1 − 1/x + 2/x² − 6/x³ …)
    xs = np.where(big, 1.0, x)
    scaled = np.where(big, (1 - 1 / x + 2 / x**2 - 6 / x**3) / x, np.exp(xs) * exp1(xs))
    return scaled / math.log(2.0)


def fading_time_factor(snr_db: np.ndarray | Sequence[float], floor: float = 0.0) -> np.ndarray:
    """E[log2(1 + s) / log2(1 + s·max(h, floor))], h ~ Exp(1): the mean upload time under
    Rayleigh block fading relative to the time at the mean SNR s, per client.

    Without a floor it is infinite: near h = 0, 1/log2(1 + s h) ≈ ln 2/(s h) and
    ∫₀ e^{−h}/h dh diverges, so simulated round times are heavy-tailed and their sample mean
    never settles. An outage floor (``network.fading_floor``: a fade below it is served at the
    floor's rate, e.g. by power control or retransmission) makes it finite:
    (1 − e^{−f})/log2(1 + s f) + ∫_f^∞ e^{−h}/log2(1 + s h) dh, times log2(1 + s).
    """
    from scipy.integrate import quad

    snr_db = _check_snr(snr_db)
    if isinstance(floor, bool) or not (math.isfinite(floor) and floor >= 0):
        raise bad_value("network.fading_floor", floor, "a finite number >= 0")
    if floor == 0:
        return np.full(snr_db.shape, np.inf)
    out = np.empty(snr_db.shape)
    for i, s in enumerate(10.0 ** (snr_db / 10.0)):
        tail, _ = quad(lambda h, s=s: math.exp(-h) / math.log2(1.0 + s * h), floor, np.inf)
        head = -math.expm1(-floor) / math.log2(1.0 + s * floor)
        out[i] = math.log2(1.0 + s) * (head + tail)
    return out


def planning_time_factor(snr_db: np.ndarray | Sequence[float], floor: float = 0.0) -> np.ndarray:
    """What the planner multiplies t_full (mean-SNR upload time) by when fading is on.

    With an outage floor: the exact mean, `fading_time_factor`. Without one the mean time is
    infinite, so the planner uses the ergodic rate instead, log2(1 + s) / E[log2(1 + s h)]:
    the time the upload takes at the long-run mean rate (finite; below the simulated mean).
    """
    if floor > 0:
        return fading_time_factor(snr_db, floor)
    snr_db = _check_snr(snr_db)
    return spectral_efficiency(snr_db) / ergodic_spectral_efficiency(snr_db)


def generate_profiles(
    n: int,
    *,
    full_payload_bits: float,
    local_steps: int,
    f_tot_hz: float,
    step_time_median_s: float = 0.2,
    step_time_sigma: float = 0.5,
    distance_min_m: float = 20.0,
    distance_max_m: float = 200.0,
    path_loss_exponent: float = 3.5,
    path_loss_ref_db: float = 38.0,
    tx_power_dbm: float = 20.0,
    noise_psd_dbm_hz: float = -174.0,
    rng: np.random.Generator,
) -> ClientProfiles:
    """Heterogeneous clients: lognormal step times and a log-distance path-loss channel.

    τ_full = H · step time, step time ~ LogNormal(log median, σ). Distance ~ U[d_min, d_max];
    PL = PL_ref + 10·α·log10(d); SNR = P_tx − PL − (N0 + 10·log10 f_tot), i.e. the SNR over the
    whole band (a client granted less band sees less noise, so this is conservative and keeps
    t_n independent of the allocation, as the paper's model needs); t_full = bits / SE.
    """
    if n < 1:
        raise bad_value("n_clients", n, "must be >= 1")
    for name, value in (("f_tot_hz", f_tot_hz), ("full_payload_bits", full_payload_bits)):
        if not (math.isfinite(value) and value > 0):
            raise bad_value(name, value, "must be finite and > 0")
    if not 0 < distance_min_m <= distance_max_m:
        raise bad_value("distance_min_m", distance_min_m, f"must be in (0, {distance_max_m}]")
    step = step_time_median_s * np.exp(step_time_sigma * rng.standard_normal(n))
    distance = rng.uniform(distance_min_m, distance_max_m, size=n)
    path_loss = path_loss_ref_db + 10.0 * path_loss_exponent * np.log10(distance)
    noise_dbm = noise_psd_dbm_hz + 10.0 * math.log10(f_tot_hz)
    snr_db = tx_power_dbm - path_loss - noise_dbm
    se = spectral_efficiency(snr_db)
    return ClientProfiles(
        tau_full_s=local_steps * step,
        t_full=full_payload_bits / se,
        distance_m=distance,
        path_loss_db=path_loss,
        snr_db=snr_db,
        spectral_efficiency=se,
    )


PROFILE_COLUMNS = ("tau_full_s", "t_full")


def profiles_from_rows(rows: Sequence[dict], source: str = "profiles") -> ClientProfiles:
    """Profiles from rows with `tau_full_s` and `t_full` (other columns optional)."""
    if not rows:
        raise ConfigError(f"{source}: no clients (need one row per client with tau_full_s, t_full)")
    cols: dict[str, list[float]] = {c: [] for c in ClientProfiles.__dataclass_fields__}
    for i, row in enumerate(rows):
        for c in cols:
            raw = row.get(c, "")
            if c in PROFILE_COLUMNS and (raw is None or raw == ""):
                raise ConfigError(f"{source}: row {i} has no {c}")
            try:
                value = float(raw) if raw not in (None, "") else math.nan
            except (TypeError, ValueError):
                raise ConfigError(f"{source}: row {i}: {c} = {raw!r} is not a number") from None
            if c in PROFILE_COLUMNS and not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"{source}: row {i}: {c} = {raw!r} is invalid: must be finite and >= 0"
                )
            cols[c].append(value)
    return ClientProfiles(**{c: np.asarray(v, dtype=float) for c, v in cols.items()})


def profiles_to_rows(profiles: ClientProfiles) -> list[dict[str, float]]:
    """One dict per client with every profile column (for clients.csv)."""
    names = list(ClientProfiles.__dataclass_fields__)
    return [{name: float(getattr(profiles, name)[i]) for name in names} for i in range(profiles.n)]
