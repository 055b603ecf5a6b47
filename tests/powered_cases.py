"""Shared by the powered-report tests (test_powered.py, test_target_rule.py): hand-made run
directories with one metrics line per evaluation."""

from __future__ import annotations

import json
from pathlib import Path

T975_2 = 4.302652729911275  # t quantile 0.975 with 2 degrees of freedom (tables)


def write_run(
    root: Path,
    label: str,
    seed: int,
    evals: list[tuple[float, float, float]],
    *,
    method: str | None = None,
    task: str = "arc-e",
    calibration_s: float = 0.0,
    end_s: float | None = None,
    plan: dict | None = None,
) -> Path:
    """A run directory: one metrics line per (sim_time_s, accuracy, eval_loss), round 0 first;
    optionally a last line without evaluation at end_s."""
    run = root / f"{label}-seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for r, (t, acc, loss) in enumerate(evals):
        lines.append(
            {
                "round": r,
                "sim_time_s": t,
                "calibration_sim_time_s": calibration_s if r == 0 else None,
                "train_loss": None if r == 0 else 1.0,
                "eval": {task: acc},
                "eval_accuracy": acc,
                "eval_loss": loss,
                "eval_losses": {task: loss},
                "eval_n": {task: 500},
                "eval_majority": {task: 0.28},
                "eval_chance": {task: 0.25},
            }
        )
    if end_s is not None:
        lines.append({"round": len(lines), "sim_time_s": end_s, "train_loss": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"method": method or label.split("-")[0], "seed": seed, "stop_reason": "time_budget"}
    if plan is not None:
        summary["plan"] = plan
    (run / "summary.json").write_text(json.dumps(summary))
    return run
