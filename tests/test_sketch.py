"""Sketching, independent sampling and unbiased aggregation (paper §II, Eq. 3–6, PAPER_NOTES #7).

Statistical checks use a fixed seed and a tolerance of 4 standard errors (or a chi-square
quantile at 1e-6), so they are deterministic and would fail for a real bias.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from fedlora.errors import ConfigError
from fedlora.system.sketch import (
    aggregation_weights,
    algorithm1_literal_aggregate,
    check_k,
    check_q,
    draw_participants,
    draw_sketch_scales,
    sample_participants,
    sketch_indices,
    sketch_masks,
    sketch_scale_vectors,
    truncation_scale_vectors,
    truncation_scales,
    unbiased_aggregate,
    unbiased_weights,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("q", [[0.0, 0.5], [0.5, 1.5], [0.5, -0.1], [math.nan], [math.inf]])
def test_check_q_rejects_values_outside_0_1(q):
    with pytest.raises(ConfigError, match=r"q\[\d\].*\(0, 1\]"):
        check_q(q)


def test_check_q_names_the_first_bad_entry_and_never_clamps():
    with pytest.raises(ConfigError, match=r"q\[2\] = 1\.0001"):
        check_q([1.0, 0.3, 1.0001])
    np.testing.assert_array_equal(check_q([1.0, 1e-12]), [1.0, 1e-12])


@pytest.mark.parametrize("q", [[], [[0.5]]])
def test_check_q_rejects_empty_or_non_vector(q):
    with pytest.raises(ConfigError, match="1-D"):
        check_q(q)


@pytest.mark.parametrize(
    ("k", "gamma", "pattern"),
    [
        ([0, 2], 4, r"k\[0\] = 0 .*1\.\.4"),
        ([2, 5], 4, r"k\[1\] = 5 .*1\.\.4"),
        ([-1], 4, r"k\[0\] = -1"),
        ([1.5], 4, r"k = \[1\.5\].*integers"),
        ([math.nan], 4, "integers"),
        ([1], 0, r"gamma = 0 .*>= 1"),
        ([1], True, "gamma = True"),
        ([1], 2.0, "gamma = 2.0"),
        ([], 4, "1-D"),
    ],
)
def test_check_k_rejects_k_outside_1_to_gamma_and_bad_gamma(k, gamma, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_k(k, gamma)


def test_check_k_accepts_integral_floats_and_the_full_range():
    np.testing.assert_array_equal(check_k([1.0, 4.0], 4), [1, 4])
    assert check_k(np.array([1, 2, 3, 4], dtype=np.int32), 4).dtype == np.int64


# ----------------------------------------------------------------------------- E[S] = I


def test_sketch_indices_is_a_sorted_k_subset_and_full_at_k_equal_gamma():
    g = rng(1)
    for k in range(1, 9):
        idx = sketch_indices(8, k, g)
        assert idx.shape == (k,)
        assert np.all(np.diff(idx) > 0)  # sorted, no repeats
        assert idx.min() >= 0 and idx.max() < 8
    np.testing.assert_array_equal(sketch_indices(8, 8, g), np.arange(8))


def test_sketch_indices_rejects_k_outside_1_to_gamma():
    with pytest.raises(ConfigError, match=r"k\[0\] = 0"):
        sketch_indices(8, 0, rng())
    with pytest.raises(ConfigError, match=r"k\[0\] = 9"):
        sketch_indices(8, 9, rng())


def _subset_counts(masks: np.ndarray, gamma: int, k: int) -> np.ndarray:
    """How often each of the C(γ, k) subsets occurs among the rows of `masks` (draws, γ)."""
    subsets = list(itertools.combinations(range(gamma), k))
    code = {s: i for i, s in enumerate(subsets)}
    counts = np.zeros(len(subsets))
    for row in masks:
        counts[code[tuple(np.flatnonzero(row))]] += 1
    return counts


def _assert_uniform(counts: np.ndarray) -> None:
    """Pearson chi-square against the uniform distribution, at significance 1e-6."""
    expected = counts.sum() / counts.size
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < stats.chi2.ppf(1 - 1e-6, df=counts.size - 1), chi2


@pytest.mark.parametrize(("gamma", "k"), [(5, 2), (6, 3), (4, 1)])
def test_sketch_masks_each_k_subset_is_equally_likely(gamma, k):
    draws = 12_000
    masks = sketch_masks(gamma, np.full(draws, k), rng(gamma * 10 + k))  # (draws, γ)
    _assert_uniform(_subset_counts(masks, gamma, k))


def test_sketch_indices_each_k_subset_is_equally_likely():
    g = rng(7)
    masks = np.zeros((6000, 5))
    for row in masks:
        row[sketch_indices(5, 2, g)] = 1.0
    _assert_uniform(_subset_counts(masks, 5, 2))


def test_sketch_masks_have_exactly_k_ones_per_row():
    k = np.array([1, 3, 8, 5, 2, 8, 1])
    masks = sketch_masks(8, k, rng(2))
    assert masks.shape == (7, 8)
    assert set(np.unique(masks)) <= {0.0, 1.0}
    np.testing.assert_array_equal(masks.sum(axis=1), k)
    np.testing.assert_array_equal(masks[2], np.ones(8))  # k = γ: the full adapter


def test_sketch_masks_are_deterministic_for_a_seed():
    k = [2, 3, 4]
    np.testing.assert_array_equal(sketch_masks(6, k, rng(5)), sketch_masks(6, k, rng(5)))
    assert not np.array_equal(sketch_masks(6, k * 20, rng(5)), sketch_masks(6, k * 20, rng(6)))


class _KeysInOrder:
    """Stands in for a Generator: `random` returns given key rows (one per permutation)."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys

    def random(self, shape: tuple[int, int]) -> np.ndarray:
        assert shape == self.keys.shape
        return self.keys


@pytest.mark.parametrize(("gamma", "k"), [(4, 1), (4, 2), (5, 3), (5, 5)])
def test_sketch_masks_exact_inclusion_probability_by_enumerating_key_orders(gamma, k):
    # i.i.d. uniform keys put every one of the γ! orderings with probability 1/γ!, so feeding
    # each ordering once enumerates the distribution of `sketch_masks` exactly.
    perms = np.array(list(itertools.permutations(range(gamma))), dtype=float)  # (γ!, γ)
    keys = (perms + 0.5) / gamma  # distinct keys in (0, 1) with exactly that ordering
    masks = sketch_masks(gamma, np.full(len(perms), k), _KeysInOrder(keys))  # (γ!, γ)
    # P(index j in the sketch) = k/γ exactly, so E[S_jj] = (γ/k)·(k/γ) = 1
    # (each index is in k·(γ − 1)! of the γ! orderings' sketches)
    np.testing.assert_array_equal(masks.sum(axis=0), k * math.factorial(gamma - 1))
    # and every k-subset occurs exactly k!(γ − k)! times: uniform over the C(γ, k) subsets
    counts = _subset_counts(masks, gamma, k)
    np.testing.assert_array_equal(counts, math.factorial(k) * math.factorial(gamma - k))


def test_inclusion_probability_is_k_over_gamma_for_every_index():
    # Prepare: many draws of a 3-of-8 sketch. Each index count is Binomial(draws, 3/8).
    gamma, k, draws = 8, 3, 40_000
    masks = sketch_masks(gamma, np.full(draws, k), rng(11))
    counts = masks.sum(axis=0)
    p = k / gamma
    sigma = math.sqrt(draws * p * (1 - p))
    # Assert: every index within 4 binomial σ of draws·k/γ (and the counts add up exactly).
    assert counts.sum() == draws * k
    assert np.all(np.abs(counts - draws * p) < 4 * sigma), (counts, draws * p, sigma)


def test_scale_vectors_are_gamma_over_k_on_the_sketch_and_zero_elsewhere():
    k = np.array([1, 2, 4, 8])
    s = sketch_scale_vectors(8, k, rng(3))  # (C, γ)
    for row, kc in zip(s, k):
        nz = row[row != 0]
        assert nz.size == kc
        np.testing.assert_allclose(nz, 8 / kc, rtol=0, atol=0)
    # exactly γ/k on k entries: the row sum is γ for every client, so E[S] = I needs only
    # the uniform inclusion probability k/γ checked above.
    np.testing.assert_allclose(s.sum(axis=1), 8.0)


def test_expected_sketch_is_identity_monte_carlo():
    # E[S] = I on the diagonal, and E[B S A] = B A for a LoRA product (paper Eq. 3–5).
    gamma, draws = 6, 20_000
    k = rng(0).integers(1, gamma + 1, size=draws)
    s = sketch_scale_vectors(gamma, k, rng(21))  # (draws, γ)
    mean, se = s.mean(axis=0), s.std(axis=0, ddof=1) / math.sqrt(draws)
    assert np.all(np.abs(mean - 1.0) < 4 * se), (mean, se)

    b = rng(1).standard_normal((3, gamma))  # (m, γ)
    a = rng(2).standard_normal((gamma, 4))  # (γ, n)
    prods = np.einsum("mg,dg,gn->dmn", b, s, a)  # (draws, m, n): B diag(s_d) A
    mean, se = prods.mean(axis=0), prods.std(axis=0, ddof=1) / math.sqrt(draws)
    assert np.all(np.abs(mean - b @ a) < 4 * se)


def test_truncation_scale_vectors_keep_the_first_r_unscaled():
    s = truncation_scale_vectors(4, [1, 3, 4])
    np.testing.assert_array_equal(s, [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ConfigError, match=r"rank\[0\] = 5"):
        truncation_scale_vectors(4, [5])


# ----------------------------------------------------------------------------- sampling


def test_sample_participants_frequencies_match_q_and_empty_rounds_happen():
    q = np.array([0.05, 0.3, 0.5, 0.9, 1.0])
    g = rng(4)
    draws = 10_000
    hits = np.zeros(q.size)
    empty = 0
    for _ in range(draws):
        p = sample_participants(q, g)
        assert np.all(np.diff(p) > 0)  # sorted indices, no repeats
        hits[p] += 1
        empty += p.size == 0
    sigma = np.sqrt(draws * q * (1 - q))
    assert np.all(np.abs(hits - draws * q) <= 4 * sigma + 1e-12)
    assert hits[-1] == draws  # q = 1: always in
    assert empty == 0  # client 4 always participates

    # a round with no participant has probability Π(1 − q_n) (PAPER_NOTES #13)
    q2 = np.array([0.2, 0.1, 0.3])
    p_empty = float(np.prod(1 - q2))
    n_empty = sum(sample_participants(q2, g).size == 0 for _ in range(draws))
    assert abs(n_empty - draws * p_empty) < 4 * math.sqrt(draws * p_empty * (1 - p_empty))


def test_sample_participants_rejects_bad_q():
    with pytest.raises(ConfigError, match=r"q\[1\] = 0\.0"):
        sample_participants([0.5, 0.0], rng())


# ----------------------------------------------------------------------------- aggregation


def test_aggregation_weights_are_a_over_q_of_the_participants():
    w = aggregation_weights([0.1, 0.2, 0.7], [0.5, 1.0, 0.35], np.array([0, 2]))
    np.testing.assert_allclose(w, [0.2, 2.0])
    assert aggregation_weights([0.5, 0.5], [1.0, 1.0], np.array([], dtype=int)).size == 0


def test_aggregation_weights_reject_mismatched_lengths_and_bad_q():
    with pytest.raises(ConfigError, match="one entry per client: got 2 and 3"):
        aggregation_weights([0.5, 0.5], [0.5, 0.5, 0.5], np.array([0]))
    with pytest.raises(ConfigError, match=r"q\[0\] = 0\.0"):
        aggregation_weights([0.5, 0.5], [0.0, 0.5], np.array([1]))


def test_unbiased_aggregate_hand_computed():
    # X = 1; X_1 = 3 with weight 0.5, X_2 = 0 with weight 0.25:
    # X − [0.5·(1 − 3) + 0.25·(1 − 0)] = 1 − (−1 + 0.25) = 1.75
    x = {"w": np.array([1.0, 2.0])}
    clients = [{"w": np.array([3.0, 2.0])}, {"w": np.array([0.0, 4.0])}]
    out = unbiased_aggregate(x, clients, [0.5, 0.25])
    # second entry: 2 − [0.5·0 + 0.25·(2 − 4)] = 2.5
    np.testing.assert_allclose(out["w"], [1.75, 2.5])
    np.testing.assert_array_equal(x["w"], [1.0, 2.0])  # input untouched


def test_unbiased_aggregate_with_no_participant_returns_an_unchanged_copy():
    x = {"a": np.arange(3.0), "b": np.ones((2, 2), dtype=np.float32)}
    out = unbiased_aggregate(x, [], [])
    for name in x:
        np.testing.assert_array_equal(out[name], x[name])
        assert out[name].dtype == x[name].dtype
        assert not np.shares_memory(out[name], x[name])


def test_unbiased_aggregate_keeps_dtype_and_rejects_weight_count_mismatch():
    x = {"a": np.zeros(2, dtype=np.float32)}
    out = unbiased_aggregate(x, [{"a": np.ones(2, dtype=np.float32)}], [1.0])
    assert out["a"].dtype == np.float32
    np.testing.assert_array_equal(out["a"], [1.0, 1.0])
    with pytest.raises(ConfigError, match="got 2 weights for 1 clients"):
        unbiased_aggregate(x, [{"a": np.ones(2)}], [0.5, 0.5])


def test_unbiased_aggregate_rejects_missing_or_misshapen_client_parameters():
    x = {"a": np.zeros(3)}
    with pytest.raises(ConfigError, match="client update 0 has no parameter 'a'"):
        unbiased_aggregate(x, [{"b": np.zeros(3)}], [1.0])
    # (3, 1) against (3,) would broadcast to (3, 3) and silently change the global shape
    with pytest.raises(ConfigError, match=r"client update 1: a has shape \(3, 1\)"):
        unbiased_aggregate(x, [{"a": np.ones(3)}, {"a": np.ones((3, 1))}], [0.5, 0.5])


def _monte_carlo_aggregates(aggregate, draws: int, seed: int):
    """Prepare a 4-client instance with unequal a_n and q_n; run `aggregate` `draws` times."""
    g = rng(seed)
    a = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.9, 0.25, 0.5, 0.15])
    x = {"A": g.standard_normal((2, 3)), "B": g.standard_normal(3)}
    clients = [{name: v + g.standard_normal(v.shape) for name, v in x.items()} for _ in a]
    target = {name: sum(a[n] * clients[n][name] for n in range(a.size)) for name in x}
    samples = {name: np.empty((draws, *v.shape)) for name, v in x.items()}
    sampler = rng(seed + 1)
    for d in range(draws):
        p = sample_participants(q, sampler)
        out = aggregate(x, [clients[n] for n in p], a, q, p)
        for name in x:
            samples[name][d] = out[name]
    return a, q, x, clients, target, samples


def test_unbiased_aggregation_mean_equals_weighted_client_average():
    # PAPER_NOTES #7 / Appendix A: E[X^{r+1}] = Σ a_n X_n^H for any q_n in (0, 1].
    draws = 10_000
    a, q, x, clients, target, samples = _monte_carlo_aggregates(
        lambda x, cs, a, q, p: unbiased_aggregate(x, cs, aggregation_weights(a, q, p)),
        draws,
        seed=100,
    )
    for name in x:
        mean = samples[name].mean(axis=0)
        se = samples[name].std(axis=0, ddof=1) / math.sqrt(draws)
        z = np.abs(mean - target[name]) / se
        assert np.all(z < 4), (name, z)


def test_literal_algorithm1_aggregation_is_biased():
    # Algorithm 1 taken literally: E[X⁺] = X − η Σ a_n (X − X_n)/q_n ≠ Σ a_n X_n.
    draws, lr = 10_000, 0.05
    a, q, x, clients, target, samples = _monte_carlo_aggregates(
        lambda x, cs, a, q, p: algorithm1_literal_aggregate(x, cs, a, q, p, lr),
        draws,
        seed=100,
    )
    for name in x:
        mean = samples[name].mean(axis=0)
        se = samples[name].std(axis=0, ddof=1) / math.sqrt(draws)
        # far from the unbiased target ...
        assert np.max(np.abs(mean - target[name]) / se) > 20
        # ... and at the mean the derivation predicts (one η and one 1/q_n too many)
        predicted = x[name] - lr * sum(
            a[n] * (x[name] - clients[n][name]) / q[n] for n in range(a.size)
        )
        assert np.all(np.abs(mean - predicted) < 4 * se)


# ----------------------------------------------------------------------------- round kernels


def test_round_kernels_equal_their_checked_forms_draw_for_draw():
    """The kernels the methods call each round (no checks) give what the checked public
    functions give, from the same generator state."""
    q, a = check_q([0.3, 1.0, 0.7, 0.05]), np.array([0.1, 0.2, 0.3, 0.4])
    k = check_k([1, 8, 3, 5], 8)
    for seed in range(5):
        np.testing.assert_array_equal(
            draw_participants(q, rng(seed)), sample_participants(q, rng(seed))
        )
        np.testing.assert_array_equal(
            draw_sketch_scales(8, k, rng(seed)), sketch_scale_vectors(8, k, rng(seed))
        )
    part = np.array([0, 2, 3])
    np.testing.assert_array_equal(unbiased_weights(a, q, part), aggregation_weights(a, q, part))
    np.testing.assert_array_equal(truncation_scales(8, k), truncation_scale_vectors(8, k))


def test_round_kernels_assert_on_unchecked_input():
    """A bug that hands a kernel an unchecked vector trips an assertion, not a silent draw."""
    with pytest.raises(AssertionError):
        draw_participants(np.array([1, 0]), rng())  # integers: never through check_q
    with pytest.raises(AssertionError, match="outside"):
        draw_sketch_scales(4, np.array([0, 2]), rng())
    with pytest.raises(AssertionError):
        truncation_scales(4, np.array([5]))
