"""The CPU protocol confirmed on fresh questions (rule: research/cpu_protocol/cpu_protocol.md, "The
confirmation on fresh questions", committed before any of these runs).

Each setting is one `fedlora run` (the product itself) that evaluates the untrained adapter
(round 0) and the final one on the same fresh questions (500 ARC-e and 500 ARC-c disjoint from
the seed-0 subsets, and OBQA's 500) and writes per-question acc, acc_norm and mc_loss to
predictions.jsonl. Settings run one after another in the rule's order; a setting whose files
are already in the results folder is skipped, so a killed runner resumes. Each finished run's
files (config.toml, metrics.jsonl, predictions.jsonl, summary.json, clients.csv) and its
run_info.json (wall and CPU seconds, load before and after, CPU flags, code commit) are copied
to the results folder. `--summarize` applies the rule to whatever has landed.

    nohup .venv/bin/python research/cpu_protocol/cpu_protocol.py > protocol.log 2>&1 &
    .venv/bin/python research/cpu_protocol/cpu_protocol.py --summarize > results/cpu_protocol/summary.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `research`
from fedlora.llm.eval_stats import paired_change  # noqa: E402
from research.measure import measured, read_predictions  # noqa: E402

COMMON = [
    "model.name=smollm2-135m",
    "model.dtype=fp32",
    "model.device=cpu",
    "model.threads=1",  # amended 10:12 UTC: one thread on a core of its own (docs)
    "lora.rank=16",
    "lora.alpha=32",
    "lora.layers=8",
    'data.tasks=["arc-e", "arc-c", "obqa"]',
    'data.eval_tasks=["arc-e", "arc-c", "obqa"]',
    "data.train_limit=400",
    "data.eval_limit=500",
    "data.eval_seed=1",
    'data.eval_exclude=["arc-e:0", "arc-c:0"]',
    "data.max_seq_len=128",
    "data.dirichlet_alpha=0.1",
    "training.local_steps=5",
    "training.batch_size=4",
    "training.slots=5",
    "training.momentum=0",
    "training.sketch_step=scaled",
    "training.checkpoint_every=1000",
    "training.seed=0",
    "evaluation.format=harness",
    "evaluation.predictions=true",
    "output.progress=false",
]
QV = 'lora.target_modules=["q_proj", "v_proj"]'
QKVUD = 'lora.target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]'
ALL7 = (
    'lora.target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", '
    '"down_proj"]'
)
SGD = ["training.lr=0.2"]
ADAMW = [
    "training.optimizer=adamw",
    "training.lr=3e-4",
    "training.adam_betas=[0.9, 0.999]",
    "training.adam_eps=1e-8",
    "training.weight_decay=0",
    "training.optimizer_state=reset",
    "training.lr_schedule=constant",
]


def alg1(n: int, budget: int) -> list[str]:
    """Algorithm 1 with q_n = 0.2: 0.2·N participants × 5 steps = N client-steps a round."""
    rounds = budget // n
    return [
        "method.name=sketched",
        "method.q=fixed",
        "method.q_fixed=0.2",
        "method.k=uniform",
        f"data.n_clients={n}",
        f"training.rounds={rounds}",
        f"training.eval_every={rounds}",
    ]


def fedavg(n: int, budget: int) -> list[str]:
    rounds = budget // (5 * n)
    return [
        "method.name=fedavg",
        "method.clients_per_round=0",
        f"data.n_clients={n}",
        f"training.rounds={rounds}",
        f"training.eval_every={rounds}",
    ]


# The rule's table, in its order.
SETTINGS: list[tuple[str, list[str]]] = [
    ("alg1-n10-s1000", [*alg1(10, 1000), QV, *SGD]),
    ("fedavg-n10-s1000", [*fedavg(10, 1000), QV, *SGD]),
    ("alg1-n20-s1000", [*alg1(20, 1000), QV, *SGD]),
    ("alg1-n50-s1000", [*alg1(50, 1000), QV, *SGD]),
    ("alg1-n10-s1000-qkvud", [*alg1(10, 1000), QKVUD, *SGD]),
    ("alg1-n10-s1000-all7", [*alg1(10, 1000), ALL7, *SGD]),
    ("alg1-n10-s1000-adamw", [*alg1(10, 1000), QV, *ADAMW]),
    ("alg1-n10-s2000", [*alg1(10, 2000), QV, *SGD]),
    ("alg1-n20-s2000", [*alg1(20, 2000), QV, *SGD]),
    ("alg1-n50-s2000", [*alg1(50, 2000), QV, *SGD]),
    ("fedavg-n10-s1000-lr0.05", [*fedavg(10, 1000), QV, "training.lr=0.05"]),
]
CONDITIONAL = {"fedavg-n10-s1000-lr0.05": "fedavg-n10-s1000"}  # runs only if that one lost


def run_setting(name: str, overrides: list[str], runs: Path, results: Path) -> None:
    run_dir = runs / name
    cmd = [sys.executable, "-m", "fedlora.cli", "run", "--out", str(run_dir), "--overwrite"]
    dest = results / name
    timing = measured(
        name, lambda: subprocess.run([*cmd, *COMMON, *overrides], check=True), run_dir, dest
    )
    info = {"setting": name, "overrides": overrides, **timing}
    (dest / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")


# ----------------------------------------------------------------------------- the rule


def paired(before: list, after: list) -> tuple[float, float, float, int, int]:
    """The library's paired comparison (`fedlora.llm.eval_stats.paired_change`): mean change,
    half-width of its normal 95% interval, exact McNemar p, questions gained and lost."""
    pair = paired_change(before, after)
    lo, hi = pair["gain_ci95"]
    return pair["gain"], (hi - lo) / 2, pair["mcnemar_p"], pair["gained"], pair["lost"]


def gain_text(first: dict, last: dict, key: str) -> tuple[str, float, float]:
    """'a→b (+g [lo, hi], p)' for one task's per-question 0/1 key; returns (text, gain, p)."""
    assert first["ids"] == last["ids"], "the same questions before and after"
    a0, a1 = np.asarray(first[key], float), np.asarray(last[key], float)
    g, hw, p, _, _ = paired(first[key], last[key])
    text = (
        f"{100 * a0.mean():.1f}→{100 * a1.mean():.1f} "
        f"({100 * g:+.1f} [{100 * (g - hw):+.1f}, {100 * (g + hw):+.1f}], p {p:.2g})"
    )
    return text, g, p


def evaluate_setting(results: Path, name: str) -> dict | None:
    run_dir = results / name
    if not (run_dir / "run_info.json").exists():
        return None
    preds = read_predictions(run_dir)
    first, last = preds[0], preds[max(preds)]
    e0, e1 = first["arc-e"], last["arc-e"]
    acc0, acc1 = np.asarray(e0["correct"], float), np.asarray(e1["correct"], float)
    mc0, mc1 = np.asarray(e0["mc_loss"]), np.asarray(e1["mc_loss"])
    gain, hw, p, gained, lost = paired(e0["correct"], e1["correct"])
    dmc, dmc_hw, *_ = paired(e0["mc_loss"], e1["mc_loss"])  # the mean change and its interval
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = 5 * sum(m.get("n_participants", 0) for m in metrics if m.get("round", 0) > 0)
    info = json.loads((run_dir / "run_info.json").read_text())
    return {
        "name": name,
        "steps": steps,
        "acc0": acc0.mean(),
        "acc1": acc1.mean(),
        "gain": gain,
        "gain_hw": hw,
        "p": p,
        "gained": gained,
        "lost": lost,
        "mc0": mc0.mean(),
        "mc1": mc1.mean(),
        "dmc": dmc,
        "dmc_hw": dmc_hw,
        "passes": gain >= 0.03 and p < 0.01 and mc1.mean() < mc0.mean(),
        "norm_e": gain_text(e0, e1, "correct_norm")[0],
        "arc_c": gain_text(first["arc-c"], last["arc-c"], "correct")[0],
        "norm_c": gain_text(first["arc-c"], last["arc-c"], "correct_norm")[0],
        "norm_o": gain_text(first["obqa"], last["obqa"], "correct_norm")[0],
        "info": info,
        "baselines": next(m for m in metrics if "eval_majority" in m),
    }


def summarize(results: Path) -> str:
    rows = [r for name, _ in SETTINGS if (r := evaluate_setting(results, name)) is not None]
    if not rows:
        return "no finished setting yet"
    base = rows[0]["baselines"]
    lines = [
        "# The CPU protocol on fresh questions: results",
        "",
        "Written by `research/cpu_protocol/cpu_protocol.py --summarize` from the run directories beside it; "
        "the rule is research/cpu_protocol/cpu_protocol.md.",
        "",
        "Questions: " + ", ".join(f"{t} n = {n}" for t, n in base["eval_n"].items()) + ". Chance "
        "25%; most-frequent label: "
        + ", ".join(f"{t} {100 * v:.1f}%" for t, v in base["eval_majority"].items())
        + ". Pass: ARC-e acc ≥ +3 points, exact McNemar p < 0.01, lower ARC-e mc_loss. "
        "Intervals: paired normal 95%; p: exact two-sided McNemar.",
        "",
        "| setting | client-steps | ARC-e acc % before→after | gain, points [95%] | gained/lost "
        "| McNemar p | ARC-e mc_loss before→after (Δ [95%]) | passes | ARC-e acc_norm | ARC-c acc "
        "| ARC-c acc_norm | OBQA acc_norm | wall s / CPU s | load start→end | CPU flags |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        i = r["info"]
        lines.append(
            f"| {r['name']} | {r['steps']} | {100 * r['acc0']:.1f}→{100 * r['acc1']:.1f} | "
            f"{100 * r['gain']:+.1f} [{100 * (r['gain'] - r['gain_hw']):+.1f}, "
            f"{100 * (r['gain'] + r['gain_hw']):+.1f}] | {r['gained']}/{r['lost']} | "
            f"{r['p']:.2g} | {r['mc0']:.3f}→{r['mc1']:.3f} ({r['dmc']:+.3f} "
            f"[{r['dmc'] - r['dmc_hw']:+.3f}, {r['dmc'] + r['dmc_hw']:+.3f}]) | "
            f"{'yes' if r['passes'] else 'no'} | {r['norm_e']} | {r['arc_c']} | {r['norm_c']} | "
            f"{r['norm_o']} | {i['wall_s']:.0f} / {i['cpu_s']:.0f} | "
            f"{i['load_1min_start']}→{i['load_1min_end']} | {i['cpu_flags']} |"
        )
    lines += ["", overlap_line(results / rows[0]["name"])]
    passing = [r for r in rows if r["passes"]]
    lines.append("")
    if not passing:
        lines.append("No finished setting passes: no protocol is chosen (mc_loss stays primary).")
        return "\n".join(lines)
    order = [name for name, _ in SETTINGS]

    def tie_key(r: dict) -> tuple:  # the rule's tie-breaks, within 1 point of the best gain
        return (
            r["steps"],
            r["name"].startswith("fedavg"),
            "qkvud" in r["name"] or "all7" in r["name"],
            "adamw" in r["name"],
            order.index(r["name"]),
        )

    best_gain = max(r["gain"] for r in passing)
    best = min((r for r in passing if r["gain"] >= best_gain - 0.01), key=tie_key)
    lines.append(
        f"Passing: {', '.join(r['name'] for r in passing)}. Chosen by the rule: **{best['name']}** "
        f"(ARC-e {100 * best['gain']:+.1f} points, p = {best['p']:.2g})."
    )
    return "\n".join(lines)


EARLIER = Path("results/cpu_pilot_harness/alg1-1000-lr0.2")  # the seed-0 questions


def overlap_line(run_dir: Path) -> str:
    """How many of these questions the earlier (seed-0) harness pilot also asked, per task."""
    if not (EARLIER / "predictions.jsonl").is_file():
        return f"(no {EARLIER} here to check the questions are fresh)"
    now, before = read_predictions(run_dir)[0], read_predictions(EARLIER)[0]
    parts = [
        f"{t} {len(set(now[t]['ids']) & set(before[t]['ids']))} of {len(now[t]['ids'])}"
        for t in now
        if t in before
    ]
    return f"Questions also asked by the seed-0 pilot ({EARLIER}): " + ", ".join(parts) + "."


def due(name: str, results: Path) -> bool:
    """A conditional setting runs only when the setting it depends on lost ARC-e accuracy."""
    if name not in CONDITIONAL:
        return True
    parent = evaluate_setting(results, CONDITIONAL[name])
    return parent is not None and parent["gain"] < 0


def supports(overrides: list[str]) -> bool:
    """Whether the installed fedlora accepts these overrides (AdamW needs a newer one)."""
    cmd = [sys.executable, "-m", "fedlora.cli", "config", "show", *COMMON, *overrides]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/cpu_protocol", help="where the runs go")
    ap.add_argument("--results", default="results/cpu_protocol", help="where their files go")
    ap.add_argument("--summarize", action="store_true", help="apply the rule and exit")
    ap.add_argument(
        "--only",
        nargs="*",
        help="setting names to run, in this order (default: all, in the rule's order)",
    )
    args = ap.parse_args()
    results = Path(args.results)
    if args.summarize:
        print(summarize(results))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = dict(SETTINGS)
    for name in args.only or ():
        if name not in settings:
            ap.error(f"--only: unknown setting {name!r}; the settings: {', '.join(settings)}")
    # --only runs the named settings in the order given; by default the rule's order
    for name in args.only or list(settings):
        overrides = settings[name]
        if (results / name / "run_info.json").exists():
            continue
        if not due(name, results):
            print(f"{name}: not due by the rule (its condition is not met)", flush=True)
            continue
        if not supports(overrides):
            print(f"{name}: skipped, this fedlora does not accept its settings", flush=True)
            continue
        run_setting(name, overrides, Path(args.runs), results)
        print(summarize(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
