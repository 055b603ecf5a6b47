"""The noise multiplier for a target ε: the smallest σ on the 10^-decimals grid whose ε(δ),
by the library-backed accountant, keeps the target (the privacy trade-off's σ)."""

from __future__ import annotations

import pytest

from fedlora.errors import ConfigError
from fedlora.system.privacy import epsilon, noise_multiplier_for_epsilon

pytest.importorskip("dp_accounting")

# (target, kind, rate, N): the trade-off's four settings, 100 rounds, δ = 1e-5. The smallest
# σ to 3 decimals whose ε keeps the target; rounding the root to the nearest instead gives
# 1.537 (ε 8.0037) and 17.782 (ε 2.00006), which exceed their targets.
CASES = [
    (8.0, "poisson", 0.2, 0, 1.538),
    (2.0, "poisson", 0.2, 0, 4.502),
    (8.0, "uniform", 0.2, 10, 5.406),
    (2.0, "uniform", 0.2, 10, 17.783),
]


@pytest.mark.parametrize(("target", "kind", "rate", "n", "expected"), CASES)
def test_the_smallest_sigma_to_three_decimals_keeps_the_target(target, kind, rate, n, expected):
    sigma = noise_multiplier_for_epsilon(target, kind, rate, 100, 1e-5, n_clients=n)
    assert sigma == expected
    events = [(kind, rate, 100)]
    assert epsilon(events, sigma, 1e-5, n) <= target
    assert epsilon(events, round(sigma - 0.001, 3), 1e-5, n) > target


def test_other_grids_and_small_sigmas_keep_the_same_rule():
    for decimals in (0, 1, 2):
        sigma = noise_multiplier_for_epsilon(8.0, "poisson", 0.2, 100, 1e-5, decimals=decimals)
        step = 10.0**-decimals
        assert sigma == round(sigma, decimals)
        assert epsilon([("poisson", 0.2, 100)], sigma, 1e-5) <= 8.0
        assert epsilon([("poisson", 0.2, 100)], round(sigma - step, decimals), 1e-5) > 8.0
    big = noise_multiplier_for_epsilon(100.0, "poisson", 0.2, 100, 1e-5)  # a root below 0.5
    assert epsilon([("poisson", 0.2, 100)], big, 1e-5) <= 100.0
    assert epsilon([("poisson", 0.2, 100)], round(big - 0.001, 3), 1e-5) > 100.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"rate": 0.0}, "rate"),
        ({"rate": 1.5}, "rate"),
        ({"rounds": 0}, "rounds"),
        ({"delta": 1.0}, "delta"),
        ({"events_kind": "shuffle"}, "events_kind"),
        ({"events_kind": "uniform", "n_clients": 0}, "n_clients"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs, name):
    args = {"target_epsilon": 8.0, "events_kind": "poisson", "rate": 0.2, "rounds": 100}
    with pytest.raises(ConfigError, match=name):
        noise_multiplier_for_epsilon(**{**args, "delta": 1e-5, **kwargs})
