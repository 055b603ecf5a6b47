"""The planner study's rule in code (research/study_planner/study_planner.md): its per-task metric, the pilot's
budget, target and best fixed sampling rule, time to target censored at the budget, and the
paired statistics of the report (log-ratio t interval, Holm's step-down correction).

Everything here is a pure function of metrics lines (`RunRecord`s); the runner
(`research.study_planner.study_runner`) and the report (`research.study_planner.study_report`) call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedlora.errors import ConfigError, bad_value
from fedlora.studies.runs import RunRecord

# metric field -> (metrics.jsonl key holding {task: value}, higher is better)
METRIC_FIELDS = {
    "acc": ("eval", True),
    "acc_norm": ("eval_acc_norm", True),
    "mc_loss": ("eval_mc_losses", False),
    "loss": ("eval_losses", False),
}
EPS = 1e-9


@dataclass(frozen=True)
class Metric:
    """One task's metric, written `TASK/FIELD` (e.g. `arc-e/acc`)."""

    task: str
    field: str

    @property
    def key(self) -> str:
        return METRIC_FIELDS[self.field][0]

    @property
    def higher(self) -> bool:
        return METRIC_FIELDS[self.field][1]

    @property
    def text(self) -> str:
        return f"{self.task}/{self.field}"

    @property
    def scale(self) -> float:
        """100 for an accuracy (reported in percent, its differences in points), 1 for a loss."""
        return 100.0 if self.field in ("acc", "acc_norm") else 1.0

    def gain(self, value: float, start: float) -> float:
        """The improvement from `start` to `value` (signed: a drop of accuracy is negative)."""
        return value - start if self.higher else start - value


def parse_metric(text: object, where: str = "study.metric") -> Metric:
    """`TASK/FIELD` with FIELD one of acc, acc_norm (higher is better), mc_loss, loss."""
    allowed = "TASK/FIELD with FIELD one of " + ", ".join(METRIC_FIELDS) + " (e.g. arc-e/acc)"
    if not isinstance(text, str):
        raise bad_value(where, text, allowed)
    task, sep, field = text.partition("/")
    if not sep or not task.strip() or field not in METRIC_FIELDS:
        raise bad_value(where, text, allowed)
    return Metric(task.strip(), field)


def metric_points(run: RunRecord, metric: Metric) -> list[tuple[float, float]]:
    """(sim_time_s, value) of every evaluation of the metric's task, in order."""
    out = []
    for line in run.lines:
        value = (line.get(metric.key) or {}).get(metric.task)
        if value is not None:
            out.append((float(line["sim_time_s"]), float(value)))
    return out


def start_value(points: Sequence[tuple[float, float]]) -> float | None:
    """The first evaluation (round 0: the untrained adapter)."""
    return points[0][1] if points else None


def time_to_target(
    points: Sequence[tuple[float, float]], metric: Metric, gain: float, budget_s: float
) -> tuple[float, bool]:
    """(time, True) of the first evaluation at or before the budget whose gain over the run's
    own round-0 value is >= `gain`; (budget, False) when none: "not reached", censored at B."""
    start = start_value(points)
    if start is not None:
        for t, v in points:
            if t > budget_s + EPS:
                break
            if metric.gain(v, start) >= gain - EPS:
                return t, True
    return budget_s, False


def value_at_budget(points: Sequence[tuple[float, float]], budget_s: float) -> float | None:
    """The evaluation at the round that spends the budget (the first at or past it); the last
    evaluation of a run that stopped before it."""
    for t, v in points:
        if t >= budget_s - EPS:
            return v
    return points[-1][1] if points else None


def level_on_grid(
    points: Sequence[tuple[float, float]], grid: Sequence[float]
) -> list[float | None]:
    """The step curve read on `grid`: the last evaluation at or before each time (None before
    the first). Every arm is read on the same times whatever its evaluations' own times."""
    out: list[float | None] = []
    for g in grid:
        before = [v for t, v in points if t <= g + EPS]
        out.append(before[-1] if before else None)
    return out


def pilot_budget(fslora_clock_s: float, round_to_s: float) -> float:
    """B = FSLoRA's pilot clock at its round cap / 2, rounded down to `round_to_s` (0: none)."""
    half = fslora_clock_s / 2
    budget = math.floor(half / round_to_s) * round_to_s if round_to_s > 0 else half
    if not budget > 0:
        raise ConfigError(
            f"pilot: the budget FSLoRA's clock / 2 = {half:g} s rounds down to {budget:g} s "
            f"(study.budget_round_s = {round_to_s:g}): raise the pilot's round cap "
            "(training.rounds) or lower study.budget_round_s"
        )
    return float(budget)


def derive_rule(
    pilot: Mapping[str, Sequence[tuple[float, float]]],
    metric: Metric,
    budget_s: float,
    fraction: float,
    fixed_rules: Sequence[str],
) -> dict:
    """The target and the best fixed rule from the pilot's curves ({label: points}).

    gain = `fraction` × the largest signed improvement over round 0 that any pilot run
    reaches at an evaluation within B (a drop is no improvement); refused when no run
    improved. fixed-best = the fixed rule first at the target, ties and "not reached" broken
    by the better value at B, then by the order given."""
    starts = {lab: start_value(pts) for lab, pts in pilot.items()}
    missing = [lab for lab, s in starts.items() if s is None]
    if missing:
        raise ConfigError(f"pilot: run {missing[0]!r} has no evaluation of {metric.text}")
    best_gain, best_label = -math.inf, ""
    for lab, pts in pilot.items():
        for t, v in pts:
            if t <= budget_s + EPS and metric.gain(v, starts[lab]) > best_gain:
                best_gain, best_label = metric.gain(v, starts[lab]), lab
    if not best_gain > 0:
        raise ConfigError(
            f"pilot: no run improved {metric.text} over its round-0 value within the budget "
            f"{budget_s:g} s (largest change {best_gain:+.4g}): no target above round 0 exists; "
            "the protocol does not learn in the pilot's budget"
        )
    gain = fraction * best_gain
    start = sum(starts.values()) / len(starts)

    def key(lab: str) -> tuple[float, float, int]:
        t, _ = time_to_target(pilot[lab], metric, gain, budget_s)
        v = value_at_budget(pilot[lab], budget_s)
        better = -(v if metric.higher else -v) if v is not None else math.inf
        return t, better, list(fixed_rules).index(lab)

    unknown = [lab for lab in fixed_rules if lab not in pilot]
    if unknown:
        raise ConfigError(f"pilot: no run of the fixed rule {unknown[0]!r}")
    order = sorted(fixed_rules, key=key)
    return {
        "metric": metric.text,
        "budget_s": float(budget_s),
        "target_gain": gain,
        "pilot_start": start,
        "pilot_target": start + gain if metric.higher else start - gain,
        "pilot_best_gain": best_gain,
        "pilot_best_run": best_label,
        "fixed_best": order[0],
        "fixed_order": order,
        "pilot_times_s": {
            lab: list(time_to_target(pts, metric, gain, budget_s)) for lab, pts in pilot.items()
        },
    }


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times
    (m − i + 1), made monotone, capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class LogRatio:
    """Paired ratio T_arm / T_base over seeds: geometric mean, 95% t interval on the logs and
    the two-sided one-sample t test of mean log = 0 (None with one seed)."""

    mean: float
    lo: float | None
    hi: float | None
    p: float | None
    n: int


def log_ratio(arm: Sequence[float], base: Sequence[float]) -> LogRatio:
    """Per seed log(arm / base); times <= 0 (a target met at round 0) count as 1e-9 s."""
    if len(arm) != len(base) or not arm:
        raise bad_value("log_ratio", (len(arm), len(base)), "two non-empty lists of one length")
    logs = [math.log(max(a, EPS)) - math.log(max(b, EPS)) for a, b in zip(arm, base)]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return LogRatio(math.exp(mean), None, None, None, n)
    from scipy import stats

    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    if sd == 0:
        p = 1.0 if mean == 0 else 0.0
        return LogRatio(math.exp(mean), math.exp(mean), math.exp(mean), p, n)
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.975, n - 1)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return LogRatio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), p, n)


HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"


def speed_verdict(
    ratio: LogRatio,
    p_holm: float | None,
    speedup: float,
    *,
    arm_censored: bool = False,
    base_censored: bool = False,
) -> str:
    """A claim "the arm reaches the target `speedup` times sooner" (1: merely sooner).

    held: Holm-adjusted p < 0.05 with the arm faster, and the geometric-mean speed-up
    (1 / ratio) >= `speedup`; not held: the speed-up's 95% interval lies below `speedup`;
    inconclusive otherwise (one seed, or an interval across the line). A censored time is a
    lower bound: "held" needs every seed of the arm to reach the target (its time could
    only be longer), "not held" every seed of the baseline."""
    if ratio.lo is None or ratio.hi is None or p_holm is None:
        return INCONCLUSIVE
    if p_holm < 0.05 and ratio.mean < 1 and 1 / ratio.mean >= speedup and not arm_censored:
        return HELD
    if 1 / ratio.lo < speedup and not base_censored:
        return NOT_HELD
    return INCONCLUSIVE


# ----------------------------------------------------------------- protocol v2's rule
# (research/study_planner/study_planner_v2.md): a crossing that holds, a learning criterion, a step-size grid


def window_to_budget(
    points: Sequence[tuple[float, float]], budget_s: float
) -> list[tuple[float, float]]:
    """The evaluations up to and including the one at the round that spends B (the run's
    last: an analysed run stops there), in order."""
    out = []
    for t, v in points:
        out.append((t, v))
        if t >= budget_s - EPS:
            break
    return out


def time_to_target_held(
    points: Sequence[tuple[float, float]], metric: Metric, gain: float, budget_s: float, hold: int
) -> tuple[float, bool]:
    """(time, True) of the first evaluation from which `hold` consecutive evaluations all
    reach `gain` over the run's round 0, among the evaluations up to the round that spends B;
    (budget, False) when none ("not reached", censored at B). A crossing at the last
    evaluation alone does not count when hold > 1: nothing after it shows that it holds."""
    window = window_to_budget(points, budget_s)
    start = start_value(window)
    if start is None:
        return budget_s, False
    ok = [metric.gain(v, start) >= gain - EPS for _, v in window]
    for i in range(len(window) - hold + 1):
        if all(ok[i : i + hold]):
            return window[i][0], True
    return budget_s, False


@dataclass(frozen=True)
class Learning:
    """The pilot's learning criterion for one run: its gain at B (the evaluation at the
    round that spends B) is at least `min_gain`, and no evaluation within B falls more than
    `max_drop` below round 0."""

    learned: bool
    gain_at_budget: float
    worst_drop: float


def learning(
    points: Sequence[tuple[float, float]],
    metric: Metric,
    budget_s: float,
    min_gain: float,
    max_drop: float,
) -> Learning:
    window = window_to_budget(points, budget_s)
    start = start_value(window)
    if start is None:
        return Learning(False, -math.inf, math.inf)
    gains = [metric.gain(v, start) for _, v in window]
    at_budget, drop = gains[-1], max(0.0, -min(gains))
    ok = at_budget >= min_gain - EPS and drop <= max_drop + EPS
    return Learning(ok, at_budget, drop)


def choose_step(
    trials: Mapping[float, Sequence[tuple[float, float]]],
    metric: Metric,
    budget_s: float,
    min_gain: float,
    max_drop: float,
) -> tuple[float, bool]:
    """(factor, learned) for one arm from its pilot runs ({step factor: points}; factor 1 is
    the protocol's step size). The protocol's step when it learns; else the factor of the
    grid that learns with the largest gain at B (ties: the factor nearest 1, the smaller);
    else 1, marked as not learning."""
    crit = {f: learning(p, metric, budget_s, min_gain, max_drop) for f, p in trials.items()}
    if 1.0 in crit and crit[1.0].learned:
        return 1.0, True
    good = [f for f, c in crit.items() if c.learned and f != 1.0]
    if not good:
        return 1.0, False
    best = max(good, key=lambda f: (crit[f].gain_at_budget, -abs(math.log(f)), -f))
    return best, True


def derive_rule_v2(
    pilot: Mapping[str, Mapping[float, Sequence[tuple[float, float]]]],
    metric: Metric,
    budget_s: float,
    target_gain: float,
    hold: int,
    fixed_rules: Sequence[str],
    min_gain: float,
    max_drop: float,
) -> dict:
    """Protocol v2's rule from the pilot ({label: {step factor: points}}): each arm's step
    factor and whether it learned; fixed-best = the fixed rule (at its chosen step) with the
    shortest held time to target, ties and "not reached" broken by the better value at B,
    then by the order given. The target gain is the config's, never the pilot's."""
    unknown = [lab for lab in fixed_rules if lab not in pilot]
    if unknown:
        raise ConfigError(f"pilot: no run of the fixed rule {unknown[0]!r}")
    steps, times, learned_by = {}, {}, {}
    for lab, trials in pilot.items():
        if 1.0 not in trials or start_value(trials[1.0]) is None:
            raise ConfigError(f"pilot: run {lab!r} has no evaluation of {metric.text}")
        factor, learned = choose_step(trials, metric, budget_s, min_gain, max_drop)
        steps[lab] = factor
        learned_by[lab] = {
            f"{f:g}": learning(p, metric, budget_s, min_gain, max_drop).__dict__
            for f, p in trials.items()
        }
        times[lab] = list(
            time_to_target_held(trials[factor], metric, target_gain, budget_s, hold)
        ) + [learned]

    def key(lab: str) -> tuple[float, float, int]:
        t, _, _ = times[lab]
        v = value_at_budget(window_to_budget(pilot[lab][steps[lab]], budget_s), budget_s)
        better = -(v if metric.higher else -v) if v is not None else math.inf
        return t, better, list(fixed_rules).index(lab)

    order = sorted(fixed_rules, key=key)
    return {
        "metric": metric.text,
        "budget_s": float(budget_s),
        "target_gain": float(target_gain),
        "hold_evals": hold,
        "learn_min_gain": min_gain,
        "learn_max_drop": max_drop,
        "steps": steps,
        "learning": learned_by,
        "fixed_best": order[0],
        "fixed_order": order,
        "pilot_times_s": times,
    }
