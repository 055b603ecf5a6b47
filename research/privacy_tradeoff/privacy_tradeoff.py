"""Privacy against accuracy on the CPU protocol: LoRA (`sketched`) and FFA-LoRA at ε ≈ ∞, 8, 2
(rule: research/privacy_tradeoff/privacy_tradeoff.md, committed before any of its runs).

Every run is one `fedlora run` on the base config (configs/demo.toml) with one torch thread on
the CPU, ARC-e evaluated at round 0 and the last round only. Three stages:

    clip     the two 10-round runs without noise and with a bound no update reaches; the clip
             bound C of each method is the median of every participant's ‖w_n Δ_n‖ over rounds
             1-10 (the metrics lines' `dp_update_norms`), to 2 significant digits: clip.json
    run      the 6 primary runs, then the 2 secondary ones, each with its σ (the smallest, to
             3 decimals, whose ε(δ) after the run's rounds keeps the target: recomputed and
             checked against the rule's numbers) and its method's C from clip.json
    summary  summary.md and summary.json: each run against its round 0, FFA-LoRA against LoRA
             at each ε, and the verdict by the rule

A run whose files are already in the results folder is skipped, so a killed stage resumes.
Each finished run's files and its run_info.json (wall and CPU seconds of the run's process,
the load before and after, CPU flags, code commit, σ, C) are copied to the results folder.

    research/privacy_tradeoff/privacy_tradeoff.py clip    --out results/privacy
    research/privacy_tradeoff/privacy_tradeoff.py run     --out results/privacy [--only LABEL ...] [--primary-only]
    research/privacy_tradeoff/privacy_tradeoff.py summary --out results/privacy
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
from fedlora.config import load_config  # noqa: E402
from fedlora.errors import ConfigError, DataError  # noqa: E402
from fedlora.federation.methods.registry import method_class  # noqa: E402
from fedlora.system.privacy import epsilon, noise_multiplier_for_epsilon  # noqa: E402
from research.measure import git_commit, measured  # noqa: E402

BASE = "configs/demo.toml"
COMMON = [
    "model.threads=1",
    "model.device=cpu",
    'data.eval_tasks=["arc-e"]',
    "training.eval_every=100",
    "output.progress=false",
]
ARMS = {"lora": [], "ffa": ["method.name=ffalora", "method.clients_per_round=2"]}
DELTA = 1e-5
# the clip stage: no noise, a bound no update reaches, 10 rounds; its evaluation decides
# nothing, so two questions (the fewest valid: one gives a non-finite interval, which a
# run refuses as divergence; data.eval_limit = 0 means all)
CLIP_ROUNDS = 10
CLIP_RUN = [
    'privacy.mode="central"',
    "privacy.noise_multiplier=0",
    "privacy.clip_norm=1e9",
    f"training.rounds={CLIP_ROUNDS}",
    "data.eval_limit=2",
]
# label -> (arm, privacy level): "inf" σ = 0; ("eps", E) the smallest σ whose ε keeps E;
# ("as", L) the σ of label L (FFA-LoRA at sketched's noise multiplier)
PRIMARY = {
    "lora-inf": ("lora", "inf"),
    "ffa-inf": ("ffa", "inf"),
    "lora-eps8": ("lora", ("eps", 8.0)),
    "ffa-eps8": ("ffa", ("eps", 8.0)),
    "lora-eps2": ("lora", ("eps", 2.0)),
    "ffa-eps2": ("ffa", ("eps", 2.0)),
}
SECONDARY = {"ffa-sigma8": ("ffa", ("as", "lora-eps8")), "ffa-sigma2": ("ffa", ("as", "lora-eps2"))}
LABELS = {**PRIMARY, **SECONDARY}
# the σ the rule lists (computed before the runs); the runner refuses a run whose σ differs
RULE_SIGMA = {"lora-eps8": 1.538, "lora-eps2": 4.502, "ffa-eps8": 5.406, "ffa-eps2": 17.783}
RULE_SIGMA.update({"ffa-sigma8": RULE_SIGMA["lora-eps8"], "ffa-sigma2": RULE_SIGMA["lora-eps2"]})


def execute(args: list[str]) -> None:
    """One `fedlora run` in a process of its own (tests replace this with an in-process run)."""
    subprocess.run([sys.executable, "-m", "fedlora.cli", "run", *args], check=True)


def run_one(label: str, overrides: list[str], base: str, runs: Path, out: Path, extra: dict):
    """The run `label` from `base` with `overrides`; its files and run_info.json into out/label."""
    run_dir = runs / label
    args = ["--out", str(run_dir), "--overwrite", "--config", base, *COMMON, *overrides]
    timing = measured(label, lambda: execute(args), run_dir, out / label)
    info = {"label": label, "base": base, "overrides": [*COMMON, *overrides], **extra, **timing}
    (out / label / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")


def landed(out: Path, label: str) -> bool:
    return (out / label / "run_info.json").is_file()


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- clip


def two_digits(x: float) -> float:
    """`x` rounded to 2 significant digits."""
    return float(f"{x:.2g}")


def clip_stage(base: str, runs: Path, out: Path) -> int:
    values: dict[str, dict] = {}
    for arm, arm_overrides in ARMS.items():
        label = f"clip-{arm}"
        overrides = [*arm_overrides, *CLIP_RUN]
        if not landed(out, label):
            run_one(label, overrides, base, runs, out, {"stage": "clip"})
        lines = metrics_lines(out / label)
        per_round = [
            [x["round"], x["dp_update_norms"]] for x in lines if 1 <= x["round"] <= CLIP_ROUNDS
        ]
        norms = [n for _, round_norms in per_round for n in round_norms]
        if not norms:
            raise DataError(f"{out / label}: no participant in rounds 1-{CLIP_ROUNDS}")
        median = float(np.median(norms))
        values[arm] = {"clip_norm": two_digits(median), "median": median, "norms": per_round}
    clip = {
        "rule": "research/privacy_tradeoff/privacy_tradeoff.md",
        "clip_norm": {arm: v["clip_norm"] for arm, v in values.items()},
        "median_norm": {arm: v["median"] for arm, v in values.items()},
        "n_norms": {arm: sum(len(n) for _, n in v["norms"]) for arm, v in values.items()},
        "what": "median over the participants of rounds 1-10 of the weighted update norm "
        "before clipping (dp_update_norms), to 2 significant digits",
        "norms": {arm: v["norms"] for arm, v in values.items()},
        "overrides": {arm: [*COMMON, *ARMS[arm], *CLIP_RUN] for arm in ARMS},
        "base": base,
        "command": " ".join(["research/privacy_tradeoff/privacy_tradeoff.py", *sys.argv[1:]]),
        "commit": git_commit(),
    }
    path = out / "clip.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if (old["clip_norm"], old["median_norm"]) != (clip["clip_norm"], clip["median_norm"]):
            raise DataError(
                f"{path} holds C = {old['clip_norm']} (medians {old['median_norm']}), these "
                f"runs give C = {clip['clip_norm']} (medians {clip['median_norm']}): not "
                "overwritten (C is fixed before any DP run)"
            )
        print(f"{path}: unchanged, C = {old['clip_norm']}")
        return 0
    path.write_text(json.dumps(clip, indent=1) + "\n")
    print(f"{path}: C = {clip['clip_norm']}")
    return 0


# ----------------------------------------------------------------------------- run


def accounting(base: str, arm: str) -> tuple[str, float, int, int]:
    """(event kind, rate, rounds, N) of `arm`'s runs, as fedlora accounts them."""
    cfg = load_config(base, [*COMMON, *ARMS[arm]])
    n, m = cfg.data.n_clients, cfg.method.clients_per_round
    if method_class(cfg.method.name).dp_sampling == "uniform":
        return "uniform", (m if m else n) / n, cfg.training.rounds, n
    if cfg.method.q != "fixed":
        raise ConfigError(f"method.q = {cfg.method.q!r}: this runner needs one rate ('fixed')")
    return "poisson", float(cfg.method.q_fixed), cfg.training.rounds, n


def sigma_of(label: str, base: str) -> tuple[float, float | None]:
    """σ of `label` and its accountant ε(δ) after the run's rounds (None: σ = 0, no bound)."""
    arm, level = LABELS[label]
    if level == "inf":
        return 0.0, None
    kind, rate, rounds, n = accounting(base, arm)
    if level[0] == "as":
        sigma = sigma_of(level[1], base)[0]
    else:
        sigma = noise_multiplier_for_epsilon(level[1], kind, rate, rounds, DELTA, n_clients=n)
    return sigma, epsilon([(kind, rate, rounds)], sigma, DELTA, n)


def check_rule_sigma(labels: list[str], base: str, rule_check: bool) -> list[str]:
    """The σ of `labels` that differ from the rule's numbers (each a line), [] when all agree."""
    if not rule_check:
        print(f"base {base} is not the rule's: σ not checked against the rule's numbers")
        return []
    bad = []
    for label in labels:
        if label in RULE_SIGMA and (sigma := sigma_of(label, base)[0]) != RULE_SIGMA[label]:
            arm, level = LABELS[label]
            kind, rate, rounds, n = accounting(base, arm)
            rule_eps = epsilon([(kind, rate, rounds)], RULE_SIGMA[label], DELTA, n)
            what = (
                f"{level[1]}'s σ"
                if level[0] == "as"
                else "the smallest σ to 3 decimals whose ε(δ) keeps the target"
            )
            bad.append(
                f"{label}: the rule lists σ = {RULE_SIGMA[label]} (ε = {rule_eps:.6g}); "
                f"recomputed: {sigma}, {what}"
            )
    return bad


def run_stage(base: str, runs: Path, out: Path, labels: list[str], rule_check: bool) -> int:
    clip_path = out / "clip.json"
    if not clip_path.is_file():
        raise DataError(f"{clip_path} not found: run the clip stage first (C is fixed by it)")
    clip = json.loads(clip_path.read_text())["clip_norm"]
    bad = check_rule_sigma(labels, base, rule_check)
    if bad:
        free = [x for x in labels if LABELS[x][1] == "inf" or x not in RULE_SIGMA]
        print(
            "refused: σ differs from research/privacy_tradeoff/privacy_tradeoff.md:",
            *bad,
            sep="\n  ",
        )
        print(
            "Amend the rule (below it, with the time and the reason) and RULE_SIGMA in "
            "research/privacy_tradeoff/privacy_tradeoff.py"
            + (f"; the runs that need no σ: --only {' '.join(free)}" if free else "")
        )
        return 2
    for label in labels:
        if landed(out, label):
            print(f"{label}: already in {out}, skipped", flush=True)
            continue
        arm = LABELS[label][0]
        sigma, eps = sigma_of(label, base)
        dp = ['privacy.mode="central"', f"privacy.noise_multiplier={sigma}"]
        dp += [f"privacy.clip_norm={clip[arm]}", f"privacy.delta={DELTA}"]
        extra = {"stage": "run", "sigma": sigma, "clip_norm": clip[arm], "epsilon_bound": eps}
        run_one(label, [*ARMS[arm], *dp], base, runs, out, extra)
    return 0


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("clip", "run", "summary"))
    ap.add_argument("--out", default="results/privacy", help="the results folder")
    ap.add_argument("--runs", default="runs/privacy", help="where the run directories go")
    ap.add_argument(
        "--base", "--config", dest="base", default=BASE, help=f"the base config ({BASE})"
    )
    ap.add_argument("--only", nargs="+", metavar="LABEL", help="these runs, in this order")
    ap.add_argument("--primary-only", action="store_true", help="the 6 primary runs only")
    args = ap.parse_args(argv)
    out, runs = Path(args.out), Path(args.runs)
    labels = list(PRIMARY) if args.primary_only else list(LABELS)
    for label in args.only or ():
        if label not in LABELS:
            ap.error(f"--only: unknown label {label!r}; the labels: {', '.join(LABELS)}")
    labels = args.only or labels
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.stage == "summary":
            from research.privacy_tradeoff.privacy_tradeoff_summary import write_summary

            return write_summary(out, list(LABELS))
        out.mkdir(parents=True, exist_ok=True)
        if args.stage == "clip":
            return clip_stage(args.base, runs, out)
        return run_stage(args.base, runs, out, labels, rule_check=args.base == BASE)
    except (ConfigError, DataError) as e:
        print(f"research/privacy_tradeoff/privacy_tradeoff.py {args.stage}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
