"""The figures of the reports (matplotlib, Agg backend): accuracy and eval_loss against the
simulated wall-clock, one colour per label (`plot_runs`, `plot_losses`), and over seeds the
mean with its 95% band (`plot_bands`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlora.studies.claims import Group, groups
from fedlora.studies.figures import (
    DIVERGED_FACTOR,
    clock_unit,
    diverged,
    draw_references,
    fit_ylim,
    mean_band,
    panels,
    pooled_constant,
    pooled_n,
    pyplot,
    sampled,
    save_figure,
    split_references,
    time_grid,
)
from fedlora.studies.runs import (
    MEAN_TASK,
    RunRecord,
    final_value,
    points,
    time_to,
)

_pyplot, _panels, _clock_unit = pyplot, panels, clock_unit


def plot_runs(
    runs: Sequence[RunRecord], targets: dict[str, float], path: Path, title: str = ""
) -> Path:
    """Accuracy against simulated wall-clock (minutes, or seconds below 2 min), one panel per
    task (the targets' tasks, or every task the runs evaluated without targets), one colour
    per label (every seed drawn; a target as a dashed line). Written with the Agg backend."""
    plt = _pyplot()

    tasks = list(targets) or list(dict.fromkeys(t for r in runs for t in r.tasks()))
    fig, axes = _panels(plt, len(tasks), 6.0, 4.0)
    runs, refs = split_references(runs)  # the references: lines at their final accuracy
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
        draw_references(ax, refs, lambda r, t=task: _final_accuracy(r, t), 100.0)
        for key, style, name in (
            ("eval_majority", ":", "most-frequent label"),
            ("eval_chance", "-.", "chance"),
        ):
            value = _baseline(runs, task, key)
            if value is not None:
                ax.axhline(100 * value, color="black", linestyle=style, linewidth=1, label=name)
        if task in targets:
            ax.axhline(100 * targets[task], color="gray", linestyle="--", linewidth=1)
            ax.set_title(f"{task} (target {100 * targets[task]:.0f}%)")
        else:
            ax.set_title(task)
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)


def _final_accuracy(run: RunRecord, task: str) -> float | None:
    curve = run.eval_points(task)
    return curve[-1][1] if curve else None


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
    """A per-task score of the eval set (majority or chance) over all seeds' questions
    (`figures.pooled_constant`); the mean eval task's is the mean over tasks."""
    if task != MEAN_TASK:
        return pooled_constant(runs, task, key)
    tasks = sorted({t for r in runs for x in r.lines for t in (x.get(key) or {})})
    values = [v for v in (pooled_constant(runs, t, key) for t in tasks) if v is not None]
    return sum(values) / len(values) if values else None


def plot_losses(
    runs: Sequence[RunRecord], path: Path, target_loss: float | None = None, title: str = ""
) -> Path | None:
    """Mean eval_loss against simulated wall-clock, one colour per label; None (nothing
    written) when no run logged eval_loss."""
    if not any(r.loss_points() for r in runs):
        return None
    plt = _pyplot()

    runs, refs = split_references(runs)  # the references: lines at their final eval_loss
    labels = list(dict.fromkeys(r.label for r in runs))
    unit, scale = _clock_unit(runs)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    shown: list[float] = [target_loss] if target_loss else []
    shown += draw_references(ax, refs, lambda r: (r.loss_points() or [(0.0, None)])[-1][1])
    for i, label in enumerate(labels):
        first = True
        for run in (r for r in runs if r.label == label):
            curve = run.loss_points()
            if not curve:
                continue
            xs, ys = [t / scale for t, _ in curve], [v for _, v in curve]
            bad = any(not math.isfinite(v) or v > DIVERGED_FACTOR * ys[0] for v in ys)
            if bad:  # drawn on its own, kept out of the y-limits (`figures.diverged`)
                ax.plot(
                    xs,
                    ys,
                    linestyle="--",
                    color=plt.cm.tab10(i % 10),
                    label=f"{label} seed {run.seed} DIVERGED ({min(ys):.3g}…{max(ys):.3g})",
                )
                continue
            ax.plot(xs, ys, marker=".", color=plt.cm.tab10(i % 10), label=label if first else None)
            shown += ys
            first = False
    if target_loss:
        ax.axhline(target_loss, color="gray", linestyle="--", linewidth=1, label="target")
    fit_ylim(ax, shown)
    ax.set_xlabel(f"simulated wall-clock ({unit})")
    ax.set_ylabel("mean eval_loss (nats per answer token)")
    ax.set_title(title or "held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def band(
    runs: Sequence[RunRecord], task: str, metric: str, grid: Sequence[float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean and 95% t band over seeds of the step curves on `grid`, only where every seed
    has a value and has not ended (a run's curve stops at its last clock): the seeds are
    averaged at the same simulated time (`figures.mean_band`)."""
    return mean_band([sampled(r, task, metric, grid) for r in runs], grid)


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
    """Accuracy (%) or eval_loss (nats) vs simulated minutes (seconds when the longest run is
    under 2 minutes): per label every seed as a thin step line and the mean over seeds with a
    95% band on one common time grid (where every seed has started and not ended); chance and
    most-frequent-label lines over all seeds' questions (accuracy), the calibration period
    shaded, censored ends marked (x), the target dashed. The y-limits show every mean, seed,
    reference line and target; a diverged seed (`figures.diverged`) is left out of its mean,
    drawn dashed on its own and named in the legend. None when no run has the metric."""
    plt = pyplot()

    runs, refs = split_references(runs)  # the references: lines at their final value
    gs = groups(runs, order)
    tasks = [t for t in targets if any(points(r, t, metric) for g in gs for r in g.runs)]
    if not tasks:
        return None
    fig, axes = panels(plt, len(tasks), 6.4, 4.4)
    colors = {g.label: plt.cm.tab10(i % 10) for i, g in enumerate(gs)}
    everything = [r for g in gs for r in g.runs]
    unit, per = clock_unit(everything)
    frame = _BandFrame(metric, 100.0 if metric == "accuracy" else 1.0, per, time_grid(everything))
    for ax, task in zip(axes.flat, tasks):
        target = (targets if metric == "accuracy" else target_losses or {}).get(task)
        shown: list[float] = []
        for g in gs:
            shown += _draw_group(ax, g, task, target, colors[g.label], frame)
        shown += draw_references(ax, refs, lambda r, t=task: final_value(r, t, metric), frame.scale)
        if metric == "accuracy":
            shown += _draw_pooled_constants(ax, everything, task)
            ax.set_ylabel("accuracy (%)")
        else:
            ax.set_ylabel("eval_loss (nats per answer token)")
        if target is not None:
            shown.append(_draw_target(ax, frame.scale * target))
        fit_ylim(ax, shown)
        n = pooled_n(everything, task)
        seeds = max(len(g.runs) for g in gs)
        size = f", {n} questions over" if n else ","
        ax.set_title(f"{task}{size} {seeds} seeds (mean, 95% t band; x = censored)", fontsize=9)
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)


@dataclass(frozen=True)
class _BandFrame:
    """What every panel of `plot_bands` shares: the metric and the axes' scales."""

    metric: str
    scale: float  # y: 100 for accuracy (%), 1 for eval_loss
    per: float  # x: seconds per unit of the time axis
    grid: list[float]  # the common simulated times of the bands


def _draw_group(
    ax: Any, g: Group, task: str, target: float | None, color: Any, frame: _BandFrame
) -> list[float]:
    """One label on one panel: its seeds, calibration period, mean with its band and
    censored ends. Returns the y-values the limits must show (kept seeds, then the mean)."""
    kept = [r for r in g.runs if not diverged(r, task, frame.metric)]
    shown = _draw_seeds(ax, g, kept, task, color, frame)
    _shade_calibration(ax, g, color, frame.per)
    shown += _draw_band(ax, g, kept, task, color, frame)
    if target is not None:
        _mark_censored(ax, kept, task, target, color, frame)
    return shown


def _draw_seeds(
    ax: Any, g: Group, kept: list[RunRecord], task: str, color: Any, frame: _BandFrame
) -> list[float]:
    """Every seed thin, so no run disappears where the band cannot be drawn (seeds that
    start or end apart); a diverged one dashed and named. Returns the kept seeds' values."""
    shown: list[float] = []
    for r in g.runs:
        pts = points(r, task, frame.metric)
        if not pts:
            continue
        xs, ys = [t / frame.per for t, _ in pts], [frame.scale * v for _, v in pts]
        if r in kept:
            ax.step(xs, ys, where="post", color=color, alpha=0.3, linewidth=0.8, marker=".", ms=3)
            shown += ys
        else:
            ax.step(
                xs,
                ys,
                where="post",
                color=color,
                linestyle="--",
                linewidth=1,
                label=f"{g.label} seed {r.seed} DIVERGED ({min(ys):.3g}…"
                f"{max(ys):.3g}), not in mean",
            )
    return shown


def _shade_calibration(ax: Any, g: Group, color: Any, per: float) -> None:
    """The label's mean calibration period, hatched from 0 (none when it calibrated none)."""
    cal = [r.calibration_time_s for r in g.runs]
    if any(cal):
        ax.axvspan(
            0,
            sum(cal) / len(cal) / per,
            color=color,
            alpha=0.08,
            hatch="//",
            label=f"{g.label} calibration (mean)",
        )


def _draw_band(
    ax: Any, g: Group, kept: list[RunRecord], task: str, color: Any, frame: _BandFrame
) -> list[float]:
    """The mean over the kept seeds with its 95% t band. Returns the mean's values."""
    xs, mean, lo, hi = band(kept, task, frame.metric, frame.grid)
    if frame.metric == "accuracy":  # an interval over few seeds can pass 0 or 100%
        lo, hi = [max(0.0, v) for v in lo], [min(1.0, v) for v in hi]
    minutes = [x / frame.per for x in xs]
    n = f"n={len(kept)}" + (f" of {len(g.runs)}" if len(kept) < len(g.runs) else "")
    scale = frame.scale
    ax.plot(minutes, [scale * v for v in mean], color=color, linewidth=2, label=f"{g.label} ({n})")
    ax.fill_between(
        minutes, [scale * v for v in lo], [scale * v for v in hi], color=color, alpha=0.12
    )
    return [scale * v for v in mean]


def _mark_censored(
    ax: Any, kept: list[RunRecord], task: str, target: float, color: Any, frame: _BandFrame
) -> None:
    """An x at the end of each seed that never reached the target."""
    for r in kept:
        if not time_to(r, task, frame.metric, target)[1]:
            end = final_value(r, task, frame.metric)
            if end is not None:
                ax.plot(
                    r.total_time_s / frame.per, frame.scale * end, marker="x", color=color, ms=8
                )


def _draw_pooled_constants(ax: Any, everything: list[RunRecord], task: str) -> list[float]:
    """Chance and most-frequent-label accuracy over all seeds' questions (%), as lines.
    Returns the values drawn."""
    shown = []
    for key, style, name in (
        ("eval_chance", "-.", "chance"),
        ("eval_majority", ":", "most-frequent label"),
    ):
        value = pooled_constant(everything, task, key)
        if value is not None:
            ax.axhline(
                100 * value,
                color="black",
                linestyle=style,
                linewidth=1,
                label=f"{name} ({100 * value:.1f}%, all seeds' questions)",
            )
            shown.append(100 * value)
    return shown


def _draw_target(ax: Any, y: float) -> float:
    """The target as a dashed line at `y` (already scaled). Returns it."""
    ax.axhline(y, color="gray", linestyle="--", linewidth=1.2, label=f"target ({y:.3g})")
    return y
