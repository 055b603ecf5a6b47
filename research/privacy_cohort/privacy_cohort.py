"""Client-level DP at N = 1,000 clients, 50 expected a round: no DP, fixed and adaptive
clipping at ε = 8 and 2, and the planner within planner.max_epsilon against uniform sampling
(rule: research/privacy_cohort/privacy_cohort.md, committed before any of its runs).

Every run is one `fedlora run` on the base config (research/privacy_cohort/privacy_cohort.toml)
with one torch thread on the CPU. Stages (the rule says why each exists and what it decides):

    stage1   no DP, H = 1 and 2 local steps, 20 rounds, ARC-e at 0, 10, 20: the cheapest
             (H, R) that learns, and from its update norms the clip bounds: stage1.json
    stage1b  (amendment 3, after stage 1 chose none) the same with server momentum
    stage1c  (amendment 4, after stage 1b chose none) stage 1b's runs continued to 40 rounds
    run      the four DP arms at the chosen setting, then the planner arm (or planner.json)
    summary  summary.md and summary.json (privacy_cohort_summary.py)
    sigma    the rule's σ table, recomputed

A landed run is skipped and a run stopped part way goes on from its checkpoint, so a killed
stage resumes; `--commit` git-commits each finished run's files as it lands. Usage:
`privacy_cohort.py STAGE --out results/privacy_cohort [--only RUN...] [--commit]`.
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
from fedlora.llm.eval_stats import paired_change  # noqa: E402
from fedlora.system.privacy import (  # noqa: E402
    epsilon,
    noise_multiplier_for_epsilon,
    poisson_epsilon,
    sum_noise_multiplier,
)
from research.measure import RUN_FILES, git_commit, measured, read_predictions  # noqa: E402
from research.privacy_cohort.privacy_cohort_summary import EPSILONS, PLANNER, UNIFORM  # noqa: E402
from research.privacy_cohort.privacy_cohort_summary import STAGES as STAGE_PREFIXES  # noqa: E402

BASE = "research/privacy_cohort/privacy_cohort.toml"
TASK = "arc-e"
DELTA = 1e-5
COMMON = ["model.threads=1", "model.device=cpu", f'data.eval_tasks=["{TASK}"]']
NO_DP = ['privacy.mode="central"', "privacy.noise_multiplier=0", "privacy.clip_norm=1e9"]
# stage 1: local steps H searched, rounds evaluated, what "learns" means
STAGE1_H = (1, 2)
STAGE1_ROUNDS = (10, 20)
LEARN_GAIN = 0.02
# amendment 4 (stage 1b chose none): stage 1b's two runs continued to 40 rounds (resumed)
STAGE1C_ROUNDS = (10, 20, 30, 40)
# amendment 3 (stage 1 chose none): the server momentum of DP federated training, one setting
STAGE1B_SERVER = [
    'method.server_optimizer="avgm"',
    "method.server_lr=1.0",
    "method.server_momentum=0.9",
]
# the rule's σ (computed before the runs, research/privacy_cohort/privacy_cohort.md): the
# smallest σ to 3 decimals whose ε(δ) after R rounds of the Poisson-subsampled Gaussian at
# q = 0.05 keeps the target, for each R stage 1 may choose
RULE_SIGMA = {(10, 8.0): 0.563, (10, 2.0): 1.034, (20, 8.0): 0.604, (20, 2.0): 1.1}
RULE_SIGMA |= {(30, 8.0): 0.632, (30, 2.0): 1.153, (40, 8.0): 0.654, (40, 2.0): 1.2}  # amdt. 4
ADAPTIVE = ["privacy.target_quantile=0.5", "privacy.clip_learning_rate=0.2"]
COUNT_NOISE = 2.5  # σ_b = E[m]/20 (Andrew et al. 2021), E[m] = 50
# label -> (clipping, ε); stage 4's planner arm and its uniform counterpart: PLANNER, UNIFORM
DP_ARMS = {
    "fixed-eps8": ("fixed", 8.0),
    "fixed-eps2": ("fixed", 2.0),
    "adaptive-eps8": ("adaptive", 8.0),
    "adaptive-eps2": ("adaptive", 2.0),
}
PLANNER_ROUND_CAP = 3  # × R: the planner arm's round cap (its time budget stops it first)
# amendment 2: the planner arm's in-run probes (planner.probe_q, planner.probe_rounds)
STAGE4_PROBE_Q = (0.02, 0.01)
STAGE4_PROBE_ROUNDS = 2


def execute(args: list[str]) -> None:
    """One `fedlora run` in a process of its own (tests replace this with an in-process run)."""
    subprocess.run([sys.executable, "-m", "fedlora.cli", "run", *args], check=True)


def commit(paths: list[Path], message: str) -> None:
    """git add and commit only `paths` (a finished run's result files, stage1.json), unless
    they are committed as they are already."""
    names, cwd = [str(p.resolve()) for p in paths], paths[0].parent
    subprocess.run(["git", "add", "--", *names], check=True, cwd=cwd)
    if subprocess.run(["git", "diff", "--cached", "--quiet", "--", *names], cwd=cwd).returncode:
        subprocess.run(["git", "commit", "-q", "-m", message, "--", *names], check=True, cwd=cwd)


def landed(out: Path, label: str) -> bool:
    return (out / label / "run_info.json").is_file()


def run_one(label: str, overrides: list[str], ctx: dict, extra: dict, args=None) -> None:
    """The run `label` from the base config with `overrides` (or the `fedlora run` arguments
    `args`); its files and run_info.json into out/label; committed with --commit. A landed
    run is skipped; one stopped part way goes on from its last checkpoint."""
    out, run_dir = ctx["out"], ctx["runs"] / label
    if landed(out, label):
        print(f"{label}: already in {out}, skipped", flush=True)
        return
    if args is None:
        overrides = [*COMMON, *overrides]
        args = ["--out", str(run_dir), "--overwrite", "--config", ctx["base"], *overrides]
        saved = run_dir / "checkpoints"
        if saved.is_dir() and any(saved.iterdir()) and (run_dir / "config.toml").is_file():
            args = ["--resume", str(run_dir)]  # the same config, or fedlora refuses
            extra = {**extra, "resumed": True}  # wall_s, cpu_s: the part after the resume
    timing = measured(label, lambda: execute(args), run_dir, out / label)
    info = {"label": label, "base": ctx["base"], "overrides": overrides, **extra, **timing}
    (out / label / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")
    if ctx["commit"]:
        files = [out / label / f for f in (*RUN_FILES, "run_info.json")]
        commit(files, f"privacy_cohort: {label} ({ctx['base']})")


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def two_digits(x: float) -> float:
    return float(f"{x:.2g}")


# ----------------------------------------------------------------------------- stage 1


def learning_table(out: Path, prefix: str = "stage1") -> list[dict]:
    """Every (H, R) of stage 1 (1b, 1c): the gain at round R over round 0 on the same questions."""
    table = []
    for h in STAGE1_H:
        preds = read_predictions(out / f"{prefix}-h{h}")
        first = preds[0][TASK]
        for r in STAGE1C_ROUNDS if prefix == "stage1c" else STAGE1_ROUNDS:
            change = paired_change(first["correct"], preds[r][TASK]["correct"])
            learns = change["gain"] >= LEARN_GAIN - 1e-12 and change["gain_ci95"][0] > 0
            table.append({"H": h, "R": r, "client_steps": h * r, **change, "learns": learns})
    return table


def choose(table: list[dict]) -> dict | None:
    """The cheapest setting that learns: fewest client-steps H·R, then fewest rounds."""
    learned = [row for row in table if row["learns"]]
    return min(learned, key=lambda row: (row["client_steps"], row["R"]), default=None)


def stage1_runs(ctx: dict, only: list[str] | None = None, prefix: str = "stage1") -> int:
    """Stage 1's runs (`only`: some of them, so that two can run side by side, one per core),
    then, once both have landed, stage1.json. `prefix` "stage1b" (amendment 3): the same with
    the server momentum STAGE1B_SERVER; "stage1c" (amendment 4): stage 1b's runs continued
    (`extend_one`); each into PREFIX.json, only after the stage before chose none."""
    server = STAGE1B_SERVER if prefix in ("stage1b", "stage1c") else []
    before = {"stage1b": "stage1", "stage1c": "stage1b"}.get(prefix)
    if before:
        first = ctx["out"] / f"{before}.json"
        if not first.is_file() or json.loads(first.read_text())["chosen"] is not None:
            raise DataError(f"{first}: {prefix} runs only after {before} chose no setting")
    for h in STAGE1_H:
        if only and f"{prefix}-h{h}" not in only:
            continue
        if prefix == "stage1c":
            extend_one(h, ctx)
            continue
        rounds = [f"training.local_steps={h}", f"training.rounds={max(STAGE1_ROUNDS)}"]
        rounds.append(f"training.eval_every={STAGE1_ROUNDS[0]}")
        run_one(f"{prefix}-h{h}", [*rounds, *NO_DP, *server], ctx, {"stage": prefix, "H": h})
    missing = [f"{prefix}-h{h}" for h in STAGE1_H if not landed(ctx["out"], f"{prefix}-h{h}")]
    if missing:
        print(
            f"{prefix}: waiting for {', '.join(missing)}; {prefix}.json is written when both land"
        )
        return 0
    table = learning_table(ctx["out"], prefix)
    chosen = choose(table)
    doc: dict = {"rule": "research/privacy_cohort/privacy_cohort.md", "table": table}
    doc.update(chosen=None, server=server, commit=git_commit())
    if chosen is not None:
        lines = metrics_lines(ctx["out"] / f"{prefix}-h{chosen['H']}")
        norms = {x["round"]: x["dp_update_norms"] or [] for x in lines if x["round"] >= 1}
        whole = [n for r in range(1, chosen["R"] + 1) for n in norms.get(r, [])]
        if not whole or not norms.get(1):
            raise DataError(f"{prefix}-h{chosen['H']}: no update norms in rounds 1-{chosen['R']}")
        doc["chosen"] = {"H": chosen["H"], "R": chosen["R"], "run": f"{prefix}-h{chosen['H']}"}
        doc["clip_norm"] = two_digits(float(np.median(whole)))
        doc["first_clip_norm"] = two_digits(float(np.median(norms[1])))
        doc["n_norms"] = len(whole)
    path = ctx["out"] / f"{prefix}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if ctx["commit"]:
        commit([path], f"privacy_cohort: {prefix}.json")
    if chosen is None:
        print(f"{prefix}: no setting learns within the rule's bound; the study stops (rule)")
        return 0
    print(f"{prefix}: H = {chosen['H']}, R = {chosen['R']}; C = {doc['clip_norm']}")
    return 0


def extend_one(h: int, ctx: dict) -> None:
    """Amendment 4: stage 1b's run of H local steps continued to round max(STAGE1C_ROUNDS),
    resumed in a copy of its run directory (bit-identical to one longer run, checked before
    the amendment) into out/stage1c-hH; the committed stage-1b files stay as they are."""
    import shutil

    source, run_dir = ctx["runs"] / f"stage1b-h{h}", ctx["runs"] / f"stage1c-h{h}"
    if not run_dir.exists() and not landed(ctx["out"], f"stage1c-h{h}"):
        if not (source / "checkpoints").is_dir():
            raise DataError(f"{source}: stage 1b's run (with its checkpoints) is needed")
        shutil.copytree(source, run_dir)
    rounds = f"training.rounds={max(STAGE1C_ROUNDS)}"
    extra = {"stage": "stage1c", "H": h, "extends": f"stage1b-h{h}"}
    run_one(f"stage1c-h{h}", [rounds], ctx, extra, ["--resume", str(run_dir), "--force", rounds])


def chosen_stage(out: Path) -> dict | None:
    """The setting every later run uses: the first choice of stages 1, 1b, 1c, with its clip
    bounds and server keys; None when none chose one. Raises when a needed file is missing."""
    for prefix in STAGE_PREFIXES:
        path = out / f"{prefix}.json"
        if not path.is_file():
            raise DataError(f"{path} not found: run {prefix} first ((H, R) and C are fixed by it)")
        doc = json.loads(path.read_text())
        if doc["chosen"] is not None:
            stage = {**doc["chosen"], "clip_norm": doc["clip_norm"]}
            stage.update(first_clip_norm=doc["first_clip_norm"], server=doc.get("server", []))
            return stage
    return None


# ----------------------------------------------------------------------------- sigma


def sigma_table() -> dict[tuple[int, float], float]:
    """σ for every (R, ε) the rule lists, recomputed with fedlora's accountant at q = 0.05."""
    return {
        (r, e): noise_multiplier_for_epsilon(e, "poisson", 0.05, r, DELTA)
        for r, e in sorted(RULE_SIGMA)
    }


def check_sigma(base: str, rounds: int) -> list[str]:
    """The base config samples at q = 0.05 for every client, and the rule's σ at `rounds` are
    fedlora's; each difference is a line ([] when all agree)."""
    cfg = load_config(base, COMMON)
    if cfg.method.q != "fixed" or cfg.method.name != "sketched":
        return [
            f"{base}: method {cfg.method.name}, q {cfg.method.q}: the rule's is sketched, fixed"
        ]
    bad = []
    for e in map(float, EPSILONS):
        want = noise_multiplier_for_epsilon(e, "poisson", cfg.method.q_fixed, rounds, DELTA)
        if RULE_SIGMA.get((rounds, e)) != want:
            bad.append(f"ε {e}, {rounds} rounds: the rule lists {RULE_SIGMA.get((rounds, e))}")
            bad[-1] += f", fedlora's accountant at q = {cfg.method.q_fixed}: {want}"
    return bad


def dp_overrides(clipping: str, eps: float, stage: dict) -> tuple[list[str], dict]:
    """The privacy keys of one DP arm and what run_info.json records of them."""
    sigma = RULE_SIGMA[(stage["R"], eps)]
    dp = ['privacy.mode="central"', f"privacy.noise_multiplier={sigma}", f"privacy.delta={DELTA}"]
    extra = {"sigma": sigma, "clipping": clipping, "target_epsilon": eps}
    if clipping == "fixed":
        dp.append(f"privacy.clip_norm={stage['clip_norm']}")
        extra["clip_norm"] = stage["clip_norm"]
    else:
        dp += ['privacy.clipping="adaptive"', *ADAPTIVE, f"privacy.clip_count_noise={COUNT_NOISE}"]
        dp.append(f"privacy.clip_norm={stage['first_clip_norm']}")
        extra["first_clip_norm"] = stage["first_clip_norm"]
        extra["sum_noise_multiplier"] = sum_noise_multiplier(sigma, COUNT_NOISE)
    extra["epsilon_bound"] = poisson_epsilon(0.05, sigma, stage["R"], DELTA)
    return dp, extra


def run_stage(ctx: dict, labels: list[str]) -> int:
    stage = chosen_stage(ctx["out"])
    if stage is None:
        print("stages 1, 1b and 1c found no setting that learns: the study stops there (rule)")
        return 2
    bad = check_sigma(ctx["base"], stage["R"]) if ctx["rule_check"] else []
    if bad:
        print("refused: σ differs from research/privacy_cohort/privacy_cohort.md:", *bad)
        return 2
    steps = [f"training.local_steps={stage['H']}", f"training.rounds={stage['R']}"]
    steps += stage["server"]
    for label in labels:
        if label == PLANNER:
            continue
        clipping, eps = DP_ARMS[label]
        dp, extra = dp_overrides(clipping, eps, stage)
        evals = [f"training.eval_every={stage['R']}"]
        run_one(label, [*steps, *evals, *dp], ctx, {"stage": "run", **stage, **extra})
    if PLANNER in labels:
        return planner_arm(ctx, stage)
    return 0


def probe_epsilon(sigma: float) -> float:
    """ε(δ) of `proposed`'s in-run probes alone: every client at each rate of STAGE4_PROBE_Q
    for 2 × STAGE4_PROBE_ROUNDS rounds (two k per rate), fedlora's accounting at σ."""
    n = 2 * STAGE4_PROBE_ROUNDS
    return epsilon([("poisson", q, n) for q in STAGE4_PROBE_Q], sigma, DELTA)


def planner_arm(ctx: dict, stage: dict) -> int:
    """`proposed` within planner.max_epsilon = 8 at the uniform arm's σ and C, for the uniform
    ε = 8 arm's simulated time (the common budget), evaluated every 10 rounds and at it; not
    run (planner.json says why) when its in-run probes alone spend more than the budget."""
    if landed(ctx["out"], PLANNER):
        print(f"{PLANNER}: already in {ctx['out']}, skipped", flush=True)
        return 0
    if not landed(ctx["out"], UNIFORM):
        raise DataError(f"{UNIFORM} has not landed: the planner arm's time budget is its time")
    dp, extra = dp_overrides("fixed", 8.0, stage)
    spent = probe_epsilon(extra["sigma"])
    if spent > 8.0:
        reason = (
            f"proposed's in-run probes (every client at q = {', '.join(map(str, STAGE4_PROBE_Q))}) "
            f"alone spend ε = {spent:.3g} > 8 at σ = {extra['sigma']}: the run would stop for "
            "its budget during the probes, before any plan (rule, stage 4)"
        )
        doc = {"status": "not run", "reason": reason, "probe_epsilon": spent, **extra}
        path = ctx["out"] / "planner.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        if ctx["commit"]:
            commit([path], "privacy_cohort: planner.json (stage 4 not run)")
        print(f"{PLANNER}: not run: {reason}")
        return 0
    budget = json.loads((ctx["out"] / UNIFORM / "summary.json").read_text())["sim_time_s"]
    overrides = [
        f"training.local_steps={stage['H']}",
        f"training.rounds={PLANNER_ROUND_CAP * stage['R']}",
        f"training.eval_every={STAGE1_ROUNDS[0]}",
        f"training.time_budget_s={budget}",
        'method.name="proposed"',
        "planner.max_epsilon=8.0",
        f"planner.probe_q=[{STAGE4_PROBE_Q[0]}, {STAGE4_PROBE_Q[1]}]",
        f"planner.probe_rounds={STAGE4_PROBE_ROUNDS}",
        *stage["server"],
        *dp,
    ]
    extra.update(time_budget_s=budget, max_epsilon=8.0, probe_epsilon=spent)
    run_one(PLANNER, overrides, ctx, {"stage": "run", **stage, **extra})
    return 0


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=(*STAGE_PREFIXES, "run", "summary", "sigma"))
    ap.add_argument("--out", default="results/privacy_cohort", help="the results folder")
    ap.add_argument("--runs", default="runs/privacy_cohort", help="where the run directories go")
    ap.add_argument("--base", "--config", dest="base", default=BASE, help=f"base config ({BASE})")
    labels = [*DP_ARMS, PLANNER]
    stage1_labels = [f"{p}-h{h}" for p in STAGE_PREFIXES for h in STAGE1_H]
    ap.add_argument(
        "--only", nargs="+", choices=[*labels, *stage1_labels], help="these runs, in this order"
    )
    ap.add_argument("--commit", action="store_true", help="git-commit each finished run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    ctx = {"out": out, "runs": Path(args.runs), "base": args.base, "commit": args.commit}
    ctx["rule_check"] = args.base == BASE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.stage == "sigma":
            for (r, e), s in sigma_table().items():
                eps = poisson_epsilon(0.05, s, r, DELTA)
                print(f"R = {r}, ε = {e:g}: σ = {s} (ε {eps:.5f}; rule {RULE_SIGMA[(r, e)]})")
            return 0 if sigma_table() == RULE_SIGMA else 2
        if args.stage == "summary":
            from research.privacy_cohort.privacy_cohort_summary import write_summary

            return write_summary(out, labels)
        out.mkdir(parents=True, exist_ok=True)
        only = args.only or []
        stage1 = args.stage in STAGE_PREFIXES
        allowed = [f"{args.stage}-h{h}" for h in STAGE1_H] if stage1 else labels
        wrong = [x for x in only if x not in allowed]
        if wrong:
            raise DataError(f"--only {wrong[0]} is not a run of this stage ({', '.join(allowed)})")
        if stage1:
            return stage1_runs(ctx, only, args.stage)
        return run_stage(ctx, only or labels)
    except (ConfigError, DataError) as e:
        print(f"research/privacy_cohort/privacy_cohort.py {args.stage}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
