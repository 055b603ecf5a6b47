"""report.md from finished runs (`fedlora report`): reads only config.toml, metrics.jsonl and
summary.json of each run directory (`fedlora.studies.runs`; a suite's suite.toml gives its
labels and targets), assembles the tables (`fedlora.studies.tables`) and draws the plots
(`fedlora.studies.plots`). Times are simulated wall-clock seconds; how a time to target, its
censoring and the speed-up over FSLoRA are read is said in `fedlora.studies.tables`.

`SUITE_FILE`, `collect_runs` (`studies.runs`) and `reclock` (`studies.reclock`) are imported
from here by `studies.experiments`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from fedlora.errors import ConfigError, DataError, bad_value
from fedlora.federation.machine_log import machine_summary
from fedlora.files import atomic_write, refuse_link
from fedlora.studies.plots import plot_losses, plot_runs
from fedlora.studies.privacy_trace import TRACE_FILE, plot_privacy, privacy_trace
from fedlora.studies.runs import REFERENCE, RunRecord
from fedlora.studies.tables import (
    baseline_section,
    format_accuracy,
    format_time,
    loss_section,
    mcnemar_section,
    privacy_section,
    speedup,
    summarize,
)

__all__ = ["render_markdown", "write_report"]


def render_markdown(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    *,
    title: str = "fedlora report",
    order: Sequence[str] | None = None,
    command: str = "",
    plot_name: str = "accuracy_vs_time.png",
    note: str = "",
    target_loss: float | None = None,
    mcnemar: bool = False,
) -> str:
    """report.md: time to target per label and task, final accuracy, speed-up over FSLoRA.

    Runs without metrics lines (failed before round 0) are listed under "Failed runs"."""
    failed = [r for r in runs if r.summary.error]
    runs = [r for r in runs if r.lines]
    tasks = list(targets) or list(dict.fromkeys(t for r in runs for t in r.tasks()))
    # without a target only the final accuracies of the cells are read (1.0: any target)
    cells = summarize(runs, targets or {t: 1.0 for t in tasks}, order)
    seeds = sorted({r.seed for r in runs})
    out = [f"# {title}", ""]
    if command:
        out += ["Produced by:", "", "```", command, "```", ""]
    out += [
        f"Runs: {len(runs)} ({len({r.label for r in runs})} methods, seeds {seeds}). "
        "Times are simulated wall-clock seconds (`sim_time_s`); mean ± 95% t interval over "
        "seeds. `>=`: some seed never reached the target (its time is its last clock, a lower "
        "bound). `proposed` includes its calibration runs' simulated time.",
        "",
        *([note, ""] if note else []),
    ]
    labels = list(dict.fromkeys(c.label for c in cells))
    by = {(c.label, c.task): c for c in cells}
    if targets:
        out += ["## Time to target accuracy (s)", "", *_time_sections(runs, targets, labels, by)]
    else:
        out += ["No target given: the time-to-target tables appear with `--target TASK=ACCURACY`."]
    out += ["", "## Final accuracy", ""]
    out += ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for label in labels:
        out.append(
            f"| {label} | "
            + " | ".join(format_accuracy(by[label, t].final_accuracy) for t in tasks)
            + " |"
        )
    out += ["", "## Runs", ""]
    out += [
        "| method | seed | rounds | simulated time (s) | of which calibration (s) | "
        "uplink (MB) | empty rounds | stop | compute (s) | machine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        for r in sorted((r for r in runs if r.label == label), key=lambda r: r.seed):
            s = r.summary
            mb, empty = s.total_uplink_bits, s.empty_rounds
            out.append(
                f"| {label} | {r.seed} | {r.lines[-1].get('round', '-') if r.lines else '-'} | "
                f"{r.total_time_s:.1f} | {r.calibration_time_s:.1f} | "
                f"{'-' if mb is None else f'{mb / 8e6:.1f}'} | {'-' if empty is None else empty} | "
                f"{s.stop_reason or s.error or 'unfinished'} | {s.compute_s or 0.0:.0f} | "
                f"{machine_summary(r.path)} |"
            )
    out += baseline_section(runs, labels)
    out += privacy_section(runs, labels)
    if any(privacy_trace(r) is not None for r in runs):
        out += ["", f"![ε spent and the clip bound, per round]({TRACE_FILE})"]
    if target_loss:
        out += loss_section(runs, labels, target_loss)
    if mcnemar:
        out += mcnemar_section(runs, labels)
    if failed:
        out += ["", "## Failed runs", ""]
        out += [f"- {r.label} seed {r.seed}: {r.summary.error}" for r in failed]
    out += ["", f"![accuracy against simulated wall-clock]({plot_name})", ""]
    if any(r.loss_points() for r in runs):
        out += ["![eval_loss against simulated wall-clock](eval_loss_vs_time.png)", ""]
    return "\n".join(out)


def _time_sections(
    runs: Sequence[RunRecord], targets: dict[str, float], labels: list[str], by: dict
) -> list[str]:
    """Time to target, the speed-up over FSLoRA and the times without calibration."""
    tasks = list(targets)
    out: list[str] = []
    header = "| method | " + " | ".join(f"{t} (>= {100 * targets[t]:.0f}%)" for t in tasks) + " |"
    out += [header, "|---" * (len(tasks) + 1) + "|"]
    for label in labels:
        out.append(f"| {label} | " + " | ".join(format_time(by[label, t]) for t in tasks) + " |")
    ref_label = next((lab for lab in labels if lab == REFERENCE), None)
    if ref_label is None:
        ref_label = next(
            (r.label for r in runs if r.method == REFERENCE and r.label in labels), None
        )
    if ref_label:
        out += ["", f"## Speed-up over {ref_label} (its mean time / the method's)", ""]
        out += ["| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for label in labels:
            row = [speedup(by[label, t], by.get((ref_label, t))) for t in tasks]
            out.append(f"| {label} | " + " | ".join(row) + " |")
    calibrated = [lab for lab in labels if any(by[lab, t].calibration_s[0] > 0 for t in tasks)]
    if calibrated:
        out += ["", "## Time to target without the calibration runs (s)", ""]
        out += [
            "The same times minus the calibration's simulated time (as if the constants A–D "
            "were known beforehand)"
            + (f"; speed-up over {ref_label} in brackets." if ref_label else "."),
            "",
            "| method | " + " | ".join(tasks) + " |",
            "|---" * (len(tasks) + 1) + "|",
        ]
        for label in calibrated:
            row = []
            for t in tasks:
                c = by[label, t]
                bare = dataclasses.replace(
                    c, times_s=[x - s for x, s in zip(c.times_s, c.calibration_s)]
                )
                ref = by.get((ref_label, t)) if ref_label else None
                row.append(format_time(bare) + (f" [{speedup(bare, ref)}]" if ref_label else ""))
            out.append(f"| {label} | " + " | ".join(row) + " |")
    return out


# what `fedlora report` writes into --out (the first run's directory by default)
REPORT_FILES = (
    "report.md",
    "report.html",
    "accuracy_vs_time.png",
    "eval_loss_vs_time.png",
    "accuracy_bands.png",
    "eval_loss_bands.png",
    "accuracy_paired.png",
    "eval_loss_paired.png",
    TRACE_FILE,
)


def refuse_linked_outputs(out: Path) -> None:
    """Refuse, before anything is written, an --out that is not a folder, or where a report
    file is a symbolic link (each file is also opened without following one:
    `fedlora.files.atomic_write`) or a folder."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a folder: choose another --out")
    for name in REPORT_FILES:
        if (out / name).is_symlink():
            raise refuse_link(out / name)
        if (out / name).is_dir():
            raise ConfigError(
                f"--out {str(out)!r}: {name} is a folder where the report writes a file: "
                "move it away or choose another --out"
            )


def write_report(
    runs: Sequence[RunRecord],
    targets: dict[str, float],
    out_dir: str | Path,
    *,
    title: str = "fedlora report",
    order: Sequence[str] | None = None,
    command: str = "",
    note: str = "",
    target_loss: float | None = None,
    mcnemar: bool = False,
) -> Path:
    """Write report.md, accuracy_vs_time.png (and eval_loss_vs_time.png when the runs logged
    eval_loss, privacy_trace.png when a run used client-level DP) into `out_dir`; returns the report's path. `target_loss`: add the time to a
    mean eval_loss; `mcnemar`: add the paired test of every two runs of the same seed."""
    if not runs:
        raise DataError("no runs to report")
    if not any(r.lines for r in runs):
        raise DataError("no run has metrics yet: " + ", ".join(str(r.path) for r in runs))
    for task, value in targets.items():
        if not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ConfigError(f"target {task} = {value!r} is invalid: an accuracy in (0, 1]")
    out = Path(out_dir)
    refuse_linked_outputs(out)
    if target_loss is not None and not (
        isinstance(target_loss, (int, float)) and math.isfinite(target_loss) and target_loss > 0
    ):
        raise bad_value("--target-loss", target_loss, "an eval_loss > 0")
    # rendered first: what it reads and checks (a damaged summary) refuses before any write
    text = render_markdown(
        runs,
        targets,
        title=title,
        order=order,
        command=command,
        note=note,
        target_loss=target_loss,
        mcnemar=mcnemar,
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        plot_runs([r for r in runs if r.lines], targets, out / "accuracy_vs_time.png", title)
        plot_losses([r for r in runs if r.lines], out / "eval_loss_vs_time.png", target_loss, title)
        plot_privacy([r for r in runs if r.lines], out / TRACE_FILE, title)
        atomic_write(out / "report.md", text.encode("utf-8"))  # never through a link
    except OSError as e:
        where = f" {e.filename!r}" if e.filename else ""
        raise ConfigError(f"--out {str(out)!r}: cannot write{where}: {e.strerror or e}") from None
    return out / "report.md"
