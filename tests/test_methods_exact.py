"""The aggregation rules published after FSLoRA, each tested on its defining property with
hand-checkable shapes: FFA-LoRA, FedEx-LoRA and Fed-SB are exact (the global ΔW equals
Σ p_n ΔW_n), FedSA-LoRA never uploads B, RoLoRA moves one factor per round, and every
method's payload is the hand count of what it sends."""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.federation.clientmemory import ClientMemory
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.fedexlora import FedExLoRA
from fedlora.federation.methods.fedsalora import FedSALoRA
from fedlora.federation.methods.fedsb import FedSB
from fedlora.federation.methods.ffalora import FFALoRA
from fedlora.federation.methods.rolora import RoLoRA

GAMMA = 2
SHAPES = {"m0": (6, 4), "m1": (3, 5)}  # module -> (out, in)
A_W = np.array([0.5, 0.3, 0.2])  # data weights of 3 clients


def _global(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for mod, (o, i) in SHAPES.items():
        out[f"{mod}.lora_A"] = rng.normal(size=(GAMMA, i))
        out[f"{mod}.lora_B"] = rng.normal(size=(o, GAMMA))
    return out


def _clients(g: dict, rng: np.random.Generator, moves: str) -> list[dict[str, np.ndarray]]:
    """Three client states from the global one, each moving the factors in `moves`."""
    states = []
    for _ in range(3):
        s = {k: v.copy() for k, v in g.items()}
        for k in s:
            if k[-1] in moves:
                s[k] = s[k] + rng.normal(size=s[k].shape)
        states.append(s)
    return states


def _plan(method, r=0) -> RoundPlan:
    return method.plan_round(r, np.random.default_rng(0), np.random.default_rng(1))


def _product(state: dict, mod: str) -> np.ndarray:
    b, a = state[f"{mod}.lora_B"], state[f"{mod}.lora_A"]
    r = state.get(f"{mod}.lora_R", np.eye(GAMMA))
    return b @ r @ a


def _mean_product(states: list[dict], mod: str) -> np.ndarray:
    return sum(w * _product(s, mod) for w, s in zip(A_W, states))


def test_ffalora_trains_b_only_and_its_average_is_exact():
    rng = np.random.default_rng(0)
    g = _global(rng)
    method = FFALoRA(a=A_W, gamma=GAMMA)
    plan = _plan(method)
    assert [t.trains for t in plan.tasks] == ["B"] * 3
    states = _clients(g, rng, "B")
    agg = method.aggregate(g, plan, states)
    for mod in SHAPES:
        np.testing.assert_array_equal(agg.global_state[f"{mod}.lora_A"], g[f"{mod}.lora_A"])
        np.testing.assert_allclose(
            _product(agg.global_state, mod), _mean_product(states, mod), rtol=0, atol=1e-12
        )
    # payload: B only, Σ out·γ = (6 + 3)·2 = 18, up and down
    p = method.payload(plan.tasks[0], SHAPES, plan)
    assert (p.uplink_params, p.downlink_params) == (18, 18)


def test_fedexlora_folds_the_residual_into_the_base_exactly():
    rng = np.random.default_rng(1)
    g = _global(rng)
    scaling = 0.75
    method = FedExLoRA(a=A_W, gamma=GAMMA, scaling=scaling)
    plan = _plan(method)
    states = _clients(g, rng, "AB")
    agg = method.aggregate(g, plan, states)
    for mod in SHAPES:
        b_bar = sum(w * s[f"{mod}.lora_B"] for w, s in zip(A_W, states))
        np.testing.assert_allclose(agg.global_state[f"{mod}.lora_B"], b_bar, atol=1e-12)
        # the new global ΔW (adapter + this round's residual, minus the old adapter's)
        got = scaling * _product(agg.global_state, mod) + agg.base_delta[mod]
        np.testing.assert_allclose(got, scaling * _mean_product(states, mod), atol=1e-12)
        assert np.linalg.norm(agg.base_delta[mod]) > 1e-3  # FedAvg's cross terms are real
    # payload: up γ(out+in) = 2·(10 + 8) = 36; down that + out·in = 36 + 24 + 15 = 75
    p = method.payload(plan.tasks[0], SHAPES, plan)
    assert (p.uplink_params, p.downlink_params) == (36, 75)


def test_fedsb_averages_r_exactly_and_sends_only_r():
    rng = np.random.default_rng(2)
    method = FedSB(a=A_W, gamma=GAMMA, seed=3)
    g = method.initial_state(_global(rng))
    for mod in SHAPES:
        b, a = g[f"{mod}.lora_B"], g[f"{mod}.lora_A"]
        np.testing.assert_allclose(b.T @ b, np.eye(GAMMA), atol=1e-12)  # orthonormal columns
        np.testing.assert_allclose(a @ a.T, np.eye(GAMMA), atol=1e-12)  # orthonormal rows
        np.testing.assert_array_equal(g[f"{mod}.lora_R"], np.zeros((GAMMA, GAMMA)))
    plan = _plan(method)
    assert {t.trains for t in plan.tasks} == {"R"}
    states = _clients(g, rng, "R")
    agg = method.aggregate(g, plan, states)
    for mod in SHAPES:
        for part in ("A", "B"):
            key = f"{mod}.lora_{part}"
            np.testing.assert_array_equal(agg.global_state[key], g[key])
        np.testing.assert_allclose(
            _product(agg.global_state, mod), _mean_product(states, mod), atol=1e-12
        )
    # payload: γ² per module, 2 modules: 8 up, 8 down, whatever the layer sizes
    p = method.payload(plan.tasks[0], SHAPES, plan)
    assert (p.uplink_params, p.downlink_params) == (8, 8)
    assert method.payload(plan.tasks[0], {"x": (1000, 1000)}, plan).uplink_params == 4


def test_fedsalora_never_uploads_b_and_averages_a():
    rng = np.random.default_rng(3)
    g = _global(rng)
    method = FedSALoRA(a=A_W, gamma=GAMMA)
    memory = ClientMemory(method.is_local, g)
    plan = _plan(method)
    trained = _clients(g, rng, "AB")
    uploads = [memory.keep(t.client, s) for t, s in zip(plan.tasks, trained)]
    assert all(not any(k.endswith(".lora_B") for k in u) for u in uploads)
    agg = method.aggregate(g, plan, uploads)  # the server has no B to read
    for mod in SHAPES:
        a_bar = sum(w * s[f"{mod}.lora_A"] for w, s in zip(A_W, trained))
        np.testing.assert_allclose(agg.global_state[f"{mod}.lora_A"], a_bar, atol=1e-12)
        np.testing.assert_array_equal(agg.global_state[f"{mod}.lora_B"], g[f"{mod}.lora_B"])
    # each client gets its own B back next time; one that never trained gets the init
    for t, s in zip(plan.tasks, trained):
        for mod in SHAPES:
            key = f"{mod}.lora_B"
            np.testing.assert_array_equal(memory.restore(t.client)[key], s[key])
    np.testing.assert_array_equal(memory.restore(7)["m0.lora_B"], g["m0.lora_B"])
    # the evaluation view Σ a_n B_n, and the memory survives its checkpoint form
    view = memory.mean(A_W)
    np.testing.assert_allclose(
        view["m1.lora_B"], sum(w * s["m1.lora_B"] for w, s in zip(A_W, trained)), atol=1e-12
    )
    again = ClientMemory(method.is_local, g)
    again.load_state_dict(memory.state_dict())
    np.testing.assert_array_equal(again.mean(A_W)["m1.lora_B"], view["m1.lora_B"])
    # payload: A only, Σ γ·in = 2·(4 + 5) = 18
    p = method.payload(plan.tasks[0], SHAPES, plan)
    assert (p.uplink_params, p.downlink_params) == (18, 18)


@pytest.mark.parametrize("r, factor", [(0, "B"), (1, "A"), (2, "B"), (5, "A")])
def test_rolora_moves_one_factor_per_round(r, factor):
    rng = np.random.default_rng(4 + r)
    g = _global(rng)
    method = RoLoRA(a=A_W, gamma=GAMMA)
    plan = _plan(method, r)
    assert {t.trains for t in plan.tasks} == {factor}
    states = _clients(g, rng, factor)
    agg = method.aggregate(g, plan, states)
    frozen = "A" if factor == "B" else "B"
    for mod in SHAPES:
        key = f"{mod}.lora_{frozen}"
        np.testing.assert_array_equal(agg.global_state[key], g[key])
        np.testing.assert_allclose(  # one factor moved: the average is exact
            _product(agg.global_state, mod), _mean_product(states, mod), atol=1e-12
        )
    # payload: up the trained factor (B: 18, A: 18 — Σ out·γ = 18, Σ γ·in = 18), down both
    p = method.payload(plan.tasks[0], SHAPES, plan)
    assert p.uplink_params == 18 and p.downlink_params == 36
    assert method.payload(plan.tasks[0], {"x": (7, 3)}, plan).uplink_params == (
        14 if factor == "B" else 6
    )


def test_partial_participation_weights_and_empty_rounds():
    method = FFALoRA(a=A_W, gamma=GAMMA, clients_per_round=2)
    plan = _plan(method)
    assert len(plan.tasks) == 2
    g = _global(np.random.default_rng(5))
    assert method.aggregate(g, RoundPlan(0, ()), []).global_state == g
    task = ClientTask(0, np.ones(GAMMA), GAMMA, 1.0)
    assert task.trains == "AB"  # the default: both factors


@pytest.mark.parametrize("rslora, want", [(False, 32.0 / 16), (True, 32.0 / 4)])
def test_fedexlora_folds_with_the_forward_factor_of_the_run(rslora, want):
    from fedlora.config import load_config
    from fedlora.federation.methods import make_method

    cfg = load_config(None, ["method.name=fedexlora", "lora.rank=16", "lora.alpha=32",
                             f"lora.rslora={str(rslora).lower()}", "data.n_clients=3"])  # fmt: skip
    method = make_method(cfg, A_W, np.random.default_rng(0))
    assert method.scaling == want
