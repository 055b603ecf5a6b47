"""Per-round bits and seconds of every method in one shared setting (no model is run).

    .venv/bin/python tools/baseline_costs.py                       # paper_table1, 200 rounds
    .venv/bin/python tools/baseline_costs.py --config configs/cpu_table1.toml --rounds 50

The setting is the table1 suite file's: its clients (generated profiles of seed 0), clients per
round, rank budgets, cost models and downlink rate; the adapter is SmolLM2-135M's (q_proj
576→576 and v_proj 576→192 on 30 layers) unless --layers says otherwise. Every method plans
`--rounds` rounds with the engine's derived generators and is charged by
`fedlora.federation.clock.round_cost`, exactly as in a run. Printed per round (mean over the rounds): participants, Σ rank used,
uplink and downlink Mbit (totals over the participants), the broadcast seconds and the round
seconds, and the seconds with the downlink free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from fedlora.config.experiment import ExperimentConfig
from fedlora.federation.clock import round_cost
from fedlora.federation.methods import make_method
from fedlora.federation.profiles import build_profiles
from fedlora.studies.experiments import load_suite
from fedlora.system.seeding import derive_rng

METHODS = {  # label -> overrides of the suite's config
    "fedavg": ("method.name=fedavg",),
    "fslora (k ~ U[4, γ])": ("method.name=fslora",),
    "fslora (k = ranks)": ("method.name=fslora", "method.fslora.k=ranks"),
    "heterolora": ("method.name=heterolora",),
    "flexlora": ("method.name=flexlora",),
    "fedstacklora": ("method.name=fedstacklora",),
    "sketched (q = 0.2, k uniform)": ("method.name=sketched", "method.q=fixed", "method.k=uniform"),
}


def _cost_fields(cfg: ExperimentConfig) -> dict:
    """`round_cost`'s config fields (it takes the fields, not the whole config)."""
    return {"net": cfg.network, "gamma": cfg.lora.rank, "seed": cfg.training.seed}


def smollm2_shapes(layers: int) -> dict[str, tuple[int, int]]:
    return {
        **{f"model.layers.{i}.self_attn.q_proj": (576, 576) for i in range(30 - layers, 30)},
        **{f"model.layers.{i}.self_attn.v_proj": (192, 576) for i in range(30 - layers, 30)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/paper_table1.toml")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--layers", type=int, default=30, help="top layers with LoRA (SmolLM2: 30)")
    args = ap.parse_args()
    from fedlora.config import config_from_dict, parse_override, set_override

    suite = load_suite("table1", args.config)
    shapes = smollm2_shapes(args.layers)
    base = suite.config_for("fslora", 0)
    net = base.network
    print(
        f"{args.config}: N = {base.data.n_clients}, m = {base.method.clients_per_round}, "
        f"γ = {base.lora.rank}, {net.bits_per_param} bits/param, comm {net.comm_cost}, "
        f"comp {net.comp_cost}, downlink {net.downlink_rate_bps / 1e6:g} Mbit/s, "
        f"{args.rounds} rounds; load average {os.getloadavg()[0]:.2f}"
    )
    header = ("method", "n", "Σk", "up Mbit", "down Mbit", "dl s", "round s", "free-dl s")
    print(f"{header[0]:<32}" + "".join(f"{h:>11}" for h in header[1:]))
    for label, overrides in METHODS.items():
        raw = {s: dict(v) for s, v in suite.raw.items()}
        for text in (*overrides, "training.seed=0"):
            section, key, value = parse_override(text)
            set_override(raw, section, key, value, source=label)
        cfg = config_from_dict(raw, source=label)
        free = cfg.replace(network=dataclasses.replace(cfg.network, downlink_rate_bps=0.0))
        full_bits = cfg.lora.rank * sum(o + i for o, i in shapes.values()) * net.bits_per_param
        profiles = build_profiles(cfg, full_bits)
        a = np.full(cfg.data.n_clients, 1.0 / cfg.data.n_clients)
        method = make_method(cfg, a, derive_rng(0, "strategy"), tau_full_s=profiles.tau_full_s)
        rows = []
        for r in range(args.rounds):
            plan = method.plan_round(r, derive_rng(0, "sampling", r), derive_rng(0, "sketch", r))
            paid = round_cost(profiles, plan, method, shapes, r, **_cost_fields(cfg))
            unpaid = round_cost(profiles, plan, method, shapes, r, **_cost_fields(free))
            rank = sum(t.rank_used for t in plan.tasks)
            rows.append((len(plan.tasks), rank, paid.uplink_bits / 1e6, paid.downlink_bits / 1e6,
                         paid.downlink_s, paid.round_time_s, unpaid.round_time_s))  # fmt: skip
        mean = np.mean(rows, axis=0)
        print(f"{label:<32}" + "".join(f"{x:>11.2f}" for x in mean))


if __name__ == "__main__":
    main()
