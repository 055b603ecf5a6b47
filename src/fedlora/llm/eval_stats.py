"""The statistics of an evaluation's per-question results: the Wilson interval of an
accuracy, the normal interval of a mean over questions, the majority and chance baselines of
an eval set, and the paired change of two evaluations on the same questions (gain with its
interval, questions gained and lost, the exact McNemar p-value)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.tasks import Example

__all__ = [
    "Z95",
    "majority_score",
    "chance_score",
    "mcnemar_p",
    "paired_change",
    "wilson_interval",
    "mean_interval",
]

Z95 = 1.959963984540054  # Φ^{-1}(0.975)


def majority_score(examples: Sequence[Example]) -> float:
    """Accuracy of always answering the label that is most often correct in `examples`."""
    if not examples:
        raise DataError("majority_score: no examples")
    return max(Counter(ex.answer for ex in examples).values()) / len(examples)


def chance_score(examples: Sequence[Example]) -> float:
    """Expected accuracy of a uniform random guess: the mean of 1 / (number of labels)."""
    if not examples:
        raise DataError("chance_score: no examples")
    return float(np.mean([1.0 / len(ex.labels) for ex in examples]))


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: b, c are the discordant pairs (only run A right, only
    run B right); under H0 (equal accuracy) b ~ Binomial(b + c, 1/2)."""
    for name, v in (("b", b), ("c", c)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DataError(f"{name} = {v!r} is invalid: a count >= 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def paired_change(before: Sequence[bool | int], after: Sequence[bool | int]) -> dict[str, Any]:
    """The paired change of per-question correctness on the same questions: the gain in
    accuracy with its normal 95% interval over questions, the questions gained and lost, and
    the exact McNemar p-value."""
    if len(before) != len(after) or not before:
        raise DataError(f"paired questions: {len(before)} before and {len(after)} after")
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    gained, lost = int((d > 0).sum()), int((d < 0).sum())
    gain, (lo, hi) = float(d.mean()), (math.nan, math.nan)
    if d.size > 1:
        half = Z95 * float(np.std(d, ddof=1)) / math.sqrt(d.size)
        lo, hi = gain - half, gain + half
    return {
        "gain": gain,
        "gain_ci95": [lo, hi],
        "gained": gained,
        "lost": lost,
        "mcnemar_p": mcnemar_p(gained, lost),
    }


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion correct/n (95% for the default z)."""
    if n <= 0:
        raise DataError(f"n = {n!r} is invalid: the interval needs at least one example")
    if not 0 <= correct <= n:
        raise DataError(f"correct = {correct!r} is invalid: must be in 0..{n}")
    p = correct / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def mean_interval(
    values: Sequence[float], lower: float = -math.inf
) -> tuple[float, tuple[float, float]]:
    """The mean of per-question values and its normal 95% interval (nan for one question),
    cut at `lower`, the least value the mean can take (0 for a loss): the part of the normal
    interval below it holds no possible mean, so cutting it keeps the coverage (a mean that
    lay in the normal interval lies in the cut one) and never reports an impossible bound."""
    n = len(values)
    mean = float(np.mean(values))
    half = Z95 * float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else math.nan
    return mean, (max(lower, mean - half) if n > 1 else math.nan, mean + half)
