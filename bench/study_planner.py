"""The runner of issue 21's study (rule: docs/study_planner.md; config:
configs/study_planner.toml). Not a timing benchmark: it drives `fedlora run` per arm and seed
and tabulates the runs.

    .venv/bin/python bench/study_planner.py check
    .venv/bin/python bench/study_planner.py pilot  --out runs/study_planner
    .venv/bin/python bench/study_planner.py run    --out runs/study_planner
    .venv/bin/python bench/study_planner.py report --out runs/study_planner
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import tomllib

CONFIG = Path(__file__).parents[1] / "configs" / "study_planner.toml"
FIXED_RULES = {
    "fixed-full": ["method.name=sketched", "method.q=full", "method.k=full"],
    "fixed-0.2": ["method.name=sketched", "method.q=fixed", "method.q_fixed=0.2", "method.k=full"],
    "fixed-uniform": ["method.name=sketched", "method.q=uniform", "method.k=full"],
    "fixed-weighted": ["method.name=sketched", "method.q=weighted", "method.k=full"],
}
ARMS = {
    "proposed-inrun": ["method.name=proposed", "planner.calibration=in-run"],
    "proposed-separate": [
        "method.name=proposed",
        "planner.calibration=separate",
        "planner.replan_every=0",
    ],  # fmt: skip
    "fslora": ["method.name=fslora"],
}


def load() -> tuple[dict, Path]:
    """The study table and the experiment config without it (written next to the runs)."""
    raw = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    return raw.pop("study"), raw


def write_base(out: Path) -> Path:
    """The experiment sections of the config, checked, as the runs' base config."""
    from fedlora.config import config_from_dict, dump_toml

    _, raw = load()
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base.toml"
    base.write_text(dump_toml(config_from_dict(raw, source=str(CONFIG))), encoding="utf-8")
    return base


def run_one(out: Path, base: Path, label: str, overrides: list[str], seed: int, extra=()) -> Path:
    run_dir = out / f"{label}-seed{seed}"
    if (run_dir / "summary.json").exists():
        return run_dir
    args = [sys.executable, "-m", "fedlora.cli", "run", "-q"]
    if (run_dir / "config.toml").exists():
        args += ["--resume", str(run_dir)]
    else:
        args += ["-c", str(base), "--out", str(run_dir), *overrides, f"training.seed={seed}",
                 *extra]  # fmt: skip
    print(" ".join(args[2:]), flush=True)
    subprocess.run(args, check=True)
    return run_dir


def evals(run_dir: Path, metric: str) -> list[tuple[float, float]]:
    """(sim_time_s, metric) of every evaluated metrics line."""
    out = []
    for text in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        line = json.loads(text)
        if metric in line and line[metric] is not None:
            out.append((float(line["sim_time_s"]), float(line[metric])))
    return out


def time_to(points, target: float, higher: bool, budget: float) -> float:
    for t, v in points:
        if t <= budget and (v >= target if higher else v <= target):
            return t
    return math.inf


def at_budget(points, budget: float) -> float:
    before = [v for t, v in points if t <= budget + 1e-9]
    return before[-1] if before else math.nan


def pilot(out: Path) -> None:
    study, _ = load()
    base = write_base(out)
    seed, higher, metric = study["pilot_seed"], study["higher_is_better"], study["metric"]
    runs = {lab: run_one(out, base, lab, ov, seed) for lab, ov in {**FIXED_RULES,
            "fslora": ARMS["fslora"]}.items()}  # fmt: skip
    pts = {lab: evals(d, metric) for lab, d in runs.items()}
    budget = study["budget_s"] or math.floor(pts["fslora"][-1][0] / 2 / 10) * 10
    start = pts["fslora"][0][1]
    best = max(abs(at_budget(p, budget) - start) for p in pts.values())
    target = start + (0.5 * best if higher else -0.5 * best)
    order = sorted(FIXED_RULES, key=lambda lab: (time_to(pts[lab], target, higher, budget),
                   -at_budget(pts[lab], budget) if higher else at_budget(pts[lab], budget)))  # fmt: skip
    rule = {"budget_s": budget, "target": target, "metric": metric, "fixed_best": order[0],
            "pilot_seed": seed}  # fmt: skip
    path = out / "rule.json"
    if path.exists() and json.loads(path.read_text()) != rule:
        raise SystemExit(f"{path} exists with a different rule: the rule is fixed once written")
    path.write_text(json.dumps(rule, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(rule, indent=2))


def run_all(out: Path) -> None:
    study, _ = load()
    rule = json.loads((out / "rule.json").read_text(encoding="utf-8"))
    base = write_base(out)
    budget = rule["budget_s"]
    extra = (f"training.time_budget_s={budget}", f"training.eval_every_s={budget / 10}")
    arms = {**ARMS, "fixed-best": FIXED_RULES[rule["fixed_best"]]}
    for seed in study["seeds"]:
        for label, overrides in arms.items():
            run_one(out, base, label, overrides, seed, extra)


def _log_t(ratios: np.ndarray) -> str:
    from scipy import stats

    logs = np.log(ratios)
    mean = float(np.mean(logs))
    if logs.size < 2:
        return f"{math.exp(mean):.2f}"
    half = float(stats.t.ppf(0.975, logs.size - 1) * np.std(logs, ddof=1) / math.sqrt(logs.size))
    return f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]"


def report(out: Path) -> None:
    study, _ = load()
    rule = json.loads((out / "rule.json").read_text(encoding="utf-8"))
    budget, target, metric = rule["budget_s"], rule["target"], rule["metric"]
    higher = study["higher_is_better"]
    labels = [*ARMS, "fixed-best"]
    table: dict[str, list[tuple[float, float]]] = {lab: [] for lab in labels}
    for seed in study["seeds"]:
        for lab in labels:
            pts = evals(out / f"{lab}-seed{seed}", metric)
            table[lab].append((min(time_to(pts, target, higher, budget), budget),
                               at_budget(pts, budget)))  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f}; budget {budget:g} s; target {metric} "
          f"{'>=' if higher else '<='} {target:.4g}; fixed-best = {rule['fixed_best']}")  # fmt: skip
    print("\n| arm | time to target (s), per seed | metric at budget, per seed |\n|---|---|---|")
    for lab in labels:
        times = ", ".join(f"{t:.0f}" for t, _ in table[lab])
        vals = ", ".join(f"{v:.4f}" for _, v in table[lab])
        print(f"| {lab} | {times} | {vals} |")
    base_lab = min(("fslora", "fixed-best"), key=lambda lab: np.mean([t for t, _ in table[lab]]))
    print(f"\npaired against {base_lab} (time ratio: geometric mean [95% t-interval on logs]):")
    for lab in ("proposed-inrun", "proposed-separate"):
        ratios = np.array([a[0] / b[0] for a, b in zip(table[lab], table[base_lab])])
        diffs = np.array([a[1] - b[1] for a, b in zip(table[lab], table[base_lab])])
        print(f"- {lab}: time ratio {_log_t(ratios)}; metric difference mean "
              f"{np.mean(diffs):+.4f} (per seed {', '.join(f'{d:+.4f}' for d in diffs)})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("check", "pilot", "run", "report"))
    ap.add_argument("--out", type=Path, default=Path("runs/study_planner"))
    args = ap.parse_args()
    study, _ = load()
    if args.stage == "check" or args.stage in ("pilot", "run"):
        from fedlora.config import load_config

        base = write_base(args.out)
        for overrides in [*ARMS.values(), *FIXED_RULES.values()]:  # every arm's config checks
            load_config(str(base), [*overrides, "training.time_budget_s=100"])
        print(f"config valid, with every arm's overrides: {base}")
        if not study["protocol_fixed"]:
            msg = ("[study] protocol_fixed = false: set the CPU protocol of docs/cpu_protocol.md "
                   "in configs/study_planner.toml first (docs/study_planner.md)")  # fmt: skip
            if args.stage == "check":
                print(msg)
                return
            raise SystemExit(msg)
    {"check": lambda o: None, "pilot": pilot, "run": run_all, "report": report}[args.stage](
        args.out
    )


if __name__ == "__main__":
    main()
