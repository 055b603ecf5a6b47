"""A suite's report: report.md and its plot (`fedlora.studies.report`) followed by the
over-seeds sections, band plots (`fedlora.studies.powered`) and paired-difference plots
(`fedlora.studies.figures`), then report.html (`fedlora.studies.html`); rebuilt from the runs'
metrics files alone (`fedlora report`, and `fedlora compare` after its runs)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError, bad_value
from fedlora.files import append_file
from fedlora.studies.figures import plot_paired
from fedlora.studies.html import write_html
from fedlora.studies.reclock import reclock
from fedlora.studies.report import write_report
from fedlora.studies.runs import collect_runs, flat_config


def report_suite(
    paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    targets: dict[str, float] | None = None,
    title: str | None = None,
    cost_model: tuple[str, str] | None = None,
    command: str | None = None,
    target_loss: float | None = None,
    mcnemar: bool = False,
    reference: str | None = None,
) -> Path:
    """Rebuild report.md, its plots and report.html (the same, self-contained) from run or
    suite directories (metrics files only). `reference`: the label the paired-difference
    plots subtract (default FSLoRA's; `fedlora.studies.figures.pick_reference`).

    `cost_model` = (comm_cost, comp_cost) re-clocks every run first (`fedlora.studies.reclock.reclock`).
    """
    runs, suite = collect_runs(paths)
    check_one_config_per_label(runs)
    _check_reference(runs, reference)
    _check_targets(runs, targets or {})
    note = ""
    if cost_model:
        runs = [reclock(r, *cost_model) if r.lines else r for r in runs]
        note = (
            f"Re-clocked under comm_cost = {cost_model[0]}, comp_cost = {cost_model[1]} from "
            "the runs' participants and k (`fedlora report --comm-cost/--comp-cost`). The "
            "baselines' times are exact under that model; `proposed` keeps the plan it made "
            "for the cost model it ran with."
        )
    merged = dict(suite.get("targets", {}))
    merged.update(targets or {})
    path = write_report(
        runs,
        merged,
        out_dir,
        title=title or suite.get("title", "fedlora report"),
        order=suite.get("labels"),
        command=command if command is not None else suite.get("command", ""),
        note=note,
        target_loss=target_loss,
        mcnemar=mcnemar,
    )
    if merged:  # the over-seeds sections measure time to the targets
        pilots = [Path(p) / "pilot" for p in paths if (Path(p) / "pilot").is_dir()]
        pilot_runs = collect_runs(pilots)[0] if pilots else []
        path = _append_powered(
            path, runs, merged, suite, title or suite.get("title", ""), pilot_runs, reference
        )
    try:
        write_html(path)
    except OSError as e:
        raise ConfigError(
            f"--out {str(out_dir)!r}: cannot write report.html: {e.strerror or e}"
        ) from None
    return path


IGNORED_SECTIONS = ("output",)  # where a run's files go: not part of the experiment


def check_one_config_per_label(runs: Sequence[Any]) -> None:
    """The runs of one label are seeds of one method: refused when two of them have the same
    seed, or configs that differ in anything but training.seed (and [output])."""
    first: dict[str, Any] = {}
    seen: dict[tuple[str, int], Any] = {}
    for run in runs:
        if (run.label, run.seed) in seen:
            raise ConfigError(
                f"runs {str(seen[run.label, run.seed].path)!r} and {str(run.path)!r} are both "
                f"{run.label!r} seed {run.seed}: report each seed of a method once"
            )
        seen[run.label, run.seed] = run
        mine = {
            k: v
            for k, v in flat_config(run.config).items()
            if k != "training.seed" and k.split(".")[0] not in IGNORED_SECTIONS
        }
        if run.label not in first:
            first[run.label] = (run, mine)
            continue
        other, theirs = first[run.label]
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:
            k = differ[0]
            raise ConfigError(
                f"runs {str(other.path)!r} and {str(run.path)!r} are both reported as "
                f"{run.label!r}, but their configs differ in {k} ({theirs.get(k)!r} vs "
                f"{mine.get(k)!r}{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}): "
                "the seeds of one method must differ only in training.seed; report them "
                "separately (or in directories named <label>-seed<N> with distinct labels)"
            )


def _check_reference(runs: Sequence[Any], reference: str | None) -> None:
    labels = list(dict.fromkeys(r.label for r in runs if r.lines))
    if reference is not None and reference not in labels:
        raise bad_value("--reference", reference, "one of the runs' labels: " + ", ".join(labels))


def _check_targets(runs: Sequence[Any], targets: dict[str, float]) -> None:
    """Every --target names a task the runs evaluated (or `mean`, their mean)."""
    from fedlora.studies.runs import MEAN_TASK

    tasks = list(dict.fromkeys(t for r in runs if r.lines for t in r.tasks()))
    unknown = [t for t in targets if t != MEAN_TASK and t not in tasks]
    if unknown and tasks:
        raise bad_value(
            "--target",
            f"{unknown[0]}={targets[unknown[0]]:g}",
            f"no run evaluated task {unknown[0]!r}; the runs' tasks: {', '.join(tasks)} "
            f"(or {MEAN_TASK}, their mean)",
        )


def _append_powered(
    path: Path,
    runs: Sequence[Any],
    targets: dict[str, float],
    suite: dict[str, Any],
    title: str,
    pilot_runs: Sequence[Any] = (),
    reference: str | None = None,
) -> Path:
    """The over-seeds sections and band plots (`fedlora.studies.powered`) after report.md;
    with the suite's pilot runs, the eval_loss targets also as decreases from round 0
    (`fedlora.studies.target_rule.loss_drops`)."""
    from fedlora.studies import powered
    from fedlora.studies.claims import SIMILAR_MARGIN
    from fedlora.studies.plots import plot_bands
    from fedlora.studies.target_rule import loss_drops

    runs = [r for r in runs if r.lines]
    losses = {t: float(v) for t, v in suite.get("target_losses", {}).items()}
    drops = loss_drops([r for r in pilot_runs if r.lines], losses) if pilot_runs else {}
    text = powered.render(
        runs,
        targets,
        target_losses=losses,
        target_drops=drops,
        suite=str(suite.get("suite", "")),
        order=suite.get("labels"),
        margin=float(suite.get("similar_margin", SIMILAR_MARGIN)),
        rule=str(suite.get("target_rule", "")),
    )
    images = []
    for metric, name in (("accuracy", "accuracy_bands.png"), ("loss", "eval_loss_bands.png")):
        drawn = plot_bands(
            runs,
            targets,
            metric,
            path.parent / name,
            title=title,
            order=suite.get("labels"),
            target_losses=losses,
        )
        if drawn is not None:
            images.append(f"![{metric} over seeds against simulated time]({name})")
    for metric, name in (("accuracy", "accuracy_paired.png"), ("loss", "eval_loss_paired.png")):
        drawn = plot_paired(
            runs,
            list(targets),
            metric,
            path.parent / name,
            title=title,
            reference=reference,
            order=suite.get("labels"),
        )
        if drawn is not None:
            images.append(f"![{metric}: paired difference to the reference method]({name})")
    append_file(path, (text + "\n" + "\n\n".join(images) + "\n").encode("utf-8"))
    return path


def format_command(argv: Sequence[str]) -> str:
    return "fedlora " + " ".join(shlex.quote(a) for a in argv)
