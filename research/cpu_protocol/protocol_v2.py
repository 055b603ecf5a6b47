"""Protocol v2's confirmation (research/cpu_protocol/protocol_v2.md): configs/demo.toml on several training
seeds, each run on a core of its own, and the rule's verdict over the seeds.

    .venv/bin/python research/cpu_protocol/protocol_v2.py run --seeds 0 --core 0 --out results/protocol_v2
    .venv/bin/python research/cpu_protocol/protocol_v2.py summary --out results/protocol_v2
    .venv/bin/python research/cpu_protocol/protocol_v2.py run --seeds 0 --core 0 --runs runs/protocol_v3 \
        --out results/protocol_v3 --set training.rounds=200 training.eval_every=50
    .venv/bin/python research/cpu_protocol/protocol_v2.py run --seeds 0 --core 0,1 --runs runs/demo_timed \
        --out results/demo_timed --set model.threads=2      # the demo timed on both cores, quiet

`run` writes runs/protocol_v2/seed<S> (the run) and OUT/seed<S>/ (config.toml, metrics.jsonl,
predictions.jsonl, summary.json, clients.csv and run_info.json: wall and CPU seconds, load,
CPU flags, commit). `summary` reads OUT/seed*/summary.json and writes OUT/summary.md and
OUT/summary.json: each seed's paired gain on the same 500 ARC-e questions, and the mean gain
with its 95% t interval over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `research`
from research.measure import measured  # noqa: E402  (the recipes' one measured-run helper)

CONFIG = "configs/demo.toml"
# every confirmation run: one torch thread on a core of its own, fp32 on the CPU
COMMON = ["model.device=cpu", "model.threads=1", "output.progress=false"]
TASK = "arc-e"


def run_seed(seed: int, core: str, runs: Path, out: Path, extra: list[str]) -> None:
    run_dir = runs / f"seed{seed}"
    argv = ["taskset", "-c", core, sys.executable, "-m", "fedlora.cli", "run"]
    argv += ["--config", CONFIG, "--out", str(run_dir), "--overwrite"]
    overrides = [*COMMON, *extra, f"training.seed={seed}"]
    dest = out / f"seed{seed}"
    start = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    start = start.stdout.strip()
    timing = measured(
        f"seed{seed}", lambda: subprocess.run([*argv, *overrides], check=True), run_dir, dest
    )
    info = {"config": CONFIG, "overrides": overrides, "core": core, "commit_at_start": start}
    info.update(timing)  # its "commit" is the checkout's at the end
    (dest / "run_info.json").write_text(json.dumps(info, indent=1) + "\n")


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t interval (n - 1 degrees of freedom)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def summary(out: Path) -> dict:
    seeds = {}
    for path in sorted(out.glob("seed*/summary.json")):
        s = json.loads(path.read_text())
        pair = s["paired_eval"][TASK]
        seeds[path.parent.name] = {
            "before": s["initial_eval"][TASK]["accuracy"],
            "after": s["final_eval"][TASK]["accuracy"],
            "n": s["final_eval"][TASK]["n"],
            "gain": pair["gain"],
            "gain_ci95": pair["gain_ci95"],
            "gained": pair["gained"],
            "lost": pair["lost"],
            "mcnemar_p": pair["mcnemar_p"],
        }
    gains = [v["gain"] for v in seeds.values()]
    result: dict = {"task": TASK, "metric": "acc", "seeds": seeds}
    if len(gains) >= 2:
        mean, lo, hi = t_interval(gains)
        confirmed = lo > 0 and min(gains) >= 0
        result.update(mean_gain=mean, mean_gain_ci95=[lo, hi], confirmed=confirmed)
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# {out.name}: the confirmation (research/cpu_protocol/protocol_v2.md)",
        "",
        f"ARC-e `acc` on the same {next(iter(seeds.values()))['n'] if seeds else '?'} "
        "questions for every seed, before and after training (paired).",
        "",
        "| seed | before | after | paired gain [95%] | gained / lost | exact McNemar p |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in seeds.items():
        lo, hi = v["gain_ci95"]
        lines.append(
            f"| {name[4:]} | {100 * v['before']:.1f}% | {100 * v['after']:.1f}% | "
            f"{100 * v['gain']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
            f"{v['gained']} / {v['lost']} | {v['mcnemar_p']:.3g} |"
        )
    if "mean_gain" in result:
        lo, hi = result["mean_gain_ci95"]
        lines += [
            "",
            f"Mean gain over {len(gains)} seeds: {100 * result['mean_gain']:+.2f} points, 95% t "
            f"interval [{100 * lo:+.2f}, {100 * hi:+.2f}]; smallest seed {100 * min(gains):+.1f}. "
            f"Rule: interval above zero and no seed below zero: "
            f"**{'confirmed' if result['confirmed'] else 'not confirmed'}**.",
        ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["run", "summary"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--core", default="0", help="the CPU core(s) of the runs (taskset -c: 0, or 0,1 for two)"
    )
    ap.add_argument("--runs", type=Path, default=Path("runs/protocol_v2"))
    ap.add_argument("--out", type=Path, default=Path("results/protocol_v2"))
    ap.add_argument(
        "--set", nargs="*", default=[], help="overrides of the protocol (protocol v3: rounds)"
    )
    args = ap.parse_args()
    if args.stage == "run":
        for seed in args.seeds:
            if (args.out / f"seed{seed}" / "run_info.json").is_file():
                print(f"seed{seed}: landed earlier, skipped", flush=True)
                continue
            run_seed(seed, args.core, args.runs, args.out, args.set)
    print(json.dumps(summary(args.out), indent=1))


if __name__ == "__main__":
    main()
