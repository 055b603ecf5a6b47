"""The pilot's sections of the planner study's report (`study_report`): each arm's step size
chosen on the pilot, every pilot run's own time to target, and the learning criterion's
numbers per pilot run (protocol v2: research/study_planner/study_planner_v2.md, rules 5–7)."""

from __future__ import annotations

import math
from typing import Any

from fedlora.federation.progress import ACCURACY_DROP
from research.study_planner.study_checks import pilot_label
from research.study_planner.study_rule import Metric, metric_points, time_to_target_held


def steps_lines(rule: dict[str, Any]) -> list[str]:
    """Protocol v2: each arm's step size, chosen on the pilot by the learning criterion."""
    if "steps" not in rule:
        return []
    out = []
    for lab, factor in rule["steps"].items():
        learned = rule["pilot_times_s"][lab][2]
        out.append(
            f"- step of {lab}: {rule['step_keys'][lab]} = {rule['step_values'][lab]:.4g} "
            f"(x{factor:g} the protocol's; {'learned' if learned else 'did NOT learn'} "
            "on the pilot)"
        )
    return out


def learning_lines(rule: dict[str, Any], scale: float) -> list[str]:
    if "learning" not in rule:
        return []
    pts = " points" if scale == 100 else ""
    out = [
        "",
        f"Learning criterion: gain at B >= {scale * rule['learn_min_gain']:g}{pts} and no "
        f"evaluation more than {scale * rule['learn_max_drop']:g}{pts} below round 0.",
        "",
        "| arm | step factor | gain at B (a run stopped at the drop: at its stop) | worst drop "
        "| learned |",
        "|---|---|---|---|---|",
    ]
    for lab, trials in rule["learning"].items():
        for factor, c in trials.items():
            out.append(
                f"| {lab} | x{factor} | {scale * c['gain_at_budget']:+.2f} | "
                f"{scale * c['worst_drop']:.2f} | {c['learned']} |"
            )
    return out


def pilot_lines(rule: dict[str, Any], metric: Metric, pilot: dict[str, Any]) -> list[str]:
    """The pilot's runs: their time to target and evaluations (reported, never analysed)."""
    lines = [
        "",
        f"## Pilot (seed {rule['pilot_seed']}, never analysed)",
        "",
        "| run | time to target (min) | reached | evaluations | stopped |",
        "|---|---|---|---|---|",
    ]
    others = []
    for lab, run in pilot.items():
        pts = metric_points(run, metric)
        if "steps" in rule:  # protocol v2: every pilot run's own held time, grid runs too
            if pilot_label(lab, rule)[0] not in rule["steps"]:
                others.append(lab)
                continue
            t, reached = time_to_target_held(
                pts, metric, rule["target_gain"], rule["budget_s"], int(rule["hold_evals"])
            )
        else:
            t, reached = rule["pilot_times_s"].get(lab, [math.nan, False])[:2]
        stop = run.summary.stop_reason or "-"
        if stop == ACCURACY_DROP and pts:  # a grid run stopped where it fell (amendment 5)
            stop = f"at the drop, {pts[-1][0]:.0f} s"
        lines.append(f"| {lab} | {t / 60:.2f} | {reached} | {len(pts)} | {stop} |")
    if others:
        lines += [
            "",
            "Pilot runs of labels rule.json has no step for (taken out of the study by an "
            "amendment; their files stay in pilot/, never part of the rule): "
            + ", ".join(others)
            + ".",
        ]
    return lines
