"""Methods `sketched` and `fedavg`, q/k strategies, and the engine's round cost accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_allclose

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.clock import round_cost
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import ClientTask, RoundPlan, sketch_payload_params
from fedlora.federation.methods.fedavg import FedAvg
from fedlora.federation.methods.sketched import Sketched
from fedlora.federation.methods.strategies import resolve_k, resolve_q
from fedlora.system.network import ClientProfiles, allocate_bandwidth
from fedlora.system.seeding import derive_rng

SHAPES = {"m.q_proj": (3, 2), "m.v_proj": (1, 2)}  # (out, in)


def _adapter(value_a: float, value_b: float, gamma: int = 2) -> dict[str, np.ndarray]:
    return {
        f"{name}.lora_{part}": np.full(
            (gamma, inp) if part == "A" else (out, gamma),
            value_a if part == "A" else value_b,
            dtype=np.float32,
        )
        for name, (out, inp) in SHAPES.items()
        for part in "AB"
    }


# ----------------------------------------------------------------------------- sketched


def test_sketched_aggregate_hand_computed():
    # Prepare: global X = 1, two participants with a = (0.25, 0.75), q = (0.5, 1.0)
    method = Sketched(a=np.array([0.25, 0.75]), q=np.array([0.5, 1.0]), k=np.array([2, 2]), gamma=2)
    plan = RoundPlan(
        0,
        (
            ClientTask(0, np.ones(2), 2, 0.25 / 0.5),
            ClientTask(1, np.ones(2), 2, 0.75 / 1.0),
        ),
    )
    # Execute: X ← X − 0.5 (X − 3) − 0.75 (X − 5) = 1 + 1 + 3 = 5
    out = method.aggregate(_adapter(1.0, 1.0), plan, [_adapter(3.0, 3.0), _adapter(5.0, 5.0)])
    # Assert
    for value in out.global_state.values():
        assert_allclose(value, 5.0)
    assert out.base_delta is None


def test_sketched_plan_uses_q_and_k():
    # Prepare
    gamma = 8
    method = Sketched(
        a=np.full(4, 0.25), q=np.array([1.0, 1.0, 1e-9, 1.0]), k=np.array([1, 4, 8, 8]), gamma=gamma
    )
    # Execute
    plan = method.plan_round(3, np.random.default_rng(0), np.random.default_rng(1))
    # Assert: client 2 (q ≈ 0) is out; each scale has k non-zeros of value γ/k; weight a/q
    assert plan.round == 3 and plan.participants == [0, 1, 3]
    for task, k in zip(plan.tasks, (1, 4, 8)):
        assert task.rank_used == k
        assert np.count_nonzero(task.scale) == k
        assert_allclose(task.scale[task.scale != 0], gamma / k)
        assert task.weight == pytest.approx(0.25)


def test_sketched_round_without_participants():
    method = Sketched(
        a=np.array([0.5, 0.5]), q=np.array([1e-12, 1e-12]), k=np.array([1, 1]), gamma=2
    )
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    assert plan.tasks == ()
    out = method.aggregate(_adapter(1.0, 2.0), plan, [])
    assert_allclose(out.global_state["m.q_proj.lora_B"], 2.0)


def test_sketched_unbiased_over_rounds_monte_carlo():
    # E[X⁺] = Σ a_n X_n with real sketch draws: client n's update only touches its sketch;
    # with X_n = X + δ_n·S_n-masked, E[X⁺] = X + Σ a_n δ_n (k_n/γ) on every component.
    gamma = 4
    a = np.array([0.2, 0.3, 0.5])
    q = np.array([0.3, 0.6, 0.9])
    k = np.array([1, 2, 4])
    delta = np.array([1.0, -2.0, 0.5])
    method = Sketched(a=a, q=q, k=k, gamma=gamma)
    x0 = {"w": np.zeros(gamma)}
    trials = 40_000
    rng_s, rng_k = np.random.default_rng(7), np.random.default_rng(8)
    samples = np.empty((trials, gamma))
    for i in range(trials):
        plan = method.plan_round(i, rng_s, rng_k)
        clients = [{"w": (t.scale != 0) * delta[t.client]} for t in plan.tasks]
        samples[i] = method.aggregate(x0, plan, clients).global_state["w"]
    expected = np.full(gamma, np.sum(a * delta * k / gamma))
    se = samples.std(axis=0) / np.sqrt(trials)
    assert np.all(np.abs(samples.mean(axis=0) - expected) < 4 * se)


# ----------------------------------------------------------------------------- fedavg


def test_fedavg_normalised_weighted_mean():
    # Prepare: participants 0 and 2 with a = 0.1 and 0.3 → weights 0.25, 0.75
    method = FedAvg(a=np.array([0.1, 0.6, 0.3]), gamma=2, clients_per_round=2)
    plan = RoundPlan(0, (ClientTask(0, np.ones(2), 2, 0.1), ClientTask(2, np.ones(2), 2, 0.3)))
    # Execute
    out = method.aggregate(_adapter(0.0, 0.0), plan, [_adapter(4.0, 8.0), _adapter(8.0, 0.0)])
    # Assert: A = 0.25·4 + 0.75·8 = 7, B = 0.25·8 + 0 = 2
    assert_allclose(out.global_state["m.q_proj.lora_A"], 7.0)
    assert_allclose(out.global_state["m.v_proj.lora_B"], 2.0)


def test_fedavg_samples_fixed_number_uniformly():
    method = FedAvg(a=np.full(10, 0.1), gamma=4, clients_per_round=3)
    counts = np.zeros(10)
    rng = np.random.default_rng(0)
    for r in range(3000):
        plan = method.plan_round(r, rng, rng)
        assert len(plan.tasks) == 3 and len(set(plan.participants)) == 3
        counts[plan.participants] += 1
    # each client is in with probability 3/10: 900 ± 4σ (σ = √(3000·0.3·0.7) ≈ 25)
    assert np.all(np.abs(counts - 900) < 4 * 25.1)
    everyone = FedAvg(a=np.full(5, 0.2), gamma=4).plan_round(0, rng, rng)
    assert everyone.participants == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------- strategies


def test_q_strategies():
    a = np.array([0.1, 0.2, 0.7])
    assert_allclose(resolve_q("full", a=a), 1.0)
    assert_allclose(resolve_q("fixed", a=a, q_fixed=0.2), 0.2)
    assert_allclose(resolve_q("uniform", a=a), 1 / 3)
    assert_allclose(resolve_q("weighted", a=a), a)
    assert_allclose(resolve_q((0.5, 0.25, 1.0), a=a), [0.5, 0.25, 1.0])


def test_k_strategies_in_range_and_seeded():
    for name in ("normal", "uniform"):
        k1 = resolve_k(name, n=500, gamma=16, rng=np.random.default_rng(3))
        k2 = resolve_k(name, n=500, gamma=16, rng=np.random.default_rng(3))
        assert np.array_equal(k1, k2)
        assert k1.min() >= 1 and k1.max() <= 16
    assert np.all(resolve_k("full", n=3, gamma=8, rng=np.random.default_rng(0)) == 8)
    normal = resolve_k("normal", n=20_000, gamma=16, rng=np.random.default_rng(1))
    assert abs(normal.mean() - 8.0) < 0.3  # symmetric about γ/2 (truncation is symmetric too)


def test_strategy_files(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps({"q": [0.5, 1.0]}))
    (tmp_path / "k.csv").write_text("client,k\n0,3\n1,4\n")
    a = np.array([0.5, 0.5])
    assert_allclose(resolve_q(str(tmp_path / "q.json"), a=a), [0.5, 1.0])
    k = resolve_k(str(tmp_path / "k.csv"), n=2, gamma=4, rng=np.random.default_rng(0))
    assert k.tolist() == [3, 4]


@pytest.mark.parametrize(
    "spec, match",
    [
        ((0.5, 1.5), r"method\.q\[1\] = 1\.5"),
        ((0.5,), r"one value per client"),
        ("missing.json", r"cannot read"),
    ],
)
def test_q_bad_inputs(spec, match):
    with pytest.raises(ConfigError, match=match):
        resolve_q(spec, a=np.array([0.5, 0.5]))


@pytest.mark.parametrize("spec, match", [((0, 2), r"method\.k\[0\] = 0"), ((1, 9), r"1\.\.8")])
def test_k_bad_inputs(spec, match):
    with pytest.raises(ConfigError, match=match):
        resolve_k(spec, n=2, gamma=8, rng=np.random.default_rng(0))


def test_make_method_checks_lengths_via_config():
    with pytest.raises(ConfigError, match="method.q"):
        load_config(None, ["data.n_clients=3", "method.q=[0.5, 0.5]"])
    cfg = load_config(None, ["data.n_clients=2", "method.q=[0.5, 0.25]", "method.k=[4, 8]"])
    method = make_method(cfg, np.array([0.5, 0.5]), np.random.default_rng(0))
    assert isinstance(method, Sketched)
    assert method.k.tolist() == [4, 8] and method.q.tolist() == [0.5, 0.25]


# ----------------------------------------------------------------------------- round cost


def _profiles(tau, t_full):
    n = len(tau)
    nan = np.full(n, np.nan)
    return ClientProfiles(np.asarray(tau, float), np.asarray(t_full, float), nan, nan, nan, nan)


def test_payload_params_formula():
    # k (Σ out + in) = 3 · ((3 + 2) + (1 + 2)) = 24
    assert sketch_payload_params(3, SHAPES) == 24


def _cost_fields(cfg):
    """`round_cost`'s config fields (it takes the fields, not the whole config)."""
    return {"net": cfg.network, "gamma": cfg.lora.rank, "seed": cfg.training.seed}


@pytest.mark.parametrize("comm_cost", ["exact", "linear", "quadratic"])
def test_round_cost_matches_hand_computation(comm_cost):
    # Prepare: γ = 4, two participants with k = 1 and 4; comp_cost linear
    cfg = load_config(
        None,
        [
            "lora.rank=4",
            "data.n_clients=2",
            "network.bits_per_param=16",
            "network.f_tot_hz=10.0",
            "network.comp_cost=linear",
            f"network.comm_cost={comm_cost}",
        ],
    )
    method = Sketched(a=np.array([0.5, 0.5]), q=np.array([1.0, 1.0]), k=np.array([1, 4]), gamma=4)
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    profiles = _profiles([2.0, 4.0], [80.0, 40.0])
    # Execute
    cost = round_cost(profiles, plan, method, SHAPES, 0, **_cost_fields(cfg))
    # Assert: full adapter = 4 · 8 params · 16 bits = 512 bits; client 0 sends 1/4 of it
    assert cost.uplink_bits == (8 + 32) * 16
    ratio0 = {"exact": 0.25, "linear": 0.25, "quadratic": 1 / 16}[comm_cost]
    tau = np.array([2.0 * 0.25, 4.0])
    t = np.array([80.0 * ratio0, 40.0])
    expected_time, _ = allocate_bandwidth(tau, t, 10.0)
    assert cost.round_time_s == pytest.approx(expected_time, rel=1e-12)
    assert sum(cost.bandwidth_hz) == pytest.approx(10.0)


def test_round_cost_empty_round_is_free():
    cfg = load_config(None, ["data.n_clients=2"])
    method = Sketched(a=np.array([0.5, 0.5]), q=np.array([1.0, 1.0]), k=np.array([1, 1]), gamma=16)
    cost = round_cost(
        _profiles([1, 1], [1, 1]), RoundPlan(0, ()), method, SHAPES, 0, **_cost_fields(cfg)
    )
    assert (cost.round_time_s, cost.uplink_bits, cost.downlink_bits) == (0.0, 0, 0)


def test_round_cost_downlink_broadcast_time():
    cfg = load_config(None, ["lora.rank=4", "data.n_clients=1", "network.downlink_rate_bps=64.0"])
    method = Sketched(a=np.array([1.0]), q=np.array([1.0]), k=np.array([4]), gamma=4)
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    with_dl = round_cost(_profiles([1.0], [0.0]), plan, method, SHAPES, 0, **_cost_fields(cfg))
    # 32 params · 16 bits = 512 bits at 64 bit/s = 8 s, plus τ = 1 s, upload free (t = 0)
    assert with_dl.round_time_s == pytest.approx(9.0)
    assert with_dl.downlink_s == pytest.approx(8.0)  # recorded per round (re-clocking)


def test_derived_streams_are_independent_and_reproducible():
    a = derive_rng(0, "sampling", 3).random(4)
    b = derive_rng(0, "sampling", 3).random(4)
    c = derive_rng(0, "sketch", 3).random(4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_q_and_k_are_checked_once_at_construction_never_per_round(monkeypatch):
    """The walk of method.q goes one way: checked where the method is built
    (`strategies.resolve_q` / `resolve_k`), trusted by `plan_round` every round."""
    import fedlora.federation.methods.strategies as strategies
    import fedlora.system.sketch as sketch

    calls = {"q": 0, "k": 0}

    def counting(name, real):
        def check(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return check

    for mod in (strategies, sketch):
        monkeypatch.setattr(mod, "check_q", counting("q", sketch.check_q))
        monkeypatch.setattr(mod, "check_k", counting("k", sketch.check_k))
    cfg = load_config(
        None, ["data.n_clients=3", "lora.rank=4", "method.q=[0.5, 1.0, 0.25]", "method.k=[1, 4, 2]"]
    )
    method = make_method(cfg, np.full(3, 1 / 3), np.random.default_rng(0))
    assert calls == {"q": 1, "k": 1}
    tasks = 0
    for r in range(20):
        plan = method.plan_round(r, derive_rng(0, "sampling", r), derive_rng(0, "sketch", r))
        tasks += len(plan.tasks)
    assert tasks > 0 and calls == {"q": 1, "k": 1}
