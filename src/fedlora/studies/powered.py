"""The powered report: several seeds, a common simulated-time budget, targets
fixed by a written rule from a pilot seed (`fedlora.studies.target_rule`), intervals over
seeds (`fedlora.studies.seeds`), paired comparisons and a verdict on each claim of the paper
(`fedlora.studies.claims`); `render` writes the over-seeds sections appended to report.md,
`fedlora.studies.plots.plot_bands` their figures. Reads only metrics lines
(`fedlora.studies.runs.RunRecord`).

"At the common budget": each run's last evaluation (the engine evaluates the round that
spends `training.time_budget_s`). Paired difference proposed − baseline per seed, mean,
t interval and the two-sided paired t test's p value; and McNemar's exact test on the
questions, pooled over seeds (the discordant counts summed over the seeds' run pairs,
`fedlora.studies.predictions.pooled_mcnemar`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedlora.studies.claims import (
    SIMILAR_MARGIN,
    Group,
    claims,
    final_diff,
    groups,
    paired_runs,
    proposed_group,
    reference_group,
    times_to,
)
from fedlora.studies.predictions import pooled_mcnemar
from fedlora.studies.runs import RunRecord, final_value
from fedlora.studies.seeds import paired_ratio, summarize

__all__ = [
    "render",
]


def render(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    *,
    target_losses: dict[str, float] | None = None,
    target_drops: dict[str, float] | None = None,
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
    target_drops = target_drops or {}
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
    ref = reference_group(gs)
    for task, target in targets.items():
        ends = _Targets(target, target_losses.get(task), target_drops.get(task))
        out += [f"### {task}", ""]
        out += _times_table(gs, ref, task, ends)
        prop = proposed_group(gs)
        if prop is not None:
            out += _paired_at_budget(gs, prop, task)
        out.append("")
    out += _claims_section(claims(suite, gs, targets, margin, target_losses, target_drops))
    out += _plan_section(gs)
    wall = sum((r.summary.wall_s or 0.0) for g in gs for r in g.runs)
    compute = sum((r.summary.compute_s or 0.0) for g in gs for r in g.runs)
    out += [
        f"CPU: {sum(len(g.runs) for g in gs)} runs, Σ wall_s = {wall / 3600:.2f} h (a run's "
        "last session, calibration included), Σ compute_s = "
        f"{compute / 3600:.2f} h (training and evaluation of the main rounds).",
        "",
    ]
    return "\n".join(out)


@dataclass(frozen=True)
class _Targets:
    """One task's targets: accuracy, and the optional loss level and loss drop."""

    accuracy: float
    loss: float | None
    drop: float | None


def _times_table(gs: Sequence[Group], ref: Group | None, task: str, ends: _Targets) -> list[str]:
    """Per method: times to each target over seeds, the speed-up over the reference, and
    accuracy and eval_loss at the budget."""
    head = f"| method | seeds | time to {100 * ends.accuracy:.1f}% (s) | without calibration (s) |"
    head += f" speed-up over {ref.label} |" if ref else ""
    head += f" time to loss <= {ends.loss:.4g} (s) |" if ends.loss is not None else ""
    head += f" time to a loss drop >= {ends.drop:.4g} (s) |" if ends.drop is not None else ""
    head += " accuracy at budget (%) | eval_loss at budget |"
    return [head, "|" + "---|" * (head.count("|") - 1)] + [
        "| " + " | ".join(_times_row(g, ref, task, ends)) + " |" for g in gs
    ]


def _times_row(g: Group, ref: Group | None, task: str, ends: _Targets) -> list[str]:
    """One method's cells of `_times_table`."""
    t, ok = times_to(g.runs, task, "accuracy", ends.accuracy, False)
    tb, okb = times_to(g.runs, task, "accuracy", ends.accuracy, True)
    cells = [g.label, str(len(g.runs)), summarize(t, ok.count(False)).text()]
    calibrated = any(r.calibration_time_s > 0 for r in g.runs)
    cells.append(summarize(tb, okb.count(False)).text() if calibrated else "-")
    if ref:
        a, b = paired_runs(g, ref)
        ta, ra = times_to(a, task, "accuracy", ends.accuracy, False)
        tr, rr = times_to(b, task, "accuracy", ends.accuracy, False)
        cells.append(paired_ratio(tr, rr, ta, ra).text() if a else "-")
    if ends.loss is not None:
        tl, okl = times_to(g.runs, task, "loss", ends.loss, False)
        cells.append(summarize(tl, okl.count(False)).text())
    if ends.drop is not None:
        td, okd = times_to(g.runs, task, "loss_drop", ends.drop, False)
        cells.append(summarize(td, okd.count(False)).text())
    accs = [v for v in (final_value(r, task, "accuracy") for r in g.runs) if v is not None]
    losses = [v for v in (final_value(r, task, "loss") for r in g.runs) if v is not None]
    cells.append(summarize(accs).text(100) if accs else "-")
    cells.append(summarize(losses).text(1, 4) if losses else "-")
    return cells


def _paired_at_budget(gs: Sequence[Group], prop: Group, task: str) -> list[str]:
    """The proposed method minus each baseline at the budget, paired by seed: accuracy and
    eval_loss (t test), and McNemar on the questions pooled over seeds."""
    out = [
        "",
        f"Paired at the budget, {prop.label} − baseline (mean ± 95% interval, paired t test p):",
        "",
        "| baseline | seeds | accuracy (pts) | p | eval_loss | p | McNemar, pooled "
        "over seeds: questions, only proposed right / only baseline right, p |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in gs:
        if g is prop:
            continue
        a, b = paired_runs(prop, g)
        row = [g.label, str(len(a))]
        for metric, scale, digits in (("accuracy", 100, 1), ("loss", 1, 4)):
            d = final_diff(a, b, task, metric)
            if d is None:
                row += ["-", "-"]
                continue
            ci = f" ± {d.ci * scale:.{digits}f}" if d.ci is not None else ""
            row += [f"{d.mean * scale:+.{digits}f}{ci}", "-" if d.p is None else f"{d.p:.3g}"]
        mc = pooled_mcnemar(a, b, task)
        row.append("-" if mc is None else f"{mc[0]}: {mc[1]} / {mc[2]}, p = {mc[3]:.3g}")
        out.append("| " + " | ".join(row) + " |")
    return out


def _claims_section(rows: list[dict[str, Any]]) -> list[str]:
    """Each claim of the paper with its verdict over seeds (nothing when there are none)."""
    if not rows:
        return []
    return [
        "## Claims of the paper",
        "",
        "held: the 95% interval over seeds lies on the claimed side; not held: on the "
        "other side; inconclusive: otherwise (one seed, an interval across the line, or "
        "censoring both ways).",
        "",
        "| claim | task | verdict | numbers |",
        "|---|---|---|---|",
        *(f"| {r['claim']} | {r['task']} | **{r['verdict']}** | {r['numbers']} |" for r in rows),
        "",
    ]


def _plan_section(gs: Sequence[Group]) -> list[str]:
    """Algorithm 2's fit per proposed run (summary.json's `plan`), when present."""
    rows = []
    for g in gs:
        for r in g.runs:
            plan = r.summary.plan
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
