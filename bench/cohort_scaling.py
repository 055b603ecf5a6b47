"""Does a client that sits out a round cost anything? Time and memory per round against the
number of clients N, at a fixed expected number of participants m (issue 40 item 2).

For each N (default 100, 1,000, 10,000) a process of its own builds a tiny-llama run with
q_n = m/N (so every round trains about m clients whatever N) over the commonsense training mix
split across the N clients, and trains R rounds, with and without client-level DP (central,
where every client's ε is accounted every round). Printed per N and mode:

    setup_s        building the run (data, partition, profiles, method), once
    round_ms       the median of the rounds' compute_s (training, aggregation, the clock, the
                   privacy accounting; metrics.jsonl), and of the rounds without participants
    calls/round    Python function calls per round (cProfile, a second pass): a count the
                   machine's load does not change, so an O(N) cost shows up on a busy machine
    peak_rss_mb    the process's peak resident memory

    python bench/cohort_scaling.py                    # N = 100, 1000, 10000; 8 rounds; m = 4
    python bench/cohort_scaling.py --clients 100 1000 --rounds 4 --json out.json

`--accounting` measures the privacy accounting of a round alone, without a model (the one
part of a round whose work is per client, not per participant: every client's ε is accounted
every round): the calls and time of one round's `account_round` and `budget_stop` after R
rounds, at every N. Quick, and its call counts do not depend on the machine's load.

    python bench/cohort_scaling.py --accounting --rounds 200
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = os.environ.get("FEDLORA_DATA", str(Path(__file__).parents[2] / "shared/data/commonsense"))
TASKS = '["arc-e", "arc-c", "obqa", "boolq"]'  # about 17,700 training examples
DP = ['privacy.mode="central"', "privacy.noise_multiplier=1.0", "privacy.clip_norm=0.05"]


def overrides(n_clients: int, rounds: int, participants: float, private: bool) -> list[str]:
    return [
        "model.name=tiny-llama",
        "model.dtype=fp32",
        "model.threads=1",
        f'data.data_dir="{DATA}"',
        f"data.tasks={TASKS}",
        'data.eval_tasks=["arc-e"]',
        "data.eval_limit=2",
        "data.max_seq_len=96",
        f"data.n_clients={n_clients}",
        "data.min_client_examples=1",
        "lora.rank=4",
        "lora.layers=1",
        f"training.rounds={rounds}",
        f"training.eval_every={rounds + 1}",  # round 0 and the last round evaluate
        "training.checkpoint_every=100000",  # the final checkpoint only
        "training.local_steps=1",
        "training.batch_size=1",
        'method.name="sketched"',
        'method.q="fixed"',
        f"method.q_fixed={participants / n_clients}",
        'method.k="full"',
        "output.progress=false",
        *(DP if private else []),
    ]


def measure(n_clients: int, rounds: int, participants: float, private: bool) -> dict:
    """One run in this process: setup, per-round compute, calls per round, peak RSS."""
    from fedlora.config import load_config
    from fedlora.federation import engine
    from fedlora.federation.run import prepare_run_dir, run_experiment

    cfg = load_config(None, overrides(n_clients, rounds, participants, private))
    built: dict[str, float] = {}
    real_build = engine.build_run

    def timed_build(*args, **kwargs):
        t0 = time.perf_counter()
        out = real_build(*args, **kwargs)
        built["setup_s"] = time.perf_counter() - t0
        return out

    engine.build_run = timed_build
    profile = cProfile.Profile()
    real_one_round = engine._one_round

    def profiled_round(*args, **kwargs):  # the rounds' own calls, not setup or evaluation
        profile.enable()
        try:
            return real_one_round(*args, **kwargs)
        finally:
            profile.disable()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        prepare_run_dir(cfg, run_dir)
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)  # timed, unprofiled
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        engine._one_round = profiled_round
        prepare_run_dir(cfg, run_dir, overwrite=True)
        run_experiment(cfg, run_dir, quiet=True, log=lambda m: None)
    engine._one_round, engine.build_run = real_one_round, real_build
    calls = pstats.Stats(profile).total_calls
    # the last round also evaluates: leave it out of the round times
    trained = [x["compute_s"] for x in lines[1:-1] if x["n_participants"]]
    empty = [x["compute_s"] for x in lines[1:-1] if not x["n_participants"]]
    return {
        "n_clients": n_clients,
        "privacy": "central" if private else "none",
        "setup_s": built["setup_s"],
        "round_ms": 1e3 * statistics.median(trained) if trained else None,
        "empty_round_ms": 1e3 * statistics.median(empty) if empty else None,
        "calls_per_round": calls / rounds,
        "metrics_line_bytes": len(json.dumps(lines[-2])),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure_accounting(n_clients: int, rounds: int, participants: float) -> dict:
    """One central-DP round's accounting after `rounds` rounds, at N clients with distinct
    rates (the planner's q_n: every client its own), without a model."""
    from types import SimpleNamespace

    from fedlora.config import load_config
    from fedlora.federation.methods.registry import method_class
    from fedlora.federation.privacy import account_round, budget_stop, make_privacy
    from fedlora.federation.progress import Progress

    rng = np.random.default_rng(0)
    q = np.clip(rng.uniform(0.5, 1.5, n_clients) * participants / n_clients, 1e-6, 1.0)
    cfg = load_config(None, [f"data.n_clients={n_clients}", *DP, "planner.max_epsilon=1e6"])
    method = SimpleNamespace(privacy=make_privacy(cfg, method_class(cfg.method.name)), q=q)
    progress = Progress()
    sent = SimpleNamespace(tasks=())
    for _ in range(rounds - 1):
        account_round(method, sent, progress)
        progress.round += 1
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    budget_stop(method, progress)
    line = account_round(method, sent, progress)
    profile.disable()
    return {
        "n_clients": n_clients,
        "rounds": rounds,
        "accounting_ms": 1e3 * (time.perf_counter() - t0),
        "calls": pstats.Stats(profile).total_calls,
        "epsilon_bytes": len(json.dumps(line["epsilon"])),
        "ledger_bytes": len(json.dumps(progress.privacy_ledger)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--participants", type=float, default=4.0, help="m: expected per round")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--accounting", action="store_true", help="the privacy accounting alone")
    p.add_argument("--one", nargs=2, metavar=("N", "PRIVATE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.accounting:
        for n in args.clients:
            r = measure_accounting(n, args.rounds, args.participants)
            print(
                f"N = {n:6d}, round {args.rounds}: accounting {r['accounting_ms']:8.1f} ms, "
                f"{r['calls']:8d} calls; metrics epsilon {r['epsilon_bytes']:7d} B, "
                f"ledger {r['ledger_bytes']:8d} B"
            )
        return 0
    if args.one:
        row = measure(int(args.one[0]), args.rounds, args.participants, args.one[1] == "1")
        print(json.dumps(row))
        return 0
    load = os.getloadavg()[0]
    print(f"rounds {args.rounds}, m = {args.participants:g} per round, load {load:.1f}")
    rows = []
    for n in args.clients:
        for private in (False, True):
            cmd = [sys.executable, __file__, "--one", str(n), str(int(private))]
            cmd += ["--rounds", str(args.rounds), "--participants", str(args.participants)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"N = {n:6d} {r['privacy']:7s}: setup {r['setup_s']:6.1f} s, round "
                f"{r['round_ms'] or 0:7.1f} ms (empty {r['empty_round_ms'] or 0:6.1f} ms), "
                f"{r['calls_per_round']:9.0f} calls/round, metrics line "
                f"{r['metrics_line_bytes']:7d} B, peak RSS {r['peak_rss_mb']:6.0f} MB"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
