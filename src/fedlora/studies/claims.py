"""The paper's claims checked over seeds: the runs grouped by label and paired by
seed, and one verdict per (claim, task) from the statistics of `fedlora.studies.seeds`:
Table I's ordering and speed-up of `proposed` over FSLoRA, Fig. 2/3's planned q/k reaching
the target first, and a similar final accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedlora.studies.runs import REFERENCE, RunRecord, final_value, time_to
from fedlora.studies.seeds import (
    HELD,
    INCONCLUSIVE,
    NOT_HELD,
    PairedDiff,
    paired_diff,
    paired_ratio,
    ratio_verdict,
    similar_verdict,
)

PAPER_SPEEDUP = (2.8, 4.2)  # Table I: proposed over FSLoRA on ARC-e, ARC-c, OBQA, SIQA
SIMILAR_MARGIN = 0.02  # "similar final accuracy": the paired difference within ±2 points
# the paper's orderings, fastest first (time to target)
ORDERINGS = {
    "table1": ("proposed", "fslora", "fedstacklora", "heterolora"),
    "sampling": ("proposed-q",),  # Fig. 2: planned q before every fixed strategy
    "ranks": ("proposed-k",),  # Fig. 3: planned k before every fixed strategy
}


@dataclass
class Group:
    """The runs of one label, paired by seed."""

    label: str
    runs: list[RunRecord]

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def groups(runs: Sequence[RunRecord], order: Sequence[str] | None = None) -> list[Group]:
    """The runs with metrics by label (`order` first, then as found), each in seed order."""
    labels: list[str] = [x for x in (order or []) if any(r.label == x for r in runs)]
    labels += [r.label for r in runs if r.label not in labels]
    out = []
    for label in dict.fromkeys(labels):
        group = sorted((r for r in runs if r.label == label and r.lines), key=lambda r: r.seed)
        if group:
            out.append(Group(label, group))
    return out


def paired_runs(a: Group, b: Group) -> tuple[list[RunRecord], list[RunRecord]]:
    """The runs of two labels on their common seeds, in seed order."""
    common = sorted(set(a.seeds) & set(b.seeds))
    pick = {r.seed: r for r in a.runs}, {r.seed: r for r in b.runs}
    return [pick[0][s] for s in common], [pick[1][s] for s in common]


def times_to(
    runs: Sequence[RunRecord], task: str, metric: str, target: float, bare: bool
) -> tuple[list[float], list[bool]]:
    """Each run's (time to target, reached); `bare`: minus its calibration's simulated time."""
    res = [time_to(r, task, metric, target) for r in runs]
    cal = [r.calibration_time_s if bare else 0.0 for r in runs]
    return [t - c for (t, _), c in zip(res, cal)], [ok for _, ok in res]


def final_diff(
    a: Sequence[RunRecord], b: Sequence[RunRecord], task: str, metric: str
) -> PairedDiff | None:
    """Paired difference a − b of the last evaluated values (`metric` of `task`) over the
    run pairs (one seed each) where both have one; None when no pair has."""
    pairs = [(final_value(x, task, metric), final_value(y, task, metric)) for x, y in zip(a, b)]
    kept = [(x, y) for x, y in pairs if x is not None and y is not None]
    return paired_diff([x for x, _ in kept], [y for _, y in kept]) if kept else None


def reference_group(gs: Sequence[Group]) -> Group | None:
    """The group labelled (else the first of method) `REFERENCE`."""
    return next((g for g in gs if g.label == REFERENCE), None) or next(
        (g for g in gs if g.runs[0].method == REFERENCE), None
    )


def proposed_group(gs: Sequence[Group]) -> Group | None:
    """The first group whose label starts with "proposed"."""
    return next((g for g in gs if g.label.startswith("proposed")), None)


def claims(
    suite: str,
    gs: Sequence[Group],
    targets: dict[str, float],
    margin: float = SIMILAR_MARGIN,
    target_losses: dict[str, float] | None = None,
    target_drops: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per (claim, task, metric): claim, task, verdict, the numbers behind it.

    The time claims (ordering, speed-up) are judged on the accuracy targets and, when
    `target_losses` is given, again on the eval_loss targets (time to a mean eval_loss <= the
    target; the CPU protocol's primary target, research/cpu_protocol/cpu_protocol.md), and with
    `target_drops` on eval_loss decreases from each run's own round 0 (`runs.time_to`'s
    "loss_drop"), as separate rows.
    """
    rows: list[dict[str, Any]] = []
    prop = proposed_group(gs)
    for task, target in targets.items():
        rows += time_claims(suite, gs, task, "accuracy", target)
        if target_losses and task in target_losses:
            rows += time_claims(suite, gs, task, "loss", target_losses[task])
        if target_drops and task in target_drops:
            rows += time_claims(suite, gs, task, "loss_drop", target_drops[task])
        if prop is not None:
            verdicts, numbers = [], []
            for g in gs:
                if g is prop:
                    continue
                a, b = paired_runs(prop, g)
                d = final_diff(a, b, task, "accuracy")
                if d is None:
                    continue
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


def time_claims(
    suite: str, gs: Sequence[Group], task: str, metric: str, target: float
) -> list[dict[str, Any]]:
    """The ordering claim of `suite` and, for table1, the speed-up over the reference (with
    and without the calibration's time), judged by the time to `target` of `metric`
    ("accuracy": first evaluation >= target; "loss": first eval_loss <= target;
    "loss_drop": first eval_loss <= the run's round-0 eval_loss − target)."""
    rows: list[dict[str, Any]] = []
    by = {g.label: g for g in gs}
    prop = proposed_group(gs)
    to = {
        "accuracy": "time to target",
        "loss": f"time to eval_loss <= {target:.4g}",
        "loss_drop": f"time to an eval_loss drop >= {target:.4g}",
    }[metric]
    order = [lab for lab in ORDERINGS.get(suite, ()) if lab in by]
    if suite == "table1":
        pairs = list(zip(order, order[1:]))
        name = "Table I ordering: " + " < ".join(order) + f" ({to})"
    elif prop is not None:
        pairs = [(prop.label, g.label) for g in gs if g is not prop]
        what = "q" if suite == "sampling" else "k"
        fig = "2" if suite == "sampling" else "3"
        name = f"Fig. {fig}: planned {what} reaches the target first"
        name += "" if metric == "accuracy" else f" ({to})"
    else:
        pairs = []
    if pairs:
        verdicts, numbers = [], []
        for fast, slow in pairs:
            a, b = paired_runs(by[fast], by[slow])
            if not a:
                verdicts.append(INCONCLUSIVE)
                numbers.append(f"{slow}/{fast}: no common seed")
                continue
            ta, ra = times_to(a, task, metric, target, False)
            tb, rb = times_to(b, task, metric, target, False)
            ratio = paired_ratio(tb, rb, ta, ra)
            verdicts.append(ratio_verdict(ratio, 1.0))
            numbers.append(f"{slow}/{fast} {ratio.text()}")
        rows.append(
            {"claim": name, "task": task, "verdict": _all(verdicts), "numbers": "; ".join(numbers)}
        )
    ref = reference_group(gs)
    if suite == "table1" and prop is not None and ref is not None:
        for bare in (False, True):
            a, b = paired_runs(prop, ref)
            ta, ra = times_to(a, task, metric, target, bare)
            tb, rb = times_to(b, task, metric, target, False)
            ratio = paired_ratio(tb, rb, ta, ra)
            rows.append(
                {
                    "claim": f"speed-up over {ref.label} >= {PAPER_SPEEDUP[0]}x "
                    f"(paper: {PAPER_SPEEDUP[0]}–{PAPER_SPEEDUP[1]}x)"
                    + ("" if metric == "accuracy" else f", {to}")
                    + (" without the calibration's time" if bare else ""),
                    "task": task,
                    "verdict": ratio_verdict(ratio, PAPER_SPEEDUP[0]),
                    "numbers": ratio.text(),
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
