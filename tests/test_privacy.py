"""Client-level differential privacy: the accounting against an RDP computation written from
the papers (tests/rdp_reference.py), the clipping
by hand, the noise's standard deviation, the refusals, and runs end to end (σ = 0 is the run
without DP bit for bit; a resumed run draws the same noise)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import rdp_reference as ref
from fedlora.cli import main
from fedlora.config import load_config
from fedlora.errors import ConfigError
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.registry import check_method_config, method_class
from fedlora.federation.privacy import make_privacy
from fedlora.federation.privacy_mechanisms.base import PrivacyMechanism
from fedlora.system.privacy import epsilon, max_poisson_rate, noise_over_signal, poisson_epsilon
from fedlora.system.privacy_ledger import PrivacyLedger, RoundSetting

SETTING = RoundSetting("central", 1.0, 1.0, "poisson")

pytest.importorskip("dp_accounting")


@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.1, 1.0, 50), (0.5, 2.0, 7), (1.0, 0.8, 3)])
def test_a_uniform_rate_gives_the_epsilon_of_the_subsampled_gaussians_rdp(q, sigma, steps):
    lo, hi = ref.poisson_bounds(q, sigma, steps, 1e-5)
    got = poisson_epsilon(q, sigma, steps, 1e-5)
    assert lo * (1 - 1e-9) <= got <= hi * (1 + 1e-9)
    assert got == pytest.approx(lo, rel=2e-3)
    ledger = PrivacyLedger(3)
    for _ in range(steps):
        ledger.record(RoundSetting("central", sigma, 1.0, "poisson"), "poisson", np.full(3, q))
    assert ledger.epsilons(1e-5) == [got] * 3


def test_hand_computed_rdp_points():
    # Mironov et al. 2019, integer α: A_2 = 1 + q²(e^{1/σ²} − 1); q = 0.5, σ = 1
    assert ref.poisson_rdp(0.5, 1.0, 2) == pytest.approx(math.log(1 + 0.25 * (math.e - 1)))
    # the plain Gaussian: α/(2σ²); and the conversion at one order by hand
    assert ref.gaussian_rdp(2.0, 3) == pytest.approx(3 / 8)
    by_hand = 10 * 3 / 8 + math.log(2 / 3) - (math.log(1e-5) + math.log(3)) / 2
    assert ref.epsilon_from_rdp({3: 10 * 3 / 8}, 1e-5) == pytest.approx(by_hand)


def test_m_of_n_sampling_is_accounted_without_replacement_at_half_sigma():
    # 4 of 20 clients: replace-one adjacency, the sensitivity of the sum is 2C: Wang, Balle &
    # Kasiviswanathan's bound at σ/2, above the divergence of one pair of neighbours' outputs
    got = epsilon([("uniform", 0.2, 10)], 1.5, 1e-6, 20)
    upper = ref.wor_upper_epsilon(0.2, 0.75, 10, 1e-6)
    lower = ref.epsilon_from_rdp(
        {a: 10 * ref.shift_pair_rdp(0.2, 1.5, a) for a in ref.ORDERS if a <= 64}, 1e-6
    )
    assert lower < got <= upper * (1 + 1e-9)
    assert got == pytest.approx(upper, rel=1e-6)
    # every client every round: the plain Gaussian (add or remove one client, sensitivity C)
    assert epsilon([("uniform", 1.0, 10)], 1.5, 1e-6, 20) == pytest.approx(
        ref.gaussian_epsilon_reference(1.5, 10, 1e-6), rel=1e-9
    )
    # local: the Gaussian at σ/2 (any two of a client's data sets, 2C)
    assert epsilon([("local", 1.0, 10)], 1.5, 1e-6) == pytest.approx(
        ref.gaussian_epsilon_reference(0.75, 10, 1e-6), rel=1e-9
    )


def test_per_client_rates_compose_and_the_ledger_survives_a_dict():
    ledger = PrivacyLedger(2)
    ledger.record(SETTING, "poisson", np.array([0.2, 0.6]))
    ledger.record(SETTING, "poisson", np.array([0.2, 0.3]))
    eps = ledger.epsilons(1e-5)
    # client 1: one round at 0.6 and one at 0.3 compose additively in RDP
    composed = {a: ref.poisson_rdp(0.6, 1.0, a) + ref.poisson_rdp(0.3, 1.0, a) for a in ref.ORDERS}
    assert eps[1] == pytest.approx(ref.epsilon_from_rdp(composed, 1e-5), rel=2e-3)
    assert eps[0] == poisson_epsilon(0.2, 1.0, 2, 1e-5) < eps[1]
    saved = json.loads(json.dumps(ledger.to_dict()))
    again = PrivacyLedger.restore(2, saved, legacy_sigma=9.0, legacy_rounds=0)
    assert again.epsilons(1e-5) == eps and again.rounds == 2
    zero = PrivacyLedger(2)
    zero.record(RoundSetting("central", 0.0, 1.0, "poisson"), "poisson", np.full(2, 0.2))
    assert math.isinf(zero.epsilons(1e-5)[0])  # σ = 0: no guarantee
    assert PrivacyLedger(2).epsilons(1e-5) == [0.0, 0.0]  # before any round


def test_the_largest_rate_within_a_budget_keeps_it_and_is_tight():
    q = max_poisson_rate(4.0, 1.0, 30, 1e-5)
    assert 0 < q < 1
    assert poisson_epsilon(q, 1.0, 30, 1e-5) <= 4.0 < poisson_epsilon(q * 1.01, 1.0, 30, 1e-5)
    assert ref.poisson_bounds(q, 1.0, 30, 1e-5)[0] <= 4.0  # the exact RDP keeps it too
    assert max_poisson_rate(1e6, 1.0, 30, 1e-5) == 1.0


def _privacy(mode: str, sigma: float, clip: float, method: str = "sketched") -> PrivacyMechanism:
    cfg = load_config(
        None,
        [
            "data.n_clients=4",
            f'method.name="{method}"',
            f'privacy.mode="{mode}"',
            f"privacy.noise_multiplier={sigma}",
            f"privacy.clip_norm={clip}",
        ],
    )
    return make_privacy(cfg, method_class(cfg.method.name))


def _plan(weights, trains="AB", gamma=2, round_=3) -> RoundPlan:
    tasks = tuple(ClientTask(i, np.ones(gamma), gamma, w, trains) for i, w in enumerate(weights))
    return RoundPlan(round_, tasks)


def test_the_weighted_update_is_clipped_and_one_within_the_bound_is_untouched():
    g = {"m.lora_A": np.zeros((2, 3), np.float32), "m.lora_B": np.zeros((3, 2), np.float32)}
    big = {"m.lora_A": np.full((2, 3), 1.0, np.float32), "m.lora_B": np.zeros((3, 2), np.float32)}
    small = {k: v * 0.01 for k, v in big.items()}
    dp = _privacy("central", 1.0, 1.0)
    plan = _plan([2.0, 2.0])  # a_n/q_n = 2: ‖2·Δ‖ = 2√6 for big, 0.02√6 for small
    out = dp.clip(g, plan, [big, small])
    assert out[1] is small
    assert 2 * np.linalg.norm(out[0]["m.lora_A"]) == pytest.approx(1.0, rel=1e-6)
    assert out[0]["m.lora_A"][0, 0] == pytest.approx(1 / (2 * math.sqrt(6)), rel=1e-6)
    # FedAvg normalises its weights over the participants: p = 1/2 each, so ‖Δ/2‖ <= 1
    fed = _privacy("central", 1.0, 1.0, "fedavg").clip(g, plan, [big, small])
    assert np.linalg.norm(fed[0]["m.lora_A"]) / 2 == pytest.approx(1.0, rel=1e-6)
    # FFA-LoRA trains B only: its A is neither clipped nor noised
    ffa = _privacy("central", 1.0, 1e-3, "ffalora").clip(g, _plan([1.0, 1.0], "B"), [big])
    assert ffa[0] is big


def test_central_noise_has_standard_deviation_sigma_times_clip_on_the_trained_factors():
    g = {"m.lora_A": np.zeros((64, 256), np.float32), "m.lora_B": np.zeros((256, 64), np.float32)}
    dp = _privacy("central", 1.5, 0.2)
    out = dp.noise(g, dict(g), _plan([1.0]))
    for k in g:
        assert float(np.std(out[k])) == pytest.approx(0.3, rel=0.02)
        assert abs(float(np.mean(out[k]))) < 0.01
    again = dp.noise(g, dict(g), _plan([1.0]))  # the round's own stream: the same draw
    assert all(np.array_equal(out[k], again[k]) for k in g)
    other = dp.noise(g, dict(g), _plan([1.0], round_=4))
    assert not np.array_equal(out["m.lora_A"], other["m.lora_A"])
    b_only = dp.noise(g, dict(g), _plan([1.0], "B"))
    assert np.all(b_only["m.lora_A"] == 0) and np.std(b_only["m.lora_B"]) > 0.25
    assert _privacy("central", 0.0, 0.2).noise(g, g, _plan([1.0])) is g  # σ = 0: none


def test_the_noise_over_signal_is_z_sqrt_d_over_m_by_hand():
    # the cohort of docs/privacy.md: σ 0.654, d = 245,760 entries, m = 50 -> 0.654·495.74/50
    assert noise_over_signal(0.654, 245_760, 50.0) == pytest.approx(6.4843, rel=1e-4)
    assert noise_over_signal(1.5, 100, 2.0) == 7.5 and noise_over_signal(0.5, 4, 4.0) == 0.25
    assert noise_over_signal(0.0, 100, 0.0) == 0.0 and noise_over_signal(1.0, 100, 0.0) == math.inf
    g = {"m.lora_A": np.zeros((2, 8), np.float32), "m.lora_B": np.zeros((8, 2), np.float32)}
    dp = _privacy("central", 1.5, 0.2)  # sketched, 4 clients at q = 1 (the default): m = 4
    method = type("M", (), {"q": np.ones(4)})()
    assert dp.noise_note(method) is None  # before any noise
    dp.noise(g, dict(g), _plan([1.0], "B"))  # B only: d = 16
    assert "z·√d/m = 1.5·√16/4 = 1.5 (above 1" in dp.noise_note(method)
    dp.noise(g, dict(g), _plan([1.0]))  # A and B: d = 32; m = 12 -> 1.5·√32/12 = 0.707
    assert "= 0.707 (at most 1" in dp.noise_note(type("M", (), {"q": np.full(4, 3.0)})())
    assert _privacy("local", 1.5, 0.2).noise_note(method) is None  # central DP's figure only


def test_local_noise_on_the_weighted_update_has_the_same_deviation_on_sent_components():
    g = {"m.lora_A": np.zeros((4, 4096), np.float32), "m.lora_B": np.zeros((4096, 4), np.float32)}
    dp = _privacy("local", 2.0, 0.5)
    scale = np.array([2.0, 0.0, 2.0, 0.0])  # a sketch of components 0 and 2
    plan = RoundPlan(0, (ClientTask(1, scale, 2, 4.0),))  # weight a_n/q_n = 4
    (out,) = dp.clip(g, plan, [dict(g)])
    a = 4.0 * out["m.lora_A"]  # the weighted update w·Δ as aggregated
    assert float(np.std(a[[0, 2]])) == pytest.approx(1.0, rel=0.03)
    assert np.all(a[[1, 3]] == 0) and np.all(out["m.lora_B"][:, [1, 3]] == 0)


def _cli_error(tmp_path: Path, capsys, *overrides: str) -> str:
    assert main(["config", "show", *overrides]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("privacy.noise_multiplier=-1", "privacy.noise_multiplier"),
        ("privacy.delta=1", "privacy.delta"),
        ("privacy.delta=0", "privacy.delta"),
        ("privacy.clip_norm=0", "privacy.clip_norm"),
        ('privacy.mode="global"', "privacy.mode"),
    ],
)
def test_bad_privacy_settings_exit_2_naming_the_field(tmp_path, capsys, override, field):
    err = _cli_error(tmp_path, capsys, 'privacy.mode="central"', override)
    assert field in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["flexlora", "fedstacklora", "fedexlora", "fedsalora"])
def test_a_method_whose_aggregate_is_not_a_sum_refuses_privacy(tmp_path, capsys, name):
    err = _cli_error(tmp_path, capsys, 'privacy.mode="central"', f'method.name="{name}"')
    assert "privacy.mode" in err and name in err
    load_config(None, [f'method.name="{name}"'])  # without privacy: fine


def test_heterolora_self_pruning_and_budgets_without_central_privacy_are_refused():
    with pytest.raises(ConfigError, match=r"method\.heterolora\.pruning"):
        check_method_config(load_config(None, ['privacy.mode="local"', 'method.name="heterolora"',
                                               "method.heterolora.pruning=0.5"]))  # fmt: skip
    with pytest.raises(ConfigError, match="planner.max_epsilon"):  # the mechanism's fact
        check_method_config(load_config(None, ['privacy.mode="local"', "planner.max_epsilon=8"]))
    with pytest.raises(ConfigError, match="planner.max_epsilon"):
        load_config(None, ['privacy.mode="central"', "planner.max_epsilon=[1, 2]"])
