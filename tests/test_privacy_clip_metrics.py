"""The metrics line's clipping fields under client-level DP: every participant's weighted
update norm ‖w_n Δ_n‖ before clipping, their median and the share that was clipped, by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedlora.config import load_config
from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.registry import method_class
from fedlora.federation.privacy import account_round, clip_fields, make_privacy
from fedlora.federation.privacy_mechanisms.base import PrivacyMechanism
from fedlora.federation.progress import Progress

pytest.importorskip("dp_accounting")
S6 = math.sqrt(6.0)


def _privacy(clip: float, method: str = "sketched") -> PrivacyMechanism:
    overrides = ["data.n_clients=4", f'method.name="{method}"', 'privacy.mode="central"']
    cfg = load_config(
        None, [*overrides, "privacy.noise_multiplier=1.0", f"privacy.clip_norm={clip}"]
    )
    return make_privacy(cfg, method_class(cfg.method.name))


def _round(weights: list[float]) -> tuple[dict, RoundPlan, list[dict]]:
    g = {"m.lora_A": np.zeros((2, 3), np.float32), "m.lora_B": np.zeros((3, 2), np.float32)}
    # client 0 moves A by 1 everywhere (‖Δ‖ = √6), client 1 moves B by 0.5 (‖Δ‖ = √6/2)
    x0 = {"m.lora_A": np.ones((2, 3), np.float32), "m.lora_B": np.zeros((3, 2), np.float32)}
    x1 = {"m.lora_A": np.zeros((2, 3), np.float32), "m.lora_B": np.full((3, 2), 0.5, np.float32)}
    tasks = tuple(ClientTask(i, np.ones(2), 2, w, "AB") for i, w in enumerate(weights))
    return g, RoundPlan(1, tasks), [x0, x1]


def _account(dp: PrivacyMechanism, plan: RoundPlan) -> dict:
    method = SimpleNamespace(privacy=dp, q=[0.5, 0.5, 0.5, 0.5])
    return account_round(method, plan, Progress())


def test_two_participants_give_the_hand_computed_median_and_clipped_share():
    dp = _privacy(clip=1.0)
    g, plan, states = _round([2.0, 0.5])  # ‖u_0‖ = 2√6 ≈ 4.90 > 1, ‖u_1‖ = 0.25√6 ≈ 0.61 <= 1
    dp.clip(g, plan, states)
    line = _account(dp, plan)
    assert line["dp_update_norms"] == pytest.approx([2 * S6, 0.25 * S6], rel=1e-6)
    assert line["dp_update_norm_median"] == pytest.approx(1.125 * S6, rel=1e-6)
    assert line["dp_clipped_fraction"] == 0.5
    assert len(line["epsilon"]) == 4
    # the norms belong to the round that clipped: the next round without participants has none
    again = _account(dp, RoundPlan(2, ()))
    assert again["dp_update_norms"] == []
    assert again["dp_update_norm_median"] is None and again["dp_clipped_fraction"] is None


def test_the_norms_are_those_of_the_weights_the_method_aggregates_with():
    dp = _privacy(clip=0.5, method="fedavg")  # normalised: w = 0.8 and 0.2
    g, plan, states = _round([2.0, 0.5])
    dp.clip(g, plan, states)
    line = _account(dp, plan)
    assert line["dp_update_norms"] == pytest.approx([0.8 * S6, 0.1 * S6], rel=1e-6)
    assert line["dp_clipped_fraction"] == 0.5  # 1.96 > 0.5, 0.24 <= 0.5
    assert clip_fields([3.0, 1.0, 2.0], 2.0) == {
        "dp_update_norms": [3.0, 1.0, 2.0],
        "dp_update_norm_median": 2.0,
        "dp_clipped_fraction": pytest.approx(1 / 3),  # exactly C is not clipped
    }


def test_a_run_without_privacy_has_no_clipping_fields():
    assert account_round(SimpleNamespace(privacy=None), RoundPlan(1, ()), None) == {}
