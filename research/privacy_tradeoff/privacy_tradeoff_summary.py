"""The summary stage of research/privacy_tradeoff/privacy_tradeoff.py: summary.md and summary.json from whatever
runs have landed in the results folder, by the rule of research/privacy_tradeoff/privacy_tradeoff.md.

Per run: ARC-e acc at the last evaluation against round 0 on the same questions (gain, normal
95% interval, gained/lost, exact McNemar p: the library's `paired_change`), acc_norm, mc_loss,
the simulated time, σ, C and the final largest client ε. Per ε: FFA-LoRA against LoRA on the
same questions at the last evaluation, and the verdict on the FFA-LoRA claim.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.eval_stats import paired_change
from research.measure import gain_interval, pct, read_predictions

TASK = "arc-e"
EPSILONS = (8, 2)
P_DECIDES = 0.05
# The rule's overall verdict (research/privacy_tradeoff/privacy_tradeoff.md, amendment 2, before any run)
OVERALL = "held at both ε: held; not held at both ε: not held; otherwise inconclusive"


def _mean(values: list) -> float:
    return float(np.mean(np.asarray(values, dtype=float)))


def load_run(run_dir: Path) -> dict | None:
    """One landed run's figures, or None when it has not landed."""
    if not (run_dir / "run_info.json").is_file():
        return None
    preds = read_predictions(run_dir)
    first, last = preds[0][TASK], preds[max(preds)][TASK]
    if first["ids"] != last["ids"]:
        raise DataError(f"{run_dir}: round 0 and the last evaluation asked other questions")
    summary = json.loads((run_dir / "summary.json").read_text())
    info = json.loads((run_dir / "run_info.json").read_text())
    line0 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    privacy = summary.get("privacy") or {}
    return {
        "ids": last["ids"],
        "correct": last["correct"],
        "last_round": max(preds),
        "acc": [_mean(first["correct"]), _mean(last["correct"])],
        "change": paired_change(first["correct"], last["correct"]),
        "acc_norm": [_mean(first["correct_norm"]), _mean(last["correct_norm"])],
        "mc_loss": [_mean(first["mc_loss"]), _mean(last["mc_loss"])],
        "sim_time_s": summary["sim_time_s"],
        "sigma": privacy.get("noise_multiplier"),
        "clip_norm": privacy.get("clip_norm"),
        # the largest client ε spent (None: σ = 0, no finite ε); "max_epsilon" in older summaries
        "max_epsilon": privacy.get("largest_epsilon", privacy.get("max_epsilon")),
        "epsilon": privacy.get("epsilon"),  # every client's final ε (None: not finite)
        "wall_s": info["wall_s"],
        "cpu_s": info["cpu_s"],
        "load": [info["load_1min_start"], info["load_1min_end"]],
        "commit": info["commit"],
        "n": len(last["ids"]),
        "chance": line0["eval_chance"][TASK],
        "majority": line0["eval_majority"][TASK],
    }


def compare(lora: dict, ffa: dict) -> dict:
    """FFA-LoRA against LoRA at the last evaluation on the same questions, and the verdict."""
    if lora["ids"] != ffa["ids"]:
        raise DataError("the two runs of a comparison asked other questions")
    pair = paired_change(lora["correct"], ffa["correct"])  # ffa − lora
    if pair["gain"] > 0 and pair["mcnemar_p"] < P_DECIDES:
        verdict = "held"
    elif pair["gain"] < 0 and pair["mcnemar_p"] < P_DECIDES:
        verdict = "not held"
    else:
        verdict = "inconclusive"
    gains = [r["change"]["gain_ci95"][0] > 0 for r in (lora, ffa)]
    return {**pair, "verdict": verdict, "neither_gains": not any(gains)}


def overall(verdicts: list[str | None]) -> str:
    if any(v is None for v in verdicts):
        return "not decided (a run is missing)"
    if all(v == "held" for v in verdicts):
        return "held"
    if all(v == "not held" for v in verdicts):
        return "not held"
    return "inconclusive"


def _eps(r: dict) -> str:
    if r["sigma"] == 0 or r["max_epsilon"] is None:
        return "∞"
    return f"{r['max_epsilon']:.4g}"


def run_row(label: str, r: dict | None) -> str:
    if r is None:
        return f"| {label} | not run |" + " |" * 11
    c = r["change"]
    return (
        f"| {label} | {r['sigma']:g} | {r['clip_norm']:g} | {_eps(r)} | "
        f"{pct(r['acc'][0])}→{pct(r['acc'][1])} | {gain_interval(c)} | {c['gained']}/{c['lost']} "
        f"| {c['mcnemar_p']:.2g} | {pct(r['acc_norm'][0])}→{pct(r['acc_norm'][1])} | "
        f"{r['mc_loss'][0]:.3f}→{r['mc_loss'][1]:.3f} | {r['sim_time_s']:.0f} | "
        f"{r['wall_s']:.0f} / {r['cpu_s']:.0f} | {r['load'][0]}→{r['load'][1]} |"
    )


def write_summary(out: Path, labels: list[str]) -> int:
    runs = {label: load_run(out / label) for label in labels}
    done = [r for r in runs.values() if r is not None]
    if done and any(r["ids"] != done[0]["ids"] for r in done):
        raise DataError(f"{out}: the runs asked other questions; the rule pairs the same ones")
    comparisons: dict[str, dict | None] = {}
    for e in EPSILONS:
        lora, ffa = runs.get(f"lora-eps{e}"), runs.get(f"ffa-eps{e}")
        comparisons[str(e)] = None if lora is None or ffa is None else compare(lora, ffa)
    secondary: dict[str, dict | None] = {}
    for e in EPSILONS:
        lora, ffa = runs.get(f"lora-eps{e}"), runs.get(f"ffa-sigma{e}")
        secondary[str(e)] = None if lora is None or ffa is None else compare(lora, ffa)
    verdict = overall([None if c is None else c["verdict"] for c in comparisons.values()])
    md = summary_md(runs, comparisons, secondary, verdict)
    (out / "summary.md").write_text(md)
    clean = {
        label: (
            {"status": "not run"}
            if r is None
            else {"status": "done", **{k: v for k, v in r.items() if k not in ("ids", "correct")}}
        )
        for label, r in runs.items()
    }
    base = done[0] if done else None
    doc = {
        "rule": "research/privacy_tradeoff/privacy_tradeoff.md",
        "task": TASK,
        "questions": None if base is None else base["n"],
        "chance": None if base is None else base["chance"],
        "most_frequent_label": None if base is None else base["majority"],
        "runs": clean,
        "ffa_vs_lora": comparisons,
        "secondary_ffa_at_sketched_sigma_vs_lora": secondary,
        "verdict": verdict,
        "verdict_rule": OVERALL,
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(md)
    return 0


def summary_md(runs: dict, comparisons: dict, secondary: dict, verdict: str) -> str:
    done = [r for r in runs.values() if r is not None]
    lines = [
        "# Privacy against accuracy on the CPU protocol: results",
        "",
        "Written by `research/privacy_tradeoff/privacy_tradeoff.py summary` from the run folders beside it; the rule "
        "is research/privacy_tradeoff/privacy_tradeoff.md. One seed: every verdict holds for these questions and "
        "this seed only.",
        "",
    ]
    if done:
        b = done[0]
        lines.append(
            f"Questions: ARC-e, n = {b['n']} (the same in every run), evaluated at round 0 and "
            f"round {b['last_round']}. Chance {pct(b['chance'])}%; most-frequent label "
            f"{pct(b['majority'])}%. Intervals: paired normal 95%; p: exact two-sided McNemar."
        )
        lines.append("")
    lines += [
        "| run | σ | C | final max ε | ARC-e acc % before→after | gain, points [95%] "
        "| gained/lost | McNemar p | acc_norm % before→after | mc_loss before→after "
        "| sim_time_s | one core's time: wall s / CPU s | load start→end |",
        "|---" * 13 + "|",
    ]
    lines += [run_row(label, r) for label, r in runs.items()]
    lines += [
        "",
        "## FFA-LoRA against LoRA at the same ε (ARC-e acc at the last evaluation, paired)",
        "",
    ]
    lines += ["| ε | FFA − LoRA, points [95%] | FFA-only/LoRA-only correct | McNemar p | verdict |"]
    lines += ["|---|---|---|---|---|"]
    for e, c in comparisons.items():
        if c is None:
            lines.append(f"| {e} | not run | | | |")
        else:
            lines.append(
                f"| {e} | {gain_interval(c)} | {c['gained']}/{c['lost']} | {c['mcnemar_p']:.2g} | "
                f"{c['verdict']} |"
            )
    for e, c in comparisons.items():
        if c is not None and c["neither_gains"]:
            lines.append(
                f"\nAt ε = {e} neither arm's run gains over its round 0 (its interval is not "
                "above zero): the comparison shows which method loses less, not which learns."
            )
    lines += ["", f"**The FFA-LoRA claim (better than LoRA under DP): {verdict}** ({OVERALL})."]
    lines += ["", "Secondary (decides nothing): FFA-LoRA at sketched's σ against LoRA at ε:", ""]
    for e, c in secondary.items():
        text = (
            "not run" if c is None else f"{gain_interval(c)} points, McNemar p {c['mcnemar_p']:.2g}"
        )
        lines.append(f"- ffa-sigma{e} − lora-eps{e}: {text}")
    return "\n".join(lines) + "\n"
