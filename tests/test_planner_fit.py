"""The constrained fit of Theorem 1's constants and the in-run progress rates (issue 21):
synthetic loss curves generated from Theorem 1's model with known A–D."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fedlora.errors import ConfigError
from fedlora.system import planner
from fedlora.system.planner.fit import constrained_fit, progress_rates, progress_rates_by_client
from planner_cases import QUAD

GAMMA = 8
TRUE = planner.Constants(A=40.0, B=1.0, C=0.02, D=0.002)  # B = 1: the fit's normalisation


def _yz(a, q, k):
    a2 = np.asarray(a) ** 2
    return float(np.sum(a2 / q)), float(np.sum(a2 / q * GAMMA**2 / np.asarray(k, float) ** 2))


def _curve(a, settings, order, rounds_each, constants, noise=0.0, seed=0):
    """log L_r of one run: each round multiplies the loss by exp(−ρ), ρ = (B − CY − DZ)/A."""
    rng = np.random.default_rng(seed)
    log_l, of_round, level = [], [], math.log(2.0)
    for j in order:
        y, z = _yz(a, *settings[j])
        rho = (constants.B - constants.C * y - constants.D * z) / constants.A
        for _ in range(rounds_each):
            log_l.append(level + noise * rng.standard_normal())
            of_round.append(j)
            level -= rho
    return log_l, of_round


def _probes(n):
    return [(np.full(n, q), np.full(n, k)) for k in (GAMMA, 2) for q in (0.3, 0.15)]


def test_fit_recovers_known_constants_from_a_noiseless_curve():
    # Prepare: 10 clients, the four probes in palindromic order, 3 rounds each
    a = np.random.default_rng(1).dirichlet(np.ones(10))
    settings = _probes(10)
    log_l, of_round = _curve(a, settings, [0, 1, 2, 3, 3, 2, 1, 0], 3, TRUE)
    # Execute
    rates, counts = progress_rates(log_l, of_round)
    yz = np.array([_yz(a, *s) for s in settings])
    fit = constrained_fit(rates, yz[:, 0], yz[:, 1], weights=counts)
    # Assert: exact recovery (tolerance 1e-6 relative) and nothing floored
    got = fit.constants
    for name in "ABCD":
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert fit.floors == {} and fit.residual < 1e-9
    assert counts.tolist() == [6, 6, 6, 6]


@pytest.mark.parametrize("seed", range(20))
def test_fit_with_noise_stays_within_the_stated_tolerance(seed):
    # noise of sd 1e-4 on each round's log-loss, 6 rounds per block, 20 seeds: A within 1%,
    # C within 25%, D within 5% (measured worst: 0.2%, 11%, 2%). With sd 3e-4 C's worst
    # error is 32%, with 1e-3 400%: C needs a clean loss signal; real losses rely on the floor
    a = np.random.default_rng(2).dirichlet(np.ones(10))
    settings = _probes(10)
    log_l, of_round = _curve(a, settings, [0, 1, 2, 3, 3, 2, 1, 0], 6, TRUE, 1e-4, seed)
    rates, counts = progress_rates(log_l, of_round)
    yz = np.array([_yz(a, *s) for s in settings])
    got = constrained_fit(rates, yz[:, 0], yz[:, 1], weights=counts).constants
    assert got.A == pytest.approx(TRUE.A, rel=0.01)
    assert got.C == pytest.approx(TRUE.C, rel=0.25)
    assert got.D == pytest.approx(TRUE.D, rel=0.05)


def test_empty_rounds_count_but_give_no_equation():
    log_l = [0.0, None, -0.3, -0.45]  # rounds of settings 0, 0, 0, 1: ρ_0 = 0.15, ρ_1 unseen
    rates, counts = progress_rates(log_l, [0, 0, 0, 1])
    assert rates[0] == pytest.approx(0.15) and math.isnan(rates[1])
    assert counts.tolist() == [3, 1]


def _plan_with(constants, a, tau, t_full):
    problem = planner.PlanProblem(gamma=GAMMA, f_tot=100.0, a=a, tau_full_s=tau,
                                  t_full=t_full, constants=constants)  # fmt: skip
    return planner.multi_start(problem, constants, QUAD)


def test_c_not_identified_is_floored_and_named():
    # Prepare: halving q never slowed a run (true C = 0), D as in TRUE
    a = np.random.default_rng(3).dirichlet(np.ones(10))
    flat = dataclasses.replace(TRUE, C=1e-300)
    settings = _probes(10)
    log_l, of_round = _curve(a, settings, [0, 1, 2, 3, 3, 2, 1, 0], 3, flat)
    rates, counts = progress_rates(log_l, of_round)
    yz = np.array([_yz(a, *s) for s in settings])
    # Execute
    fit = constrained_fit(rates, yz[:, 0], yz[:, 1], weights=counts)
    # Assert: C floored (named, with the reason), the others recovered
    assert set(fit.floors) == {"C"} and "not identified" in fit.floors["C"]
    assert fit.raw["C"] == pytest.approx(0.0, abs=1e-12)
    assert fit.constants.C == pytest.approx(0.1 / yz[:, 0].max())
    assert fit.constants.A == pytest.approx(TRUE.A, rel=1e-6)
    assert fit.constants.D == pytest.approx(TRUE.D, rel=1e-6)
    assert "floored: C (not identified" in fit.describe()


def test_flat_rates_fall_back_to_the_floors_instead_of_planning_q_to_zero():
    # Prepare: the powered runs: no probe was slower than another (C = D = 0)
    rng = np.random.default_rng(3)
    a = rng.dirichlet(np.ones(10))
    flat = dataclasses.replace(TRUE, C=1e-300, D=1e-300)
    settings = _probes(10)
    log_l, of_round = _curve(a, settings, [0, 1, 2, 3, 3, 2, 1, 0], 3, flat)
    rates, counts = progress_rates(log_l, of_round)
    yz = np.array([_yz(a, *s) for s in settings])
    # Execute
    fit = constrained_fit(rates, yz[:, 0], yz[:, 1], weights=counts)
    tau, t_full = rng.uniform(0.5, 3.0, 10), rng.uniform(10.0, 100.0, 10)
    floored = _plan_with(fit.constants, a, tau, t_full)
    naive = _plan_with(dataclasses.replace(fit.constants, C=1e-12, D=1e-12), a, tau, t_full)
    # Assert: both floored; the naive constants plan q → 0, the floored ones do not: their
    # plan stays where the variance term is below B (Y < max Y / 0.1)
    assert set(fit.floors) == {"C", "D"}
    assert naive.q.min() < 1e-4
    assert floored.q.min() > 100 * naive.q.min()
    assert float(np.sum(a**2 / floored.q)) < yz[:, 0].max() / 0.1


def test_c_with_one_q_in_the_data_is_not_identified():
    # one Y in the data: C = 1/Y (A = D = 0) fits every row exactly, whatever the rates, and
    # nnls lands there with A at round-off (2.4e-13 here; this fit used to pass as A > 0 and
    # get C floored): refused, naming the cause
    a = np.full(4, 0.25)
    settings = [(np.full(4, 0.3), np.full(4, k)) for k in (8, 4, 2)]
    yz = np.array([_yz(a, *s) for s in settings])
    rates = [(1 - 0.5 * y - TRUE.D * z) / TRUE.A for y, z in yz]  # C absorbed: one Y
    with pytest.raises(ConfigError, match="share one sampling rate .* not identified"):
        constrained_fit(rates, yz[:, 0], yz[:, 1])


def test_fit_refuses_rates_without_information():
    with pytest.raises(ConfigError, match="positive progress rate"):
        constrained_fit([np.nan, -1.0, 0.5], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])


# The pilot's fit after round 24 (study_planner, proposed-inrun seed 7, docs: plandiag): the
# q = 0.15 probes' rates came out negative, the two kept rows (probes 1 and 3) share
# Y = Σa²/q at q = 0.3; nnls returned A = 3.6e-14, C = 1/Y (the vertex), which passed A > 0
PILOT_R24 = {
    "rates": [0.040855459384025065, -0.027570643055225524, 0.027196365172251644,
              -0.046902797832557644],
    "counts": [2, 2, 18, 2],
    "y": [1.092697718861724, 2.185395437723448, 1.092697718861724, 2.185395437723448],
    "z": [1.092697718861724, 2.185395437723448, 17.483163501787583, 34.96632700357517],
}  # fmt: skip


def test_a_zero_up_to_round_off_with_one_sampling_rate_is_refused_naming_the_cause():
    from scipy.optimize import nnls

    p = PILOT_R24
    # the raw nnls solution is the vertex with A at round-off (what the old check let through)
    keep = np.asarray(p["rates"]) > 0
    sw = np.sqrt(np.asarray(p["counts"], float)[keep])
    design = np.column_stack([np.asarray(p[c])[keep] for c in ("rates", "y", "z")])
    x, _ = nnls(design * sw[:, None], sw)
    assert 0 < x[0] * max(p["rates"]) <= 1e-9
    assert x[1] == pytest.approx(1 / p["y"][0], rel=1e-9)
    with pytest.raises(ConfigError) as err:
        constrained_fit(p["rates"], p["y"], p["z"], weights=p["counts"])
    text = str(err.value)
    assert "0 up to round-off" in text
    assert "share one sampling rate" in text and "not identified" in text
    assert "raise planner.probe_rounds" in text


def test_a_exactly_zero_with_one_sampling_rate_names_the_cause():
    # pilot round 8's rates (probes 1 and 3 kept, one Y): nnls gives A = 0 exactly
    p = dict(PILOT_R24, rates=[0.09096236616466714, -0.11406944636879571,
                               0.20019397179939138, -0.13340160114612729], counts=[2, 2, 2, 2])  # fmt: skip
    with pytest.raises(ConfigError, match=r"fit: A = 0 with A, C, D >= 0: the settings with "
                                          r"positive progress share one sampling rate"):  # fmt: skip
        constrained_fit(p["rates"], p["y"], p["z"], weights=p["counts"])


def test_a_zero_with_several_sampling_rates_keeps_its_message():
    # Y varies, but the faster settings are the noisier ones: the rows are explained by C·Y
    # alone (ρ grows with Y), A = 0; the message stays the "no information" one
    y, z = [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match=r"A = 0 with A, C, D >= 0 \(the progress rates carry"):
        constrained_fit([0.1, 0.2, 0.3], y, z)


def test_tiny_rates_still_fit_the_threshold_is_on_a_times_rho():
    # rates ~ 1e-7 (A ~ 1e6 rounds): the progress term A·ρ is still a real share of B, so the
    # fit is kept with the same numbers (the round-off test is on A·ρ, not on A)
    a = np.full(4, 0.25)
    settings = [(np.full(4, q), np.full(4, k)) for k in (8, 2) for q in (0.3, 0.15)]
    yz = np.array([_yz(a, *s) for s in settings])
    c, d = 0.5 / yz[:, 0].max(), 0.3 / yz[:, 1].max()
    rates = [(1 - c * y - d * z) / 1e6 for y, z in yz]
    fit = constrained_fit(rates, yz[:, 0], yz[:, 1])
    assert [fit.raw[x] for x in "ACD"] == pytest.approx([1e6, c, d], rel=1e-6)
    assert fit.floors == {}


def _mixed_world(seed, sd, probe_rounds=4, n=10, q=0.3):
    """The probes' rounds with a random participant mix (each client joins with q, at least
    one) of clients whose log-loss levels differ by −0.38..+0.43 (the pilot's spread): each
    participant's log-loss = level + offset_c + noise; the round's train_loss is their mean
    loss. The level falls by the hand-set rate of the setting in force."""
    from fedlora.federation.methods.proposed_replan import probe_schedule

    rng = np.random.default_rng(seed)
    offsets = np.linspace(-0.38, 0.43, n)
    true = np.array([0.010, 0.008, 0.009, 0.006])
    schedule = probe_schedule(probe_rounds)
    level, mean_logs, pairs = math.log(2.0), [], []
    for j in schedule:
        who = np.flatnonzero(rng.random(n) < q)
        who = who if who.size else rng.integers(n, size=1)
        logs = level + offsets[who] + sd * rng.standard_normal(who.size)
        pairs.append([[int(c), float(v)] for c, v in zip(who, logs)])
        mean_logs.append(math.log(float(np.mean(np.exp(logs)))))
        level -= true[j]
    return true, mean_logs, pairs, schedule


def test_client_offsets_recover_the_rates_that_the_participant_mix_hides():
    # noiseless per-client losses: the within-client fit is exact, the mean-loss fit is off by
    # 4-12x the rates themselves (measured over 20 seeds: min 0.043, median 0.12)
    for seed in range(20):
        true, mean_logs, pairs, schedule = _mixed_world(seed, 0.0)
        plain, counts = progress_rates(mean_logs, schedule)
        rates, counts2, se = progress_rates_by_client(pairs, schedule)
        assert counts2.tolist() == counts.tolist() == [4, 4, 4, 4]
        assert rates == pytest.approx(true, abs=1e-12)
        assert np.max(np.abs(plain - true)) > 0.02


def test_client_offsets_with_noise_stay_within_the_stated_tolerance():
    # minibatch noise sd 0.002 on each participant's log-loss, 20 seeds: every rate within
    # 0.003 of the truth (measured worst 0.0019), the errors within 4 SEs (measured 3.2); the
    # mean-loss fit's worst rate error is > 0.02 at every seed (measured min 0.043)
    for seed in range(20):
        true, mean_logs, pairs, schedule = _mixed_world(seed, 0.002)
        plain, _ = progress_rates(mean_logs, schedule)
        rates, _, se = progress_rates_by_client(pairs, schedule)
        assert np.max(np.abs(rates - true)) < 0.003
        assert np.all(np.abs(rates - true) < 4 * se)
        assert np.max(np.abs(plain - true)) > 0.02


def test_client_offsets_a_client_seen_once_contributes_nothing():
    true, _, pairs, schedule = _mixed_world(3, 0.002)
    base, _, _ = progress_rates_by_client(pairs, schedule)
    once = [list(p) for p in pairs]
    once[5] = [*once[5], [99, 50.0]]  # client 99, one round, an absurd loss level
    got, counts, _ = progress_rates_by_client(once, schedule)
    assert got == pytest.approx(base, abs=1e-12) and counts.tolist() == [4, 4, 4, 4]


def test_client_offsets_rates_not_determined_are_nan():
    # one client, rounds of settings 0, 0, 0, 1 (round 2 without a loss): its rows at
    # n_0 = 0, 1, 3 lie on log L = −0.1·n_0 (ρ_0 = 0.1, exact: SE 0), no loss is seen after
    # the round of setting 1: ρ_1 nan; an empty round counts in n_0 but gives no row
    pairs = [[[0, 0.0]], [[0, -0.1]], None, [[0, -0.3]]]
    rates, counts, se = progress_rates_by_client(pairs, [0, 0, 0, 1])
    assert rates[0] == pytest.approx(0.1, rel=1e-12) and math.isnan(rates[1])
    assert counts.tolist() == [3, 1] and se[0] == pytest.approx(0.0, abs=1e-12)
    # settings 0 and 1 alternate and the losses are seen only at even rounds: n_0 = n_1 at
    # every row, so only ρ_0 + ρ_1 is determined, neither rate
    pairs = [[[0, 0.0]], None, [[0, -0.3]], None, [[0, -0.6]]]
    rates, _, _ = progress_rates_by_client(pairs, [0, 1, 0, 1, 0])
    assert np.isnan(rates).all()
