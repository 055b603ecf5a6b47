"""Statistics over seeds (fedlora.studies.seeds): t intervals, paired ratios with censoring,
paired differences and the verdicts, against hand computations."""

from __future__ import annotations

import math

import pytest

from fedlora.errors import ConfigError
from fedlora.studies import seeds
from fedlora.studies.seeds import t_interval95

T975_2 = 4.302652729911275  # t quantile 0.975 with 2 degrees of freedom (tables)


def test_t_interval_matches_hand_computation():
    # mean 20, sd 10, n = 3: t_{0.975, 2} = 4.302652729911275 -> 4.3027 * 10 / sqrt(3)
    assert t_interval95([10.0, 20.0, 30.0]) == pytest.approx(4.302652729911275 * 10 / math.sqrt(3))
    assert t_interval95([7.0]) is None


def test_paired_ratio_geometric_mean_and_interval_by_hand():
    # ratios 2, 4, 4: logs ln2·(1, 2, 2), mean ln2·5/3, sd ln2/√3, se ln2/3
    r = seeds.paired_ratio([10, 20, 40], [True] * 3, [5, 5, 10], [True] * 3)
    assert r.mean == pytest.approx(2 ** (5 / 3))
    assert r.lo == pytest.approx(2 ** (5 / 3 - T975_2 / 3))
    assert r.hi == pytest.approx(2 ** (5 / 3 + T975_2 / 3))
    assert r.lower_valid and r.upper_valid and r.n == 3
    assert seeds.ratio_verdict(r, 1.0) == seeds.HELD  # lo = 1.17 > 1
    assert seeds.ratio_verdict(r, 2.8) == seeds.INCONCLUSIVE  # 1.17 < 2.8 < 8.6
    assert seeds.ratio_verdict(r, 9.0) == seeds.NOT_HELD  # hi = 8.6 < 9
    assert r.text() == f"3.17x [{2 ** (5 / 3 - T975_2 / 3):.2f}, {2 ** (5 / 3 + T975_2 / 3):.2f}]"


def test_paired_ratio_with_censored_seeds_keeps_only_the_valid_side():
    # the reference never reached in seed 0: its ratio is >= 2, so only the lower end is valid
    r = seeds.paired_ratio([10, 20, 40], [False, True, True], [5, 5, 10], [True] * 3)
    assert r.lower_valid and not r.upper_valid
    assert r.text().startswith(">= 3.17x [1.17, ?]")
    assert seeds.ratio_verdict(r, 1.0) == seeds.HELD
    assert seeds.ratio_verdict(r, 9.0) == seeds.INCONCLUSIVE  # the upper end is not known
    # the method censored: only the upper end is valid
    m = seeds.paired_ratio([10, 20, 40], [True] * 3, [5, 5, 10], [True, False, True])
    assert m.upper_valid and not m.lower_valid and m.text().startswith("<= ")
    assert seeds.ratio_verdict(m, 1.0) == seeds.INCONCLUSIVE
    # both censored in one seed: nothing is known
    both = seeds.paired_ratio([10, 20], [False, True], [5, 5], [False, True])
    assert both.text() == "n/a (censored both ways)"
    assert seeds.ratio_verdict(both, 1.0) == seeds.INCONCLUSIVE
    # one seed: no interval
    one = seeds.paired_ratio([10], [True], [5], [True])
    assert one.mean == pytest.approx(2.0) and one.lo is None and one.text() == "2.00x"
    assert seeds.ratio_verdict(one, 1.0) == seeds.INCONCLUSIVE
    with pytest.raises(ConfigError, match="paired_ratio"):
        seeds.paired_ratio([1, 2], [True, True], [1], [True])


def test_paired_diff_t_test_by_hand():
    # d = (0.1, 0, 0.2): mean 0.1, sd 0.1, t = √3; with 2 df the two-sided p = 1 − t/√(t² + 2)
    d = seeds.paired_diff([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    assert d.mean == pytest.approx(0.1) and d.n == 3
    assert d.ci == pytest.approx(T975_2 * 0.1 / math.sqrt(3))
    assert d.p == pytest.approx(1 - math.sqrt(3) / math.sqrt(5))
    same = seeds.paired_diff([0.5, 0.5], [0.5, 0.5])
    assert same.mean == 0 and same.p == 1.0
    assert seeds.paired_diff([0.5], [0.4]).p is None
    with pytest.raises(ConfigError, match="paired_diff"):
        seeds.paired_diff([], [])


@pytest.mark.parametrize(
    "mean, ci, verdict",
    [(0.005, 0.01, seeds.HELD), (0.1, 0.02, seeds.NOT_HELD),
     (-0.1, 0.02, seeds.NOT_HELD), (0.01, 0.02, seeds.INCONCLUSIVE),
     (0.0, None, seeds.INCONCLUSIVE)],
)  # fmt: skip
def test_similar_verdict_is_an_equivalence_test(mean, ci, verdict):
    assert seeds.similar_verdict(seeds.PairedDiff(mean, ci, None, 3), 0.02) == verdict


def test_summary_text_marks_censoring():
    assert seeds.summarize([10.0, 20.0, 30.0]).text() == f"20.0 ± {T975_2 * 10 / 3**0.5:.1f}"
    assert seeds.summarize([10.0, 20.0], censored=1).text() == ">= 15.0 (1/2 censored)"
    assert seeds.summarize([0.5]).text(100) == "50.0"


def test_ratio_text_keeps_extreme_ratios_short():
    # a target met at the calibration's end: without it the time is ~0 (raised to 1e-9 s)
    r = seeds.paired_ratio([2.0], [True], [0.0], [True])
    assert r.text() == "2e+09x"
    assert seeds.paired_ratio([1.0], [True], [500.0], [True]).text() == "0.002x"
