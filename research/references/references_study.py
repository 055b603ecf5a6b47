"""The references study's summary (rule: research/references/references_study.md): the federated protocol
beside centralized and local training, three seeds, the same 500 ARC-e questions.

The runs are one `fedlora compare` (research/references/references.toml, the `references` suite: labels
`federated`, `centralized`, `local`, one run directory `<label>-seed<s>` each); this script
reads their summary.json, config.toml and predictions.jsonl and writes references_summary.md
and references_summary.json beside them:

    fedlora compare --suite references -c research/references/references.toml --out results/references
    research/references/references_study.py summary results/references

Per seed s, on the task's final evaluation: the gains over the shared round 0,
G_X(s) = acc_X(s) − acc_0(s) for X in federated (f), centralized (c), local (l); then over
the seeds (the unit), each mean with its 95% t interval, the paired differences f − c and
f − l, and the share of the centralized gain that federated keeps, ρ = mean G_f / mean G_c,
with Fieller's 95% confidence set (`fieller`). Refused (exit 2, naming the run): a missing or
failed run, runs of one seed that did not start from the same round-0 accuracy, evaluated
different numbers of questions or ran different numbers of rounds, and configs that differ in
anything but the method (and output) fields.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import tomllib

from fedlora.config import dump_toml
from fedlora.errors import DataError
from fedlora.federation.rundir import load_saved_config
from fedlora.llm.eval_stats import mcnemar_p
from fedlora.studies.predictions import read_predictions
from fedlora.studies.runs import flat_config

LABELS = ("federated", "centralized", "local")
TASK = "arc-e"
# the fields an arm may change: the method and where it writes
ARM_FIELDS = ("method.name", "method.budget_of")
STEM = "references_summary"  # its files in the suite directory (.md, .json)


def t_quantile(n: int) -> float:
    """t_{0.975, n−1}."""
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1))


def mean_interval(values: list[float]) -> dict:
    """Mean and 95% t interval over seeds (None for one seed)."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if x.size < 2:
        return {"mean": mean, "ci95": None, "values": x.tolist()}
    half = t_quantile(x.size) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return {"mean": mean, "ci95": [mean - half, mean + half], "values": x.tolist()}


def fieller(x: list[float], y: list[float]) -> dict:
    """The ratio ρ = mean(x) / mean(y) of paired samples and Fieller's 95% set: every ρ with
    (x̄ − ρȳ)² ≤ t² Var(x̄ − ρȳ), Var from the paired sample covariances / n. Bounded only
    when ȳ is distinguished from 0 (a = ȳ² − t²·v_yy > 0); else `bounded` is False."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = x.size
    ratio = float(x.mean() / y.mean()) if y.mean() != 0 else math.nan
    if n < 2:
        return {"ratio": ratio, "ci95": None, "bounded": False}
    cov = np.cov(np.vstack([x, y]), ddof=1) / n  # covariances of the means
    t2 = t_quantile(n) ** 2
    a = y.mean() ** 2 - t2 * cov[1, 1]
    b = -2.0 * (x.mean() * y.mean() - t2 * cov[0, 1])
    c = x.mean() ** 2 - t2 * cov[0, 0]
    disc = b * b - 4 * a * c
    if a <= 0 or disc < 0:
        return {"ratio": ratio, "ci95": None, "bounded": False}
    root = math.sqrt(disc)
    return {"ratio": ratio, "ci95": [(-b - root) / (2 * a), (-b + root) / (2 * a)], "bounded": True}


def verdict(interval: list[float] | None) -> str:
    """Above 0: "positive"; below 0: "negative"; across 0 or none: "inconclusive"."""
    if interval is None:
        return "inconclusive"
    return "positive" if interval[0] > 0 else "negative" if interval[1] < 0 else "inconclusive"


def _read_arm(run_dir: Path) -> tuple[dict, dict]:
    """(summary.json, the flat resolved config) of a finished run; DataError otherwise."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise DataError(f"{run_dir}: no summary.json (the run has not finished)")
    summary = json.loads(path.read_text(encoding="utf-8"))
    if "error" in summary:
        raise DataError(f"{run_dir}: the run failed: {summary['error']}")
    # as a run records it: an arm written before the [method.<name>] tables equals one after
    cfg = load_saved_config(run_dir / "config.toml")
    return summary, flat_config(tomllib.loads(dump_toml(cfg)))


def _check_same_setting(configs: dict[str, dict], where: str) -> None:
    """The arms of one seed differ only in ARM_FIELDS and [output]."""
    base = configs["federated"]
    for label, cfg in configs.items():
        differ = sorted(
            k
            for k in set(base) | set(cfg)
            if base.get(k) != cfg.get(k) and k not in ARM_FIELDS and not k.startswith("output.")
        )
        if differ:
            raise DataError(f"{where}: {label} differs from federated in {', '.join(differ)}")


def seed_row(out: Path, seed: int) -> dict:
    """One seed's numbers: round-0 and final accuracy of every arm, gains, local's spread and
    the McNemar test of federated against centralized on the shared questions."""
    arms = {label: _read_arm(out / f"{label}-seed{seed}") for label in LABELS}
    _check_same_setting({k: v[1] for k, v in arms.items()}, f"{out} seed {seed}")
    initial = {k: s["initial_eval"][TASK] for k, (s, _) in arms.items()}
    final = {k: s["final_eval"][TASK] for k, (s, _) in arms.items()}
    acc0 = {k: v["accuracy"] for k, v in initial.items()}
    if len(set(acc0.values())) != 1 or len({v["n"] for v in final.values()}) != 1:
        raise DataError(
            f"{out} seed {seed}: the arms are not paired (round-0 accuracy {acc0}, "
            f"questions {[v['n'] for v in final.values()]})"
        )
    rounds = {k: s["rounds"] for k, (s, _) in arms.items()}
    if len(set(rounds.values())) != 1:
        raise DataError(f"{out} seed {seed}: the arms ran different rounds {rounds}")
    row = {
        "seed": seed,
        "n": final["federated"]["n"],
        "round0": acc0["federated"],
        "final": {k: v["accuracy"] for k, v in final.items()},
        "rounds": rounds,
    }
    row["gain"] = {k: v - row["round0"] for k, v in row["final"].items()}
    spread = (arms["local"][0].get("clients") or {}).get("spread", {}).get(TASK)
    row["local_clients"] = spread
    a, b = (
        read_predictions(out / f"federated-seed{seed}"),
        read_predictions(out / f"centralized-seed{seed}"),
    )
    if TASK in a and TASK in b:
        ra = dict(zip(a[TASK]["ids"], a[TASK]["correct"]))
        rb = dict(zip(b[TASK]["ids"], b[TASK]["correct"]))
        common = sorted(set(ra) & set(rb))
        fed_only = sum(1 for q in common if ra[q] and not rb[q])
        cen_only = sum(1 for q in common if rb[q] and not ra[q])
        row["mcnemar_fed_vs_centralized"] = {
            "n": len(common),
            "federated_only": fed_only,
            "centralized_only": cen_only,
            "p": mcnemar_p(fed_only, cen_only),
        }
    return row


def summarize(out: Path, seeds: list[int]) -> dict:
    rows = [seed_row(out, s) for s in seeds]
    gains = {k: [r["gain"][k] for r in rows] for k in LABELS}
    fed_minus = {
        k: [r["final"]["federated"] - r["final"][k] for r in rows] for k in ("centralized", "local")
    }
    result = {
        "task": TASK,
        "seeds": seeds,
        "per_seed": rows,
        "gain": {k: mean_interval(v) for k, v in gains.items()},
        "federated_minus_centralized": mean_interval(fed_minus["centralized"]),
        "federated_minus_local": mean_interval(fed_minus["local"]),
        "share_of_centralized_gain": fieller(gains["federated"], gains["centralized"]),
    }
    central = verdict(result["gain"]["centralized"]["ci95"])
    result["verdicts"] = {
        "centralized_gain": central,
        "federated_beats_local": verdict(result["federated_minus_local"]["ci95"]),
        "federated_below_centralized": verdict(result["federated_minus_centralized"]["ci95"]),
        # the share is estimated only where the centralized gain is distinguished from 0
        "share_estimated": central == "positive" and result["share_of_centralized_gain"]["bounded"],
    }
    return result


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def _interval(d: dict) -> str:
    ci = d["ci95"]
    return _pts(d["mean"]) + (f" [{_pts(ci[0])}, {_pts(ci[1])}]" if ci else " (one seed)")


def render(result: dict) -> str:
    lines = [
        f"# References study: {result['task']}, seeds {result['seeds']}",
        "",
        "Accuracy in percent; gains and differences in points, 95% t intervals over seeds.",
        "",
        "| seed | questions | round 0 | federated | centralized | local (mean of clients) "
        "| local best / worst client | federated vs centralized: only f / only c, McNemar p |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["per_seed"]:
        spread = r["local_clients"]
        bw = (
            f"{spread['best_client']}: {100 * spread['max']:.1f} / "
            f"{spread['worst_client']}: {100 * spread['min']:.1f}"
            if spread
            else "-"
        )
        m = r.get("mcnemar_fed_vs_centralized")
        mc = f"{m['federated_only']} / {m['centralized_only']}, p = {m['p']:.3g}" if m else "-"
        f = r["final"]
        lines.append(
            f"| {r['seed']} | {r['n']} | {100 * r['round0']:.1f} | {100 * f['federated']:.1f} "
            f"| {100 * f['centralized']:.1f} | {100 * f['local']:.1f} | {bw} | {mc} |"
        )
    share = result["share_of_centralized_gain"]
    ci = share["ci95"]
    share_text = f"{share['ratio']:.2f}" + (
        f" [{ci[0]:.2f}, {ci[1]:.2f}] (Fieller)" if ci else " (Fieller set unbounded)"
    )
    v = result["verdicts"]
    lines += [
        "",
        "| measure | mean over seeds [95% interval] | verdict |",
        "|---|---|---|",
        *(
            f"| gain of {k} over round 0 | {_interval(result['gain'][k])} | "
            f"{verdict(result['gain'][k]['ci95'])} |"
            for k in LABELS
        ),
        f"| federated − centralized | {_interval(result['federated_minus_centralized'])} | "
        f"{v['federated_below_centralized']} |",
        f"| federated − local | {_interval(result['federated_minus_local'])} | "
        f"{v['federated_beats_local']} |",
        f"| share of the centralized gain federated keeps | {share_text} | "
        f"{'estimated' if v['share_estimated'] else 'not estimated (rule)'} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help=f"{STEM}.md and .json of a finished study")
    p.add_argument("out", type=Path, help="the suite directory (fedlora compare --out)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    try:
        result = summarize(args.out, args.seeds)
    except DataError as e:
        print(f"references_study: error: {e}", file=sys.stderr)
        return 2
    (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = render(result)
    (args.out / f"{STEM}.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
