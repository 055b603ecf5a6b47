"""The powered report (issue 14): several seeds, a common simulated-time budget, targets
fixed by a written rule from a pilot seed, intervals over seeds, paired comparisons and a
verdict on each claim of the paper. Reads only metrics lines (`fedlora.studies.report.RunRecord`).

Statistics (all over seeds; a seed is one partition, one set of client profiles and one
sampling stream, the same for every method of a suite, so comparisons are paired by seed):

- A mean's 95% interval is the t interval over seeds (none for one seed).
- Time to target: the first evaluation at or above the accuracy target (at or below the loss
  target). A seed that never gets there is *censored*: its time is only known to be >= its
  last clock; a mean with a censored seed is a lower bound (">=") and has no interval.
- Speed-up of a method over a reference, per seed s: T_ref(s) / T_method(s); its summary is
  the geometric mean with the t interval of the mean log ratio, exponentiated. A seed where
  only the reference is censored gives a lower bound on its ratio, only the method an upper
  bound; the interval is then one-sided valid (see `paired_ratio`).
- "At the common budget": each run's last evaluation (the engine evaluates the round that
  spends `training.time_budget_s`). Paired difference proposed − baseline per seed, mean,
  t interval and the two-sided paired t test's p value; and McNemar's exact test on the
  questions, pooled over seeds (the discordant counts summed over the seeds' run pairs).

Verdicts (`Verdict`): a claim *holds* when its interval lies on the claimed side, *does not
hold* when it lies on the other side, and is *inconclusive* otherwise (one seed, an interval
across the line, or censoring in both directions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, bad_value
from fedlora.studies.report import RunRecord, save_figure, t_interval95

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
REFERENCE = "fslora"
PAPER_SPEEDUP = (2.8, 4.2)  # Table I: proposed over FSLoRA on ARC-e, ARC-c, OBQA, SIQA
SIMILAR_MARGIN = 0.02  # "similar final accuracy": the paired difference within ±2 points
# the paper's orderings, fastest first (time to target)
ORDERINGS = {
    "table1": ("proposed", "fslora", "fedstacklora", "heterolora"),
    "sampling": ("proposed-q",),  # Fig. 2: planned q before every fixed strategy
    "ranks": ("proposed-k",),  # Fig. 3: planned k before every fixed strategy
}
RULE_KEYS = ("budget_fraction", "floor_se", "text")


# ----------------------------------------------------------------------------- reading runs


def task_accuracy(line: dict[str, Any], task: str) -> float | None:
    value = (line.get("eval") or {}).get(task)
    return None if value is None else float(value)


def task_loss(line: dict[str, Any], task: str) -> float | None:
    value = (line.get("eval_losses") or {}).get(task)
    return None if value is None else float(value)


def points(run: RunRecord, task: str, metric: str) -> list[tuple[float, float]]:
    """(sim_time_s, value) of every evaluation of `task`; metric "accuracy" or "loss"."""
    get = task_accuracy if metric == "accuracy" else task_loss
    out = []
    for line in run.lines:
        value = get(line, task)
        if value is not None:
            out.append((float(line["sim_time_s"]), value))
    return out


def level_at(run: RunRecord, task: str, metric: str, time_s: float) -> float | None:
    """The last evaluated value at or before `time_s` (the curve is a step function)."""
    value = None
    for t, v in points(run, task, metric):
        if t > time_s:
            break
        value = v
    return value


def time_to(run: RunRecord, task: str, metric: str, target: float) -> tuple[float, bool]:
    """(time, reached): first evaluation at/above an accuracy target or at/below a loss
    target; (last clock, False) when never (censored)."""
    for t, v in points(run, task, metric):
        if (v >= target) if metric == "accuracy" else (v <= target):
            return t, True
    return run.total_time_s, False


def final_value(run: RunRecord, task: str, metric: str) -> float | None:
    pts = points(run, task, metric)
    return pts[-1][1] if pts else None


def eval_constant(run: RunRecord, task: str, key: str) -> float | None:
    """A per-task constant of the eval set from the first line that logged it
    (eval_majority, eval_chance, eval_n)."""
    for line in run.lines:
        value = (line.get(key) or {}).get(task)
        if value is not None:
            return float(value)
    return None


# ----------------------------------------------------------------------------- statistics


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


def pooled_mcnemar(a: Sequence[RunRecord], b: Sequence[RunRecord], task: str) -> tuple | None:
    """McNemar's exact test on the questions of the last evaluations, pooled over the seeds
    (pairs of runs of one seed, from predictions.jsonl; `fedlora.studies.report.paired_tests`):
    (questions, only a right, only b right, p). None when a run has no predictions."""
    from fedlora.errors import DataError
    from fedlora.studies.report import mcnemar_p, paired_tests

    n = only_a = only_b = 0
    for x, y in zip(a, b):
        try:
            tests = [t for t in paired_tests(x.path, y.path) if t.task == task]
        except DataError:
            return None
        for t in tests:
            n, only_a, only_b = n + t.n, only_a + t.a_only, only_b + t.b_only
    return (n, only_a, only_b, mcnemar_p(only_a, only_b)) if n else None


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


# ----------------------------------------------------------------------------- targets by rule


def check_rule(rule: Any, where: str = "suite.target_rule") -> dict[str, Any]:
    """The target rule table: budget_fraction in (0, 1], floor_se >= 0, text (the rule in
    words, written before the pilot ran)."""
    if not isinstance(rule, dict):
        raise bad_value(where, rule, "a table {budget_fraction, floor_se, text}")
    unknown = [k for k in rule if k not in RULE_KEYS]
    if unknown:
        raise bad_value(f"{where}.{unknown[0]}", rule[unknown[0]], f"keys: {', '.join(RULE_KEYS)}")
    frac = rule.get("budget_fraction")
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise bad_value(f"{where}.budget_fraction", frac, "a number in (0, 1]")
    floor = rule.get("floor_se", 0.0)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 0:
        raise bad_value(f"{where}.floor_se", floor, "a number >= 0")
    text = rule.get("text", "")
    if not isinstance(text, str) or not text.strip():
        raise bad_value(f"{where}.text", text, "the rule in words (a non-empty string)")
    return {"budget_fraction": float(frac), "floor_se": float(floor), "text": text}


def rule_targets(
    runs: Sequence[RunRecord], tasks: Sequence[str], budget_s: float, rule: dict[str, Any]
) -> dict[str, Any]:
    """Targets from pilot runs by the rule (issue 14 item 2).

    Per task, at t = budget_fraction · budget_s, over the *baselines* (labels not starting
    with "proposed"): accuracy target = the lowest level any baseline has reached by t (the
    slowest baseline's), raised to the floor majority + floor_se · √(m(1 − m)/n) (m the
    most-frequent-label score, n the eval size); loss target = the highest eval_loss any
    baseline has at t (no floor). Returns {"accuracy": {task: x}, "loss": {task: x},
    "details": {task: {...the numbers behind...}}}.
    """
    if not budget_s > 0:
        raise bad_value("training.time_budget_s", budget_s, "> 0 for a target rule (a budget)")
    rule = check_rule(rule)
    at_s = rule["budget_fraction"] * budget_s
    baselines = [r for r in runs if not r.label.startswith("proposed") and r.lines]
    if not baselines:
        raise ConfigError("target rule: the pilot has no baseline run with metrics")
    acc, loss, details = {}, {}, {}
    for task in tasks:
        acc_levels = {r.label: level_at(r, task, "accuracy", at_s) for r in baselines}
        loss_levels = {r.label: level_at(r, task, "loss", at_s) for r in baselines}
        known = {k: v for k, v in acc_levels.items() if v is not None}
        if not known:
            raise ConfigError(f"target rule: no pilot baseline evaluated {task!r} by {at_s:g} s")
        slowest = min(known, key=lambda k: known[k])
        majority = eval_constant(baselines[0], task, "eval_majority")
        n = eval_constant(baselines[0], task, "eval_n")
        floor = None
        if majority is not None and n:
            floor = majority + rule["floor_se"] * math.sqrt(majority * (1 - majority) / n)
        target = known[slowest] if floor is None else max(known[slowest], floor)
        acc[task] = min(target, 1.0)
        lk = {k: v for k, v in loss_levels.items() if v is not None}
        if lk:
            loss[task] = max(lk.values())
        details[task] = {
            "at_s": at_s,
            "accuracy_at": known,
            "slowest": slowest,
            "majority": majority,
            "n": n,
            "floor": floor,
            "floored": floor is not None and floor > known[slowest],
            "loss_at": lk,
        }
    return {"accuracy": acc, "loss": loss, "details": details}


def targets_toml(result: dict[str, Any], rule: dict[str, Any], pilot: str) -> str:
    """targets.toml written by the pilot: the targets, the rule and the numbers behind."""
    import json

    lines = [
        "# Targets fixed from the pilot seed by the suite's rule, before the main runs.",
        f"rule = {json.dumps(rule['text'])}",
        f"budget_fraction = {rule['budget_fraction']!r}",
        f"floor_se = {rule['floor_se']!r}",
        f"pilot = {json.dumps(pilot)}",
        "",
        "[targets]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in result["accuracy"].items()),
        "",
        "[target_losses]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in result["loss"].items()),
        "",
    ]
    for task, d in result["details"].items():
        lines += [f"[details.{json.dumps(task)}]"]
        for key in ("at_s", "slowest", "majority", "n", "floor", "floored"):
            if d[key] is not None:
                value = d[key]
                lines.append(
                    f"{key} = {json.dumps(value) if not isinstance(value, float) else repr(value)}"
                )
        lines.append(
            "accuracy_at = {"
            + ", ".join(f"{json.dumps(k)} = {v!r}" for k, v in d["accuracy_at"].items())
            + "}"
        )
        if d["loss_at"]:
            lines.append(
                "loss_at = {"
                + ", ".join(f"{json.dumps(k)} = {v!r}" for k, v in d["loss_at"].items())
                + "}"
            )
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the report


@dataclass
class Group:
    """The runs of one label, paired by seed."""

    label: str
    runs: list[RunRecord]

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def groups(runs: Sequence[RunRecord], order: Sequence[str] | None = None) -> list[Group]:
    labels: list[str] = [x for x in (order or []) if any(r.label == x for r in runs)]
    labels += [r.label for r in runs if r.label not in labels]
    out = []
    for label in dict.fromkeys(labels):
        group = sorted((r for r in runs if r.label == label and r.lines), key=lambda r: r.seed)
        if group:
            out.append(Group(label, group))
    return out


def _paired(a: Group, b: Group) -> tuple[list[RunRecord], list[RunRecord]]:
    """The runs of two labels on their common seeds, in seed order."""
    common = sorted(set(a.seeds) & set(b.seeds))
    pick = {r.seed: r for r in a.runs}, {r.seed: r for r in b.runs}
    return [pick[0][s] for s in common], [pick[1][s] for s in common]


def _times(runs: Sequence[RunRecord], task: str, metric: str, target: float, bare: bool):
    res = [time_to(r, task, metric, target) for r in runs]
    cal = [r.calibration_time_s if bare else 0.0 for r in runs]
    return [t - c for (t, _), c in zip(res, cal)], [ok for _, ok in res]


def _reference(gs: Sequence[Group]) -> Group | None:
    return next((g for g in gs if g.label == REFERENCE), None) or next(
        (g for g in gs if g.runs[0].method == REFERENCE), None
    )


def _proposed(gs: Sequence[Group]) -> Group | None:
    return next((g for g in gs if g.label.startswith("proposed")), None)


def claims(
    suite: str,
    gs: Sequence[Group],
    targets: dict[str, float],
    margin: float = SIMILAR_MARGIN,
) -> list[dict[str, Any]]:
    """One row per (claim, task): claim, task, verdict, the numbers behind it."""
    rows: list[dict[str, Any]] = []
    by = {g.label: g for g in gs}
    prop = _proposed(gs)
    for task, target in targets.items():
        order = [lab for lab in ORDERINGS.get(suite, ()) if lab in by]
        if suite == "table1":
            pairs = list(zip(order, order[1:]))
            name = "Table I ordering: " + " < ".join(order) + " (time to target)"
        elif prop is not None:
            pairs = [(prop.label, g.label) for g in gs if g is not prop]
            name = (
                "Fig. 2: planned q reaches the target first"
                if suite == "sampling"
                else "Fig. 3: planned k reaches the target first"
            )
        else:
            pairs = []
        if pairs:
            verdicts, numbers = [], []
            for fast, slow in pairs:
                a, b = _paired(by[fast], by[slow])
                if not a:
                    verdicts.append(INCONCLUSIVE)
                    numbers.append(f"{slow}/{fast}: no common seed")
                    continue
                ta, ra = _times(a, task, "accuracy", target, False)
                tb, rb = _times(b, task, "accuracy", target, False)
                ratio = paired_ratio(tb, rb, ta, ra)
                verdicts.append(ratio_verdict(ratio, 1.0))
                numbers.append(f"{slow}/{fast} {ratio.text()}")
            rows.append({"claim": name, "task": task, "verdict": _all(verdicts),
                         "numbers": "; ".join(numbers)})  # fmt: skip
        ref = _reference(gs)
        if suite == "table1" and prop is not None and ref is not None:
            for bare in (False, True):
                a, b = _paired(prop, ref)
                ta, ra = _times(a, task, "accuracy", target, bare)
                tb, rb = _times(b, task, "accuracy", target, False)
                ratio = paired_ratio(tb, rb, ta, ra)
                rows.append(
                    {
                        "claim": f"speed-up over {ref.label} >= {PAPER_SPEEDUP[0]}x "
                        f"(paper: {PAPER_SPEEDUP[0]}–{PAPER_SPEEDUP[1]}x)"
                        + (" without the calibration's time" if bare else ""),
                        "task": task,
                        "verdict": ratio_verdict(ratio, PAPER_SPEEDUP[0]),
                        "numbers": ratio.text(),
                    }
                )
        if prop is not None:
            verdicts, numbers = [], []
            for g in gs:
                if g is prop:
                    continue
                a, b = _paired(prop, g)
                fa = [final_value(r, task, "accuracy") for r in a]
                fb = [final_value(r, task, "accuracy") for r in b]
                keep = [(x, y) for x, y in zip(fa, fb) if x is not None and y is not None]
                if not keep:
                    continue
                d = paired_diff([x for x, _ in keep], [y for _, y in keep])
                verdicts.append(similar_verdict(d, margin))
                ci = f" ± {100 * d.ci:.1f}" if d.ci is not None else ""
                numbers.append(f"vs {g.label} {100 * d.mean:+.1f}{ci} pts")
            if verdicts:
                rows.append(
                    {
                        "claim": f"similar final accuracy (paired difference within "
                        f"±{100 * margin:g} points)",
                        "task": task,
                        "verdict": _all(verdicts),
                        "numbers": "; ".join(numbers),
                    }
                )
    return rows


def _all(verdicts: Sequence[str]) -> str:
    """A conjunction: NOT_HELD if any part fails, HELD if all hold, else INCONCLUSIVE."""
    if any(v == NOT_HELD for v in verdicts):
        return NOT_HELD
    if verdicts and all(v == HELD for v in verdicts):
        return HELD
    return INCONCLUSIVE


def render(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    *,
    target_losses: dict[str, float] | None = None,
    suite: str = "",
    order: Sequence[str] | None = None,
    margin: float = SIMILAR_MARGIN,
    rule: str = "",
) -> str:
    """The over-seeds sections of report.md (markdown)."""
    gs = groups(runs, order)
    if not gs:
        return ""
    target_losses = target_losses or {}
    seeds = sorted({s for g in gs for s in g.seeds})
    out = ["", "## Over seeds (powered report)", ""]
    out += [
        f"Seeds {seeds}; every comparison is paired by seed (same partition, client profiles "
        "and sampling). Mean ± 95% t interval over seeds; `>=` marks censored seeds (target "
        "never reached: the time is the run's last clock). Speed-ups: geometric mean of the "
        "per-seed ratios [95% interval]. 'At the budget' = each run's last evaluation.",
        "",
    ]
    if rule:
        out += [f"Targets fixed before the main runs by the rule: {rule}", ""]
    ref = _reference(gs)
    for task, target in targets.items():
        out += [f"### {task}", ""]
        loss_t = target_losses.get(task)
        head = f"| method | seeds | time to {100 * target:.1f}% (s) | without calibration (s) |"
        head += f" speed-up over {ref.label} |" if ref else ""
        head += f" time to loss <= {loss_t:.4g} (s) |" if loss_t is not None else ""
        head += " accuracy at budget (%) | eval_loss at budget |"
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for g in gs:
            t, ok = _times(g.runs, task, "accuracy", target, False)
            tb, okb = _times(g.runs, task, "accuracy", target, True)
            cells = [g.label, str(len(g.runs)), summarize(t, ok.count(False)).text()]
            calibrated = any(r.calibration_time_s > 0 for r in g.runs)
            cells.append(summarize(tb, okb.count(False)).text() if calibrated else "-")
            if ref:
                a, b = _paired(g, ref)
                ta, ra = _times(a, task, "accuracy", target, False)
                tr, rr = _times(b, task, "accuracy", target, False)
                cells.append(paired_ratio(tr, rr, ta, ra).text() if a else "-")
            if loss_t is not None:
                tl, okl = _times(g.runs, task, "loss", loss_t, False)
                cells.append(summarize(tl, okl.count(False)).text())
            accs = [v for v in (final_value(r, task, "accuracy") for r in g.runs) if v is not None]
            losses = [v for v in (final_value(r, task, "loss") for r in g.runs) if v is not None]
            cells.append(summarize(accs).text(100) if accs else "-")
            cells.append(summarize(losses).text(1, 4) if losses else "-")
            out.append("| " + " | ".join(cells) + " |")
        prop = _proposed(gs)
        if prop is not None:
            out += ["", f"Paired at the budget, {prop.label} − baseline (mean ± 95% interval, "
                    "paired t test p):", ""]  # fmt: skip
            out += ["| baseline | seeds | accuracy (pts) | p | eval_loss | p | McNemar, pooled "
                    "over seeds: questions, only proposed right / only baseline right, p |",
                    "|---|---|---|---|---|---|---|"]  # fmt: skip
            for g in gs:
                if g is prop:
                    continue
                a, b = _paired(prop, g)
                row = [g.label, str(len(a))]
                for metric, scale, digits in (("accuracy", 100, 1), ("loss", 1, 4)):
                    pairs = [(final_value(x, task, metric), final_value(y, task, metric))
                             for x, y in zip(a, b)]  # fmt: skip
                    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
                    if not pairs:
                        row += ["-", "-"]
                        continue
                    d = paired_diff([x for x, _ in pairs], [y for _, y in pairs])
                    ci = f" ± {d.ci * scale:.{digits}f}" if d.ci is not None else ""
                    row += [f"{d.mean * scale:+.{digits}f}{ci}",
                            "-" if d.p is None else f"{d.p:.3g}"]  # fmt: skip
                mc = pooled_mcnemar(a, b, task)
                row.append("-" if mc is None else f"{mc[0]}: {mc[1]} / {mc[2]}, p = {mc[3]:.3g}")
                out.append("| " + " | ".join(row) + " |")
        out.append("")
    rows = claims(suite, gs, targets, margin)
    if rows:
        out += ["## Claims of the paper", ""]
        out += [
            "held: the 95% interval over seeds lies on the claimed side; not held: on the "
            "other side; inconclusive: otherwise (one seed, an interval across the line, or "
            "censoring both ways).",
            "",
            "| claim | task | verdict | numbers |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {r['claim']} | {r['task']} | **{r['verdict']}** | {r['numbers']} |" for r in rows
        ]
        out.append("")
    out += _plan_section(gs)
    wall = sum(float(r.summary.get("wall_s", 0.0) or 0.0) for g in gs for r in g.runs)
    compute = sum(float(r.summary.get("compute_s", 0.0) or 0.0) for g in gs for r in g.runs)
    out += [
        f"CPU: {sum(len(g.runs) for g in gs)} runs, Σ wall_s = {wall / 3600:.2f} h (a run's "
        "last session, calibration included), Σ compute_s = "
        f"{compute / 3600:.2f} h (training and evaluation of the main rounds).",
        "",
    ]
    return "\n".join(out)


def _plan_section(gs: Sequence[Group]) -> list[str]:
    """Algorithm 2's fit per proposed run (summary.json's `plan`), when present."""
    rows = []
    for g in gs:
        for r in g.runs:
            plan = r.summary.get("plan")
            if not plan:
                continue
            cal = "; ".join(
                f"q={c['q']:g} k={c['k']}: {c['observed_rounds']:g} vs {c['predicted_rounds']:.3g}"
                + ("" if c.get("reached_f_s", True) else " (F_s not reached)")
                for c in plan.get("calibration", [])
            )
            observed = plan.get("observed_rounds")
            rows.append(
                f"| {g.label} | {r.seed} | {plan.get('predicted_rounds', float('nan')):.3g} | "
                f"{'>= ' + str(plan.get('rounds_run')) if observed is None else observed} | "
                f"{'DEGENERATE: ' + '; '.join(plan.get('degenerate_reasons', [])) if plan.get('degenerate') else 'no'} | "
                f"{cal} |"
            )
    if not rows:
        return []
    return [
        "## Algorithm 2: does Theorem 1's model predict the rounds?",
        "",
        "Rounds to the calibration loss F_s': predicted from the fitted constants vs observed "
        "(smoothed training loss), for the planned run and its four calibration runs "
        "(observed vs predicted).",
        "",
        "| method | seed | planned run: predicted | observed | plan degenerate | calibration runs |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


# ----------------------------------------------------------------------------- plots


def _grid(runs: Sequence[RunRecord], n: int = 200) -> list[float]:
    end = max((r.total_time_s for r in runs), default=0.0)
    return [end * i / (n - 1) for i in range(n)] if end > 0 else [0.0]


def band(
    runs: Sequence[RunRecord], task: str, metric: str, grid: Sequence[float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean and 95% t band over seeds of the step curves on `grid`, only where every seed
    has a value and has not ended (a run's curve stops at its last clock)."""
    xs, mean, lo, hi = [], [], [], []
    for x in grid:
        values = []
        for r in runs:
            v = level_at(r, task, metric, x)
            if v is None or x > r.total_time_s:
                values = []
                break
            values.append(v)
        if not values:
            continue
        m = sum(values) / len(values)
        h = t_interval95(values) or 0.0
        xs.append(x)
        mean.append(m)
        lo.append(m - h)
        hi.append(m + h)
    return xs, mean, lo, hi


def plot_bands(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    metric: str,
    path: Path,
    *,
    title: str = "",
    order: Sequence[str] | None = None,
    target_losses: dict[str, float] | None = None,
) -> Path | None:
    """Accuracy (%) or eval_loss vs simulated minutes (seconds when the longest run is
    under 2 minutes): per label every seed as a thin step line and the mean over seeds with a
    95% band (where every seed has started and not ended), chance and most-frequent-label
    lines (accuracy; the y-axis starts at chance), the calibration period shaded, censored
    ends marked (x), the target dashed; eval size and seed count in each panel's title.
    None when no run has the metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gs = groups(runs, order)
    tasks = [t for t in targets if any(points(r, t, metric) for g in gs for r in g.runs)]
    if not tasks:
        return None
    cols = min(2, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False)
    colors = {g.label: plt.cm.tab10(i % 10) for i, g in enumerate(gs)}
    scale = 100.0 if metric == "accuracy" else 1.0
    longest = max((r.total_time_s for g in gs for r in g.runs), default=0.0)
    unit, per = ("min", 60.0) if longest >= 120 else ("s", 1.0)  # short simulated clocks in s
    for ax, task in zip(axes.flat, tasks):
        everything = [r for g in gs for r in g.runs]
        grid = _grid(everything)
        for g in gs:
            c = colors[g.label]
            for r in g.runs:  # every seed thin, so no run disappears where the band cannot
                pts = points(r, task, metric)  # be drawn (seeds that start or end apart)
                if pts:
                    ax.step([t / per for t, _ in pts], [scale * v for _, v in pts], where="post",
                            color=c, alpha=0.3, linewidth=0.8, marker=".", ms=3)  # fmt: skip
            cal = [r.calibration_time_s for r in g.runs]
            if any(cal):
                ax.axvspan(0, sum(cal) / len(cal) / per, color=c, alpha=0.08, hatch="//",
                           label=f"{g.label} calibration")  # fmt: skip
            xs, mean, lo, hi = band(g.runs, task, metric, grid)
            if metric == "accuracy":  # an interval over few seeds can pass 0 or 100%
                lo, hi = [max(0.0, v) for v in lo], [min(1.0, v) for v in hi]
            minutes = [x / per for x in xs]
            ax.plot(
                minutes, [scale * v for v in mean], color=c, label=f"{g.label} (n={len(g.runs)})"
            )
            ax.fill_between(
                minutes, [scale * v for v in lo], [scale * v for v in hi], color=c, alpha=0.2
            )
            target = (targets if metric == "accuracy" else target_losses or {}).get(task)
            for r in g.runs:  # censored ends: the target never reached by this seed
                if target is not None and not time_to(r, task, metric, target)[1]:
                    end = final_value(r, task, metric)
                    if end is not None:
                        ax.plot(r.total_time_s / per, scale * end, marker="x", color=c, ms=8)
        n = eval_constant(everything[0], task, "eval_n")
        if metric == "accuracy":
            chance = eval_constant(everything[0], task, "eval_chance")
            majority = eval_constant(everything[0], task, "eval_majority")
            if chance is not None:
                ax.axhline(100 * chance, color="black", linestyle="-.", linewidth=1, label="chance")
                ax.set_ylim(bottom=100 * chance)
            if majority is not None:
                ax.axhline(100 * majority, color="black", linestyle=":", linewidth=1,
                           label="most-frequent label")  # fmt: skip
            if task in targets:
                ax.axhline(100 * targets[task], color="gray", linestyle="--", linewidth=1,
                           label="target")  # fmt: skip
            ax.set_ylabel("accuracy (%)")
        else:
            if task in (target_losses or {}):
                ax.axhline(target_losses[task], color="gray", linestyle="--", linewidth=1,
                           label="target")  # fmt: skip
            ax.set_ylabel("eval_loss (NLL of the answer tokens)")
        seeds = max(len(g.runs) for g in gs)
        size = f", {int(n)} questions" if n else ""
        ax.set_title(f"{task}{size}, {seeds} seeds (mean, 95% band; x = censored)", fontsize=9)
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)
