"""The planner study's figures (results/study_planner/*.png, beside report.md): the metric
against simulated time, mean over seeds with its 95% t band; the paired difference of each
arm to FSLoRA on the same seed; and every pilot run's curve (`pilot_figure`, drawn by
`study_planner.py status --figure`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.studies.figures import mean_band, panels, pyplot, save_figure
from fedlora.studies.runs import RunRecord, eval_constant, load_run
from research.study_planner.study_rule import Metric, level_on_grid, metric_points
from research.study_planner.study_spec import REFERENCE, StudySpec
from research.study_planner.study_stats import Cell, eval_reference

# the names `fedlora report` uses for the same two figures (a run directory's manifest knows
# them): accuracy for acc/acc_norm, eval_loss for a loss metric
FIGURES = {
    True: ("accuracy_bands.png", "accuracy_paired.png"),
    False: ("eval_loss_bands.png", "eval_loss_paired.png"),
}


def figures(out: Path, rule: dict[str, Any], metric: Metric, cells: dict[str, list[Cell]]) -> None:
    """Mean over seeds with its 95% t band on a fine grid to B; the paired difference to
    FSLoRA per arm (mean and band)."""
    plt = pyplot()
    budget = rule["budget_s"]
    grid = [budget * i / 100 for i in range(101)]
    curves = {
        arm: [level_on_grid(metric_points(c.run, metric), grid) for c in row]
        for arm, row in cells.items()
    }
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, cs in curves.items():
        xs, mean, lo, hi = mean_band(cs, grid)
        (line,) = ax.plot([x / 60 for x in xs], mean, label=arm)
        ax.fill_between([x / 60 for x in xs], lo, hi, alpha=0.2, color=line.get_color())
    ref = eval_reference(cells, metric) or {}
    # the line styles of fedlora's own figures (fedlora.studies.plots)
    for key, text, style in (("majority", "most-frequent label", ":"), ("chance", "chance", "-.")):
        if key in ref:
            ax.axhline(ref[key], color="black", lw=0.8, ls=style, label=f"{text} {ref[key]:.3f}")
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel(metric.text + (f" (n = {ref['n']:.0f})" if "n" in ref else ""))
    ax.legend(fontsize=8)
    save_figure(
        fig, out / FIGURES[metric.higher][0], title=f"{metric.text}: mean over seeds, 95% t band"
    )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ref = curves.get(REFERENCE)
    for arm, cs in curves.items():
        if ref is None or arm == REFERENCE:
            continue
        diffs = [
            [None if u is None or v is None else u - v for u, v in zip(a, b)]
            for a, b in zip(cs, ref)
        ]
        xs, mean, lo, hi = mean_band(diffs, grid)
        (line,) = ax.plot([x / 60 for x in xs], mean, label=arm)
        ax.fill_between([x / 60 for x in xs], lo, hi, alpha=0.2, color=line.get_color())
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel(f"{metric.text}: arm - FSLoRA (same seed)")
    ax.legend(fontsize=8)
    save_figure(
        fig, out / FIGURES[metric.higher][1], title="paired difference to FSLoRA, 95% t band"
    )


PILOT_FIGURE = "pilot_curves.png"


@dataclass(frozen=True)
class PilotLevels:
    """What the pilot figure draws beside the runs (from the study's config or rule.json)."""

    budget_s: float
    target_gain: float
    learn_min_gain: float
    learn_max_drop: float
    pilot_seed: int


def pilot_figure(spec: StudySpec, out: Path, path: Path) -> Path | None:
    """`draw_pilot` of the pilot's known jobs under `out` (those with an evaluation), in the
    config's arm order; a run still going is dashed. None when there is nothing to draw."""
    from research.study_planner.study_pilot import pilot_dir, pilot_jobs
    from research.study_planner.study_runner import finished

    jobs, _ = pilot_jobs(spec, out, finished)
    by_arm: dict[str, list[tuple[float, RunRecord, bool]]] = {lab: [] for lab in spec.pilot_labels}
    for label, factor in jobs:
        run_dir = pilot_dir(out, label, factor, spec.pilot_seed)
        if (run_dir / "metrics.jsonl").is_file():
            by_arm[label].append((factor, load_run(run_dir), finished(run_dir)))
    levels = PilotLevels(
        spec.budget_s, spec.target_gain, spec.learn_min_gain, spec.learn_max_drop, spec.pilot_seed
    )
    return draw_pilot(by_arm, spec.metric, levels, path)


def draw_pilot(
    by_arm: dict[str, list[tuple[float, RunRecord, bool]]],
    metric: Metric,
    levels: PilotLevels,
    path: Path,
) -> Path | None:
    """Every pilot run's metric against simulated time, one panel per arm ({arm: [(step
    factor, run, finished)]}, arms without a run left out), one line per step factor (an
    unfinished run dashed): its round 0, the target (round 0 + the target gain), the learning
    criterion's two levels (round 0 + min gain, round 0 − max drop), chance and the
    most-frequent label, and B, on one scale. None when no run has an evaluation."""
    by_arm = {
        lab: runs
        for lab, runs in by_arm.items()
        if any(metric_points(r, metric) for _, r, _ in runs)
    }
    arms = list(by_arm)
    if not arms:
        return None
    scale = metric.scale
    first = by_arm[arms[0]][0][1]
    ref = {k: eval_constant(first, metric.task, f"eval_{k}") for k in ("n", "chance", "majority")}
    plt = pyplot()
    fig, axes = panels(plt, len(arms), 5.0, 3.0)
    flat = [ax for row in axes for ax in row]
    for i, (ax, label) in enumerate(zip(flat, arms)):
        start = None
        for factor, run, done in sorted(by_arm[label], key=lambda fr: fr[0]):
            pts = metric_points(run, metric)
            if not pts:
                continue
            start = pts[0][1] if start is None else start
            ax.plot(
                [t / 60 for t, _ in pts],
                [v * scale for _, v in pts],
                "-" if done else "--",
                marker=".",
                label=f"x{factor:g}" + ("" if done else " (running)"),
            )
        sign = 1 if metric.higher else -1
        for level, text, ls in (
            (start, "round 0", "-"),
            (start + sign * levels.target_gain, "target", "--"),
            (start + sign * levels.learn_min_gain, "learns: min gain", ":"),
            (start - sign * levels.learn_max_drop, "learns: max drop", ":"),
        ):  # the reference lines are named in the first panel only
            ax.axhline(level * scale, color="grey", lw=0.8, ls=ls, label=text if not i else None)
        for key, text, ls in (("majority", "most-frequent label", ":"), ("chance", "chance", "-.")):
            if ref[key] is not None:
                ax.axhline(
                    ref[key] * scale, color="black", lw=0.8, ls=ls, label=text if not i else None
                )
        ax.axvline(levels.budget_s / 60, color="red", lw=0.8, label="B" if not i else None)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("simulated time (min)", fontsize=8)
        n = f" (n = {ref['n']:.0f})" if ref["n"] is not None else ""
        ax.set_ylabel(metric.text + n, fontsize=8)
        ax.legend(fontsize=6)
    low, high = zip(*(ax.get_ylim() for ax in flat[: len(arms)]))
    for ax in flat[: len(arms)]:  # one scale for every panel: the arms compare by eye
        ax.set_ylim(min(low), max(high))
    title = f"pilot, seed {levels.pilot_seed}: {metric.text} at each evaluation"
    return save_figure(fig, path, axes=flat[len(arms) :], title=title)


def pilot_figure_of_rule(
    out: Path, rule: dict[str, Any], metric: Metric, pilot: dict[str, RunRecord]
) -> Path | None:
    """The report's pilot figure (protocol v2: `out`/pilot_curves.png): `draw_pilot` of the
    pilot runs of rule.json's arms (every one finished once the rule exists), in its order."""
    from research.study_planner.study_checks import pilot_label

    by_arm: dict[str, list[tuple[float, RunRecord, bool]]] = {lab: [] for lab in rule["steps"]}
    for name, run in pilot.items():
        label, factor = pilot_label(name, rule)
        if label in by_arm:
            by_arm[label].append((factor, run, True))
    levels = PilotLevels(
        rule["budget_s"],
        rule["target_gain"],
        rule["learn_min_gain"],
        rule["learn_max_drop"],
        rule["pilot_seed"],
    )
    return draw_pilot(by_arm, metric, levels, out / PILOT_FIGURE)
