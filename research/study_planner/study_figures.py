"""The planner study's two figures (results/study_planner/*.png, beside report.md): the
metric against simulated time, mean over seeds with its 95% t band; and the paired
difference of each arm to FSLoRA on the same seed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlora.studies.figures import mean_band, pyplot, save_figure
from research.study_planner.study_rule import Metric, level_on_grid, metric_points
from research.study_planner.study_spec import REFERENCE
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
