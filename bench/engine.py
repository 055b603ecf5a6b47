"""Engine overhead and memory for the demo configuration.

Prints, in one run:
- client-steps/s of whole rounds, and the share of round time spent outside local training
  (planning, aggregation, round-time computation, metrics, checkpoints; evaluation is
  reported separately);
- peak RSS of a process that builds a run and trains 2 rounds with N = 50 and N = 1,000
  clients and q_n = 4/N (so the same work; memory must not grow with N beyond indices and
  profiles).

    python bench/engine.py                      # the demo model (smollm2-135m), 3 rounds
    python bench/engine.py --model tiny-llama   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))


def _overrides(args: argparse.Namespace, n_clients: int, rounds: int) -> list[str]:
    return [
        f"model.name={args.model}",
        f"model.threads={args.threads}",
        f'data.data_dir="{DATA}"',
        f"data.n_clients={n_clients}",
        f"training.rounds={rounds}",
        f"training.eval_every={rounds + 1}",  # only the last round evaluates
        f"data.eval_limit={args.eval_limit}",
        "training.checkpoint_every=1",
        *args.set,
    ]


def measure_rounds(args: argparse.Namespace) -> dict:
    import fedlora.llm.evaluation
    import fedlora.llm.train
    from fedlora.config import load_config
    from fedlora.federation.run import prepare_run_dir, run_experiment

    timers = {"train_s": 0.0, "steps": 0}
    evals: list[float] = []  # evaluations: round 0 (outside any round) and the last round
    real_train, real_eval = fedlora.llm.train.local_train, fedlora.llm.evaluation.evaluate

    def timed_train(model, lora, batches, lr, **kw):
        t0 = time.perf_counter()
        out = real_train(model, lora, batches, lr, **kw)
        timers["train_s"] += time.perf_counter() - t0
        timers["steps"] += len(batches) * len(batches[0])
        return out

    def timed_eval(*a, **kw):
        t0 = time.perf_counter()
        out = real_eval(*a, **kw)
        evals.append(time.perf_counter() - t0)
        return out

    fedlora.llm.train.local_train = timed_train
    fedlora.llm.evaluation.evaluate = timed_eval
    cfg = load_config(None, _overrides(args, args.clients, args.rounds))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(cfg, run_dir)
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds_s = sum(m["compute_s"] for m in lines[1:])
    n_initial = len(cfg.data.eval_tasks)  # round 0's evaluations are not inside any round
    eval_in_rounds_s = sum(evals[n_initial:])
    return {
        "rounds_s": rounds_s,
        "train_s": timers["train_s"],
        "steps": timers["steps"],
        "eval_s": eval_in_rounds_s,
        "outside_s": rounds_s - timers["train_s"] - eval_in_rounds_s,
    }


def measure_rss(args: argparse.Namespace, n_clients: int) -> dict:
    from fedlora.config import load_config
    from fedlora.federation.run import prepare_run_dir, run_experiment

    # the same expected number of participants (4) for every N: memory, not work, is measured
    extra = ["data.eval_limit=8", f"method.q_fixed={4 / n_clients}", "data.min_client_examples=1"]
    cfg = load_config(None, _overrides(args, n_clients, 2) + extra)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(cfg, run_dir)
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    return {
        "n_clients": n_clients,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--eval-limit", type=int, default=50)
    p.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    p.add_argument("--rss-only", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.rss_only:
        print(json.dumps(measure_rss(args, args.rss_only)))
        return

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, load {os.getloadavg()}")
    r = measure_rounds(args)
    print(f"\nrounds: {args.rounds} with N = {args.clients}")
    print(
        f"  client-steps/s (whole rounds, eval excluded): {r['steps'] / (r['rounds_s'] - r['eval_s']):.3f}"
    )
    print(f"  client-steps/s (local training only):         {r['steps'] / r['train_s']:.3f}")
    share = r["outside_s"] / (r["rounds_s"] - r["eval_s"])
    print(
        f"  time outside local training: {r['outside_s']:.2f} s = {100 * share:.1f}% (target <= 10%)"
    )
    print(f"  evaluation ({args.eval_limit} questions): {r['eval_s']:.1f} s")

    print("\npeak RSS (separate processes, 2 rounds each):")
    rss = []
    for n in (50, 1000):
        cmd = [sys.executable, __file__, "--rss-only", str(n), "--model", args.model]
        cmd += [f"--threads={args.threads}"] + [f"--set={s}" for s in args.set]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rss.append(json.loads(out.strip().splitlines()[-1]))
        print(f"  N = {n:5d}: {rss[-1]['peak_rss_mb']:.0f} MB")
    print(f"  ratio N=1000 / N=50: {rss[1]['peak_rss_mb'] / rss[0]['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    main()
