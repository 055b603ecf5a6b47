"""The tables of report.md over one or a few seeds: time to target per (method, task) as a
`Cell`, the speed-up over the reference, the time to a mean eval_loss, the last evaluation
against the baselines, McNemar's paired test and, for runs with client-level DP, their
privacy (mode, σ, clip bound, δ and the final largest client ε).

Time to target (Table I): the simulated wall-clock `sim_time_s` of the first metrics line
whose eval accuracy on the task is >= the task's target (line 0, the untrained adapter,
counts; for `proposed` its clock starts at the calibration's simulated time). A run that never
reaches the target is *censored*: its time is only known to be >= its last `sim_time_s`.
Means over seeds use those lower bounds and are then printed as ">= x"; the 95% interval is
the t interval over seeds (none for one seed or any censored seed). Speed-up over FSLoRA is
the ratio of the two means; it is a bound (">=" or "<=") when one side is censored and "n/a"
when both are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedlora.errors import DataError
from fedlora.studies.predictions import paired_tests, read_predictions
from fedlora.studies.runs import RunRecord, time_to_loss, time_to_target
from fedlora.studies.seeds import t_interval95


@dataclass
class Cell:
    """Time to target of one (label, task) over seeds."""

    label: str
    task: str
    target: float
    times_s: list[float]
    reached: list[bool]
    final_accuracy: list[float]
    calibration_s: list[float]

    @property
    def censored(self) -> int:
        return sum(not r for r in self.reached)

    @property
    def mean_s(self) -> float:
        return sum(self.times_s) / len(self.times_s)

    @property
    def ci_s(self) -> float | None:
        return None if self.censored else t_interval95(self.times_s)

    @classmethod
    def of_runs(
        cls,
        label: str,
        task: str,
        target: float,
        runs: Sequence[RunRecord],
        results: Sequence[tuple[float, bool]],
        finals: Sequence[float],
    ) -> Cell:
        """The cell of `runs` (one label) from their (time, reached) and final values."""
        return cls(
            label,
            task,
            target,
            [t for t, _ in results],
            [ok for _, ok in results],
            list(finals),
            [r.calibration_time_s for r in runs],
        )


def summarize(
    runs: Sequence[RunRecord], targets: dict[str, float], order: Sequence[str] | None = None
) -> list[Cell]:
    """One `Cell` per (label, task) in label order (`order` first, then as found)."""
    labels: list[str] = list(order or [])
    for run in runs:
        if run.label not in labels:
            labels.append(run.label)
    cells = []
    for label in labels:
        group = [r for r in runs if r.label == label]
        if not group:
            continue
        for task, target in targets.items():
            results = [time_to_target(r, task, target) for r in group]
            finals = [r.final_accuracy(task) for r in group]
            kept = [f for f in finals if f is not None]
            cells.append(Cell.of_runs(label, task, target, group, results, kept))
    return cells


def speedup(cell: Cell, reference: Cell | None) -> str:
    """Reference mean / this mean, with the direction of a bound when censored."""
    if reference is None:
        return "n/a"
    if cell.censored and reference.censored:
        return "n/a"
    if cell.mean_s <= 0:  # reached before any simulated time passed
        return "n/a" if reference.mean_s <= 0 else "inf"
    ratio = reference.mean_s / cell.mean_s
    text = "inf" if math.isinf(ratio) else f"{ratio:.2f}x"
    if reference.censored:
        return ">= " + text
    if cell.censored:
        return "<= " + text
    return text


def format_time(cell: Cell) -> str:
    """Mean time ± 95% interval, or '>= mean (censored/n not reached)'."""
    text = f"{cell.mean_s:.1f}"
    if cell.censored:
        return f">= {text} ({cell.censored}/{len(cell.times_s)} not reached)"
    ci = cell.ci_s
    return text + (f" ± {ci:.1f}" if ci is not None else "")


def format_accuracy(values: Sequence[float]) -> str:
    """Mean accuracy in % ± 95% interval in points; '-' for no value."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    ci = t_interval95(values)
    return f"{100 * mean:.1f}%" + (f" ± {100 * ci:.1f}" if ci is not None else "")


def loss_section(runs: Sequence[RunRecord], labels: list[str], target_loss: float) -> list[str]:
    """Time to a mean eval_loss <= `target_loss` and the final eval_loss per label."""
    out = ["", f"## Time to eval_loss <= {target_loss:g} (s)", ""]
    out += [
        "The first simulated time at which the mean eval_loss over the eval tasks is <= the "
        "target (`>=`: not reached by some seed, a lower bound).",
        "",
        "| method | time (s) | final eval_loss |",
        "|---|---|---|",
    ]
    for label in labels:
        group = [r for r in runs if r.label == label]
        results = [time_to_loss(r, target_loss) for r in group]
        finals = [r.loss_points()[-1][1] for r in group if r.loss_points()]
        cell = Cell.of_runs(label, "eval_loss", target_loss, group, results, finals)
        ci = t_interval95(finals)
        final = "-" if not finals else f"{sum(finals) / len(finals):.4f}"
        out.append(
            f"| {label} | {format_time(cell)} | {final}{'' if ci is None else f' ± {ci:.4f}'} |"
        )
    return out


def baseline_section(runs: Sequence[RunRecord], labels: list[str]) -> list[str]:
    """Each run's last evaluation beside the most-frequent-label and chance scores ([] when
    no run logged its Wilson intervals)."""
    rows = []
    for label in labels:
        for r in sorted((r for r in runs if r.label == label), key=lambda r: r.seed):
            line = r.last_eval_line()
            if line is None or not line.get("eval_ci95"):
                continue
            for task, acc in line["eval"].items():
                lo, hi = line["eval_ci95"][task]
                loss = (line.get("eval_losses") or {}).get(task)
                mc = (line.get("eval_mc_losses") or {}).get(task)
                mc_text = "-"
                if mc is not None and not math.isnan(mc):
                    mlo, mhi = line["eval_mc_loss_ci95"][task]
                    mc_text = (
                        f"{mc:.4f} [{mlo:.4f}, {mhi:.4f}] ({line['eval_mc_chance'][task]:.3f})"
                    )
                rows.append(
                    f"| {label} | {r.seed} | {task} | {line.get('round', '-')} | "
                    f"{100 * acc:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                    f"{100 * line['eval_majority'][task]:.1f}% | "
                    f"{100 * line['eval_chance'][task]:.1f}% | "
                    f"{mc_text} | {'-' if loss is None else f'{loss:.4f}'} | "
                    f"{line['eval_n'][task]} |"
                )
    if not rows:
        return []
    return [
        "",
        "## Last evaluation against the baselines",
        "",
        "Accuracy with its 95% Wilson interval beside the score of always answering the most "
        "frequent label of the same questions and chance: an accuracy shows learning only "
        "when its interval lies above both. mc_loss: −log softmax over the options' scores of "
        "the correct one, with its 95% interval and (chance, ln n_options); it falls only as "
        "the correct option gains on the others.",
        "",
        "| method | seed | task | round | accuracy [95%] | most-frequent label | chance | "
        "mc_loss [95%] (chance) | eval_loss | n |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def mcnemar_section(runs: Sequence[RunRecord], labels: list[str]) -> list[str]:
    """Two runs: that pair. More: every two runs of the same seed (the same eval subset) and
    different labels."""
    ordered = [r for label in labels for r in runs if r.label == label]
    if len(ordered) == 2:
        pairs = [(ordered[0], ordered[1])]
    else:
        pairs = [
            (a, b)
            for i, a in enumerate(ordered)
            for b in ordered[i + 1 :]
            if a.seed == b.seed and a.label != b.label
        ]
    unique = len({r.label for r in ordered}) == len(ordered)

    def name(r: RunRecord) -> str:
        return r.label if unique else f"{r.path.parent.name}/{r.path.name}"

    rows = []
    for a, b in pairs:
        if not read_predictions(a.path) or not read_predictions(b.path):
            continue
        for t in paired_tests(a.path, b.path):
            rows.append(
                f"| {name(a)} | {name(b)} | {t.task} | {t.n} | {t.both} | {t.a_only} | "
                f"{t.b_only} | {t.neither} | {100 * t.accuracy_a:.1f}% | "
                f"{100 * t.accuracy_b:.1f}% | {t.p_value:.4g} |"
            )
    out = ["", "## Paired test (McNemar)", ""]
    if not rows:
        return out + ["No pair of runs (of the same seed) wrote predictions.jsonl.", ""]
    return out + [
        "Last evaluation of each run, on the questions both scored (matched by question id). "
        "A only / B only: the discordant questions; p: exact two-sided McNemar (binomial on "
        "the discordant pairs).",
        "",
        "| run A | run B | task | n | both right | A only | B only | neither | "
        "accuracy A | accuracy B | p |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def privacy_section(runs: Sequence[RunRecord], labels: list[str]) -> list[str]:
    """Each run's client-level DP from its summary.json ``privacy``: mode, σ, clip bound, δ and
    the final largest client ε(δ) (∞ with σ = 0); [] when no run used privacy."""
    rows = []
    for label in labels:
        for r in sorted((r for r in runs if r.label == label), key=lambda r: r.seed):
            p = r.summary.fields.get("privacy")
            if p is None:
                continue
            if not isinstance(p, dict) or not isinstance(p.get("mode"), str):
                raise DataError(
                    f"{r.path}/summary.json: privacy = {p!r} is not what fedlora writes"
                )
            key = "largest_epsilon" if "largest_epsilon" in p else "max_epsilon"  # older runs
            eps = p.get(key)
            eps_text = _infinite(p) if eps is None else _number(eps, key, r)
            rows.append(
                f"| {label} | {r.seed} | {p['mode']} | {_number(p.get('noise_multiplier'), 'noise_multiplier', r)} | "
                f"{_number(p.get('clip_norm'), 'clip_norm', r)} | {_number(p.get('delta'), 'delta', r)} | "
                f"{eps_text} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Privacy",
        "",
        "Client-level differential privacy (docs/privacy.md): the noise multiplier σ, the clip "
        "bound C on each participant's weighted update, and the largest ε(δ) over the clients "
        "after the run's last round.",
        "",
        "| method | seed | mode | σ | clip C | δ | final max ε |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def _infinite(p: dict) -> str:
    """Why a run's ε is infinite: rounds released without noise, or σ = 0."""
    if p.get("unprotected_rounds"):
        return f"∞ ({p['unprotected_rounds']} rounds without noise)"
    return "∞ (σ = 0: no guarantee)"


# what fedlora writes in summary.json's `privacy`: (lowest, highest, whether the bounds are
# excluded); a value outside (a NaN, a negative ε: a summary altered or damaged) is refused
_PRIVACY_RANGES = {
    "largest_epsilon": (0.0, math.inf, False, "a finite ε >= 0 (null: ∞)"),
    "max_epsilon": (0.0, math.inf, False, "a finite ε >= 0 (null: ∞)"),  # before the ledger
    "noise_multiplier": (0.0, math.inf, False, "a finite σ >= 0"),
    "clip_norm": (0.0, math.inf, True, "a finite C > 0"),
    "delta": (0.0, 1.0, True, "a δ in (0, 1)"),
}


def _number(value: object, key: str, run: RunRecord) -> str:
    lo, hi, open_, allowed = _PRIVACY_RANGES[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{run.path}/summary.json: privacy.{key} = {value!r} is not a number")
    inside = lo < value < hi if open_ else lo <= value < hi
    if not (math.isfinite(value) and inside):
        raise DataError(
            f"{run.path}/summary.json: privacy.{key} = {value!r} is invalid: {allowed} "
            "(fedlora never writes another; the file was altered or damaged)"
        )
    return f"{value:.4g}"
