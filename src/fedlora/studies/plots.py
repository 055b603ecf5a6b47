"""The figures of the reports (matplotlib, Agg backend): accuracy and eval_loss against the
simulated wall-clock, one colour per label (`plot_runs`, `plot_losses`), and over seeds the
mean with its 95% band (`plot_bands`, issue 14).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlora.studies.claims import groups
from fedlora.studies.runs import (
    MEAN_TASK,
    RunRecord,
    eval_constant,
    final_value,
    level_at,
    points,
    time_to,
)
from fedlora.studies.seeds import t_interval95


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt: Any, n_panels: int, width: float, height: float) -> tuple[Any, Any]:
    """A figure with one width × height panel per task, two columns at most."""
    cols = min(2, n_panels)
    rows = math.ceil(n_panels / cols)
    return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def _clock_unit(runs: Sequence[RunRecord]) -> tuple[str, float]:
    """The x axis' unit and seconds per unit: minutes, or seconds when the longest run's
    simulated clock is under 2 minutes."""
    longest_s = max((r.total_time_s for r in runs), default=0.0)
    return ("min", 60.0) if longest_s >= 120 else ("s", 1.0)


def save_figure(fig: Any, path: Path, *, axes: Sequence[Any] = (), title: str = "") -> Path:
    """Turn off the unused `axes`, add the title, lay out and write `fig` to `path`; close it."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_runs(
    runs: Sequence[RunRecord], targets: dict[str, float], path: Path, title: str = ""
) -> Path:
    """Accuracy against simulated wall-clock (minutes, or seconds below 2 min), one panel per task, one colour per
    label (every seed drawn; the target as a dashed line). Written with the Agg backend."""
    plt = _pyplot()

    tasks = list(targets)
    fig, axes = _panels(plt, len(tasks), 6.0, 4.0)
    labels = list(dict.fromkeys(r.label for r in runs))
    unit, scale = _clock_unit(runs)
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    for ax, task in zip(axes.flat, tasks):
        for label in labels:
            first = True
            for run in (r for r in runs if r.label == label):
                curve = run.eval_points(task)
                if not curve:
                    continue
                xs = [t / scale for t, _ in curve]
                ys = [100 * a for _, a in curve]
                ax.plot(xs, ys, marker=".", color=colors[label], label=label if first else None)
                first = False
                wilson = _wilson_band(run, task)
                if wilson:
                    bx, lo, hi = wilson
                    ax.fill_between(
                        [t / scale for t in bx], lo, hi, color=colors[label], alpha=0.12
                    )
        for key, style, name in (
            ("eval_majority", ":", "most-frequent label"),
            ("eval_chance", "-.", "chance"),
        ):
            value = _baseline(runs, task, key)
            if value is not None:
                ax.axhline(100 * value, color="black", linestyle=style, linewidth=1, label=name)
        ax.axhline(100 * targets[task], color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{task} (target {100 * targets[task]:.0f}%)")
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)


def _wilson_band(run: RunRecord, task: str) -> tuple[list[float], list[float], list[float]]:
    """(times, lower %, upper %) of the run's logged 95% Wilson intervals of `task`."""
    xs, lo, hi = [], [], []
    for line in run.lines:
        ci = (line.get("eval_ci95") or {}).get(task)
        if ci is not None and line.get("eval"):
            xs.append(float(line["sim_time_s"]))
            lo.append(100 * ci[0])
            hi.append(100 * ci[1])
    return (xs, lo, hi) if xs else ()


def _baseline(runs: Sequence[RunRecord], task: str, key: str) -> float | None:
    """The mean over runs of a per-task constant of the eval set (majority or chance score);
    the mean eval task's is the mean over tasks."""
    values = []
    for run in runs:
        line = next((x for x in run.lines if x.get(key)), None)
        if line is None:
            continue
        per_task = line[key]
        if task == MEAN_TASK:
            values.append(sum(per_task.values()) / len(per_task))
        elif task in per_task:
            values.append(float(per_task[task]))
    return sum(values) / len(values) if values else None


def plot_losses(
    runs: Sequence[RunRecord], path: Path, target_loss: float | None = None, title: str = ""
) -> Path | None:
    """Mean eval_loss against simulated wall-clock, one colour per label; None (nothing
    written) when no run logged eval_loss."""
    if not any(r.loss_points() for r in runs):
        return None
    plt = _pyplot()

    labels = list(dict.fromkeys(r.label for r in runs))
    unit, scale = _clock_unit(runs)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for i, label in enumerate(labels):
        first = True
        for run in (r for r in runs if r.label == label):
            curve = run.loss_points()
            if curve:
                ax.plot(
                    [t / scale for t, _ in curve],
                    [v for _, v in curve],
                    marker=".",
                    color=plt.cm.tab10(i % 10),
                    label=label if first else None,
                )
                first = False
    if target_loss:
        ax.axhline(target_loss, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(f"simulated wall-clock ({unit})")
    ax.set_ylabel("eval_loss (NLL of the answer tokens)")
    ax.set_title(title or "held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


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
    plt = _pyplot()

    gs = groups(runs, order)
    tasks = [t for t in targets if any(points(r, t, metric) for g in gs for r in g.runs)]
    if not tasks:
        return None
    fig, axes = _panels(plt, len(tasks), 6.4, 4.2)
    colors = {g.label: plt.cm.tab10(i % 10) for i, g in enumerate(gs)}
    scale = 100.0 if metric == "accuracy" else 1.0
    everything = [r for g in gs for r in g.runs]
    unit, per = _clock_unit(everything)
    grid = _grid(everything)
    for ax, task in zip(axes.flat, tasks):
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
