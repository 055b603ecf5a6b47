"""A suite's report: report.md and its plot (`fedlora.studies.report`) followed by the
over-seeds sections and band plots (`fedlora.studies.powered`); rebuilt from the runs'
metrics files alone (`fedlora report`, and `fedlora compare` after its runs)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlora.studies.report import collect_runs, reclock, write_report


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
) -> Path:
    """Rebuild report.md and the plot from run or suite directories (metrics files only).

    `cost_model` = (comm_cost, comp_cost) re-clocks every run first (`fedlora.studies.report.reclock`).
    """
    runs, suite = collect_runs(paths)
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
    pilots = [Path(p) / "pilot" for p in paths if (Path(p) / "pilot").is_dir()]
    pilot_runs = collect_runs(pilots)[0] if pilots else []
    return _append_powered(path, runs, merged, suite, title or suite.get("title", ""), pilot_runs)


def _append_powered(
    path: Path,
    runs: Sequence[Any],
    targets: dict[str, float],
    suite: dict[str, Any],
    title: str,
    pilot_runs: Sequence[Any] = (),
) -> Path:
    """The over-seeds sections and band plots (`fedlora.studies.powered`) after report.md;
    with the suite's pilot runs, the eval_loss targets also as decreases from round 0
    (`fedlora.studies.target_rule.loss_drops`)."""
    from fedlora.studies import powered
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
        margin=float(suite.get("similar_margin", powered.SIMILAR_MARGIN)),
        rule=str(suite.get("target_rule", "")),
    )
    images = []
    for metric, name in (("accuracy", "accuracy_bands.png"), ("loss", "eval_loss_bands.png")):
        drawn = powered.plot_bands(runs, targets, metric, path.parent / name, title=title,
                                   order=suite.get("labels"), target_losses=losses)  # fmt: skip
        if drawn is not None:
            images.append(f"![{metric} over seeds against simulated minutes]({name})")
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n" + "\n\n".join(images) + "\n")
    return path


def format_command(argv: Sequence[str]) -> str:
    return "fedlora " + " ".join(shlex.quote(a) for a in argv)
