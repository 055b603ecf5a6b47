"""The constants A–D of P2 from calibration runs (Eq. 21, docs/paper.md, rows 1–3), and how well
a set of constants explains those runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedlora.errors import ConfigError, bad_value
from fedlora.system.planner.problem import ESTIMATION_MATRICES, Constants, Observation


def _observation_matrix(
    observations: Sequence[Observation], gamma: int, a: np.ndarray, estimation_matrix: str
) -> np.ndarray:
    rows = []
    a2 = np.asarray(a, dtype=float) ** 2
    for i, o in enumerate(observations):
        q = np.asarray(o.q, dtype=float)
        k = np.asarray(o.k, dtype=float)
        y = float(np.sum(a2 / q))
        z = float(np.sum(a2 / q * gamma**2 / k**2))  # γ²/k², docs/paper.md, row 2
        r = observations[0].rounds if (estimation_matrix == "paper" and i == 1) else o.rounds
        rows.append([1.0 / r, -1.0, y, z])
    return np.asarray(rows)


def _null_vector(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, s, vt = np.linalg.svd(m)
    if s.size < 4:
        s = np.concatenate([s, np.zeros(4 - s.size)])
    return vt[-1], s


def estimate_constants(
    observations: Sequence[Observation],
    gamma: int,
    a: Sequence[float] | np.ndarray,
    estimation_matrix: str = "fixed",
) -> Constants:
    """A–D from >= 4 calibration runs (Eq. 21, docs/paper.md, rows 1–3).

    Row i is [1/R_i, −1, Y_i, Z_i] with Y = Σ a²/q, Z = Σ a²/q·γ²/k²; x = [A, B, C, D] is the
    right singular vector of the smallest singular value (least squares in ‖Mx‖ with ‖x‖ = 1
    when there are more than four runs), rescaled to B = 1. Refuses sets that cannot identify D
    and estimates with a non-positive constant, naming the suspect run.
    """
    if estimation_matrix not in ESTIMATION_MATRICES:
        raise bad_value(
            "options.estimation_matrix",
            estimation_matrix,
            f"allowed: {', '.join(ESTIMATION_MATRICES)}",
        )
    obs = list(observations)
    if len(obs) < 4:
        raise bad_value(
            "calibration", f"{len(obs)} observations", "at least 4 runs (4 unknowns A, B, C, D)"
        )
    a = np.asarray(a, dtype=float)
    ks = np.concatenate([np.asarray(o.k, dtype=float).ravel() for o in obs])
    if np.all(ks == ks[0]):
        raise ConfigError(
            f"calibration: every run uses k = {int(ks[0])} for every client, so Z = Y·γ²/k² in "
            "every run and D cannot be told apart from C; use runs with at least two different "
            "sketch sizes k"
        )
    m = _observation_matrix(obs, gamma, a, estimation_matrix)
    ratio = m[:, 3] / m[:, 2]
    if np.ptp(ratio) <= 1e-12 * np.max(np.abs(ratio)):
        raise ConfigError(
            f"calibration: Z/Y = {ratio[0]:.6g} in every run (the same mix of sketch sizes), so D "
            "cannot be told apart from C; vary k between runs"
        )
    x, s = _null_vector(m)
    if s[-2] <= 1e-10 * s[0]:
        raise ConfigError(
            "calibration: the runs do not identify A, B, C, D (the observation matrix "
            f"[1/R, -1, Y, Z] has rank < 3, singular values {np.array2string(s, precision=3)}); "
            "vary q and k between runs"
        )
    if abs(x[1]) <= 1e-12 * np.max(np.abs(x)):
        raise ConfigError(
            f"calibration: the fit gives B = 0 (x = {np.array2string(x, precision=4)}); the rounds "
            "do not follow R = A/(B − C·Y − D·Z); check the runs"
        )
    x = x / x[1]
    names = ("A", "B", "C", "D")
    bad = [f"{names[j]} = {x[j]:.4g}" for j in (0, 2, 3) if not x[j] > 0]
    if not bad:
        return Constants(*(float(v) for v in x))
    # which run is suspect: leave each out and see whether the rest give positive constants
    suspects = []
    for i in range(len(obs)):
        rest = np.delete(m, i, axis=0)
        xi, si = _null_vector(rest)
        if abs(xi[1]) <= 1e-12 * np.max(np.abs(xi)):
            continue
        xi = xi / xi[1]
        if np.all(xi[[0, 2, 3]] > 0):
            suspects.append(i)
    if suspects:
        described = "; ".join(
            f"observation {i} (rounds = {obs[i].rounds:g}, mean q = {np.mean(obs[i].q):.3g}, "
            f"mean k = {np.mean(obs[i].k):.3g})"
            for i in suspects
        )
        hint = f"suspect: {described} — without it the fit has A, C, D > 0"
    else:
        hint = "no single observation explains it: check the rounds of every run"
    raise ConfigError(
        f"calibration: the estimate contradicts the model (A, B, C, D must be > 0): "
        f"{', '.join(bad)} with B = 1; {hint}"
    )


def calibration_fit(
    observations: Sequence[Observation],
    gamma: int,
    a: Sequence[float] | np.ndarray,
    constants: Constants,
) -> list[dict[str, float]]:
    """How well A–D explain each calibration run (Eq. 21 and Theorem 1).

    Per observation: Y = Σ a²/q, Z = Σ a²/q·γ²/k², the observed R, the predicted
    R̂ = A/(B − C·Y − D·Z) (inf when the denominator is <= 0), R̂/R − 1, and the residual of
    its row of the linear system, (A/R − B + C·Y + D·Z)/B (0 for an exact fit; what the SVD or
    non-negative fit minimises).
    """
    a2 = np.asarray(a, dtype=float) ** 2
    out = []
    for o in observations:
        q = np.asarray(o.q, dtype=float)
        k = np.asarray(o.k, dtype=float)
        y = float(np.sum(a2 / q))
        z = float(np.sum(a2 / q * gamma**2 / k**2))
        den = constants.B - constants.C * y - constants.D * z
        predicted = constants.A / den if den > 0 else math.inf
        observed = float(o.rounds)
        out.append(
            {
                "Y": y,
                "Z": z,
                "observed_rounds": observed,
                "predicted_rounds": predicted,
                "relative_error": predicted / observed - 1.0,
                "row_residual": (constants.A / observed - den) / constants.B,
            }
        )
    return out
