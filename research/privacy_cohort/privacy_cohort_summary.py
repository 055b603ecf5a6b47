"""The summary stage of research/privacy_cohort/privacy_cohort.py: summary.md and summary.json
from whatever runs have landed, by the rule of research/privacy_cohort/privacy_cohort.md.

The no-DP arm is stage 1's chosen run read at its round R. Per DP arm: ARC-e acc at its last
evaluation against round 0 and against the no-DP arm on the same questions (paired gain,
normal 95% interval, exact McNemar p: the library's `paired_change`), the share it keeps of
the no-DP gain with a paired bootstrap interval over questions, every client's ε (largest,
median) and the verdict sentence. Stage 4: the planner arm against uniform sampling at the
common simulated-time budget.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fedlora.errors import DataError
from fedlora.llm.eval_stats import paired_change
from research.measure import gain_interval, pct, read_predictions

TASK = "arc-e"
P_DECIDES = 0.05
BOOTSTRAP = 2000
NODP = "no-dp"
PLANNER, UNIFORM = "planner-eps8", "fixed-eps8"  # stage 4's planner arm and its uniform one
EPSILONS = (8, 2)  # the trade-off's two budgets (the arms' labels end in eps8, eps2)


def load_run(run_dir: Path, at_round: int | None = None) -> dict | None:
    """One landed run's figures at `at_round` (None: its last evaluation), or None."""
    if not (run_dir / "run_info.json").is_file():
        return None
    preds = read_predictions(run_dir)
    last = max(preds) if at_round is None else at_round
    first, final = preds[0][TASK], preds[last][TASK]
    if first["ids"] != final["ids"]:
        raise DataError(f"{run_dir}: round 0 and round {last} asked other questions")
    summary = json.loads((run_dir / "summary.json").read_text())
    info = json.loads((run_dir / "run_info.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = next(x for x in lines if x["round"] == last)
    eps = [e for e in (at.get("epsilon") or []) if e is not None] if last else []
    privacy = summary.get("privacy") or {}
    return {
        "ids": final["ids"],
        "before": first["correct"],
        "correct": final["correct"],
        "round": last,
        "acc": [float(np.mean(first["correct"])), float(np.mean(final["correct"]))],
        "change": paired_change(first["correct"], final["correct"]),
        "sim_time_s": at["sim_time_s"],
        "stop_reason": summary.get("stop_reason"),
        "sigma": privacy.get("noise_multiplier", 0.0),
        "clip_norm": privacy.get("clip_norm"),
        "final_clip_norm": privacy.get("final_clip_norm"),
        "largest_epsilon": max(eps) if eps else None,
        "median_epsilon": float(np.median(eps)) if eps else None,
        "wall_s": info["wall_s"],
        "cpu_s": info["cpu_s"],
        # timing of the part after a resume only (a stopped run, or stage 1c's continuation)
        "timing_partial": bool(info.get("resumed") or info.get("extends")),
        "chance": lines[0]["eval_chance"][TASK],
        "majority": lines[0]["eval_majority"][TASK],
    }


def kept_share(base: list, nodp: list, arm: list, seed: int = 0) -> dict:
    """The share of the no-DP gain the arm keeps, (arm − base)/(no-DP − base) on the same
    questions, with a paired bootstrap 95% interval over questions (resamples whose no-DP
    gain is not positive are left out and counted)."""
    b, n, a = (np.asarray(x, dtype=float) for x in (base, nodp, arm))
    whole = float((a - b).mean() / (n - b).mean()) if (n - b).mean() > 0 else math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, b.size, size=(BOOTSTRAP, b.size))
    num, den = (a - b)[idx].mean(axis=1), (n - b)[idx].mean(axis=1)
    ok = den > 0
    lo, hi = np.percentile(num[ok] / den[ok], [2.5, 97.5]) if ok.any() else (math.nan, math.nan)
    return {"share": whole, "share_ci95": [float(lo), float(hi)], "dropped": int((~ok).sum())}


def arm_verdict(change: dict, against: dict) -> str:
    """The rule's sentence for one DP arm: its gain over round 0 and its loss against no DP."""
    if not change["gain_ci95"][0] > 0:
        return "loses the gain"
    if against["gain"] < 0 and against["mcnemar_p"] < P_DECIDES:
        return "keeps part of the gain"
    return "keeps the no-DP gain"


def planner_verdict(pair: dict) -> str:
    if pair["gain"] > 0 and pair["mcnemar_p"] < P_DECIDES:
        return "the planner is better"
    if pair["gain"] < 0 and pair["mcnemar_p"] < P_DECIDES:
        return "uniform sampling is better"
    return "no difference detected"


STAGES = ("stage1", "stage1b", "stage1c")  # 1b, 1c: amendments 3, 4 (after none was chosen)


def stage_docs(out: Path) -> dict[str, dict]:
    """stage1.json, stage1b.json and stage1c.json, those that exist."""
    paths = {prefix: out / f"{prefix}.json" for prefix in STAGES}
    return {k: json.loads(p.read_text()) for k, p in paths.items() if p.is_file()}


def no_dp_run(out: Path) -> dict | None:
    """The no-DP arm: the chosen stage-1 (1b, 1c) run read at its round R."""
    for doc in stage_docs(out).values():
        if doc["chosen"] is not None:
            return load_run(out / doc["chosen"]["run"], doc["chosen"]["R"])
    return None


def compare_arms(runs: dict) -> dict:
    """Each DP arm against no DP (paired), its kept share and verdict; stage 4's pair."""
    nodp, doc = runs[NODP], {}
    for label, r in runs.items():
        if label in (NODP, PLANNER) or r is None or nodp is None:
            continue
        against = paired_change(nodp["correct"], r["correct"])
        share = kept_share(nodp["before"], nodp["correct"], r["correct"])
        doc[label] = {"vs_no_dp": against, **share, "verdict": arm_verdict(r["change"], against)}
    for eps in EPSILONS:  # adaptive − fixed at the same ε: reported, decides nothing (rule)
        fixed, adaptive = runs.get(f"fixed-eps{eps}"), runs.get(f"adaptive-eps{eps}")
        if fixed is not None and adaptive is not None:
            doc[f"adaptive_vs_fixed_eps{eps}"] = paired_change(
                fixed["correct"], adaptive["correct"]
            )
    planner, uniform = runs.get(PLANNER), runs.get(UNIFORM)
    if planner is not None and uniform is not None:
        pair = paired_change(uniform["correct"], planner["correct"])
        doc["planner_vs_uniform"] = {**pair, "verdict": planner_verdict(pair)}
    return doc


def planner_fits(run_dir: Path) -> list[dict]:
    """Every fit of the planner arm's in-run planner (its metrics' ``planner`` entries): the
    round, the kind, whether a plan was adopted, the fallback or error, the plan's q range and
    its ε with the probes' (amendment 2: the summary says whether it planned)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    fits = []
    for line in path.read_text().splitlines():
        entry = json.loads(line).get("planner")
        if not entry:
            continue
        plan = entry.get("plan") or {}
        privacy = plan.get("privacy") or {}
        fits.append(
            {
                "round": entry.get("round"),
                "kind": entry.get("kind"),
                "adopted": bool(entry.get("adopted")),
                "fallback": entry.get("fallback"),
                "error": entry.get("error"),
                "q_range": [min(plan["q"]), max(plan["q"])] if plan.get("q") else None,
                "largest_planned_epsilon": max(privacy["epsilon"]) if privacy else None,
                "spent_epsilon": max(privacy.get("spent_epsilon") or [0]) if privacy else None,
            }
        )
    return fits


def fits_md(fits: list[dict]) -> str:
    """The planner arm's fits, one line each (none: nothing)."""
    if not fits:
        return ""
    lines = ["", "The planner arm's fits (its metrics.jsonl):", ""]
    for f in fits:
        if f["q_range"] is not None:
            what = (
                f"plan {'adopted' if f['adopted'] else 'kept the current one'}, q in "
                f"[{f['q_range'][0]:.4g}, {f['q_range'][1]:.4g}], ε spent before it "
                f"{f['spent_epsilon']:.3g}, planned largest ε {f['largest_planned_epsilon']:.3g}"
            )
        else:
            what = f"no plan ({f['error']})" + (
                f"; fell back to {f['fallback']}" if f["fallback"] else ""
            )
        lines.append(f"- after round {f['round']} ({f['kind']}): {what}")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, labels: list[str]) -> int:
    runs = {NODP: no_dp_run(out), **{label: load_run(out / label) for label in labels}}
    done = [r for r in runs.values() if r is not None]
    if done and any(r["ids"] != done[0]["ids"] for r in done):
        raise DataError(f"{out}: the runs asked other questions; the rule pairs the same ones")
    comparisons = compare_arms(runs)
    note = out / "planner.json"
    planner = json.loads(note.read_text()) if note.is_file() else None
    stages = stage_docs(out)
    md = summary_md(runs, comparisons, stages, (planner or {}).get("reason", ""))
    hours = round(sum(cpu_seconds(out)) / 3600, 3)
    md += (
        trade_off_md(comparisons) + f"\nCPU-hours of every landed run (stage 1 included): {hours}\n"
    )
    (out / "summary.md").write_text(md + fits_md(planner_fits(out / PLANNER)))
    drop = ("ids", "before", "correct")
    clean = {
        label: {"status": "not run"} if r is None else {k: v for k, v in r.items() if k not in drop}
        for label, r in runs.items()
    }
    first = done[0] if done else {}
    doc = {
        "rule": "research/privacy_cohort/privacy_cohort.md",
        "task": TASK,
        "questions": len(first["ids"]) if done else None,
        "chance": first.get("chance"),
        "most_frequent_label": first.get("majority"),
        **{prefix: stages.get(prefix) for prefix in STAGES},
        "runs": clean,
        "comparisons": comparisons,
        "planner_not_run": planner,
        "planner_fits": planner_fits(out / PLANNER),
        "cpu_hours": hours,  # every landed run's CPU time (the stage-1 runs included)
    }
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    print((out / "summary.md").read_text())
    return 0


def trade_off_md(comparisons: dict) -> str:
    """The rule's sentence for item 3 (the kept shares with their verdicts; an arm not landed
    reads "not run") and adaptive − fixed at each ε, which decides nothing."""

    def kept(label: str) -> str:
        c = comparisons.get(label)
        if c is None:
            return "not run"
        lo, hi = c["share_ci95"]
        return f"{100 * c['share']:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] ({c['verdict']})"

    lines = ["", "## Item 3: the share of the no-DP gain kept", ""]
    lines.append(
        f"At N = 1,000, 50 a round: fixed clipping keeps {kept('fixed-eps8')} of the no-DP gain "
        f"at ε = 8 and {kept('fixed-eps2')} at ε = 2; adaptive clipping {kept('adaptive-eps8')} "
        f"and {kept('adaptive-eps2')}."
    )
    for eps in EPSILONS:
        pair = comparisons.get(f"adaptive_vs_fixed_eps{eps}")
        if pair is not None:
            lines.append(
                f"Adaptive − fixed clipping at ε = {eps}, paired: {gain_interval(pair)} points "
                f"(McNemar p {pair['mcnemar_p']:.2g}); reported, decides nothing (rule)."
            )
    return "\n".join(lines) + "\n"


def cpu_seconds(out: Path) -> list[float]:
    return [json.loads(p.read_text())["cpu_s"] for p in sorted(out.glob("*/run_info.json"))]


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def run_row(label: str, r: dict | None, c: dict | None) -> str:
    if r is None:
        return f"| {label} | not run |" + " |" * 10
    ch = r["change"]
    clip = _num(r["clip_norm"], "g")
    if r["final_clip_norm"] is not None:
        clip += f"→{r['final_clip_norm']:.3g}"
    against = (
        "-" if c is None else f"{gain_interval(c['vs_no_dp'])} (p {c['vs_no_dp']['mcnemar_p']:.2g})"
    )
    share = "-"
    if c is not None:
        lo, hi = c["share_ci95"]
        share = f"{100 * c['share']:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"
    return (
        f"| {label} | {r['round']} | {r['sigma']:g} | {clip} | {_num(r['largest_epsilon'])} / "
        f"{_num(r['median_epsilon'])} | {pct(r['acc'][0])}→{pct(r['acc'][1])} | "
        f"{gain_interval(ch)} (p {ch['mcnemar_p']:.2g}) | {against} | {share} | "
        f"{'-' if c is None else c['verdict']} | {r['sim_time_s']:.0f} | "
        f"{r['wall_s']:.0f} / {r['cpu_s']:.0f}{' *' if r.get('timing_partial') else ''} |"
    )


def summary_md(runs: dict, comparisons: dict, stages: dict, planner_note: str = "") -> str:
    lines = ["# Client-level DP at N = 1,000 clients: results", ""]
    lines.append(
        "Written by `research/privacy_cohort/privacy_cohort.py summary`; the rule is "
        "research/privacy_cohort/privacy_cohort.md. One seed: every verdict holds for these "
        "questions and this seed only."
    )
    lines.append("")
    titles = {
        "stage1": "Stage 1 (no DP, plain averaging)",
        "stage1b": "Stage 1b (no DP, server momentum μ = 0.9, η_s = 1: amendment 3)",
        "stage1c": "Stage 1c (stage 1b's runs continued to 40 rounds: amendment 4)",
    }
    for prefix, doc in stages.items():
        lines += [f"## {titles[prefix]}: the gain over round 0", ""]
        lines += ["| H | R | client-steps | gain, points [95%] | McNemar p | learns |"]
        lines += ["|---|---|---|---|---|---|"]
        for row in doc["table"]:
            lines.append(
                f"| {row['H']} | {row['R']} | {row['client_steps']} | {gain_interval(row)} | "
                f"{row['mcnemar_p']:.2g} | {'yes' if row['learns'] else 'no'} |"
            )
        chosen = doc["chosen"]
        lines.append("")
        if chosen is None:
            following = STAGES[STAGES.index(prefix) + 1 :]
            if not following or following[0] not in stages:
                done = ", ".join(x for x in STAGES if x in stages)
                lines.append(
                    f"**No setting learns within {done}: the study stops there** (unless an "
                    "amendment adds the next stage)."
                )
                return "\n".join(lines) + "\n"
            lines += ["No setting learns within this stage's bound.", ""]
            continue
        lines.append(
            f"Chosen: H = {chosen['H']}, R = {chosen['R']}; fixed C = {doc['clip_norm']}, "
            f"adaptive clipping's first C = {doc['first_clip_norm']}."
        )
        lines.append("")
        break
    done = [r for r in runs.values() if r is not None]
    if done:
        b = done[0]
        lines.append(
            f"ARC-e, n = {len(b['ids'])} (the same in every run). Chance {pct(b['chance'])}%; "
            f"most-frequent label {pct(b['majority'])}%. Intervals: paired normal 95% (the "
            "share: paired bootstrap over questions); p: exact two-sided McNemar."
        )
        lines.append("")
    lines += [
        "| arm | round | σ | C | ε largest / median | acc % round 0→last | gain, points [95%] "
        "| − no DP, points [95%] | share of the no-DP gain [95%] | verdict | sim_time_s "
        "| wall s / CPU s |",
        "|---" * 12 + "|",
    ]
    lines += [run_row(label, r, comparisons.get(label)) for label, r in runs.items()]
    if any(r is not None and r.get("timing_partial") for r in runs.values()):
        lines += ["", "\\* wall and CPU seconds of the part after a resume only (run_info.json)."]
    pair = comparisons.get("planner_vs_uniform")
    lines += ["", "## Stage 4: the planner within ε ≤ 8 against uniform q = 0.05 (ε 8)", ""]
    if pair is None:
        lines.append(f"Not run{': ' + planner_note if planner_note else ''}.")
    else:
        lines.append(
            f"Planner − uniform at the common simulated-time budget: {gain_interval(pair)} points, "
            f"McNemar p {pair['mcnemar_p']:.2g}: **{pair['verdict']}**."
        )
    return "\n".join(lines) + "\n"
