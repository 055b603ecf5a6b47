"""The planner study's numbers, from its run directories and rule.json: per arm and seed the
time to target (censored at the budget) and the metric at the budget; the best baseline;
the paired comparisons of every `proposed` arm with every baseline (log-ratio t interval,
paired difference, pooled exact McNemar), Holm-corrected per endpoint; the paper's claims
with their verdicts (research/study_planner/study_planner.md, "Verdicts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.errors import DataError
from fedlora.studies.predictions import pooled_mcnemar
from fedlora.studies.runs import RunRecord, eval_constant, load_run
from fedlora.studies.seeds import PairedDiff, paired_diff
from research.study_planner.study_checks import check_same_protocol
from research.study_planner.study_rule import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    LogRatio,
    Metric,
    holm,
    log_ratio,
    metric_points,
    parse_metric,
    speed_verdict,
    time_to_target,
    time_to_target_held,
    value_at_budget,
)

# Table I of the paper: minutes to the target accuracy (ARC-e 80%, ARC-c 69%, OBQA 60%,
# SIQA 60%), Qwen2.5-1.5B-Instruct, 50 clients
PAPER_TARGETS = {"arc-e": 0.80, "arc-c": 0.69, "obqa": 0.60, "siqa": 0.60}
PAPER_TABLE1 = {
    "heterolora": {"arc-e": 6.22, "arc-c": 5.93, "obqa": 7.83, "siqa": 7.12},
    "fedstacklora": {"arc-e": 3.60, "arc-c": 3.43, "obqa": 4.55, "siqa": 4.11},
    "fslora": {"arc-e": 3.35, "arc-c": 3.20, "obqa": 4.23, "siqa": 3.83},
    "proposed": {"arc-e": 1.20, "arc-c": 0.77, "obqa": 1.07, "siqa": 0.95},
}
PAPER_SPEEDUP = 2.8  # the smallest of Table I's speed-ups over FSLoRA (2.8x-4.2x)


@dataclass
class Cell:
    """One run's numbers."""

    run: RunRecord
    time_s: float  # censored at the budget when not reached
    reached: bool
    at_budget: float | None
    start: float | None


@dataclass
class Comparison:
    arm: str
    base: str
    ratio: LogRatio  # T_arm / T_base
    diff: PairedDiff | None  # metric at B, arm − base
    mcnemar: tuple | None  # (questions, only arm right, only base right, p)
    p_time_holm: float | None = None
    p_acc_holm: float | None = None
    per_seed_mcnemar: list | None = None  # protocol v2: one exact test per seed, descriptive
    margin: float = 0.0  # protocol v2: "not worse" = the t interval's lower end above -margin


def load_cells(out: Path, rule: dict[str, Any], metric: Metric) -> dict[str, list[Cell]]:
    """{arm: [Cell per analysed seed, in seed order]}; a missing run is a DataError."""
    cells: dict[str, list[Cell]] = {}
    for arm in rule["arms"]:
        row = []
        for seed in rule["seeds"]:
            run_dir = out / f"{arm}-seed{seed}"
            if not run_dir.is_dir():
                raise DataError(
                    f"{run_dir}: missing (run `research/study_planner/study_planner.py run` first)"
                )
            row.append(cell(load_run(run_dir), metric, rule))
        cells[arm] = row
    check_same_protocol(cells, rule)
    return cells


def cell(run: RunRecord, metric: Metric, rule: dict[str, Any]) -> Cell:
    pts = metric_points(run, metric)
    if (
        "hold_evals" in rule
    ):  # protocol v2: a crossing that holds (research/study_planner/study_planner_v2.md)
        t, reached = time_to_target_held(
            pts, metric, rule["target_gain"], rule["budget_s"], int(rule["hold_evals"])
        )
    else:
        t, reached = time_to_target(pts, metric, rule["target_gain"], rule["budget_s"])
    start = pts[0][1] if pts else None
    return Cell(run, t, reached, value_at_budget(pts, rule["budget_s"]), start)


def eval_reference(cells: dict[str, list[Cell]], metric: Metric) -> dict[str, float] | None:
    """The evaluation's size and the scores that need no model, from the first analysed run
    that logged them (`eval_constant`): {"n": questions, "chance": expected accuracy of a
    uniform guess, "majority": accuracy of always answering the most frequent label}; None
    when no run did (a loss metric keeps "n" only). Every seed and arm answers the same
    questions (rule 12), so one run's values are the study's."""
    for row in cells.values():
        for c in row:
            n = eval_constant(c.run, metric.task, "eval_n")
            if n is None:
                continue
            ref = {"n": n}
            if metric.scale == 100.0:  # an accuracy: its chance and majority scores
                for key in ("chance", "majority"):
                    value = eval_constant(c.run, metric.task, f"eval_{key}")
                    if value is not None:
                        ref[key] = value
            return ref
    return None


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def best_baseline(cells: dict[str, list[Cell]], baselines: list[str], higher: bool) -> str:
    """The baseline with the smallest geometric-mean time to target (censored at B); ties by
    the better mean metric at B, then by the order given."""

    def key(lab: str) -> tuple[float, float, int]:
        vals = [c.at_budget for c in cells[lab] if c.at_budget is not None]
        mean = sum(vals) / len(vals) if vals else math.nan
        return (
            geo_mean([c.time_s for c in cells[lab]]),
            -mean if higher else mean,
            baselines.index(lab),
        )

    return min(baselines, key=key)


def compare(
    cells: dict[str, list[Cell]], arm: str, base: str, metric: Metric, margin: float = 0.0
) -> Comparison:
    a, b = cells[arm], cells[base]
    ratio = log_ratio([c.time_s for c in a], [c.time_s for c in b])
    values = [(x.at_budget, y.at_budget) for x, y in zip(a, b)]
    diff = None
    if all(u is not None and v is not None for u, v in values):
        diff = paired_diff([u for u, _ in values], [v for _, v in values])  # type: ignore[misc]
    test = None
    if metric.field == "acc" and not margin:  # the first rule: pooled over the seeds
        test = pooled_mcnemar([c.run for c in a], [c.run for c in b], metric.task)
    per_seed = None
    if metric.field == "acc" and margin:
        # protocol v2: the seeds answer the same questions, so their discordant pairs are
        # not independent and are never pooled; each seed's test is reported, not judged
        per_seed = [pooled_mcnemar([x.run], [y.run], metric.task) for x, y in zip(a, b)]
    return Comparison(arm, base, ratio, diff, test, per_seed_mcnemar=per_seed, margin=margin)


def comparisons(cells: dict[str, list[Cell]], rule: dict[str, Any], metric: Metric) -> list:
    """Every proposed arm against every baseline; Holm over the family, per endpoint."""
    margin = float(rule.get("noninferiority_margin", 0.0))
    out = [
        compare(cells, p, b, metric, margin) for p in rule["proposed"] for b in rule["baselines"]
    ]
    for attr, get in (("p_time_holm", lambda c: c.ratio.p), ("p_acc_holm", _acc_p)):
        idx = [i for i, c in enumerate(out) if get(c) is not None]
        for i, adj in zip(idx, holm([get(out[i]) for i in idx])):
            setattr(out[i], attr, adj)
    return out


def _acc_p(c: Comparison) -> float | None:
    return c.mcnemar[3] if c.mcnemar else None


def not_worse(c: Comparison, higher: bool) -> str:
    """The metric at B: worse when the pooled McNemar (Holm) or, without one, the paired t
    interval shows the arm worse; not worse otherwise when it can tell."""
    if c.diff is None:
        return INCONCLUSIVE
    if c.margin:
        return not_worse_by_margin(c.diff, c.margin, higher)
    worse_side = c.diff.mean < 0 if higher else c.diff.mean > 0
    if c.p_acc_holm is not None:
        return NOT_HELD if (c.p_acc_holm < 0.05 and worse_side) else HELD
    if c.diff.ci is None:
        return INCONCLUSIVE
    lo, hi = c.diff.mean - c.diff.ci, c.diff.mean + c.diff.ci
    if (hi < 0) if higher else (lo > 0):
        return NOT_HELD
    return HELD


def not_worse_by_margin(diff: PairedDiff, margin: float, higher: bool) -> str:
    """Protocol v2, the seed as the unit: held when the 95% t interval of the paired
    difference (arm − baseline, on the better-is-positive side) lies above −margin; not held
    when it lies below −margin; inconclusive otherwise (or with one seed)."""
    if diff.ci is None:
        return INCONCLUSIVE
    mean = diff.mean if higher else -diff.mean
    if mean - diff.ci > -margin:
        return HELD
    if mean + diff.ci < -margin:
        return NOT_HELD
    return INCONCLUSIVE


def claims(
    comps: list[Comparison],
    cells: dict[str, list[Cell]],
    best: str,
    higher: bool,
    scale: float = 1.0,
) -> list[dict[str, str]]:
    """The paper's Table I claims and ours, one verdict each (rule: research/study_planner/study_planner.md;
    protocol v2's, research/study_planner/study_planner_v2.md rule 13, adds "not worse at B" against each
    baseline)."""
    by = {(c.arm, c.base): c for c in comps}

    def speed_of(c: Comparison, factor: float) -> str:
        return speed_verdict(
            c.ratio,
            c.p_time_holm,
            factor,
            arm_censored=any(not x.reached for x in cells[c.arm]),
            base_censored=any(not x.reached for x in cells[c.base]),
        )

    out = []
    arms = list(dict.fromkeys(c.arm for c in comps))
    for arm in arms:
        for base, factor, text in (
            ("fslora", PAPER_SPEEDUP, f"reaches the target >= {PAPER_SPEEDUP}x sooner than FSLoRA"),
            (
                "fslora-paper",
                PAPER_SPEEDUP,
                f"reaches the target >= {PAPER_SPEEDUP}x sooner than FSLoRA as the paper "
                "describes it (plain averaging)",
            ),
            ("fedstacklora", 1.0, "reaches the target sooner than FedStackLoRA"),
            ("heterolora", 1.0, "reaches the target sooner than HeteroLoRA"),
        ):
            c = by.get((arm, base))
            if c is not None:
                v = speed_of(c, factor)
                out.append({"arm": arm, "claim": f"Table I: {arm} {text}", "verdict": v})
        for c in (c for c in comps if c.arm == arm and c.margin):
            out.append(
                {
                    "arm": arm,
                    "claim": f"{arm} is not worse than {c.base} at the budget (the paired 95% "
                    f"t interval above -{scale * c.margin:g}{' points' if scale == 100 else ''})",
                    "verdict": not_worse(c, higher),
                }
            )
        c = by.get((arm, best))
        if c is not None:
            speed = speed_of(c, 1.0)
            acc = not_worse(c, higher)
            if NOT_HELD in (speed, acc) and not (speed == HELD and acc == HELD):
                verdict = NOT_HELD if (speed == NOT_HELD or acc == NOT_HELD) else INCONCLUSIVE
            else:
                verdict = HELD if (speed == HELD and acc == HELD) else INCONCLUSIVE
            out.append(
                {
                    "arm": arm,
                    "claim": f"ours: {arm} pays for its planning (sooner than the best baseline "
                    f"{best}, and not worse at the budget)",
                    "verdict": verdict,
                }
            )
    return out


def metric_of(rule: dict[str, Any]) -> Metric:
    return parse_metric(rule["metric"], "rule.json metric")
