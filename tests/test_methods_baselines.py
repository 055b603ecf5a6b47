"""The baselines (FSLoRA, HeteroLoRA, FedStackLoRA, FlexLoRA) and the rank budgets.

Aggregations are checked on tiny tensors against values computed by hand (in the comments),
FlexLoRA against numpy's SVD, payloads against their formulas. No torch needed.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods import make_method
from fedlora.federation.methods.base import ClientTask, RoundPlan, sketch_payload_params
from fedlora.federation.methods.fedstacklora import FedStackLoRA, fresh_adapter
from fedlora.federation.methods.flexlora import FlexLoRA, truncated_svd_factors
from fedlora.federation.methods.fslora import FSLoRA
from fedlora.federation.methods.heterolora import HeteroLoRA
from fedlora.federation.methods.ranks import capability_ranks, resolve_ranks
from fedlora.federation.methods.registry import check_method_config

SMOL_SHAPES = {  # SmolLM2-135M, q and v on 30 layers: q (576→576), v (576→192)
    **{f"layers.{i}.q_proj": (576, 576) for i in range(30)},
    **{f"layers.{i}.v_proj": (192, 576) for i in range(30)},
}


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _state(a: list, b: list, name: str = "m") -> dict[str, np.ndarray]:
    return {f"{name}.lora_A": np.array(a, dtype=float), f"{name}.lora_B": np.array(b, dtype=float)}


def _task(client: int, scale: list, weight: float) -> ClientTask:
    s = np.array(scale, dtype=float)
    return ClientTask(client, s, int(np.count_nonzero(s)), weight)


# ----------------------------------------------------------------------------- rank budgets


def test_capability_ranks_are_proportional_to_speed():
    # Prepare: τ_min = 0.5 → ratios 0.5, 0.25, 0.125, 1 of γ = 8
    tau = [1.0, 2.0, 4.0, 0.5]
    # Execute
    ranks = capability_ranks(tau, 8)
    # Assert
    assert ranks.tolist() == [4, 2, 1, 8]


def test_capability_ranks_round_up_and_stay_in_1_to_gamma():
    # ⌈4·1/3⌉ = 2, ⌈4·1/100⌉ = 1 (never 0), τ = 0 is the fastest possible device → γ
    assert capability_ranks([1.0, 3.0, 100.0, 0.0], 4).tolist() == [4, 2, 1, 4]
    assert capability_ranks([0.0, 0.0], 5).tolist() == [5, 5]
    assert capability_ranks([2.0, 2.0, 2.0], 16).tolist() == [16, 16, 16]


@pytest.mark.parametrize("tau", [[1.0, -1.0], [np.nan, 1.0], [np.inf]])
def test_capability_ranks_reject_bad_times(tau):
    with pytest.raises(ConfigError, match=r"tau_full_s\[\d\].*finite and >= 0"):
        capability_ranks(tau, 4)


def test_resolve_ranks_capability_needs_the_profiles():
    with pytest.raises(ConfigError, match="method.ranks.*capability needs the client profiles"):
        resolve_ranks("capability", n=3, gamma=4, rng=_rng())
    with pytest.raises(ConfigError, match="method.ranks.*profiles have 2 clients.*= 3"):
        resolve_ranks("capability", n=3, gamma=4, rng=_rng(), tau_full_s=np.ones(2))


def test_resolve_ranks_strategies_lists_and_errors():
    assert resolve_ranks("full", n=3, gamma=4, rng=_rng()).tolist() == [4, 4, 4]
    assert resolve_ranks([1, 2, 4], n=3, gamma=4, rng=_rng()).tolist() == [1, 2, 4]
    drawn = resolve_ranks("uniform", n=50, gamma=4, rng=_rng(1))
    assert drawn.min() >= 1 and drawn.max() <= 4
    with pytest.raises(ConfigError, match=r"method.ranks\[1\] = 5.*1\.\.γ = 1\.\.4"):
        resolve_ranks([1, 5, 2], n=3, gamma=4, rng=_rng())
    with pytest.raises(ConfigError, match="method.ranks.*one value per client"):
        resolve_ranks([1, 2], n=3, gamma=4, rng=_rng())
    with pytest.raises(ConfigError, match="method.ranks = 'fast'.*capability"):
        resolve_ranks("fast", n=3, gamma=4, rng=_rng())


def test_resolve_ranks_reads_a_json_file(tmp_path):
    path = tmp_path / "ranks.json"
    path.write_text('{"k": [2, 3]}')
    assert resolve_ranks(str(path), n=2, gamma=4, rng=_rng()).tolist() == [2, 3]


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ('method.ranks="fast"', r"method.ranks = 'fast' is invalid.*capability"),
        ("method.ranks=[1, 0, 2]", r"method.ranks\[1\] = 0 is invalid.*>= 1"),
        ("method.ranks=[1, 2]", r"method.ranks.*one entry per client: data.n_clients = 3, got 2"),
        ("method.ranks=[1, 2, 17]", r"method.ranks.*every r_n must be in 1..lora.rank = 16"),
    ],
)
def test_config_rejects_bad_ranks(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["data.n_clients=3", override])


def test_config_ranks_default_and_list_round_trip():
    assert load_config().method.ranks == "capability"
    assert load_config(None, ["data.n_clients=2", "method.ranks=[3, 5]"]).method.ranks == (3, 5)


# ----------------------------------------------------------------------------- FSLoRA


def test_fslora_plan_samples_m_clients_with_scaled_sketches():
    # Prepare: N = 5 clients, m = 2 per round, k = budgets, γ = 4
    method = FSLoRA(k=np.array([1, 2, 4, 2, 1]), gamma=4, clients_per_round=2)
    # Execute
    plan = method.plan_round(0, _rng(3), _rng(4))
    # Assert: 2 distinct sorted clients, weight 1/m, k_n non-zeros of value γ/k_n
    assert len(plan.tasks) == 2 and plan.participants == sorted(set(plan.participants))
    for t in plan.tasks:
        k = method.k[t.client]
        assert t.weight == 0.5 and t.rank_used == k
        assert np.count_nonzero(t.scale) == k
        assert np.allclose(t.scale[t.scale != 0], 4 / k)


def test_fslora_samples_every_client_equally_often():
    # uniform without replacement: each client is in a round with probability m/N = 2/5
    method = FSLoRA(k=np.full(5, 2), gamma=4, clients_per_round=2)
    counts = np.zeros(5)
    rounds = 4000
    for r in range(rounds):
        counts[method.plan_round(r, _rng(r), _rng(r + 10**6)).participants] += 1
    se = np.sqrt(rounds * 0.4 * 0.6)
    assert np.all(np.abs(counts - rounds * 0.4) < 4 * se)


def test_fslora_averages_updates_over_all_participants():
    # Prepare: γ = 2, A rows [1, 1], [2, 2]; client 0 sketched index 0 and moved A row 0 to
    # [3, 3]; client 1 sketched index 1 and moved A row 1 to [4, 4] (B likewise for columns).
    method = FSLoRA(k=np.array([1, 1]), gamma=2)
    global_state = _state([[1, 1], [2, 2]], [[1, 2]])
    c0 = _state([[3, 3], [2, 2]], [[5, 2]])
    c1 = _state([[1, 1], [4, 4]], [[1, 0]])
    plan = RoundPlan(0, (_task(0, [2, 0], 0.5), _task(1, [0, 2], 0.5)))
    # Execute
    out = method.aggregate(global_state, plan, [c0, c1]).global_state
    # Assert: X + (1/2)Σ(X_n − X): row 0 = 1 + (2 + 0)/2 = 2, row 1 = 2 + (0 + 2)/2 = 3
    # (dividing by the number of clients that touched a component would give 3 and 4)
    assert np.allclose(out["m.lora_A"], [[2, 2], [3, 3]])
    # B: column 0 = 1 + (4 + 0)/2 = 3, column 1 = 2 + (0 − 2)/2 = 1
    assert np.allclose(out["m.lora_B"], [[3, 1]])


def test_fslora_payload_is_k_components_up_and_down():
    method = FSLoRA(k=np.array([3]), gamma=8)
    plan = method.plan_round(0, _rng(), _rng())
    p = method.payload(plan.tasks[0], {"q": (576, 576), "v": (192, 576)}, plan)
    assert p.uplink_params == p.downlink_params == 3 * (1152 + 768)


# ----------------------------------------------------------------------------- HeteroLoRA


def test_heterolora_plan_truncates_to_the_rank_budget():
    method = HeteroLoRA(a=np.array([0.2, 0.8]), ranks=np.array([1, 3]), gamma=3)
    plan = method.plan_round(0, _rng(), _rng())
    assert plan.participants == [0, 1]
    # scale γ/r_n on the first r_n: the client's forward factor is α/r_n (HetLoRA)
    assert plan.tasks[0].scale.tolist() == [3, 0, 0] and plan.tasks[0].rank_used == 1
    assert plan.tasks[1].scale.tolist() == [1, 1, 1] and plan.tasks[1].weight == 0.8


def test_heterolora_zero_pads_the_updates_and_averages_with_data_weights():
    # Prepare: γ = 3, client 0 has rank 1 (its rows/columns 1, 2 are the untouched global
    # values 1), client 1 rank 3; data weights 1 and 3 → p = 0.25, 0.75.
    method = HeteroLoRA(a=np.array([1.0, 3.0]), ranks=np.array([1, 3]), gamma=3, weighting="data")
    global_state = _state([[1, 1], [1, 1], [1, 1]], [[1, 1, 1]])
    c0 = _state([[2, 2], [1, 1], [1, 1]], [[2, 1, 1]])
    c1 = _state([[4, 4], [5, 5], [6, 6]], [[4, 5, 6]])
    plan = method.plan_round(0, _rng(), _rng())
    # Execute
    agg = method.aggregate(global_state, plan, [c0, c1])
    # Assert: X + Σ p_n pad(X_n − X): row 0 = 1 + .25·1 + .75·3 = 3.5; rows 1, 2 get client 0's
    # padded update 0: 1 + .75·4 = 4, 1 + .75·5 = 4.75
    assert np.allclose(agg.global_state["m.lora_A"], [[3.5, 3.5], [4, 4], [4.75, 4.75]])
    assert np.allclose(agg.global_state["m.lora_B"], [[3.5, 4, 4.75]])
    assert agg.info["weights"]["m"] == [0.25, 0.75]


def test_heterolora_sparsity_weights_are_frobenius_norms_of_padded_products():
    # Prepare: out = in = 1, γ = 3. Client 0 (rank 1): B = [3, 9, 9], A = [1, 9, 9] → padded
    # product 3·1 = 3. Client 1 (rank 2): B = [1, 1, 9], A = [1, 1, 9] → 1 + 1 = 2.
    # The 9s are untouched global components: padding must drop them. p = 3/5, 2/5.
    method = HeteroLoRA(a=np.array([0.5, 0.5]), ranks=np.array([1, 2]), gamma=3)
    global_state = _state([[9], [9], [9]], [[9, 9, 9]])
    c0 = _state([[1], [9], [9]], [[3, 9, 9]])
    c1 = _state([[1], [1], [9]], [[1, 1, 9]])
    plan = method.plan_round(0, _rng(), _rng())
    # Execute
    agg = method.aggregate(global_state, plan, [c0, c1])
    # Assert: B = 9 + .6·[3 − 9, 0, 0] + .4·[1 − 9, 1 − 9, 0]; A likewise with [1, 9, 9], [1, 1, 9]
    assert np.allclose(agg.info["weights"]["m"], [0.6, 0.4])
    assert np.allclose(agg.global_state["m.lora_B"], [[2.2, 5.8, 9.0]])
    assert np.allclose(agg.global_state["m.lora_A"], [[1.0], [5.8], [9.0]])


def test_heterolora_sparsity_falls_back_to_data_weights_when_all_products_vanish():
    method = HeteroLoRA(a=np.array([1.0, 3.0]), ranks=np.array([1, 1]), gamma=1)
    zero_b = _state([[1.0]], [[0.0]])
    agg = method.aggregate(zero_b, method.plan_round(0, _rng(), _rng()), [zero_b, zero_b])
    assert agg.info["weights"]["m"] == [0.25, 0.75]


def test_heterolora_rejects_unknown_weighting():
    with pytest.raises(ConfigError, match="weighting = 'mean'.*sparsity, data"):
        HeteroLoRA(a=np.ones(1), ranks=np.ones(1, dtype=int), gamma=1, weighting="mean")


# ----------------------------------------------------------------------------- FedStackLoRA


def test_fedstacklora_merges_the_weighted_stacked_product_into_the_base():
    # Prepare: γ = 2, scaling 2, ranks 1 and 2, data weights 1 and 3 → p = .25, .75.
    # Client 0 trained component 0 only: B_0 diag(1, 0) A_0 = [1, 2]ᵀ[1, 0] = [[1, 0], [2, 0]]
    # (its component 1, the untouched global values 7, must not count).
    # Client 1: B_1 A_1 = [[1, 1], [0, 1]] · I = [[1, 1], [0, 1]].
    method = FedStackLoRA(
        a=np.array([1.0, 3.0]), ranks=np.array([1, 2]), gamma=2, scaling=2.0, seed=0
    )
    global_state = _state([[0, 0], [7, 7]], [[0, 7], [0, 7]])
    c0 = _state([[1, 0], [7, 7]], [[1, 7], [2, 7]])
    c1 = _state([[1, 0], [0, 1]], [[1, 1], [0, 1]])
    plan = method.plan_round(0, _rng(), _rng())
    # Execute
    agg = method.aggregate(global_state, plan, [c0, c1])
    # Assert: Δ = 2·(.25·[[1, 0], [2, 0]] + .75·[[1, 1], [0, 1]]) = [[2, 1.5], [1, 1.5]]
    assert set(agg.base_delta) == {"m"}
    assert np.allclose(agg.base_delta["m"], [[2.0, 1.5], [1.0, 1.5]])
    assert agg.info["stacked_rank"] == 3
    w0 = np.array([[10.0, 0.0], [0.0, 10.0]])
    assert np.allclose(w0 + agg.base_delta["m"], [[12.0, 1.5], [1.0, 11.5]])


def test_fedstacklora_base_delta_equals_sum_of_client_products_on_random_data():
    rng = _rng(11)
    gamma, ranks, a = 4, np.array([1, 3, 4]), np.array([0.2, 0.5, 0.3])
    method = FedStackLoRA(a=a, ranks=ranks, gamma=gamma, scaling=0.5, seed=1)
    global_state = {"l.lora_A": rng.normal(size=(gamma, 6)), "l.lora_B": np.zeros((5, gamma))}
    states = [
        {"l.lora_A": rng.normal(size=(gamma, 6)), "l.lora_B": rng.normal(size=(5, gamma))}
        for _ in ranks
    ]
    plan = method.plan_round(0, _rng(), _rng())
    delta = method.aggregate(global_state, plan, states).base_delta["l"]
    expected = sum(
        0.5 * p * s["l.lora_B"][:, :r] @ s["l.lora_A"][:r] for p, r, s in zip(a, ranks, states)
    )
    assert np.allclose(delta, expected, atol=1e-12)


def test_fedstacklora_returns_a_fresh_seeded_adapter():
    method = FedStackLoRA(a=np.ones(2), ranks=np.array([1, 2]), gamma=2, scaling=1.0, seed=3)
    global_state = {
        "l.lora_A": np.ones((2, 4), np.float32),
        "l.lora_B": np.ones((3, 2), np.float32),
    }
    plan = method.plan_round(4, _rng(), _rng())
    fresh = method.aggregate(global_state, plan, [global_state, global_state]).global_state
    # B = 0, A ~ U(−1/√in, 1/√in) = U(−0.5, 0.5), dtype kept, rebuilt from (seed, round + 1)
    assert np.all(fresh["l.lora_B"] == 0) and fresh["l.lora_B"].dtype == np.float32
    assert np.all(np.abs(fresh["l.lora_A"]) <= 0.5) and fresh["l.lora_A"].dtype == np.float32
    assert np.array_equal(fresh["l.lora_A"], fresh_adapter(global_state, 3, 5)["l.lora_A"])
    assert not np.array_equal(fresh["l.lora_A"], fresh_adapter(global_state, 3, 6)["l.lora_A"])


def test_fresh_adapter_a_is_kaiming_uniform():
    big = {"l.lora_A": np.zeros((64, 100)), "l.lora_B": np.zeros((8, 64))}
    a = fresh_adapter(big, 0, 1)["l.lora_A"]
    # U(−0.1, 0.1): support, mean 0, variance bound²/3
    assert np.abs(a).max() <= 0.1 and np.abs(a).max() > 0.099
    assert abs(a.mean()) < 4 * 0.1 / np.sqrt(3 * a.size)
    assert a.var() == pytest.approx(0.01 / 3, rel=0.05)


def test_fedstacklora_downlink_is_the_stacked_adapter():
    # Prepare: ranks 4 and 8 in one round; Σ(out + in) = 1152 + 768 = 1920 per component
    method = FedStackLoRA(a=np.ones(2), ranks=np.array([4, 8]), gamma=8, scaling=1.0)
    plan = method.plan_round(0, _rng(), _rng())
    shapes = {"q": (576, 576), "v": (192, 576)}
    # Execute
    payloads = [method.payload(t, shapes, plan) for t in plan.tasks]
    # Assert: up r_n·1920, down (4 + 8)·1920 for both
    assert [p.uplink_params for p in payloads] == [4 * 1920, 8 * 1920]
    assert [p.downlink_params for p in payloads] == [12 * 1920, 12 * 1920]


# ----------------------------------------------------------------------------- FlexLoRA


def test_flexlora_hand_computed_svd_redistribution():
    # Prepare: γ = 2, two rank-1 clients, equal weights. Products [[2, 0], [0, 0]] and
    # [[0, 0], [0, 1]] → W = [[1, 0], [0, .5]]: singular values 1 and .5.
    method = FlexLoRA(a=np.array([1.0, 1.0]), ranks=np.array([1, 1]), gamma=2)
    global_state = _state([[0, 0], [0, 0]], [[0, 0], [0, 0]])
    c0 = _state([[1, 0], [0, 0]], [[2, 0], [0, 0]])
    c1 = _state([[0, 1], [0, 0]], [[0, 0], [1, 0]])
    plan = method.plan_round(0, _rng(), _rng())
    # Execute
    agg = method.aggregate(global_state, plan, [c0, c1])
    b, a = agg.global_state["m.lora_B"], agg.global_state["m.lora_A"]
    # Assert: B A = W; the rank-1 client gets the best rank-1 part [[1, 0], [0, 0]];
    # B = UΣ has column norms σ = 1, .5; A = Vᵀ has unit rows
    assert np.allclose(b @ a, [[1, 0], [0, 0.5]])
    assert np.allclose(b[:, :1] @ a[:1], [[1, 0], [0, 0]])
    assert np.allclose(np.linalg.norm(b, axis=0), [1, 0.5])
    assert np.allclose(np.linalg.norm(a, axis=1), [1, 1])
    assert np.allclose(agg.info["singular_values"]["m"], [1, 0.5])


def test_flexlora_gives_each_client_the_best_rank_r_approximation():
    # Prepare: γ = 4, ranks 2, 3, 4 → W has rank ≥ 4 generically; compare with numpy's SVD
    rng = _rng(7)
    gamma, ranks, a = 4, np.array([2, 3, 4]), np.array([0.5, 0.3, 0.2])
    method = FlexLoRA(a=a, ranks=ranks, gamma=gamma)
    global_state = {
        "l.lora_A": rng.normal(size=(gamma, 9)),
        "l.lora_B": rng.normal(size=(6, gamma)),
    }
    states = [
        {"l.lora_A": rng.normal(size=(gamma, 9)), "l.lora_B": rng.normal(size=(6, gamma))}
        for _ in ranks
    ]
    plan = method.plan_round(0, _rng(), _rng())
    w = sum(p * s["l.lora_B"][:, :r] @ s["l.lora_A"][:r] for p, r, s in zip(a, ranks, states))
    u, sv, vt = np.linalg.svd(w)
    # Execute
    out = method.aggregate(global_state, plan, states).global_state
    # Assert: the first r components give Σ_{i<r} σ_i u_i v_iᵀ for every r (Eckart–Young)
    for r in range(1, gamma + 1):
        best = (u[:, :r] * sv[:r]) @ vt[:r]
        got = out["l.lora_B"][:, :r] @ out["l.lora_A"][:r]
        assert np.allclose(got, best, atol=1e-10)
        assert np.linalg.norm(w - got) == pytest.approx(np.sqrt(np.sum(sv[r:] ** 2)), abs=1e-9)


def test_truncated_svd_completes_a_with_orthonormal_rows_when_w_has_low_rank():
    # one rank-1 product, γ = 3: B's components 1 and 2 are zero (σ = 0) but A's rows are an
    # orthonormal basis (V of a full SVD), so those components can still be trained
    b_stack, a_stack = np.array([[1.0], [2.0]]), np.array([[3.0, 0.0, 4.0]])
    b, a = truncated_svd_factors(b_stack, a_stack, 3, rng=_rng())
    assert b.shape == (2, 3) and a.shape == (3, 3)
    assert np.allclose(b @ a, b_stack @ a_stack)
    assert np.allclose(b[:, 1:], 0) and np.allclose(a @ a.T, np.eye(3))
    assert np.linalg.norm(b[:, 0]) == pytest.approx(np.sqrt(5) * 5)  # σ = ‖[1, 2]‖·‖[3, 0, 4]‖


# ----------------------------------------------------------------------------- shared


@pytest.mark.parametrize("name", ["heterolora", "fedstacklora", "flexlora"])
def test_rank_methods_payload_is_r_components_up(name):
    cfg = load_config(
        None, [f'method.name="{name}"', "data.n_clients=3", "method.ranks=[2, 5, 16]"]
    )
    method = make_method(cfg, np.full(3, 1 / 3), _rng())
    plan = method.plan_round(0, _rng(), _rng())
    ups = [method.payload(t, SMOL_SHAPES, plan).uplink_params for t in plan.tasks]
    per_component = 30 * (576 + 576) + 30 * (192 + 576)  # 57,600
    assert [r * per_component for r in (2, 5, 16)] == ups
    assert sketch_payload_params(1, SMOL_SHAPES) == per_component


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fslora", FSLoRA),
        ("heterolora", HeteroLoRA),
        ("fedstacklora", FedStackLoRA),
        ("flexlora", FlexLoRA),
    ],
)
def test_make_method_builds_each_baseline_with_shared_budgets(name, cls):
    cfg = load_config(
        None,
        [f'method.name="{name}"', "data.n_clients=4", "lora.rank=8", "lora.alpha=4.0",
         "method.clients_per_round=2", 'method.fslora.k="ranks"'],
    )  # fmt: skip
    tau = np.array([1.0, 2.0, 4.0, 0.5])
    method = make_method(cfg, np.full(4, 0.25), _rng(), tau_full_s=tau)
    assert isinstance(method, cls)
    budgets = method.k if name == "fslora" else method.ranks
    assert budgets.tolist() == [4, 2, 1, 8]
    assert method.clients_per_round == 2
    if name == "fedstacklora":
        assert method.scaling == 0.5  # alpha / rank


def test_make_method_capability_without_profiles_uses_the_engines_compute_times():
    from fedlora.federation.profiles import build_profiles

    cfg = load_config(None, ['method.name="heterolora"', "data.n_clients=6", "training.seed=4"])
    method = make_method(cfg, np.full(6, 1 / 6), _rng())
    # the compute times do not depend on the payload bits the engine passes
    tau = build_profiles(cfg, full_payload_bits=123456.0).tau_full_s
    assert method.ranks.tolist() == capability_ranks(tau, 16).tolist()


@pytest.mark.parametrize("cls", [HeteroLoRA, FlexLoRA])
def test_rank_methods_without_participants_keep_the_global(cls):
    method = cls(a=np.ones(1), ranks=np.ones(1, dtype=int), gamma=1)
    g = _state([[1.0]], [[2.0]])
    out = method.aggregate(g, RoundPlan(0, ()), []).global_state
    assert out == g


def test_full_rank_heterolora_and_fslora_reduce_to_fedavg():
    # with every budget = γ there is nothing to pad or sketch: both are FedAvg's mean
    from fedlora.federation.methods.fedavg import weighted_mean

    rng = _rng(21)
    a = np.array([0.1, 0.6, 0.3])
    states = [{"l.lora_A": rng.normal(size=(3, 4)), "l.lora_B": rng.normal(size=(5, 3))} for _ in a]
    global_state = {"l.lora_A": rng.normal(size=(3, 4)), "l.lora_B": rng.normal(size=(5, 3))}
    het = HeteroLoRA(a=a, ranks=np.full(3, 3), gamma=3, weighting="data")
    out = het.aggregate(global_state, het.plan_round(0, _rng(), _rng()), states).global_state
    expected = weighted_mean(states, a)
    assert all(np.allclose(out[k], expected[k]) for k in expected)
    fs = FSLoRA(k=np.full(3, 3), gamma=3)
    out = fs.aggregate(global_state, fs.plan_round(0, _rng(), _rng()), states).global_state
    expected = weighted_mean(states, np.ones(3))
    assert all(np.allclose(out[k], expected[k]) for k in expected)


# ----------------------------------------------------------------------------- issue 12: HetLoRA


def _live_rank(state: dict[str, np.ndarray], mod: str = "l") -> int:
    """Components j with B[:, j] or A[j] non-zero; with both zero, neither gets a gradient
    (∂/∂B_j ∝ A_j, ∂/∂A_j ∝ B_j) and the component is dead for ever."""
    a, b = state[f"{mod}.lora_A"], state[f"{mod}.lora_B"]
    return int(np.sum((np.abs(a).sum(axis=1) > 0) | (np.abs(b).sum(axis=0) > 0)))


def test_heterolora_pads_updates_so_untrained_components_keep_their_global_values():
    # Prepare: γ = 3, both participants have rank 1 (no one trains components 1, 2);
    # global A rows 1, 2 and B columns 1, 2 are 7 (client uploads carry them unchanged)
    method = HeteroLoRA(a=np.array([1.0, 3.0]), ranks=np.array([1, 1]), gamma=3, weighting="data")
    g = _state([[1, 1], [7, 7], [7, 7]], [[1, 7, 7]])
    c0 = _state([[2, 2], [7, 7], [7, 7]], [[3, 7, 7]])
    c1 = _state([[4, 4], [7, 7], [7, 7]], [[5, 7, 7]])
    plan = method.plan_round(0, _rng(), _rng())
    # Execute
    out = method.aggregate(g, plan, [c0, c1]).global_state
    # Assert: X + Σ p_n pad(X_n − X): row 0 = 1 + .25·1 + .75·3 = 3.5; rows 1, 2 stay 7
    # (padding the modules would make them .25·0 + .75·0 = 0, dead for ever)
    assert np.allclose(out["m.lora_A"], [[3.5, 3.5], [7, 7], [7, 7]])
    assert np.allclose(out["m.lora_B"], [[1 + 0.25 * 2 + 0.75 * 4, 7, 7]])


def test_heterolora_keeps_the_live_rank_under_partial_participation():
    # Prepare: N = 10, γ = 16, 2 clients per round, ranks 3..11 (the run in the issue lost 10
    # of 16 components by round 4). Each "training" moves the client's active components.
    rng = _rng(0)
    gamma, ranks = 16, np.array([11, 5, 9, 10, 6, 9, 5, 6, 3, 8])
    method = HeteroLoRA(a=np.full(10, 0.1), ranks=ranks, gamma=gamma, clients_per_round=2)
    g = {"l.lora_A": rng.normal(size=(gamma, 6)), "l.lora_B": rng.normal(size=(5, gamma))}
    for r in range(20):
        plan = method.plan_round(r, _rng(r), _rng(r))
        states = []
        for t in plan.tasks:
            m = t.scale != 0
            s = {k: v.copy() for k, v in g.items()}
            s["l.lora_A"][m] += 0.1 * rng.normal(size=(m.sum(), 6))
            s["l.lora_B"][:, m] += 0.1 * rng.normal(size=(5, m.sum()))
            states.append(s)
        g = method.aggregate(g, plan, states).global_state
    # Assert: every component is still alive
    assert _live_rank(g) == gamma


def test_heterolora_modules_padding_is_kept_as_an_option():
    method = HeteroLoRA(
        a=np.array([1.0, 3.0]), ranks=np.array([1, 3]), gamma=3, weighting="data",
        padding="modules", scaling="global",
    )  # fmt: skip
    g = _state([[1, 1], [1, 1], [1, 1]], [[1, 1, 1]])
    c0 = _state([[2, 2], [1, 1], [1, 1]], [[2, 1, 1]])
    c1 = _state([[4, 4], [5, 5], [6, 6]], [[4, 5, 6]])
    out = method.aggregate(g, method.plan_round(0, _rng(), _rng()), [c0, c1]).global_state
    assert np.allclose(out["m.lora_A"], [[3.5, 3.5], [3.75, 3.75], [4.5, 4.5]])


def test_heterolora_scales_each_client_by_alpha_over_its_own_rank():
    # the slot computes (α/γ)·B diag(s) A; s = γ/r_n on the first r_n gives α/r_n (HetLoRA:
    # every client is a LoRA of rank r_n with the same α)
    method = HeteroLoRA(a=np.ones(2), ranks=np.array([2, 4]), gamma=4)
    plan = method.plan_round(0, _rng(), _rng())
    assert plan.tasks[0].scale.tolist() == [2, 2, 0, 0] and plan.tasks[0].rank_used == 2
    assert plan.tasks[1].scale.tolist() == [1, 1, 1, 1]
    legacy = HeteroLoRA(a=np.ones(2), ranks=np.array([2, 4]), gamma=4, scaling="global")
    assert legacy.plan_round(0, _rng(), _rng()).tasks[0].scale.tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"padding": "zeros"}, "padding = 'zeros'.*updates, modules"),
        ({"scaling": "rs"}, "scaling = 'rs'.*rank, global"),
        ({"pruning": 1.0}, r"method.heterolora.pruning = 1.0.*0 \(off\) or in \(0, 1\)"),
        ({"pruning": -0.5}, r"method.heterolora.pruning = -0.5"),
    ],
)
def test_heterolora_rejects_bad_options(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        HeteroLoRA(a=np.ones(1), ranks=np.ones(1, dtype=int), gamma=1, **kw)


def _tail_state(gamma: int, rank: int, head: float, tail: float) -> dict[str, np.ndarray]:
    """A rank-γ adapter whose first components are `head` and the HetLoRA tail `tail`."""
    a = np.zeros((gamma, 2))
    b = np.zeros((2, gamma))
    keep = int(np.floor(0.5 * rank))
    a[:keep], b[:, :keep] = head, head
    a[keep:rank], b[:, keep:rank] = tail, tail
    return {"l.lora_A": a, "l.lora_B": b}


def test_heterolora_self_pruning_shrinks_a_rank_when_its_tail_norm_falls():
    # Prepare: decay 0.5, one client of rank 4: the tail is components 2, 3.
    # Round 0: tail entries 1 → ‖B_tail‖·‖A_tail‖ = 2·2 = 4 (remembered, no pruning yet).
    # Round 1: tail 0.5 → 1 < 4: the rank becomes ⌊0.5·4⌋ = 2. Round 2: tail 2.0 (of rank 2:
    # component 1) — first value at the new rank, remembered; round 3: larger → kept.
    method = HeteroLoRA(a=np.ones(1), ranks=np.array([4]), gamma=4, pruning=0.5)
    g = _tail_state(4, 4, 0.0, 0.0)
    ranks = []
    for r, tail in enumerate([1.0, 0.5, 2.0, 3.0]):
        plan = method.plan_round(r, _rng(), _rng())
        agg = method.aggregate(g, plan, [_tail_state(4, int(method.ranks[0]), 1.0, tail)])
        ranks.append(int(method.ranks[0]))
    # Assert
    assert ranks == [4, 2, 2, 2]
    assert agg.info["ranks"] == [2]
    # the state survives a checkpoint
    again = HeteroLoRA(a=np.ones(1), ranks=np.array([4]), gamma=4, pruning=0.5)
    again.load_state_dict(method.state_dict())
    assert again.ranks.tolist() == [2] and again.state_dict() == method.state_dict()


def test_heterolora_never_prunes_below_rank_one_and_is_off_by_default():
    method = HeteroLoRA(a=np.ones(1), ranks=np.array([1]), gamma=2, pruning=0.5)
    g = _tail_state(2, 1, 0.0, 0.0)
    for r, tail in enumerate([1.0, 0.1, 0.01]):
        method.aggregate(g, method.plan_round(r, _rng(), _rng()), [_tail_state(2, 1, 1.0, tail)])
    assert method.ranks.tolist() == [1]
    off = HeteroLoRA(a=np.ones(1), ranks=np.array([2]), gamma=2)
    for r, tail in enumerate([1.0, 0.1, 0.01]):
        off.aggregate(g, off.plan_round(r, _rng(), _rng()), [_tail_state(2, 2, 1.0, tail)])
    assert off.ranks.tolist() == [2]


def test_make_method_passes_heterolora_pruning():
    cfg = load_config(
        None,
        ['method.name="heterolora"', "data.n_clients=2", "method.ranks=[2, 4]",
         "method.heterolora.pruning=0.75"],
    )  # fmt: skip
    assert make_method(cfg, np.full(2, 0.5), _rng()).pruning == 0.75
    # checked by the method (the registry), whichever method.name is
    with pytest.raises(ConfigError, match="method.heterolora.pruning = 1.5"):
        check_method_config(load_config(None, ["method.heterolora.pruning=1.5"]))


# ----------------------------------------------------------------------------- issue 12: FlexLoRA


def _flex_round(gamma: int, ranks: list[int], seed: int = 0):
    """One FlexLoRA aggregation of random client uploads; returns (method, W, global)."""
    rng = _rng(seed)
    ranks_arr = np.array(ranks)
    a = np.full(len(ranks), 1.0 / len(ranks))
    method = FlexLoRA(a=a, ranks=ranks_arr, gamma=gamma, seed=seed)
    g = {"l.lora_A": rng.normal(size=(gamma, 24)), "l.lora_B": np.zeros((20, gamma))}
    states = [
        {"l.lora_A": rng.normal(size=(gamma, 24)), "l.lora_B": rng.normal(size=(20, gamma))}
        for _ in ranks
    ]
    plan = method.plan_round(0, _rng(), _rng())
    w = sum(p * s["l.lora_B"][:, :r] @ s["l.lora_A"][:r] for p, r, s in zip(a, ranks, states))
    return method, w, method.aggregate(g, plan, states)


def test_flexlora_splits_w_as_u_sigma_and_v_transpose():
    # FlexLoRA's reference: W_g = UΣVᵀ, client n gets B = U_r Σ_r, A = V_rᵀ
    _, w, agg = _flex_round(8, [2, 3, 4])
    b, a = agg.global_state["l.lora_B"], agg.global_state["l.lora_A"]
    u, sv, vt = np.linalg.svd(w)
    for r in (2, 3, 4, 8):  # each client's slice = the reference split (up to signs)
        ref_b, ref_a = u[:, :r] * sv[:r], vt[:r]
        signs = np.sign(np.sum(a[:r] * ref_a, axis=1))
        assert np.allclose(b[:, :r] * signs, ref_b, atol=1e-10)
        assert np.allclose(a[:r] * signs[:, None], ref_a, atol=1e-10)
    assert np.allclose(a @ a.T, np.eye(8), atol=1e-10)  # A = V_γᵀ: orthonormal rows
    assert np.allclose(np.linalg.norm(b, axis=0), sv[:8], atol=1e-10)  # ‖U_j σ_j‖ = σ_j
    assert np.allclose(agg.info["singular_values"]["l"], sv[:8], atol=1e-10)


def test_flexlora_keeps_every_component_trainable_when_ranks_sum_below_gamma():
    # Prepare: participants of ranks 3 and 2, γ = 16: W has rank 5 (the case)
    _, w, agg = _flex_round(16, [3, 2])
    b, a = agg.global_state["l.lora_B"], agg.global_state["l.lora_A"]
    # Execute: the gradient of a loss L(W0 + B A) w.r.t. B is G Aᵀ (G = ∂L/∂W, generic)
    g = _rng(9).normal(size=w.shape)
    grad_b = g @ a.T  # (out, γ)
    # Assert: every component of a rank-16 client gets a non-zero gradient, and B A = W
    assert np.all(np.linalg.norm(grad_b, axis=0) > 1e-3)
    assert np.allclose(b @ a, w, atol=1e-10)
    assert np.allclose(b[:, 5:], 0, atol=1e-10)  # σ_j = 0 beyond rank(W)
    assert np.allclose(a @ a.T, np.eye(16), atol=1e-10)


def test_flexlora_reports_what_the_rank_gamma_global_loses():
    # Σ r_n = 9 > γ = 4: the global adapter is W's best rank-4 part; clients (r_n <= γ) get
    # exactly the reference's per-client truncation of the full W
    _, w, agg = _flex_round(4, [3, 3, 3])
    sv = np.linalg.svd(w, compute_uv=False)
    lost = np.sqrt(np.sum(sv[4:] ** 2)) / np.sqrt(np.sum(sv**2))
    assert agg.info["truncation_loss"]["l"] == pytest.approx(lost, rel=1e-9)
    _, _, agg = _flex_round(8, [2, 3])
    assert agg.info["truncation_loss"]["l"] == pytest.approx(0.0, abs=1e-12)


def test_flexlora_null_components_are_seeded():
    one = _flex_round(16, [3, 2], seed=1)[2].global_state["l.lora_A"]
    two = _flex_round(16, [3, 2], seed=1)[2].global_state["l.lora_A"]
    assert np.array_equal(one, two)


# ----------------------------------------------------------------------------- issue 12: FSLoRA


def test_fslora_default_draws_k_uniformly_in_4_to_gamma_as_its_reference():
    cfg = load_config(None, ['method.name="fslora"', "data.n_clients=2000", "lora.rank=16"])
    assert FSLoRA.read_options(cfg).k == "reference"  # the default of [method.fslora] k
    # Execute
    method = make_method(cfg, np.full(2000, 1 / 2000), _rng(3))
    again = make_method(cfg, np.full(2000, 1 / 2000), _rng(3))
    # Assert: integers 4..16, each with probability 1/13, reproducible from the seed
    counts = np.bincount(method.k, minlength=17)
    assert method.k.min() == 4 and method.k.max() == 16 and counts[:4].sum() == 0
    assert np.all(np.abs(counts[4:] - 2000 / 13) < 4 * np.sqrt(2000 / 13))
    assert np.array_equal(method.k, again.k)


def test_fslora_k_from_the_shared_rank_budgets_and_small_gamma():
    base = ['method.name="fslora"', "data.n_clients=3", "lora.rank=3"]
    ranks = make_method(load_config(None, [*base, "method.ranks=[1, 2, 3]",
                                           'method.fslora.k="ranks"']), np.ones(3) / 3, _rng())  # fmt: skip
    assert ranks.k.tolist() == [1, 2, 3]
    # γ < 4: the reference's range [4, γ] is empty; every client sketches all γ
    small = make_method(load_config(None, base), np.ones(3) / 3, _rng())
    assert small.k.tolist() == [3, 3, 3]
    with pytest.raises(ConfigError, match="method.fslora.k = 'paper'.*reference, ranks"):
        check_method_config(load_config(None, ['method.fslora.k="paper"']))


def test_docs_reference_tables_name_existing_tests():
    # docs/methods.md: "reference behaviour | fedlora | test" per baseline; every test it names
    # must exist, so the tables cannot drift from the suite
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "methods.md").read_text(encoding="utf-8")
    section = doc[
        doc.index("## Reference behaviour, step by step") : doc.index("## Exact payloads")
    ]
    named = re.findall(r"`(?:(tests/\w+\.py)::)?(test_\w+)`", section)
    assert len(named) > 20
    for path, name in named:
        text = (root / (path or "tests/test_methods_baselines.py")).read_text(encoding="utf-8")
        assert f"def {name}(" in text, f"docs/methods.md names {path or ''}::{name}"
