"""fedlora.federation.methods.factors: the stacked factors of a round, checked by hand on tiny
matrices, the normalised weights, the module pairs and ‖B A‖_F (issue 11: one copy for
fedstacklora, flexlora and heterolora)."""

from __future__ import annotations

import numpy as np
import pytest

from fedlora.federation.methods.base import ClientTask, RoundPlan
from fedlora.federation.methods.factors import (
    lora_modules,
    normalized_weights,
    product_fro_norm,
    product_sq_norm,
    stack_factors,
)


def _plan() -> RoundPlan:
    # γ = 2: participant 0 trained component 0 (s = 1), participant 1 both (s = 2, HetLoRA's γ/r)
    return RoundPlan(
        0,
        (
            ClientTask(client=0, scale=np.array([1.0, 0.0]), rank_used=1, weight=1.0),
            ClientTask(client=1, scale=np.array([2.0, 2.0]), rank_used=2, weight=3.0),
        ),
    )


def test_stack_factors_by_hand() -> None:
    # Prepare: B (out 2, γ 2), A (γ 2, in 3) per participant
    states = [
        {"m.lora_B": np.array([[1.0, 2.0], [3.0, 4.0]]),
         "m.lora_A": np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])},
        {"m.lora_B": np.array([[1.0, 0.0], [0.0, 1.0]]),
         "m.lora_A": np.array([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])},
    ]  # fmt: skip
    p = normalized_weights(_plan())
    # Execute
    b_stack, a_stack = stack_factors(_plan(), states, "m", p)
    # Assert: p = [1/4, 3/4]; B_stack = [p_0 B_0[:, :1] · 1, p_1 B_1 · 2] (out 2, Σr 3)
    np.testing.assert_array_equal(p, [0.25, 0.75])
    np.testing.assert_array_equal(b_stack, [[0.25, 1.5, 0.0], [0.75, 0.0, 1.5]])
    # A_stack = [A_0[:1]; A_1] (Σr 3, in 3)
    np.testing.assert_array_equal(a_stack, [[1, 0, 0], [0, 0, 1], [1, 1, 1]])
    # B_stack A_stack = Σ p_n B_n diag(s_n) A_n = [[.25, 0, 1.5], [2.25, 1.5, 1.5]]
    np.testing.assert_array_equal(b_stack @ a_stack, [[0.25, 0.0, 1.5], [2.25, 1.5, 1.5]])
    assert b_stack.dtype == a_stack.dtype == np.float64


def test_product_fro_norm_matches_the_dense_product() -> None:
    rng = np.random.default_rng(5)
    b, a = rng.normal(size=(7, 3)), rng.normal(size=(3, 5))
    assert product_fro_norm(b, a) == pytest.approx(np.linalg.norm(b @ a), rel=1e-12)
    assert product_sq_norm(b, a) == pytest.approx(np.linalg.norm(b @ a) ** 2, rel=1e-12)


def test_lora_modules_pairs_a_and_b() -> None:
    state = {"x.lora_A": 0, "x.lora_B": 0, "y.lora_A": 0, "z.lora_B": 0}
    assert lora_modules(state) == ["x"]
