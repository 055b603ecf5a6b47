"""Each method's aggregation error and bits per round on one fixed instance (no model is run).

    .venv/bin/python tools/method_table.py            # the table in docs/methods.md
    .venv/bin/python tools/method_table.py --layers 2 # a smaller adapter

The instance: SmolLM2-135M's adapter (q_proj 576→576 and v_proj 576→192 on the top `--layers`
of 30 layers), γ = 16, α = 32 (s = α/γ = 2), 16 bits per parameter, N = 4 clients with data
weights a = (0.4, 0.3, 0.2, 0.1), all taking part, rank budgets r = (16, 12, 8, 4) for the
rank-heterogeneous baselines (FSLoRA's k_n = r_n). The global adapter before the round: A
kaiming-uniform, B ~ N(0, 0.02²) (a LoRA some rounds into training; FedStackLoRA: its fresh
adapter, B = 0; Fed-SB: its own init with R ~ N(0, 0.02²)); each client moves every entry it trains (the factors its task trains, on its
active rank components) by N(0, 0.01²), seeded.

Error: ‖ΔW_global − Σ_n p_n ΔW_n‖_F over all modules (float64), with ΔW_n = s·B_n R_n
diag(scale_n) A_n the client's trained product, ΔW_global = s·B R A + the round's base merge,
and p_n the method's own normalised aggregation weights; relative: divided by ‖Σ p_n ΔW_n −
ΔW_before‖_F, the size of the round's update. Bits: the round's total over the 4 participants,
from each method's `payload` (what `fedlora.federation.clock` charges), in Mbit.
"""

from __future__ import annotations

import argparse

import numpy as np

from fedlora.federation.clientmemory import ClientMemory
from fedlora.federation.methods.fedavg import FedAvg
from fedlora.federation.methods.fedexlora import FedExLoRA
from fedlora.federation.methods.fedsalora import FedSALoRA
from fedlora.federation.methods.fedsb import FedSB
from fedlora.federation.methods.fedstacklora import FedStackLoRA
from fedlora.federation.methods.ffalora import FFALoRA
from fedlora.federation.methods.flexlora import FlexLoRA
from fedlora.federation.methods.fslora import FSLoRA
from fedlora.federation.methods.heterolora import HeteroLoRA
from fedlora.federation.methods.rolora import RoLoRA

GAMMA, ALPHA, BITS = 16, 32.0, 16
A_W = np.array([0.4, 0.3, 0.2, 0.1])
RANKS = np.array([16, 12, 8, 4])


def smollm2_shapes(layers: int) -> dict[str, tuple[int, int]]:
    return {
        **{f"model.layers.{i}.self_attn.q_proj": (576, 576) for i in range(30 - layers, 30)},
        **{f"model.layers.{i}.self_attn.v_proj": (192, 576) for i in range(30 - layers, 30)},
    }


def methods() -> dict[str, tuple[object, int]]:
    """label -> (method, round index planned)."""
    s = ALPHA / GAMMA
    kw = {"a": A_W, "gamma": GAMMA}
    return {
        "fedavg": (FedAvg(**kw), 0),
        "fslora (k_n = r_n)": (FSLoRA(k=RANKS, gamma=GAMMA), 0),
        "heterolora": (HeteroLoRA(**kw, ranks=RANKS), 0),
        "flexlora": (FlexLoRA(**kw, ranks=RANKS), 0),
        "fedstacklora": (FedStackLoRA(**kw, ranks=RANKS, scaling=s), 0),
        "ffalora": (FFALoRA(**kw), 0),
        "fedsalora": (FedSALoRA(**kw), 0),
        "fedexlora": (FedExLoRA(**kw, scaling=s), 0),
        "rolora (B round)": (RoLoRA(**kw), 0),
        "rolora (A round)": (RoLoRA(**kw), 1),
        "fedsb": (FedSB(**kw, seed=0), 0),
    }


def global_state(shapes: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for mod, (o, i) in shapes.items():
        out[f"{mod}.lora_A"] = rng.uniform(-1, 1, size=(GAMMA, i)) / np.sqrt(i)
        out[f"{mod}.lora_B"] = rng.normal(0, 0.02, size=(o, GAMMA))
    return out


def product(state: dict, mod: str, scale: np.ndarray) -> np.ndarray:
    b, a = state[f"{mod}.lora_B"], state[f"{mod}.lora_A"]
    r = state.get(f"{mod}.lora_R", np.eye(GAMMA))
    return (ALPHA / GAMMA) * (b @ r * scale[None, :]) @ a


def trained(g: dict, task, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A client's state after training: every entry it trains moved by N(0, 0.01²)."""
    active = np.asarray(task.scale) != 0
    out = {}
    for k, v in g.items():
        part = k[-1]
        move = np.zeros_like(v)
        if part in task.trains:
            if part == "A":
                move[active] = rng.normal(0, 0.01, size=v[active].shape)
            elif part == "B":
                move[:, active] = rng.normal(0, 0.01, size=v[:, active].shape)
            else:
                move = rng.normal(0, 0.01, size=v.shape)
        out[k] = v + move
    return out


def row(
    label: str, method, r: int, shapes: dict, seed: int
) -> tuple[str, float, float, float, float]:
    rng = np.random.default_rng(seed)
    g = global_state(shapes, rng)
    if isinstance(method, FedStackLoRA):  # every round starts from a fresh adapter (B = 0)
        g = {k: (np.zeros_like(v) if k.endswith("lora_B") else v) for k, v in g.items()}
    if isinstance(method, FedSB):
        g = method.initial_state(g)
        g = {k: (rng.normal(0, 0.02, v.shape) if k.endswith("lora_R") else v) for k, v in g.items()}
    plan = method.plan_round(r, np.random.default_rng(1), np.random.default_rng(2))
    states = [trained(g, t, rng) for t in plan.tasks]
    memory = ClientMemory(method.is_local, g)  # FedSA-LoRA: B stays on the client
    uploads = [memory.keep(t.client, s) for t, s in zip(plan.tasks, states)]
    agg = method.aggregate(g, plan, uploads)
    new = {**agg.global_state, **memory.mean(A_W)} if memory else agg.global_state
    p = np.array([t.weight for t in plan.tasks])
    p = p / p.sum()
    ones = np.ones(GAMMA)
    err2 = upd2 = 0.0
    for mod in shapes:
        target = sum(w * product(s, mod, t.scale) for w, s, t in zip(p, states, plan.tasks))
        got = product(new, mod, ones) + (agg.base_delta or {}).get(mod, 0.0)
        err2 += float(np.sum((got - target) ** 2))
        upd2 += float(np.sum((target - product(g, mod, ones)) ** 2))
    up = sum(method.payload(t, shapes, plan).uplink_params for t in plan.tasks) * BITS / 1e6
    down = sum(method.payload(t, shapes, plan).downlink_params for t in plan.tasks) * BITS / 1e6
    return label, np.sqrt(err2), np.sqrt(err2 / upd2), up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30, help="top layers with LoRA (SmolLM2: 30)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shapes = smollm2_shapes(args.layers)
    print(
        f"SmolLM2-135M q_proj+v_proj on {args.layers} layers, γ = {GAMMA}, α = {ALPHA:g}, "
        f"{BITS} bits/param, N = 4 (a = {A_W.tolist()}), all taking part, seed {args.seed}\n"
    )
    print("| method | ‖ΔW_global − Σ p_n ΔW_n‖_F | relative to the update | "
          "uplink Mbit/round | downlink Mbit/round |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for label, (method, r) in methods().items():
        _, err, rel, up, down = row(label, method, r, shapes, args.seed)
        print(f"| `{label}` | {err:.3g} | {rel:.3g} | {up:,.2f} | {down:,.2f} |")


if __name__ == "__main__":
    main()
