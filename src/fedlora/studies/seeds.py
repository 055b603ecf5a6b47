"""Statistics over seeds. A seed is one partition, one set of client profiles and one
sampling stream, the same for every method of a suite, so comparisons are paired by seed.

- A mean's 95% interval is the t interval over seeds (none for one seed).
- A time to target of a seed that never got there is *censored*: only known to be >= its
  last clock; a mean with a censored seed is a lower bound (">=") and has no interval.
- Speed-up of a method over a reference, per seed s: T_ref(s) / T_method(s); its summary is
  the geometric mean with the t interval of the mean log ratio, exponentiated. A seed where
  only the reference is censored gives a lower bound on its ratio, only the method an upper
  bound; the interval is then one-sided valid (see `paired_ratio`).
- Paired difference a − b per seed: mean, t interval and the two-sided paired t test's p.

Verdicts: a claim *holds* when its interval lies on the claimed side, *does not hold* when it
lies on the other side, and is *inconclusive* otherwise (one seed, an interval across the
line, or censoring in both directions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedlora.errors import bad_value

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"


def t_interval95(values: Sequence[float]) -> float | None:
    """Half-width of the 95% t interval of the mean; None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    from scipy.stats import t

    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return float(t.ppf(0.975, n - 1) * sd / math.sqrt(n))


@dataclass(frozen=True)
class Summary:
    """Mean over seeds with its 95% t half-width (None: one seed or censored)."""

    mean: float
    ci: float | None
    n: int
    censored: int = 0

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        body = f"{self.mean * scale:.{digits}f}"
        if self.censored:
            return f">= {body} ({self.censored}/{self.n} censored)"
        if self.ci is not None:
            body += f" ± {self.ci * scale:.{digits}f}"
        return body


def summarize(values: Sequence[float], censored: int = 0) -> Summary:
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals)
    ci = None if censored else t_interval95(vals)
    return Summary(mean, ci, len(vals), censored)


@dataclass(frozen=True)
class Ratio:
    """Paired ratio reference/method over seeds: geometric mean and its 95% interval.

    `lower_valid`/`upper_valid`: whether `lo`/`hi` bound the true interval (censoring in one
    direction keeps one side valid); `lo`/`hi` are None with one seed."""

    mean: float
    lo: float | None
    hi: float | None
    lower_valid: bool
    upper_valid: bool
    n: int

    def text(self) -> str:
        if not (self.lower_valid or self.upper_valid) or math.isnan(self.mean):
            return "n/a (censored both ways)"
        body = f"{_num(self.mean)}x"
        if self.lo is not None and self.hi is not None:
            lo = _num(self.lo) if self.lower_valid else "?"
            hi = _num(self.hi) if self.upper_valid else "?"
            body += f" [{lo}, {hi}]"
        if self.lower_valid and not self.upper_valid:
            body = ">= " + body
        elif self.upper_valid and not self.lower_valid:
            body = "<= " + body
        return body


def _num(x: float) -> str:
    """Two decimals, or three significant digits for the extremes (a time near 0)."""
    return f"{x:.2f}" if 0.01 <= x < 1000 else f"{x:.3g}"


def paired_ratio(
    ref_times: Sequence[float],
    ref_reached: Sequence[bool],
    times: Sequence[float],
    reached: Sequence[bool],
) -> Ratio:
    """Speed-up T_ref / T per seed (paired lists), summarised on the log scale.

    A seed where only the reference is censored has a true ratio >= the recorded one; only
    the method censored: <=; both: unknown (the result is then n/a). Times <= 0 (a target met
    before any time passed) are raised to 1e-9 s so the log is finite.
    """
    n = len(times)
    if n == 0 or len(ref_times) != n:
        raise bad_value("paired_ratio", (len(ref_times), n), "two non-empty lists of one length")
    logs, lower_ok, upper_ok = [], True, True
    for tr, rr, tm, rm in zip(ref_times, ref_reached, times, reached):
        if not rr and not rm:
            return Ratio(math.nan, None, None, False, False, n)
        if not rr:
            upper_ok = False  # the ratio is at least this
        if not rm:
            lower_ok = False  # the ratio is at most this
        logs.append(math.log(max(tr, 1e-9)) - math.log(max(tm, 1e-9)))
    mean = sum(logs) / n
    half = t_interval95(logs)
    lo = hi = None
    if half is not None:
        lo, hi = math.exp(mean - half), math.exp(mean + half)
    return Ratio(math.exp(mean), lo, hi, lower_ok, upper_ok, n)


def ratio_verdict(ratio: Ratio, line: float) -> str:
    """HELD when the ratio's interval is above `line`, NOT_HELD when below."""
    if ratio.lo is None or ratio.hi is None:
        return INCONCLUSIVE
    if ratio.lower_valid and ratio.lo > line:
        return HELD
    if ratio.upper_valid and ratio.hi < line:
        return NOT_HELD
    return INCONCLUSIVE


@dataclass(frozen=True)
class PairedDiff:
    """Paired difference a − b over seeds: mean, 95% t half-width, paired t test p value."""

    mean: float
    ci: float | None
    p: float | None
    n: int


def paired_diff(a: Sequence[float], b: Sequence[float]) -> PairedDiff:
    if len(a) != len(b) or not a:
        raise bad_value("paired_diff", (len(a), len(b)), "two non-empty lists of one length")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    half = t_interval95(d)
    p = None
    if n >= 2:
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        if sd == 0:
            p = 1.0 if mean == 0 else 0.0
        else:
            from scipy.stats import t

            p = float(2 * t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    return PairedDiff(mean, half, p, n)


def similar_verdict(diff: PairedDiff, margin: float) -> str:
    """Equivalence: HELD when the interval lies inside ±margin, NOT_HELD when outside."""
    if diff.ci is None:
        return INCONCLUSIVE
    lo, hi = diff.mean - diff.ci, diff.mean + diff.ci
    if -margin <= lo and hi <= margin:
        return HELD
    if lo > margin or hi < -margin:
        return NOT_HELD
    return INCONCLUSIVE
