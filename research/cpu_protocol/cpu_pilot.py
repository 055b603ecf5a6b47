"""The CPU pilot in the harness format (rule: research/cpu_protocol/cpu_protocol.md, committed
before any run).

Each setting is one `fedlora run` (the product itself): it evaluates the untrained adapter
(round 0) and the final one on the same 500 ARC-e + 500 OBQA test questions and writes
per-question correctness and mc_loss to predictions.jsonl. Settings run one after another in
the rule's order; a finished run directory is skipped, so a killed pilot resumes.
`--summarize` applies the rule to whatever has landed and prints the table.

    nohup .venv/bin/python research/cpu_protocol/cpu_pilot.py > pilot.log 2>&1 &
    .venv/bin/python research/cpu_protocol/cpu_pilot.py --summarize [--out results/cpu_pilot_harness]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import binomtest

SEED = 0
COMMON = [
    "model.name=smollm2-135m",
    "model.dtype=fp32",
    "model.threads=2",
    "lora.rank=16",
    "lora.alpha=32",
    'lora.target_modules=["q_proj", "v_proj"]',
    "lora.layers=8",
    'data.tasks=["arc-e", "arc-c", "obqa"]',
    'data.eval_tasks=["arc-e", "obqa"]',
    "data.train_limit=400",
    "data.eval_limit=500",
    "data.max_seq_len=128",
    "data.n_clients=10",
    "data.dirichlet_alpha=0.1",
    "training.local_steps=5",
    "training.batch_size=4",
    "training.slots=5",
    "training.momentum=0",
    "training.sketch_step=scaled",
    "training.checkpoint_every=1000",
    f"training.seed={SEED}",
    "evaluation.format=harness",
    "evaluation.predictions=true",
    "output.progress=false",
]
STEPS_PER_ROUND = {"fedavg": 50, "alg1": 10}  # client-steps per round (alg1: in expectation)


def method_args(method: str, budget: int) -> list[str]:
    rounds = budget // STEPS_PER_ROUND[method]
    common = [f"training.rounds={rounds}", f"training.eval_every={rounds}"]
    if method == "fedavg":
        return ["method.name=fedavg", "method.clients_per_round=0", *common]
    return ["method.name=sketched", "method.q=fixed", "method.q_fixed=0.2", "method.k=uniform"] + (
        common
    )


# The rule's order: budget 300 then 1,000 then 2,000 at η = 0.2; other η afterwards.
GRID = [
    ("alg1", 300, 0.2),
    ("fedavg", 300, 0.2),
    ("alg1", 1000, 0.2),
    ("fedavg", 1000, 0.2),
    ("alg1", 2000, 0.2),
    ("fedavg", 2000, 0.2),
]


def name_of(method: str, budget: int, lr: float) -> str:
    return f"{method}-{budget}-lr{lr}"


def run_setting(method: str, budget: int, lr: float, out: Path) -> None:
    name = name_of(method, budget, lr)
    args = [*COMMON, *method_args(method, budget), f"training.lr={lr}"]
    cmd = [sys.executable, "-m", "fedlora.cli", "run", "--out", str(out / name), "--overwrite"]
    print(f"[{time.strftime('%H:%M:%S')}] {name} (load {os.getloadavg()[0]:.1f})", flush=True)
    t0 = time.time()
    subprocess.run([*cmd, *args], check=True)
    (out / name / "pilot_wall_s.txt").write_text(f"{time.time() - t0:.0f}\n")


# ----------------------------------------------------------------------------- the rule


def read_predictions(run_dir: Path) -> dict[int, dict[str, dict]]:
    """round -> task -> its predictions line."""
    out: dict[int, dict[str, dict]] = {}
    for raw in (run_dir / "predictions.jsonl").read_text().splitlines():
        line = json.loads(raw)
        out.setdefault(line["round"], {})[line["task"]] = line
    return out


def pooled(rounds: dict[str, dict], key: str) -> tuple[list[str], np.ndarray]:
    ids, vals = [], []
    for task in sorted(rounds):
        ids += [f"{task}/{i}" for i in rounds[task]["ids"]]
        vals += rounds[task][key]
    return ids, np.asarray(vals, dtype=float)


def mcnemar_p(before: np.ndarray, after: np.ndarray) -> float:
    """Exact two-sided McNemar test on the discordant pairs."""
    gained = int(((after == 1) & (before == 0)).sum())
    lost = int(((after == 0) & (before == 1)).sum())
    if gained + lost == 0:
        return 1.0
    return float(binomtest(gained, gained + lost, 0.5).pvalue)


def paired(d: np.ndarray) -> tuple[float, float, float]:
    """mean, half-width of the normal 95% interval, z."""
    sd = float(np.std(d, ddof=1))
    se = sd / math.sqrt(d.size)
    return float(d.mean()), 1.959963984540054 * se, (float(d.mean()) / se if se else 0.0)


def summarize(out: Path) -> str:
    rows, head = [], None
    for method, budget, lr in GRID + EXTRA:
        run_dir = out / name_of(method, budget, lr)
        if not (run_dir / "summary.json").exists():
            continue
        preds = read_predictions(run_dir)
        first, last = preds[0], preds[max(preds)]
        ids0, acc0 = pooled(first, "correct")
        ids1, acc1 = pooled(last, "correct")
        assert ids0 == ids1, "the same questions before and after"
        _, mc0 = pooled(first, "mc_loss")
        _, mc1 = pooled(last, "mc_loss")
        gain, gain_hw, _ = paired(acc1 - acc0)
        dmc, dmc_hw, z_mc = paired(mc0 - mc1)
        p = mcnemar_p(acc0, acc1)
        passes = gain >= 0.03 and p < 0.01 and mc1.mean() < mc0.mean()
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = 5 * sum(m["n_participants"] for m in metrics if m.get("round", 0) > 0)
        per_task = ", ".join(
            f"{t} {100 * np.mean(first[t]['correct']):.1f}→{100 * np.mean(last[t]['correct']):.1f}"
            for t in sorted(last)
        )
        wall = (run_dir / "pilot_wall_s.txt").read_text().strip()
        head = head or (acc0, mc0, first)
        rows.append(
            f"| {name_of(method, budget, lr)} | {steps} | {100 * acc1.mean():.1f} | "
            f"{100 * gain:+.1f} [{100 * (gain - gain_hw):+.1f}, {100 * (gain + gain_hw):+.1f}] | "
            f"{p:.3g} | {mc1.mean():.3f} | {dmc:+.3f} [{dmc - dmc_hw:+.3f}, {dmc + dmc_hw:+.3f}]"
            f" (z {z_mc:+.1f}) | {per_task} | {int(wall) / 60:.1f} | {'yes' if passes else 'no'} |"
        )
        rows[-1] = (rows[-1], gain, z_mc, passes, name_of(method, budget, lr))
    if head is None:
        return "no finished setting yet"
    acc0, mc0, first = head
    n = acc0.size
    m0 = next(
        json.loads(x)
        for x in (out / rows[0][4] / "metrics.jsonl").read_text().splitlines()
        if "eval_majority" in x
    )
    majority = sum(m0["eval_majority"][t] * m0["eval_n"][t] for t in m0["eval_n"]) / n
    lines = [
        f"untrained adapter (round 0), {n} questions pooled: acc {100 * acc0.mean():.1f}%, "
        f"mc_loss {mc0.mean():.3f} (chance ln 4 = {math.log(4):.3f}); most-frequent label "
        f"{100 * majority:.1f}%, chance 25.0%; "
        + ", ".join(f"{t} {100 * np.mean(first[t]['correct']):.1f}%" for t in sorted(first)),
        "",
        "| setting | client-steps | acc % (pooled) | acc gain, points [95%] | McNemar p | "
        "mc_loss | mc_loss decrease [95%] | per task acc % (before→after) | run min | passes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [r[0] for r in rows]
    passing = [r for r in rows if r[3]]
    if passing:
        best = max(passing, key=lambda r: r[1])
        lines.append(f"\nchosen by the rule: {best[4]} (passes acceptance)")
    else:
        best = max(rows, key=lambda r: r[2])
        lines.append(
            "\nno setting passes the acceptance test: mc_loss becomes the primary target; "
            f"largest paired mc_loss decrease: {best[4]} (z = {best[2]:+.1f})"
        )
    return "\n".join(lines)


EXTRA: list[tuple[str, int, float]] = []  # other learning rates, added after the budgets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/cpu_pilot_harness", help="where the runs go")
    ap.add_argument("--summarize", action="store_true", help="apply the rule and exit")
    ap.add_argument("--only", nargs="*", help="setting names to run (default: the grid)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summarize:
        print(summarize(out))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for method, budget, lr in GRID + EXTRA:
        name = name_of(method, budget, lr)
        if (out / name / "summary.json").exists() or (args.only and name not in args.only):
            continue
        run_setting(method, budget, lr, out)
        print(summarize(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
