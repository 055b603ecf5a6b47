"""CPU-hour estimate of a suite file before it runs (no model is run).

    .venv/bin/python tools/suite_costs.py --suite table1 --config research/powered_suites/powered_table1.toml
    .venv/bin/python tools/suite_costs.py --suite sampling --config research/powered_suites/powered_sampling.toml \
        --step-s 1.2 --first-question-s 0.64 --question-s 0.22

Per label and seed (main seeds and the pilot seed), the label's method plans 400 rounds with
the engine's derived generators and is charged by `fedlora.federation.clock.round_cost`
exactly as in a run (SmolLM2-135M's q/v shapes on the top `lora.layers` layers): mean
participants and round seconds, rounds and client-steps in `training.time_budget_s`. The CPU estimate of a run is
client-steps × --step-s + Q × (--first-question-s + E × --question-s), Q = eval questions
(data.eval_limit × eval tasks), E = evaluations after round 0 (budget / eval_every_s). A
`proposed*` label adds its calibration at worst: 4 runs × planner.calibration_rounds rounds ×
(0.3 + 0.15)/2 · N clients × H steps × --step-s. The units are the caller's: measure them on
the machine first (research/cpu_protocol/cpu_protocol.md, bench/eval.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from baseline_costs import smollm2_shapes  # noqa: E402
from fedlora.config.experiment import ExperimentConfig  # noqa: E402
from fedlora.federation.clock import round_cost  # noqa: E402
from fedlora.federation.methods import make_method  # noqa: E402
from fedlora.federation.profiles import build_profiles  # noqa: E402
from fedlora.studies.experiments import load_suite  # noqa: E402
from fedlora.studies.suites import SUITES  # noqa: E402
from fedlora.system.seeding import derive_rng  # noqa: E402

ROUNDS = 400


def _cost_fields(cfg: ExperimentConfig) -> dict:
    """`round_cost`'s config fields (it takes the fields, not the whole config)."""
    return {"net": cfg.network, "gamma": cfg.lora.rank, "seed": cfg.training.seed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True, choices=tuple(SUITES))
    ap.add_argument("--config", required=True)
    ap.add_argument("--step-s", type=float, default=1.2, help="CPU s per client-step")
    ap.add_argument(
        "--first-question-s", type=float, default=0.64, help="CPU s per question, first eval"
    )
    ap.add_argument(
        "--question-s", type=float, default=0.22, help="CPU s per question, later evals"
    )
    args = ap.parse_args()
    spec = load_suite(args.suite, args.config)
    seeds = [*spec.seeds, *([spec.pilot_seed] if spec.pilot_seed is not None else [])]
    total = 0.0
    print(f"{args.config}: suite {args.suite}, seeds {list(spec.seeds)}, pilot {spec.pilot_seed}; "
          f"units {args.step_s} s/step, {args.first_question_s}/{args.question_s} s/question; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(
        f"{'label':<28}{'seed':>6}{'n/round':>9}{'round s':>9}{'rounds':>8}{'steps':>7}{'CPU s':>8}"
    )
    for label in spec.labels:
        for seed in seeds:
            if seed == spec.pilot_seed and label.startswith("proposed"):
                continue  # the pilot runs the baselines only
            cfg = spec.config_for(label, seed)
            shapes = smollm2_shapes(cfg.lora.layers if isinstance(cfg.lora.layers, int) else 30)
            full_bits = (
                cfg.lora.rank * sum(o + i for o, i in shapes.values()) * cfg.network.bits_per_param
            )
            profiles = build_profiles(cfg, full_bits)
            n, h = cfg.data.n_clients, cfg.training.local_steps
            budget = cfg.training.time_budget_s
            questions = cfg.data.eval_limit * len(cfg.data.eval_tasks)
            evals = (
                math.ceil(budget / cfg.training.eval_every_s) if cfg.training.eval_every_s else 0
            )
            eval_s = questions * (args.first_question_s + evals * args.question_s)
            if label.startswith("proposed"):  # plan unknown before calibration: q = 0.2, k uniform
                cfg = cfg.replace(
                    method=cfg.method.__class__(name="sketched", q="fixed", k="uniform")
                )
                calib = 4 * cfg.planner.calibration_rounds * 0.225 * n * h * args.step_s
            else:
                calib = 0.0
            a = np.full(n, 1.0 / n)
            method = make_method(
                cfg, a, derive_rng(seed, "strategy"), tau_full_s=profiles.tau_full_s
            )
            rows = []
            for r in range(ROUNDS):
                plan = method.plan_round(
                    r, derive_rng(seed, "sampling", r), derive_rng(seed, "sketch", r)
                )
                cost = round_cost(profiles, plan, method, shapes, r, **_cost_fields(cfg))
                rows.append((len(plan.tasks), cost.round_time_s))
            parts, round_s = np.mean(rows, axis=0)
            rounds = budget / round_s if round_s > 0 else float("inf")
            steps = rounds * parts * h
            cpu = steps * args.step_s + eval_s + calib
            total += cpu
            print(
                f"{label:<28}{seed:>6}{parts:>9.2f}{round_s:>9.3f}{rounds:>8.1f}{steps:>7.0f}{cpu:>8.0f}"
            )
    print(f"total ≈ {total / 3600:.2f} CPU-hours (proposed*: planned as q = 0.2, k uniform, plus "
          "its calibration at worst)")  # fmt: skip


if __name__ == "__main__":
    main()
