"""What the over-seeds figures share: the chance and most-frequent-label scores
over all seeds' questions, the rule that flags a diverged seed, y-limits that show every mean
and line, and the paired-difference figure (`plot_paired`): each method minus a reference
method, per seed and their mean with a 95% t band, on one common simulated-time grid.

The diverged-seed rule, written before it was applied to any run: a seed's eval_loss curve
of a task is *diverged* when a value is not finite or exceeds twice the seed's own first
(round-0) eval_loss. A diverged seed is left out of its method's mean and band in the figures
(the tables keep it) and drawn on its own, dashed, clipped at the axis, named in the legend
with the range it reached.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlora.federation.methods.references import REFERENCES
from fedlora.files import atomic_write
from fedlora.studies.claims import Group, groups, paired_runs, reference_group
from fedlora.studies.runs import RunRecord, eval_constant, level_at, points
from fedlora.studies.seeds import t_interval95

DIVERGED_FACTOR = 2.0  # eval_loss above this × the seed's round-0 value: diverged
# the references (docs/methods.md, "References") are drawn beside other runs as horizontal
# lines at their final value (the mean over their seeds), not as curves on the clock
REFERENCE_STYLE = (0, (6, 2, 1, 2))  # dash-dot-dot: apart from the targets and baselines


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(plt: Any, n_panels: int, width: float, height: float) -> tuple[Any, Any]:
    """A figure with one width × height panel per task, two columns at most."""
    cols = min(2, n_panels)
    rows = math.ceil(n_panels / cols)
    return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def clock_unit(runs: Sequence[RunRecord]) -> tuple[str, float]:
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
    image = io.BytesIO()  # written by fedlora, never through a link at `path`
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, image.getvalue())
    return path


def split_references(
    runs: Sequence[RunRecord],
) -> tuple[list[RunRecord], list[RunRecord]]:
    """(the runs drawn as curves, the references drawn as lines). Without another run
    beside them the references are curves like any run."""
    curves = [r for r in runs if r.method not in REFERENCES]
    if not curves:
        return list(runs), []
    return curves, [r for r in runs if r.method in REFERENCES]


def draw_references(
    ax: Any, refs: Sequence[RunRecord], final: Any, scale: float = 1.0
) -> list[float]:
    """Each reference label's final value (`final(run)`, the mean over its seeds that have
    one) as a horizontal line named in the legend; returns the values drawn (scaled)."""
    import matplotlib.pyplot as plt

    drawn = []
    labels = list(dict.fromkeys(r.label for r in refs))
    for i, label in enumerate(labels):
        values = [v for r in refs if r.label == label and (v := final(r)) is not None]
        if not values:
            continue
        level = scale * sum(values) / len(values)
        ax.axhline(
            level,
            color=plt.cm.Dark2(i % 8),
            linestyle=REFERENCE_STYLE,
            linewidth=1.4,
            label=f"{label} (reference: final, mean of {len(values)})",
        )
        drawn.append(level)
    return drawn


def time_grid(runs: Sequence[RunRecord], n: int = 200) -> list[float]:
    """`n` evenly spaced simulated times from 0 to the longest run's clock."""
    end = max((r.total_time_s for r in runs), default=0.0)
    return [end * i / (n - 1) for i in range(n)] if end > 0 else [0.0]


def pooled_constant(runs: Sequence[RunRecord], task: str, key: str) -> float | None:
    """A per-task score of the eval set (eval_chance, eval_majority) over all seeds'
    questions: each seed's score weighted by its eval_n (one run per seed: every method of a
    seed is evaluated on the same questions)."""
    per_seed: dict[int, tuple[float, float]] = {}
    for r in runs:
        value = eval_constant(r, task, key)
        if value is None or r.seed in per_seed:
            continue
        per_seed[r.seed] = (value, eval_constant(r, task, "eval_n") or 1.0)
    total = sum(n for _, n in per_seed.values())
    return sum(v * n for v, n in per_seed.values()) / total if total else None


def pooled_n(runs: Sequence[RunRecord], task: str) -> int:
    """The questions of `task` over all seeds (one run per seed)."""
    per_seed = {r.seed: eval_constant(r, task, "eval_n") for r in runs}
    return int(sum(n for n in per_seed.values() if n))


def diverged(run: RunRecord, task: str, metric: str) -> bool:
    """The module's rule: an eval_loss curve with a non-finite value or one above
    `DIVERGED_FACTOR` × its first value (accuracy curves are bounded: never diverged)."""
    if metric != "loss":
        return False
    pts = points(run, task, "loss")
    if not pts:
        return False
    first = pts[0][1]
    return any(not math.isfinite(v) or v > DIVERGED_FACTOR * first for _, v in pts)


def fit_ylim(ax: Any, values: Sequence[float], pad: float = 0.06) -> tuple[float, float]:
    """Set y-limits spanning every value given (means, kept seeds, reference lines) with a
    margin; bands may run past them. Returns the limits."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ax.get_ylim()
    lo, hi = min(finite), max(finite)
    margin = (hi - lo) * pad or max(abs(hi), 1.0) * pad
    ax.set_ylim(lo - margin, hi + margin)
    return lo - margin, hi + margin


def mean_band(
    curves: Sequence[Sequence[float | None]], grid: Sequence[float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, mean, low, high) of curves sampled on `grid`: only where every curve has a value
    (the seeds are averaged at the same simulated time, never at different lengths)."""
    xs, mean, lo, hi = [], [], [], []
    for i, x in enumerate(grid):
        values = [c[i] for c in curves]
        if not values or any(v is None for v in values):
            continue
        m = sum(values) / len(values)
        h = t_interval95(values) or 0.0
        xs.append(x)
        mean.append(m)
        lo.append(m - h)
        hi.append(m + h)
    return xs, mean, lo, hi


def sampled(run: RunRecord, task: str, metric: str, grid: Sequence[float]) -> list[float | None]:
    """The run's step curve on `grid`: None before its first evaluation and after its clock."""
    return [None if x > run.total_time_s else level_at(run, task, metric, x) for x in grid]


def paired_differences(
    a: Sequence[RunRecord],
    b: Sequence[RunRecord],
    task: str,
    metric: str,
    grid: Sequence[float],
    scale: float = 1.0,
) -> tuple[list[list[float | None]], list[tuple[int, list[float | None]]]]:
    """Per seed pair (a[i], b[i]) the difference scale × (a − b) on `grid` (None where either
    has no value or has ended): (the kept curves, [(seed, curve)] of the pairs where either
    run diverged)."""
    curves, flagged = [], []
    for ra, rb in zip(a, b):
        da, db = sampled(ra, task, metric, grid), sampled(rb, task, metric, grid)
        d = [None if u is None or v is None else scale * (u - v) for u, v in zip(da, db)]
        if diverged(ra, task, metric) or diverged(rb, task, metric):
            flagged.append((ra.seed, d))
        else:
            curves.append(d)
    return curves, flagged


def pick_reference(gs: Sequence[Group], label: str | None) -> Group | None:
    """The group named `label`, else FSLoRA's (`claims.reference_group`), else the first
    group not labelled proposed*."""
    if label:
        return next((g for g in gs if g.label == label), None)
    return reference_group(gs) or next((g for g in gs if not g.label.startswith("proposed")), None)


def plot_paired(
    runs: Sequence[RunRecord],
    tasks: Sequence[str],
    metric: str,
    path: Path,
    *,
    reference: str | None = None,
    order: Sequence[str] | None = None,
    title: str = "",
) -> Path | None:
    """Each method minus the reference method, paired by seed, against simulated time: every
    seed's difference thin, the mean over seeds with its 95% t band (where every seed's pair
    is running), zero marked. Accuracy in percentage points, eval_loss in nats. None (nothing
    written) without a reference or another method or the metric."""
    gs = groups(runs, order)
    ref = pick_reference(gs, reference)
    others = [g for g in gs if g is not ref]
    if ref is None or not others:
        return None
    tasks = [t for t in tasks if any(points(r, t, metric) for r in ref.runs)]
    if not tasks:
        return None
    plt = pyplot()
    fig, axes = panels(plt, len(tasks), 6.4, 4.2)
    colors = {g.label: plt.cm.tab10(i % 10) for i, g in enumerate(gs)}
    scale = 100.0 if metric == "accuracy" else 1.0
    everything = [r for g in gs for r in g.runs]
    unit, per = clock_unit(everything)
    grid = time_grid(everything)
    seeds = sorted({r.seed for r in ref.runs})
    for ax, task in zip(axes.flat, tasks):
        shown: list[float] = [0.0]
        for g in others:
            c = colors[g.label]
            a, b = paired_runs(g, ref)
            curves, flagged = paired_differences(a, b, task, metric, grid, scale)
            for d in curves:
                keep = [(x / per, v) for x, v in zip(grid, d) if v is not None]
                if keep:
                    ax.plot(*zip(*keep), color=c, alpha=0.3, linewidth=0.8)
                shown += [v for _, v in keep]
            xs, mean, lo, hi = mean_band(curves, grid)
            n = f"n={len(curves)}" + (f" of {len(a)}" if flagged else "")
            if not xs:  # e.g. proposed's main rounds start after the reference has ended
                n += f"; never running at the same time as {ref.label}"
            ax.plot([x / per for x in xs], mean, color=c, linewidth=2, label=f"{g.label} ({n})")
            ax.fill_between([x / per for x in xs], lo, hi, color=c, alpha=0.15)
            shown += mean
            for seed, d in flagged:
                keep = [(x / per, v) for x, v in zip(grid, d) if v is not None]
                if keep:
                    span = f"{min(v for _, v in keep):.3g}…{max(v for _, v in keep):.3g}"
                    ax.plot(
                        *zip(*keep),
                        color=c,
                        linestyle="--",
                        linewidth=1,
                        label=f"{g.label} seed {seed} DIVERGED ({span}), not in mean",
                    )
        ax.axhline(0.0, color="black", linewidth=1.2, label=f"zero (= {ref.label})")
        fit_ylim(ax, shown)
        what = "accuracy (percentage points)" if metric == "accuracy" else "eval_loss (nats)"
        ax.set_ylabel(f"{what}: method − {ref.label}")
        ax.set_xlabel(f"simulated wall-clock ({unit})")
        ax.set_title(
            f"{task}, {pooled_n(ref.runs, task)} questions over seeds {seeds}: paired "
            "difference, mean ± 95% t band",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, axes=list(axes.flat)[len(tasks) :], title=title)
