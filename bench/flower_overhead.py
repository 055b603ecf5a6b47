"""Per-round overhead of Flower (loopback SuperLink + SuperNodes) vs fedlora's own engine.

Runs the same tiny configuration (tiny-llama, 2 clients, real data) twice: with
`fedlora.federation.run.run_experiment`, then on a loopback deployment started by
`fedlora.federation.flower.deploy.LocalDeployment`; compares the per-round wall time (`compute_s` of each
metrics line: local training + aggregation for the engine; message round trip, node-side
ClientApp process start, training and aggregation for Flower). By default each SuperNode
forwards to a persistent fedlora worker; `--no-workers` trains inside Flower's per-message
ClientApp processes (the model is rebuilt every round); `--simulation` uses Flower's Ray
simulation runtime instead of a deployment. Prints the figures and the load.

    FEDLORA_DATA=../shared/data/commonsense HF_HUB_OFFLINE=1 \\
        .venv/bin/python bench/flower_overhead.py --rounds 3 [--no-workers | --simulation]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

CONFIG = """
[model]
name = "tiny-llama"
dtype = "fp32"
threads = {threads}
[lora]
rank = 4
layers = "all"
[data]
data_dir = "{data}"
n_clients = 2
train_limit = 40
eval_limit = 8
tasks = ["arc-e"]
max_seq_len = 64
[training]
rounds = {rounds}
local_steps = {steps}
batch_size = 2
slots = 1
eval_every = 1000
seed = 3
[method]
q = "full"
k = "uniform"
"""


def _round_times(run_dir: Path) -> np.ndarray:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([x["compute_s"] for x in lines if x["round"] > 0])


def main() -> None:
    from fedlora.config import load_config
    from fedlora.federation.flower.deploy import LocalDeployment, wait_for_file
    from fedlora.federation.run import prepare_run_dir, run_experiment

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="local steps H")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", default=os.environ.get("FEDLORA_DATA", "../shared/data/commonsense"))
    p.add_argument(
        "--no-workers", action="store_true", help="no persistent node workers (Flower's default)"
    )
    p.add_argument(
        "--simulation",
        action="store_true",
        help="Flower's Ray simulation runtime (127.0.0.1) instead of a loopback deployment",
    )
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="fedlora-flower-bench-") as tmp:
        tmp_path = Path(tmp)
        cfg_path = tmp_path / "exp.toml"
        cfg_path.write_text(
            CONFIG.format(
                data=Path(args.data).resolve(),
                rounds=args.rounds,
                steps=args.steps,
                threads=args.threads,
            )
        )
        cfg = load_config(cfg_path)

        engine_dir = tmp_path / "engine"
        prepare_run_dir(cfg, engine_dir)
        t0 = time.perf_counter()
        run_experiment(cfg, engine_dir, quiet=True)
        engine_total = time.perf_counter() - t0
        engine = _round_times(engine_dir)

        flower_dir = tmp_path / "flower"
        t0 = time.perf_counter()
        if args.simulation:
            from fedlora.federation.flower.common import FlowerOptions
            from fedlora.federation.flower.simulation import run_simulation

            t_started = t0
            run_simulation(cfg, FlowerOptions(out_dir=str(flower_dir)), num_cpus=2)
        else:
            with LocalDeployment(2, tmp_path / "deploy", workers=not args.no_workers) as dep:
                t_started = time.perf_counter()
                dep.submit(REPO, {"fedlora-config": str(cfg_path), "out-dir": str(flower_dir)})
                wait_for_file(
                    flower_dir / "summary.json",
                    3600,
                    alive=[dep.superlink],
                    error=flower_dir / "error.txt",
                )
        flower_total = time.perf_counter() - t0
        flower = _round_times(flower_dir)

    load = os.getloadavg()
    runtime = "Ray simulation" if args.simulation else (
        "deployment, " + ("no node workers" if args.no_workers else "node workers")
    )  # fmt: skip
    print(f"config: tiny-llama, 2 clients, q=1, H={args.steps}, b=2, threads={args.threads}; "
          f"flower runtime: {runtime}")  # fmt: skip
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"engine  per round: mean {engine.mean():.2f} s (rounds: {np.round(engine, 2).tolist()})")
    print(f"flower  per round: mean {flower.mean():.2f} s (rounds: {np.round(flower, 2).tolist()})")
    print(f"overhead per round: {flower.mean() - engine.mean():.2f} s "
          f"({flower.mean() / max(engine.mean(), 1e-9):.0f}x)")  # fmt: skip
    print(f"whole run: engine {engine_total:.1f} s, flower {flower_total:.1f} s "
          f"(deployment start {t_started - t0:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
