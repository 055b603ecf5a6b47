"""A fit of Theorem 1's constants that cannot fool the planner, and the per-round
progress rates of one run's own rounds (in-run calibration and re-planning).

Model (Theorem 1, docs/paper.md, row 2): a setting (q, k) needs R = A / (B − C·Y − D·Z) rounds to
reach a fixed level, Y = Σ a²/q, Z = Σ a²/q·γ²/k². With B = 1 each observed rate ρ = 1/R gives
one linear row A·ρ + C·Y + D·Z = 1.

`constrained_fit(rates, y, z)`
    Non-negative least squares in (A, C, D) (rows weighted by `weights`, e.g. the rounds
    behind each rate), then floors where the data do not identify a constant:

    - C (variance of the sampled aggregate): not identified when Y takes a single value in the
      data or the fit puts C at 0 (smaller q never cost rounds). Floor: C >= φ·B / max Y, i.e.
      at the least-sampled setting observed the variance term takes a share φ of B
      (φ = `floor_share`, `planner.fit_floor_share`, 0.1 by default). With the floor, R grows
      without bound before Y reaches max Y / φ: the planner cannot take q → 0.
    - D (sketching): the same with Z: not identified when Z/Y takes a single value or D = 0;
      floor D >= φ·B / max Z.
    - A: must come out > 0 beyond round-off, A·max ρ > 1e-9 (else a ConfigError: the rates
      carry no information; when the rows with ρ > 0 share one Y, i.e. one sampling rate, the
      only exact non-negative fit is the vertex C = 1/Y, A = D = 0, and the error says so:
      A, C, D are not identified, more probe rounds are needed).

    Every floor that was applied is named, with the reason, in `FitResult.floors`.
`progress_rates(log_losses, setting_of_round)`
    Per-setting progress per round from one run's training losses: least squares of
    log L_r = α − Σ_j ρ_j·n_j(r), n_j(r) = rounds of setting j before round r (rounds without
    a loss, e.g. empty rounds, count in n_j but give no equation). ρ_j = 1/R_j with R_j the
    rounds per unit decrease of log-loss: the rate Theorem 1's R is the inverse of.
`progress_rates_by_client(client_log_losses, setting_of_round)`
    The same rates from each participant's own log-loss with an intercept per client
    (`planner.fit_client_offsets`): the round's participant mix is not read as progress.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlora.errors import ConfigError
from fedlora.system.planner.problem import Constants

FLOOR_SHARE = 0.1  # φ: share of B the variance (or sketch) term takes at the data's largest Y (Z)
_SPREAD = 1e-9  # relative spread below which a column is "one value"
# A·max ρ at or below which A counts as 0: A·ρ_i is the progress term's share of B = 1 in row
# i, so a fit that gives it at most 1e-9 of B explains the rows by C·Y + D·Z alone; NNLS's
# round-off on such rows is ~1e-15 (1e-14 seen: A·ρ ~ 1e-15), a real fit's share is O(0.1..1)
_ROUNDOFF = 1e-9


@dataclass(frozen=True)
class FitResult:
    """The constants the planner uses, the raw fit and the floors applied (see module doc)."""

    constants: Constants
    raw: dict[str, float]  # A, B, C, D of the non-negative fit before floors (B = 1)
    floors: dict[str, str] = field(default_factory=dict)  # constant -> why it was floored
    residual: float = 0.0  # weighted RMS of A·ρ + C·Y + D·Z − 1 over the rows (raw fit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "constants": self.constants.to_dict(),
            "raw": dict(self.raw),
            "floors": dict(self.floors),
            "residual": float(self.residual),
        }

    def describe(self) -> str:
        c = self.constants
        text = f"A={c.A:.4g} B={c.B:.4g} C={c.C:.4g} D={c.D:.4g}"
        if self.floors:
            text += "; floored: " + "; ".join(f"{k} ({v})" for k, v in self.floors.items())
        return text


def constrained_fit(
    rates: Sequence[float] | np.ndarray,
    y: Sequence[float] | np.ndarray,
    z: Sequence[float] | np.ndarray,
    weights: Sequence[float] | np.ndarray | None = None,
    floor_share: float = FLOOR_SHARE,
) -> FitResult:
    """A, C, D >= 0 with B = 1 from rows A·ρ_i + C·Y_i + D·Z_i = 1, floors where not identified."""
    from scipy.optimize import nnls

    rho = np.asarray(rates, dtype=float)
    y, z = np.asarray(y, dtype=float), np.asarray(z, dtype=float)
    w = np.ones_like(rho) if weights is None else np.asarray(weights, dtype=float)
    keep = np.isfinite(rho) & (rho > 0) & (w > 0)
    if keep.sum() < 2:
        raise ConfigError(
            f"fit: {int(keep.sum())} setting(s) with a positive progress rate; at least 2 are "
            "needed (the loss did not fall: raise the probe rounds or the learning rate)"
        )
    rho, y, z, w = rho[keep], y[keep], z[keep], w[keep]
    sw = np.sqrt(w)
    design = np.column_stack([rho, y, z]) * sw[:, None]
    x, _ = nnls(design, sw)
    resid = float(np.sqrt(np.sum((design @ x - sw) ** 2) / np.sum(w)))
    if not x[0] * float(rho.max()) > _ROUNDOFF:  # A = 0, exactly or up to round-off
        raise ConfigError(_no_progress_term(float(x[0]), y))
    a_, c_, d_ = (float(v) for v in x)
    floors: dict[str, str] = {}
    c_floor = floor_share / float(y.max())
    d_floor = floor_share / float(z.max())
    c_why = _unidentified(y, None, c_ / c_floor, "Y = Σa²/q", "smaller q never cost rounds")
    d_why = _unidentified(
        z, y, d_ / d_floor, "Z/Y (the sketch sizes)", "smaller k never cost rounds"
    )
    if c_why and c_ < c_floor:
        floors["C"] = c_why + (f"; floor C = {floor_share:g}·B/max Y = {c_floor:.4g}")
        c_ = c_floor
    if d_why and d_ < d_floor:
        floors["D"] = d_why + (f"; floor D = {floor_share:g}·B/max Z = {d_floor:.4g}")
        d_ = d_floor
    return FitResult(
        constants=Constants(A=a_, B=1.0, C=c_, D=d_),
        raw={"A": float(x[0]), "B": 1.0, "C": float(x[1]), "D": float(x[2])},
        floors=floors,
        residual=resid,
    )


def _no_progress_term(a_raw: float, y: np.ndarray) -> str:
    """Why a fit with A = 0 (up to round-off) is refused, naming the cause."""
    a_text = "A = 0" if a_raw == 0 else f"A = {a_raw:.3g}, 0 up to round-off,"
    if np.ptp(y) <= _SPREAD * float(np.max(np.abs(y))):
        return (
            f"fit: {a_text} with A, C, D >= 0: the settings with positive progress share one "
            f"sampling rate (one Y = Σa²/q = {float(y[0]):.4g}), so A, C, D are not identified "
            f"(the only non-negative fit is the vertex C = 1/Y); raise planner.probe_rounds"
        )
    return (
        f"fit: {a_text} with A, C, D >= 0 (the progress rates carry no information about the "
        "rounds); raise the probe rounds"
    )


def _unidentified(
    col: np.ndarray, base: np.ndarray | None, relative: float, what: str, flat: str
) -> str:
    """Why a constant is not identified by the data ('' if it is); `relative` = fit/floor."""
    v = col if base is None else col / base
    if np.ptp(v) <= _SPREAD * float(np.max(np.abs(v))):
        return f"not identified: {what} takes one value in the data"
    if relative <= 1e-6:  # at the bound 0, up to round-off
        return f"not identified: the fit puts it at 0 ({flat})"
    return ""


def progress_rates(
    log_losses: Sequence[float | None], setting_of_round: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(ρ_j, rounds_j) per setting j = 0..J−1 from one run's rounds (see module doc).

    `log_losses[r]` is log of round r's training loss (None: no loss that round);
    `setting_of_round[r]` the setting in force in round r. ρ_j is nan when setting j has no
    round after which a loss was seen."""
    s = np.asarray(setting_of_round, dtype=np.int64)
    n_settings = int(s.max()) + 1 if s.size else 0
    counts = np.zeros(n_settings)
    rows, target = [], []
    for r, value in enumerate(log_losses):
        if value is not None and math.isfinite(value):
            rows.append(np.concatenate([[1.0], -counts]))
            target.append(float(value))
        counts[s[r]] += 1
    rates = np.full(n_settings, np.nan)
    if len(rows) < 2:
        return rates, counts
    m, t = np.asarray(rows), np.asarray(target)
    seen = np.any(m[:, 1:] != 0, axis=0)  # settings with a loss observed after them
    cols = np.concatenate([[0], 1 + np.flatnonzero(seen)])
    sol, *_ = np.linalg.lstsq(m[:, cols], t, rcond=None)
    rates[np.flatnonzero(seen)] = sol[1:]
    return rates, counts


def progress_rates_by_client(
    client_log_losses: Sequence[Sequence[Sequence[float]] | None],
    setting_of_round: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ρ_j, rounds_j, SE(ρ_j)) per setting from each participant's own log-loss: least squares
    of log L_{r,c} = α_c − Σ_j ρ_j·n_j(r) with an intercept α_c per client c (the within-client
    estimator: each client's rows minus their mean), so the round's participant mix (clients
    differ in loss level) is not read as progress.

    `client_log_losses[r]` holds round r's (client, log-loss) pairs (None or empty: no loss
    that round); `setting_of_round[r]` is as in `progress_rates`, and so is rounds_j. A client
    seen once contributes nothing. ρ_j is nan where the rows do not determine it (no loss seen
    after setting j, or setting j's rounds confounded with others within every client); SE_j
    from the residual scatter (nan without residual degrees of freedom)."""
    s = np.asarray(setting_of_round, dtype=np.int64)
    n_settings = int(s.max()) + 1 if s.size else 0
    counts = np.zeros(n_settings)
    who, rows, target = [], [], []
    for r, pairs in enumerate(client_log_losses):
        for client, value in pairs or ():
            if value is not None and math.isfinite(value):
                who.append(int(client))
                rows.append(-counts.copy())
                target.append(float(value))
        counts[s[r]] += 1
    rates, se = np.full(n_settings, np.nan), np.full(n_settings, np.nan)
    if not rows:
        return rates, counts, se
    m, t, who_a = np.asarray(rows), np.asarray(target), np.asarray(who)
    groups = np.unique(who_a)
    for c in groups:  # within-client: a constant column of one client becomes exact zeros
        at = who_a == c
        m[at] -= m[at].mean(axis=0)
        t[at] -= t[at].mean()
    seen = np.flatnonzero(np.any(m != 0, axis=0))
    if seen.size == 0:
        return rates, counts, se
    x = m[:, seen]
    pinv = np.linalg.pinv(x)
    sol = pinv @ t
    proj = pinv @ x  # e_j lies in the row space of x iff ρ_j is determined by the rows
    ok = np.linalg.norm(proj - np.eye(seen.size), axis=0) <= 1e-8
    rates[seen[ok]] = sol[ok]
    dof = t.size - groups.size - int(np.linalg.matrix_rank(x))
    if dof > 0:
        sigma2 = float(np.sum((x @ sol - t) ** 2)) / dof
        cov = sigma2 * (pinv @ pinv.T)  # (XᵀX)⁺ = X⁺X⁺ᵀ
        se[seen[ok]] = np.sqrt(np.maximum(np.diag(cov)[ok], 0.0))
    return rates, counts, se
