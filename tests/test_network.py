"""The wireless network model (paper §IV, Eq. 10–18; PAPER_NOTES #4–6, #14, #15)."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import brentq

from fedlora.errors import ConfigError
from fedlora.files import load_profiles
from fedlora.system.network import (
    ClientProfiles,
    allocate_bandwidth,
    comm_factor,
    comp_factor,
    expected_max_tau,
    generate_profiles,
    profiles_from_rows,
    profiles_to_rows,
    rayleigh_gains,
    round_time,
    round_time_bound,
    round_time_upper_bound,
    spectral_efficiency,
)
from fedlora.system.sketch import sample_participants


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- cost models


def test_comm_factor_hand_computed():
    # k = 4 of γ = 16: the paper's k²/γ² = 1/16; a sketch really sends k(m+n) of γ(m+n).
    np.testing.assert_allclose(comm_factor(4, 16, "quadratic"), 1 / 16)
    np.testing.assert_allclose(comm_factor(4, 16, "linear"), 0.25)
    np.testing.assert_allclose(comm_factor(4, 16, "exact"), 0.25)
    np.testing.assert_allclose(comm_factor([1, 8, 16], 16, "linear"), [1 / 16, 0.5, 1.0])
    np.testing.assert_allclose(comm_factor([16], 16, "quadratic"), [1.0])


def test_comp_factor_hand_computed():
    # affine: ρ + (1 − ρ) k/γ = 0.9 + 0.1 · 0.25 = 0.925
    np.testing.assert_allclose(comp_factor(4, 16, "affine", rho=0.9), 0.925)
    np.testing.assert_allclose(comp_factor(4, 16, "quadratic"), 1 / 16)
    np.testing.assert_allclose(comp_factor(4, 16, "linear"), 0.25)
    np.testing.assert_allclose(comp_factor([1, 16], 16, "affine", rho=1.0), [1.0, 1.0])
    np.testing.assert_allclose(
        comp_factor([1, 5, 16], 16, "affine", rho=0.0), comp_factor([1, 5, 16], 16, "linear")
    )
    np.testing.assert_allclose(comp_factor(16, 16, "affine", rho=0.3), 1.0)  # k = γ: full time


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: comm_factor(4, 16, "cubic"), "comm_cost = 'cubic'"),
        (lambda: comp_factor(4, 16, "exact"), "comp_cost = 'exact'"),
        (lambda: comp_factor(4, 16, "affine", rho=1.5), "rho = 1.5"),
        (lambda: comp_factor(4, 16, "affine", rho=-0.1), "rho = -0.1"),
    ],
)
def test_cost_models_reject_unknown_models_and_bad_rho(call, pattern):
    with pytest.raises(ConfigError, match=pattern):
        call()


# ----------------------------------------------------------------------------- allocation


def brentq_round_time(tau: np.ndarray, t: np.ndarray, f_tot: float) -> float:
    """Independent reference: the root T > max τ of Σ t_n/(T − τ_n) = f_tot (senders only)."""
    send = t > 0
    ts, taus = t[send], tau[send]
    g = lambda T: float(np.sum(ts / (T - taus))) - f_tot  # noqa: E731
    lo = taus.max() + ts[np.argmax(taus)] / f_tot  # g(lo) >= 0
    hi = taus.max() + ts.sum() / f_tot  # g(hi) <= 0
    root = lo if lo == hi else brentq(g, lo, hi, xtol=1e-300, rtol=1e-15, maxiter=500)
    return max(root, float(tau[~send].max()) if (~send).any() else 0.0)


def assert_allocation(tau: np.ndarray, t: np.ndarray, f_tot: float) -> float:
    """All sampled senders finish at T, Σ f = f_tot, and T agrees with brentq to 1e-9."""
    T, f = allocate_bandwidth(tau, t, f_tot)
    send = t > 0
    assert f.shape == t.shape
    assert np.all(f[~send] == 0)
    assert np.all(f[send] > 0)
    np.testing.assert_allclose(tau[send] + t[send] / f[send], T, rtol=1e-9)
    np.testing.assert_allclose(f.sum(), f_tot, rtol=1e-9)
    assert abs(T - brentq_round_time(tau, t, f_tot)) <= 1e-9 * T
    return T


def test_allocation_two_equal_clients_share_the_band_equally():
    T, f = allocate_bandwidth([0.0, 0.0], [1.0, 1.0], 1.0)
    assert T == pytest.approx(2.0, rel=1e-12)
    np.testing.assert_allclose(f, [0.5, 0.5], rtol=1e-12)


def test_allocation_hand_computed_quadratic():
    # τ = (0, 1), t = (1, 1), f_tot = 1: 1/T + 1/(T − 1) = 1  ⇔  T² − 3T + 1 = 0.
    T, f = allocate_bandwidth([0.0, 1.0], [1.0, 1.0], 1.0)
    expected = (3 + math.sqrt(5)) / 2
    assert T == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(f, [1 / expected, 1 / (expected - 1)], rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_random_instances_agree_with_brentq(seed):
    g = rng(seed)
    n = int(g.integers(2, 40))
    tau = g.lognormal(0.0, 1.0, n)
    t = g.lognormal(15.0, 1.5, n)  # s·Hz: ~3 Mbit at a few bit/s/Hz
    assert_allocation(tau, t, f_tot=20e6)


def test_allocation_wildly_different_scales():
    tau = np.array([0.0, 5.0, 10.0, 10.0])
    t = np.array([1e-6, 1e6, 1.0, 1e-9])
    assert_allocation(tau, t, f_tot=1e3)
    # the slowest client sends almost nothing: it still finishes at T
    assert_allocation(np.array([0.0, 1.0]), np.array([1e3, 1e-12]), f_tot=1.0)


def test_allocation_empty_set_costs_nothing():
    T, f = allocate_bandwidth([], [], 10.0)
    assert T == 0.0
    assert f.shape == (0,)


@pytest.mark.parametrize(
    ("tau", "t", "f_tot"), [(0.0, 3.0, 2.0), (2.5, 7.0, 0.5), (1.0, 1e-3, 1e6)]
)
def test_allocation_one_client_gets_the_whole_band(tau, t, f_tot):
    T, f = allocate_bandwidth([tau], [t], f_tot)
    assert T == pytest.approx(tau + t / f_tot, rel=1e-12)
    np.testing.assert_allclose(f, [f_tot], rtol=1e-12)


def test_allocation_clients_with_nothing_to_send_need_no_band():
    # τ = (1, 0.5), t = (2, 0), f_tot = 1: client 0 alone, T = 1 + 2/1 = 3
    T, f = allocate_bandwidth([1.0, 0.5], [2.0, 0.0], 1.0)
    assert T == pytest.approx(3.0, rel=1e-12)
    np.testing.assert_array_equal(f, [1.0, 0.0])

    T, f = allocate_bandwidth([1.0, 4.0], [0.0, 0.0], 1.0)  # nobody sends
    assert T == 4.0
    np.testing.assert_array_equal(f, [0.0, 0.0])

    g = rng(9)
    tau, t = g.uniform(0, 2, 12), g.uniform(1, 3, 12)
    t[[2, 5, 7]] = 0.0
    tau[[2, 5, 7]] = 0.1  # faster than everyone else: they change nothing
    T = assert_allocation(tau, t, 4.0)
    assert T == pytest.approx(allocate_bandwidth(tau[t > 0], t[t > 0], 4.0)[0], rel=1e-12)


def test_allocation_a_silent_client_slower_than_the_rest_sets_the_round_time():
    # τ = (0, 5), t = (2, 0), f_tot = 1: the sender alone would finish at 2, but the round lasts
    # τ_1 = 5; the sender needs only f = 2/(5 − 0) = 0.4 of the band to finish at T.
    T, f = allocate_bandwidth([0.0, 5.0], [2.0, 0.0], 1.0)
    assert T == 5.0
    np.testing.assert_allclose(f, [0.4, 0.0], rtol=1e-12)

    tau = np.array([0.3, 0.7, 9.0, 0.2])
    t = np.array([1.0, 2.0, 0.0, 0.5])
    T, f = allocate_bandwidth(tau, t, 2.0)
    assert T == 9.0
    send = t > 0
    np.testing.assert_allclose(tau[send] + t[send] / f[send], 9.0, rtol=1e-12)
    assert f.sum() < 2.0


def test_allocation_hundred_thousand_clients():
    g = rng(12)
    n = 100_000
    tau = g.lognormal(0.5, 0.5, n)
    t = g.lognormal(15.0, 1.0, n)
    t[g.random(n) < 0.01] = 0.0  # a few with nothing to send
    T = assert_allocation(tau, t, f_tot=20e6)
    assert T > tau.max()


@pytest.mark.parametrize(
    ("tau", "t", "f_tot", "pattern"),
    [
        ([1.0, 2.0], [1.0], 1.0, "one entry per client: got 2 and 1"),
        ([1.0, -0.5], [1.0, 1.0], 1.0, r"tau_s\[1\] = -0\.5"),
        ([1.0, math.nan], [1.0, 1.0], 1.0, r"tau_s\[1\] = nan"),
        ([1.0, 1.0], [math.inf, 1.0], 1.0, r"t\[0\] = inf"),
        ([1.0, 1.0], [1.0, -2.0], 1.0, r"t\[1\] = -2\.0"),
        ([1.0], [1.0], 0.0, "f_tot = 0.0"),
        ([1.0], [1.0], -3.0, "f_tot = -3.0"),
        ([1.0], [1.0], math.nan, "f_tot = nan"),
        ([1.0], [1.0], math.inf, "f_tot = inf"),
    ],
)
def test_allocation_rejects_bad_input(tau, t, f_tot, pattern):
    with pytest.raises(ConfigError, match=pattern):
        allocate_bandwidth(tau, t, f_tot)


# ----------------------------------------------------------------------------- bounds


def brute_force(q: np.ndarray, value) -> float:
    """Σ over all participant sets K of P(K) · value(K) (independent Bernoulli q_n)."""
    total = 0.0
    for bits in itertools.product((0, 1), repeat=q.size):
        inc = np.array(bits, dtype=bool)
        prob = float(np.prod(np.where(inc, q, 1 - q)))
        total += prob * value(inc)
    return total


def test_expected_max_tau_hand_computed():
    # sorted τ = (1, 2), q = (.5, .5): 0.5·2 + 0.5·0.5·1 = 1.25 (input order does not matter)
    assert expected_max_tau([0.5, 0.5], [2.0, 1.0]) == pytest.approx(1.25, rel=1e-15)
    assert expected_max_tau([1.0, 1.0, 1.0], [3.0, 1.0, 2.0]) == pytest.approx(3.0)
    assert expected_max_tau([0.2], [7.0]) == pytest.approx(1.4)  # max ∅ = 0


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_expected_max_tau_equals_brute_force_enumeration(n):
    g = rng(n)
    q = g.uniform(0.05, 1.0, n)
    q[0] = 1.0 if n > 2 else q[0]
    tau = g.uniform(0.0, 10.0, n)
    if n >= 5:
        tau[3] = tau[1]  # ties
    exact = brute_force(q, lambda inc: float(tau[inc].max()) if inc.any() else 0.0)
    assert expected_max_tau(q, tau) == pytest.approx(exact, rel=1e-12)


def exact_round_time(inc: np.ndarray, tau: np.ndarray, t: np.ndarray, f_tot: float) -> float:
    return allocate_bandwidth(tau[inc], t[inc], f_tot)[0]


@pytest.mark.parametrize("seed", range(5))
def test_theorem2_bounds_the_expected_round_time(seed):
    # Prepare: a random instance of N <= 8 clients, some with t = 0.
    g = rng(100 + seed)
    n = int(g.integers(2, 9))
    q = g.uniform(0.05, 1.0, n)
    tau = g.lognormal(0.0, 1.0, n)
    t = g.lognormal(0.0, 1.0, n) * (g.random(n) < 0.85)
    f_tot = float(g.uniform(0.5, 5.0))
    bound = round_time_bound(q, tau, t, f_tot)

    # the per-round inequality behind the proof: T(K) <= Σ_K t_n / f_tot + max_K τ_n
    for bits in itertools.product((False, True), repeat=n):
        inc = np.array(bits)
        if inc.any():
            per_round = t[inc].sum() / f_tot + tau[inc].max()
            assert exact_round_time(inc, tau, t, f_tot) <= per_round * (1 + 1e-12)

    # exact expectation by enumeration, and a Monte Carlo mean with the real sampler
    exact = brute_force(q, lambda inc: exact_round_time(inc, tau, t, f_tot))
    assert exact <= bound * (1 + 1e-12)
    sampler = rng(200 + seed)
    draws = 2000
    times = np.empty(draws)
    for d in range(draws):
        part = sample_participants(q, sampler)
        times[d] = allocate_bandwidth(tau[part], t[part], f_tot)[0]
    mean, se = float(np.mean(times)), float(np.std(times, ddof=1)) / math.sqrt(draws)
    assert mean <= bound
    assert abs(mean - exact) < 4 * se + 1e-12


def test_theorem2_is_tight_for_one_certain_client():
    assert round_time_bound([1.0], [2.0], [6.0], 3.0) == pytest.approx(4.0)
    assert allocate_bandwidth([2.0], [6.0], 3.0)[0] == pytest.approx(4.0)


def test_bounds_hand_computed():
    # q = (.5, .5), τ = (2, 1), t = (2, 4), f_tot = 2
    # Theorem 2: (0.5·2 + 0.5·4)/2 + E[max τ] = 1.5 + 1.25 = 2.75
    # Eq. 18: 0.5·(2/2 + 2) + 0.5·(4/2 + 1) = 1.5 + 1.5 = 3.0
    assert round_time_bound([0.5, 0.5], [2.0, 1.0], [2.0, 4.0], 2.0) == pytest.approx(2.75)
    assert round_time_upper_bound([0.5, 0.5], [2.0, 1.0], [2.0, 4.0], 2.0) == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(20))
def test_eq18_is_looser_than_theorem2(seed):
    g = rng(300 + seed)
    n = int(g.integers(1, 50))
    q = g.uniform(0.01, 1.0, n)
    tau, t = g.lognormal(0.0, 1.0, n), g.lognormal(0.0, 1.0, n)
    f_tot = float(g.uniform(0.1, 10.0))
    assert round_time_upper_bound(q, tau, t, f_tot) >= round_time_bound(q, tau, t, f_tot) * (
        1 - 1e-12
    )
    assert expected_max_tau(q, tau) <= float(np.dot(q, tau)) * (1 + 1e-12)


# ----------------------------------------------------------------------------- channel


def test_spectral_efficiency_is_shannon():
    np.testing.assert_allclose(spectral_efficiency(np.array([0.0])), [1.0])  # log2(1 + 1)
    np.testing.assert_allclose(spectral_efficiency(np.array([10 * math.log10(3)])), [2.0])
    np.testing.assert_allclose(spectral_efficiency(np.array([0.0]), np.array([3.0])), [2.0])
    np.testing.assert_allclose(spectral_efficiency(np.array([20.0])), [math.log2(101.0)])


def test_rayleigh_gains_are_unit_mean_exponential_and_seeded():
    gains = rayleigh_gains(50_000, rng(3))
    assert gains.shape == (50_000,)
    assert np.all(gains >= 0)
    # Exp(1): mean 1, standard deviation 1
    assert abs(gains.mean() - 1.0) < 4 / math.sqrt(gains.size)
    assert abs(np.mean(gains < math.log(2)) - 0.5) < 4 * 0.5 / math.sqrt(gains.size)  # median ln 2
    np.testing.assert_array_equal(rayleigh_gains(5, rng(1)), rayleigh_gains(5, rng(1)))


GEN = dict(full_payload_bits=14.7e6, local_steps=10, f_tot_hz=20e6)


def test_generate_profiles_is_deterministic_for_a_seed():
    a = generate_profiles(30, **GEN, rng=rng(4))
    b = generate_profiles(30, **GEN, rng=rng(4))
    c = generate_profiles(30, **GEN, rng=rng(5))
    for name in ClientProfiles.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).shape == (30,)
    assert not np.array_equal(a.tau_full_s, c.tau_full_s)
    assert a.n == 30 and a.has_channel


def test_generate_profiles_follow_the_channel_formulas():
    p = generate_profiles(
        200,
        **GEN,
        step_time_median_s=0.2,
        step_time_sigma=0.5,
        distance_min_m=20.0,
        distance_max_m=200.0,
        path_loss_exponent=3.5,
        path_loss_ref_db=38.0,
        tx_power_dbm=20.0,
        noise_psd_dbm_hz=-174.0,
        rng=rng(6),
    )
    d = p.distance_m
    assert np.all((d >= 20.0) & (d <= 200.0))
    np.testing.assert_allclose(p.path_loss_db, 38.0 + 35.0 * np.log10(d), rtol=1e-12)
    noise_dbm = -174.0 + 10 * math.log10(20e6)  # −100.99 dBm over 20 MHz
    np.testing.assert_allclose(p.snr_db, 20.0 - p.path_loss_db - noise_dbm, rtol=1e-12)
    np.testing.assert_allclose(p.spectral_efficiency, np.log2(1 + 10 ** (p.snr_db / 10)))
    np.testing.assert_allclose(p.t_full, 14.7e6 / p.spectral_efficiency, rtol=1e-12)
    # τ_full = H · step, step lognormal around the median 0.2 s: the log is N(log 0.2, 0.5²)
    logs = np.log(p.tau_full_s / 10)
    assert abs(logs.mean() - math.log(0.2)) < 4 * 0.5 / math.sqrt(200)
    assert np.all(p.tau_full_s > 0)


def test_generated_client_at_100_m_hand_computed():
    # PL = 38 + 35·log10(100) = 108 dB; noise = −174 + 73.01 = −100.99 dBm;
    # SNR = 20 − 108 + 100.99 = 12.99 dB; SE = log2(1 + 19.905) = 4.3858 bit/s/Hz.
    # 20 MHz × 4.39 bit/s/Hz ≈ 88 Mbit/s: the paper's ~100 Mbps total.
    p = generate_profiles(
        3, **GEN, distance_min_m=100.0, distance_max_m=100.0, step_time_sigma=0.0, rng=rng(0)
    )
    np.testing.assert_allclose(p.path_loss_db, 108.0)
    np.testing.assert_allclose(p.snr_db, 12.9897, atol=1e-4)
    np.testing.assert_allclose(p.spectral_efficiency, 4.3858, atol=1e-4)
    np.testing.assert_allclose(p.tau_full_s, 2.0)  # 10 steps of exactly 0.2 s (σ = 0)


@pytest.mark.parametrize(
    ("n", "changes", "pattern"),
    [
        (0, {}, "n_clients = 0"),
        (3, {"f_tot_hz": 0.0}, "f_tot_hz = 0.0"),
        (3, {"f_tot_hz": -1.0}, "f_tot_hz = -1.0"),
        (3, {"full_payload_bits": math.nan}, "full_payload_bits = nan"),
        (3, {"distance_min_m": 0.0}, "distance_min_m = 0.0"),
        (3, {"distance_min_m": 300.0}, r"distance_min_m = 300\.0 .*\(0, 200\.0\]"),
    ],
)
def test_generate_profiles_rejects_bad_settings(n, changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        generate_profiles(n, **{**GEN, **changes}, rng=rng())


# ----------------------------------------------------------------------------- profile files


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def assert_same_profiles(a: ClientProfiles, b: ClientProfiles) -> None:
    for name in ClientProfiles.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_profiles_csv_round_trip(tmp_path):
    p = generate_profiles(7, **GEN, rng=rng(8))
    back = load_profiles(write_csv(tmp_path / "clients.csv", profiles_to_rows(p)))
    assert_same_profiles(p, back)
    assert back.has_channel


def test_profiles_json_round_trip_list_and_clients_table(tmp_path):
    p = generate_profiles(5, **GEN, rng=rng(9))
    rows = profiles_to_rows(p)
    (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    (tmp_path / "b.JSON").write_text(json.dumps({"clients": rows}), encoding="utf-8")
    assert_same_profiles(p, load_profiles(tmp_path / "a.json"))
    assert_same_profiles(p, load_profiles(tmp_path / "b.JSON"))


def test_profiles_with_only_the_required_columns(tmp_path):
    path = tmp_path / "measured.csv"
    path.write_text("tau_full_s,t_full\n1.5,2e6\n0.25,0\n", encoding="utf-8")
    p = load_profiles(path)
    np.testing.assert_array_equal(p.tau_full_s, [1.5, 0.25])
    np.testing.assert_array_equal(p.t_full, [2e6, 0.0])
    assert np.all(np.isnan(p.spectral_efficiency)) and not p.has_channel
    assert p.n == 2


def test_profiles_csv_written_by_a_spreadsheet_with_bom(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufefftau_full_s,t_full\r\n1.0,2.0\r\n".encode())
    np.testing.assert_array_equal(load_profiles(path).tau_full_s, [1.0])


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("m.csv", "tau_full_s,distance_m\n1.0,50\n", "row 0 has no t_full"),
        ("e.csv", "tau_full_s,t_full\n1.0,\n", "row 0 has no t_full"),
        ("s.csv", "tau_full_s,t_full\n1.0,2.0\n2.0\n", "row 1 has no t_full"),
        ("n.csv", "tau_full_s,t_full\n1.0,2.0\nnan,1.0\n", "row 1: tau_full_s = 'nan'.*finite"),
        ("i.csv", "tau_full_s,t_full\ninf,1.0\n", "row 0: tau_full_s = 'inf'"),
        ("g.csv", "tau_full_s,t_full\n1.0,-2.0\n", r"row 0: t_full = '-2\.0'.*>= 0"),
        ("x.csv", "tau_full_s,t_full\n1.0,fast\n", "row 0: t_full = 'fast' is not a number"),
        ("o.csv", "tau_full_s,t_full,snr_db\n1.0,1.0,high\n", "snr_db = 'high'"),
        ("h.csv", "tau_full_s,t_full\n", "no clients"),
        ("b.json", '[\n  {"tau_full_s": 1.0,\n   "t_full": 2.0,,}\n]', "line 3 column"),
        ("l.json", '{"tau_full_s": 1.0, "t_full": 2.0}', "a list of objects"),
        ("k.json", "[1.0, 2.0]", "a list of objects"),
        ("z.json", "[]", "no clients"),
        ("v.json", '[{"tau_full_s": -1, "t_full": 2}]', "row 0: tau_full_s = -1"),
        ("u.json", '[{"tau_full_s": null, "t_full": 2}]', "row 0 has no tau_full_s"),
        ("w.json", '[{"tau_full_s": NaN, "t_full": 2}]', "row 0: tau_full_s = nan"),
        (
            "p.txt",
            "tau_full_s,t_full\n1,1\n",
            r"network\.profiles_file = .*p\.txt.*\.csv or \.json",
        ),
    ],
)
def test_load_profiles_rejects_bad_files(tmp_path, name, content, pattern):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=pattern):
        load_profiles(path)


def test_load_profiles_rejects_missing_and_undecodable_files(tmp_path):
    with pytest.raises(ConfigError, match=r"network\.profiles_file = .*nope\.csv.*cannot read"):
        load_profiles(tmp_path / "nope.csv")
    path = tmp_path / "latin1.csv"
    path.write_bytes("tau_full_s,t_full\n1,2 \xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="UTF-8"):
        load_profiles(path)


def test_profiles_reject_length_mismatch_and_negative_times():
    nan2 = np.full(2, np.nan)
    with pytest.raises(ConfigError, match="t_full has 3 entries, expected 2"):
        ClientProfiles(np.ones(2), np.ones(3), nan2, nan2, nan2, nan2)
    with pytest.raises(ConfigError, match=r"tau_full_s\[1\] = -1\.0"):
        ClientProfiles(np.array([1.0, -1.0]), np.ones(2), nan2, nan2, nan2, nan2)
    with pytest.raises(ConfigError, match="no clients"):
        profiles_from_rows([])


# ----------------------------------------------------------------------------- issue 12: fading


def _mc_gains(size: int = 400_000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).exponential(1.0, size)


@pytest.mark.parametrize("snr_db", [-5.0, 3.0, 20.0])
def test_ergodic_spectral_efficiency_matches_monte_carlo_and_the_closed_form(snr_db):
    from scipy.special import exp1

    from fedlora.system.network import ergodic_spectral_efficiency

    s = 10 ** (snr_db / 10)
    h = _mc_gains()
    draws = np.log2(1 + s * h)
    got = float(ergodic_spectral_efficiency(np.array([snr_db]))[0])
    # E[log2(1 + s h)] = e^{1/s} E1(1/s) / ln 2 for h ~ Exp(1)
    assert got == pytest.approx(np.exp(1 / s) * exp1(1 / s) / np.log(2), rel=1e-7)
    assert abs(got - draws.mean()) < 4 * draws.std() / np.sqrt(draws.size)
    assert got < float(
        spectral_efficiency(np.array([snr_db]))[0]
    )  # Jensen: below the mean-SNR rate


@pytest.mark.parametrize(("snr_db", "floor"), [(3.0, 0.05), (20.0, 0.01), (-5.0, 0.2)])
def test_fading_time_factor_with_an_outage_floor_matches_monte_carlo(snr_db, floor):
    from fedlora.system.network import fading_time_factor

    s = 10 ** (snr_db / 10)
    h = np.maximum(_mc_gains(), floor)
    draws = np.log2(1 + s) / np.log2(1 + s * h)  # upload time relative to the mean-SNR time
    got = float(fading_time_factor(np.array([snr_db]), floor)[0])
    assert abs(got - draws.mean()) < 4 * draws.std() / np.sqrt(draws.size)
    assert got > 1.0  # fading makes the mean upload longer


def test_fading_time_factor_without_a_floor_is_infinite_and_the_sample_mean_does_not_settle():
    from fedlora.system.network import fading_time_factor

    # E[1/log2(1 + s h)] diverges (≈ ln2 / (s h) near h = 0, and ∫ e^{-h}/h dh = ∞): the
    # function says so instead of returning a finite number
    assert fading_time_factor(np.array([10.0]), 0.0)[0] == np.inf
    # heavy tail: the sample mean over 10⁶ draws is well above the one over 10³ (seeded)
    s = 10.0
    means = [float(np.mean(np.log2(1 + s) / np.log2(1 + s * _mc_gains(10**e, e)))) for e in (3, 6)]
    assert means[1] > means[0]


def test_fading_functions_reject_bad_inputs():
    from fedlora.system.network import fading_time_factor

    with pytest.raises(ConfigError, match=r"network.fading_floor = -0.1 is invalid"):
        fading_time_factor(np.array([3.0]), -0.1)
    with pytest.raises(ConfigError, match=r"snr_db\[0\] = nan"):
        fading_time_factor(np.array([np.nan]), 0.1)


def test_planning_time_factor_uses_the_ergodic_rate_without_a_floor():
    from fedlora.system.network import (
        ergodic_spectral_efficiency,
        fading_time_factor,
        planning_time_factor,
    )

    snr = np.array([0.0, 10.0, 25.0])
    expected = spectral_efficiency(snr) / ergodic_spectral_efficiency(snr)
    np.testing.assert_allclose(planning_time_factor(snr, 0.0), expected)
    np.testing.assert_allclose(planning_time_factor(snr, 0.1), fading_time_factor(snr, 0.1))
    # a floor near 0 makes the mean time grow without bound (log-divergent)
    assert fading_time_factor(snr[:1], 1e-6)[0] > fading_time_factor(snr[:1], 1e-2)[0]


def _cost_fields(cfg):
    """`round_cost`'s config fields (it takes the fields, not the whole config)."""
    return {"net": cfg.network, "gamma": cfg.lora.rank, "seed": cfg.training.seed}


def test_engine_applies_the_outage_floor_to_the_fading_gains():
    from fedlora.config import load_config
    from fedlora.federation.clock import round_cost
    from fedlora.federation.methods.sketched import Sketched

    shapes = {"m": (4, 4)}
    prof = generate_profiles(
        1, full_payload_bits=1e6, local_steps=1, f_tot_hz=1e6, rng=np.random.default_rng(0)
    )
    method = Sketched(a=np.array([1.0]), q=np.array([1.0]), k=np.array([4]), gamma=4)
    plan = method.plan_round(0, np.random.default_rng(0), np.random.default_rng(0))
    base = ["lora.rank=4", "data.n_clients=1", 'network.fading="rayleigh"']
    times = {}
    for floor in (0.0, 1e9):  # a huge floor: every gain is lifted to it
        cfg = load_config(None, [*base, f"network.fading_floor={floor}"])
        times[floor] = [
            round_cost(prof, plan, method, shapes, r, **_cost_fields(cfg)).round_time_s
            for r in range(50)
        ]
    assert min(np.subtract(times[0.0], times[1e9])) > 0  # the floor only shortens uploads
    assert np.ptp(times[1e9]) == pytest.approx(0.0, abs=1e-9)  # no fading left above it


def test_proposed_plans_with_the_fading_aware_upload_time():
    from fedlora.config import load_config
    from fedlora.federation.methods.proposed_plan import planning_t_full
    from fedlora.system.network import planning_time_factor

    clients = {"t_full": np.array([2.0, 3.0]), "snr_db": np.array([5.0, 15.0])}
    plain = load_config(None, ["data.n_clients=2"])
    faded = load_config(None, ["data.n_clients=2", 'network.fading="rayleigh"',
                               "network.fading_floor=0.05"])  # fmt: skip
    np.testing.assert_array_equal(planning_t_full(plain, clients), [2.0, 3.0])
    np.testing.assert_allclose(
        planning_t_full(faded, clients), [2.0, 3.0] * planning_time_factor([5.0, 15.0], 0.05)
    )
    given = {"t_full": np.array([2.0, 3.0]), "snr_db": np.array([np.nan, np.nan])}
    np.testing.assert_array_equal(planning_t_full(faded, given), [2.0, 3.0])  # no channel data


def test_round_time_one_client_by_hand() -> None:
    # one client: T = τ + t / f_tot; τ = 2 · (0.5 + 0.5 · 8/16) = 1.5 s
    args = (np.array([2.0]), np.array([8e6]), np.array([8]), 16)
    kw = dict(comp_cost="affine", rho=0.5, f_tot_hz=1e6)
    t_linear, f = round_time(*args, comm_cost="linear", **kw)
    assert t_linear == pytest.approx(1.5 + 4.0) and f.tolist() == pytest.approx([1e6])
    assert round_time(*args, comm_cost="quadratic", **kw)[0] == pytest.approx(1.5 + 2.0)
    # exact with the payload: t = 8e6 · 3/4; without it, exact = linear
    exact = round_time(*args, comm_cost="exact", uplink_bits=np.array([3.0]), full_bits=4.0, **kw)
    assert exact[0] == pytest.approx(1.5 + 6.0)
    assert round_time(*args, comm_cost="exact", **kw)[0] == pytest.approx(1.5 + 4.0)
    # a faded channel at half the nominal efficiency doubles the upload time
    faded = round_time(
        *args, comm_cost="linear", efficiency=(np.array([2.0]), np.array([1.0])), **kw
    )
    assert faded[0] == pytest.approx(1.5 + 8.0)


def test_round_time_matches_allocate_bandwidth_and_rejects_bad_models() -> None:
    tau, t, k = np.array([1.0, 3.0]), np.array([4e6, 2e6]), np.array([16, 4])
    got = round_time(
        tau, t, k, 16, comm_cost="quadratic", comp_cost="linear", rho=0.0, f_tot_hz=2e6
    )
    want = allocate_bandwidth(tau * k / 16, t * (k / 16) ** 2, 2e6)
    assert got[0] == want[0] and got[1].tolist() == want[1].tolist()
    with pytest.raises(ConfigError, match="comm_cost.*'cubic'"):
        round_time(tau, t, k, 16, comm_cost="cubic", comp_cost="linear", rho=0.0, f_tot_hz=1.0)
    with pytest.raises(ConfigError, match="comp_cost.*'cubic'"):
        round_time(tau, t, k, 16, comm_cost="linear", comp_cost="cubic", rho=0.0, f_tot_hz=1.0)
