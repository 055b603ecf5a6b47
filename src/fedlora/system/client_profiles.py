"""The clients of the wireless network model (paper §IV): their system profiles
(`ClientProfiles`: compute time τ_n and upload time t_n of the full adapter), generated from
a log-distance path-loss channel (`generate_profiles`) or read from rows (a profiles file,
clients.csv), and the channel's spectral efficiency under Rayleigh block fading with the
factors by which fading stretches the upload time (`fading_time_factor`,
`planning_time_factor`).

Units as in `fedlora.system.network`, which turns profiles into round times. Pure numpy; no
torch, no I/O (a profiles file is read by `fedlora.files.load_profiles`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedlora.errors import ConfigError, bad_value

__all__ = [
    "PROFILE_COLUMNS",
    "ClientProfiles",
    "check_times",
    "spectral_efficiency",
    "rayleigh_gains",
    "ergodic_spectral_efficiency",
    "fading_time_factor",
    "planning_time_factor",
    "generate_profiles",
    "profiles_from_rows",
    "profiles_to_rows",
]


def check_times(name: str, x: np.ndarray) -> None:
    """Raise `ConfigError` naming the first entry of `x` that is not a finite time >= 0."""
    bad = np.flatnonzero(~np.isfinite(x) | (x < 0))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"{name}[{i}]", float(x[i]), "times must be finite and >= 0")


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
        check_times("tau_full_s", self.tau_full_s)
        check_times("t_full", self.t_full)

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
