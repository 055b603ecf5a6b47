"""Targets by a written rule: a suite's `target_rule` fixes the target
accuracies and eval_losses from a pilot seed's baselines before the main runs; the pilot
writes them with the numbers behind them to targets.toml.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedlora.errors import ConfigError, bad_value
from fedlora.studies.runs import RunRecord, eval_constant, level_at, points

RULE_KEYS = ("budget_fraction", "floor_se", "text")


def check_rule(rule: Any, where: str = "suite.target_rule") -> dict[str, Any]:
    """The target rule table: budget_fraction in (0, 1], floor_se >= 0, text (the rule in
    words, written before the pilot ran)."""
    if not isinstance(rule, dict):
        raise bad_value(where, rule, "a table {budget_fraction, floor_se, text}")
    unknown = [k for k in rule if k not in RULE_KEYS]
    if unknown:
        raise bad_value(f"{where}.{unknown[0]}", rule[unknown[0]], f"keys: {', '.join(RULE_KEYS)}")
    frac = rule.get("budget_fraction")
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise bad_value(f"{where}.budget_fraction", frac, "a number in (0, 1]")
    floor = rule.get("floor_se", 0.0)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor >= 0:
        raise bad_value(f"{where}.floor_se", floor, "a number >= 0")
    text = rule.get("text", "")
    if not isinstance(text, str) or not text.strip():
        raise bad_value(f"{where}.text", text, "the rule in words (a non-empty string)")
    return {"budget_fraction": float(frac), "floor_se": float(floor), "text": text}


def rule_targets(
    runs: Sequence[RunRecord], tasks: Sequence[str], budget_s: float, rule: dict[str, Any]
) -> dict[str, Any]:
    """Targets from pilot runs by the rule.

    Per task, at t = budget_fraction · budget_s, over the *baselines* (labels not starting
    with "proposed"): accuracy target = the lowest level any baseline has reached by t (the
    slowest baseline's), raised to the floor majority + floor_se · √(m(1 − m)/n) (m the
    most-frequent-label score, n the eval size); loss target = the highest eval_loss any
    baseline has at t (no floor). Returns {"accuracy": {task: x}, "loss": {task: x},
    "details": {task: {...the numbers behind...}}}.
    """
    if not budget_s > 0:
        raise bad_value("training.time_budget_s", budget_s, "> 0 for a target rule (a budget)")
    rule = check_rule(rule)
    at_s = rule["budget_fraction"] * budget_s
    baselines = [r for r in runs if not r.label.startswith("proposed") and r.lines]
    if not baselines:
        raise ConfigError("target rule: the pilot has no baseline run with metrics")
    acc, loss, details = {}, {}, {}
    for task in tasks:
        acc_levels = {r.label: level_at(r, task, "accuracy", at_s) for r in baselines}
        loss_levels = {r.label: level_at(r, task, "loss", at_s) for r in baselines}
        known = {k: v for k, v in acc_levels.items() if v is not None}
        if not known:
            raise ConfigError(f"target rule: no pilot baseline evaluated {task!r} by {at_s:g} s")
        slowest = min(known, key=lambda k: known[k])
        majority = eval_constant(baselines[0], task, "eval_majority")
        n = eval_constant(baselines[0], task, "eval_n")
        floor = None
        if majority is not None and n:
            floor = majority + rule["floor_se"] * math.sqrt(majority * (1 - majority) / n)
        target = known[slowest] if floor is None else max(known[slowest], floor)
        acc[task] = min(target, 1.0)
        lk = {k: v for k, v in loss_levels.items() if v is not None}
        if lk:
            loss[task] = max(lk.values())
        details[task] = {
            "at_s": at_s,
            "accuracy_at": known,
            "slowest": slowest,
            "majority": majority,
            "n": n,
            "floor": floor,
            "floored": floor is not None and floor > known[slowest],
            "loss_at": lk,
        }
    return {"accuracy": acc, "loss": loss, "details": details}


def targets_toml(result: dict[str, Any], rule: dict[str, Any], pilot: str) -> str:
    """targets.toml written by the pilot: the targets, the rule and the numbers behind."""
    import json

    lines = [
        "# Targets fixed from the pilot seed by the suite's rule, before the main runs.",
        f"rule = {json.dumps(rule['text'])}",
        f"budget_fraction = {rule['budget_fraction']!r}",
        f"floor_se = {rule['floor_se']!r}",
        f"pilot = {json.dumps(pilot)}",
        "",
        "[targets]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in result["accuracy"].items()),
        "",
        "[target_losses]",
        *(f"{json.dumps(t)} = {v!r}" for t, v in result["loss"].items()),
        "",
    ]
    for task, d in result["details"].items():
        lines += [f"[details.{json.dumps(task)}]"]
        for key in ("at_s", "slowest", "majority", "n", "floor", "floored"):
            if d[key] is not None:
                value = d[key]
                lines.append(
                    f"{key} = {json.dumps(value) if not isinstance(value, float) else repr(value)}"
                )
        lines.append(
            "accuracy_at = {"
            + ", ".join(f"{json.dumps(k)} = {v!r}" for k, v in d["accuracy_at"].items())
            + "}"
        )
        if d["loss_at"]:
            lines.append(
                "loss_at = {"
                + ", ".join(f"{json.dumps(k)} = {v!r}" for k, v in d["loss_at"].items())
                + "}"
            )
        lines.append("")
    return "\n".join(lines)


def loss_drops(pilot: Sequence[RunRecord], target_losses: dict[str, float]) -> dict[str, float]:
    """Each task's eval_loss target as a decrease from round 0 on the pilot's questions:
    Δ = (the pilot's round-0 eval_loss, the mean over its runs, which share the untrained
    adapter and the questions) − target. Every seed evaluates other questions, whose
    untrained eval_loss can already be below an absolute target (it was on the powered
    suites in results/); a decrease of Δ from each run's own round 0 means the same on every
    seed (`runs.time_to`'s "loss_drop"). Tasks without pilot evaluations, or Δ <= 0, are left
    out."""
    drops: dict[str, float] = {}
    for task, target in target_losses.items():
        firsts = [pts[0][1] for pts in (points(r, task, "loss") for r in pilot) if pts]
        if firsts:
            drop = sum(firsts) / len(firsts) - float(target)
            if drop > 0:
                drops[task] = drop
    return drops
